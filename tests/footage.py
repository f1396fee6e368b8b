"""Real face photos, and real-looking footage made from them, for tests on any machine.

`face_photos()` gives scikit-image's astronaut and matplotlib's grace_hopper (or the same two
arrays from $FACECAST_TEST_PHOTOS, an .npz saved where those packages are installed, for the
offline GPU machine). `make_face_clip()` turns a photo into what a lab camera sends and
synthetic scenes of pasted photos do not (issue 24): a face a third to half of the frame's
height, moving, turning and zooming a little from frame to frame, through a lossy video codec.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import cv2
import numpy as np

# Where each photo's face is: the centre and height of its detector box, in the photo's pixels
# (facecast's CPU stack on the unmodified photos).
FACE_CENTRE_AND_HEIGHT_PX = {"astronaut": ((225.0, 131.0), 95.0),
                             "grace_hopper": ((269.0, 244.0), 194.0)}


def face_photos() -> dict[str, np.ndarray]:
    """The two photos, RGB uint8."""
    if os.environ.get("FACECAST_TEST_PHOTOS"):
        with np.load(os.environ["FACECAST_TEST_PHOTOS"]) as saved:
            return {name: saved[name] for name in ("astronaut", "grace_hopper")}
    import matplotlib.cbook
    import skimage.data

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as stream:
        encoded = np.frombuffer(stream.read(), np.uint8)
    grace_hopper = cv2.cvtColor(cv2.imdecode(encoded, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    return {"astronaut": skimage.data.astronaut(), "grace_hopper": grace_hopper}


# Photos without a face in the same sample data (issue 24 item 5: no more false faces than
# MediaPipe, which finds none in them): a cup of coffee, a cat, a rocket, coins, bricks, gravel,
# a page of text, a horse.
FACE_FREE_PHOTOS = ("coffee", "chelsea", "rocket", "coins", "brick", "gravel", "page", "horse")


def face_free_photos() -> dict[str, np.ndarray]:
    """FACE_FREE_PHOTOS, RGB uint8, from scikit-image, or from $FACECAST_TEST_PHOTOS where it
    holds them (the offline GPU machine)."""
    if os.environ.get("FACECAST_TEST_PHOTOS"):
        with np.load(os.environ["FACECAST_TEST_PHOTOS"]) as saved:
            if all(name in saved for name in FACE_FREE_PHOTOS):
                return {name: saved[name] for name in FACE_FREE_PHOTOS}
    import skimage.data
    import skimage.util

    photos = {}
    for name in FACE_FREE_PHOTOS:
        image = skimage.util.img_as_ubyte(getattr(skimage.data, name)())
        photos[name] = np.stack([image] * 3, axis=-1) if image.ndim == 2 else image[..., :3]
    return photos


def make_face_free_clip(path: Path, photo: str = "coffee", width: int = 640, height: int = 360,
                        fps: float = 30.0, frames: int = 60) -> Path:
    """An MPEG-4 file of a face-free photo moving as `make_face_clip`'s face does."""
    return _write_clip(path, face_free_photos()[photo], None, width, height, fps, frames, 0.0)


def make_face_clip(path: Path, photo: str = "astronaut", width: int = 640, height: int = 360,
                   fps: float = 30.0, frames: int = 60, face_share: float = 0.42) -> Path:
    """An MPEG-4 file (OpenCV's FFmpeg writer, 'mp4v': lossy, with blocks and ringing) of the
    photo's face filling `face_share` of the frame's height, on a smooth path: a few percent of
    the frame sideways, ±6° of roll, ±5 % of zoom; it plays as a loop without a jump."""
    return _write_clip(path, face_photos()[photo], FACE_CENTRE_AND_HEIGHT_PX[photo], width,
                       height, fps, frames, face_share)


def _write_clip(path: Path, rgb: np.ndarray, face, width: int, height: int, fps: float,
                frames: int, face_share: float) -> Path:
    """`rgb` on a smooth, looping path (pan, ±6° roll, ±5 % zoom) through OpenCV's 'mp4v'
    encoder; `face` ((x, y), height) is scaled to `face_share` of the frame's height, else the
    photo fills the frame."""
    bgr = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2BGR)
    if face is not None:
        (face_x, face_y), face_height = face
        base_scale = face_share * height / face_height
    else:
        face_x, face_y = bgr.shape[1] / 2, bgr.shape[0] / 2
        base_scale = max(width / bgr.shape[1], height / bgr.shape[0]) * 1.1
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path} with its FFmpeg 'mp4v' encoder")
    try:
        for index in range(frames):
            phase = 2 * math.pi * index / frames
            scale = base_scale * (1 + 0.05 * math.sin(phase))
            roll_deg = 6 * math.sin(2 * phase)
            centre = (width / 2 + 0.05 * width * math.sin(phase),
                      height / 2 + 0.03 * height * math.cos(phase))
            matrix = cv2.getRotationMatrix2D((face_x, face_y), roll_deg, scale)
            matrix[:, 2] += np.asarray(centre) - (face_x, face_y)
            writer.write(cv2.warpAffine(bgr, matrix, (width, height),
                                        borderMode=cv2.BORDER_REFLECT101))
    finally:
        writer.release()
    return path


def read_clip(path: Path) -> list[np.ndarray]:
    """Every frame of a video file, BGR, as OpenCV's FFmpeg backend decodes it (what a file
    camera's capture worker publishes)."""
    capture = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    frames = []
    try:
        while True:
            ok, frame = capture.read()
            if not ok:
                return frames
            frames.append(frame)
    finally:
        capture.release()
