"""Cut the two face photos of the synthetic source out of their public-domain originals, once.

facecast's `synthetic` camera (workers/capture/sources.py) must run where only facecast's own
dependencies are installed, so the photos ship with it as PNG crops in
workers/capture/synthetic_faces/:
NASA's astronaut portrait of Eileen Collins (scikit-image's `data.astronaut()`) and the US Navy's
portrait of Grace Hopper (matplotlib's `grace_hopper.jpg` sample), both in the public domain.
Each crop is the square of twice the face box (a little lower than its centre, keeping hair, ears
and chin) around the face box that MediaPipe 0.10.21's short-range detector finds on the whole
photo (tests/models/fixtures/mediapipe_faces.npz, "<name>/boxes_px").

Run with scikit-image and matplotlib installed (the `test` extra); prints the face boxes in crop
pixels for workers/capture/sources.py.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

OUT = Path(__file__).resolve().parent.parent / "workers" / "capture" / "synthetic_faces"
FACE_BOXES_PX = {
    "astronaut": (177.56541, 82.87118, 272.9095, 178.21541),
    "grace_hopper": (171.35315, 146.91507, 365.84296, 341.3939),
}


def photo_bgr(name: str) -> np.ndarray:
    if name == "astronaut":
        import skimage.data

        return np.ascontiguousarray(skimage.data.astronaut()[..., ::-1])
    from matplotlib import cbook

    return cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (x1, y1, x2, y2) in FACE_BOXES_PX.items():
        image = photo_bgr(name)
        side = x2 - x1
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        left, top = max(int(round(cx - side)), 0), max(int(round(cy - 1.1 * side)), 0)
        right = min(int(round(cx + side)), image.shape[1])
        bottom = min(int(round(cy + 1.05 * side)), image.shape[0])
        cv2.imwrite(str(OUT / f"{name}.png"), image[top:bottom, left:right],
                    [cv2.IMWRITE_PNG_COMPRESSION, 9])
        print(f"{name}: face box in crop pixels {(x1 - left, y1 - top, x2 - left, y2 - top)}")


if __name__ == "__main__":
    main()
