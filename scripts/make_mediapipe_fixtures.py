"""Make the MediaPipe reference fixtures for facecast's face pipeline (run once, by hand).

What it does
------------
1. Builds the test images (``build_cases``): scikit-image's astronaut and matplotlib's
   grace_hopper, and transformed versions of them (rotated ±30°, darker, brighter, noisy,
   JPEG-compressed, four faces in one image, faces scaled into 1920x1080 canvases).
2. Creates a throwaway virtualenv with ``mediapipe==0.10.21`` (it pins its own OpenCV, which
   conflicts with the project's ``opencv-python-headless``, so it never enters the main
   environment), re-runs this very script inside it with ``--inside-venv``, and there runs
   MediaPipe's own ``FaceMesh(static_image_mode=True, refine_landmarks=True)`` and
   ``FaceDetection(model_selection=0)`` on every image.
3. Writes ``tests/models/fixtures/mediapipe_faces.npz`` (landmarks, boxes, keypoints, float32)
   and ``tests/models/fixtures/mediapipe_faces.json`` (case list, per-face index, the known
   placement of pasted faces, image thumbnails, and the versions used).

The tests rebuild the same images with ``build_cases`` (this file is imported by path, so it
must stay importable without mediapipe) and compare a thumbnail of each image with the one
written here, so that a drifting image library is caught rather than silently compared.

Usage::

    python scripts/make_mediapipe_fixtures.py [--venv /tmp/facecast-mediapipe-venv]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MEDIAPIPE_VERSION = "0.10.21"
REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIR = REPO_ROOT / "tests" / "models" / "fixtures"
FIXTURE_STEM = "mediapipe_faces"
THUMBNAIL_SIZE_PX = 16
CANVAS_1080P_HW = (1080, 1920)
CANVAS_GRAY_LEVEL = 110


@dataclass
class Placement:
    """Where a source photo was pasted: canvas_xy = source_xy * scale + offset (pixels)."""

    source: str
    scale: float
    offset_x_px: float
    offset_y_px: float


@dataclass
class Case:
    name: str
    rgb: np.ndarray  # HxWx3 uint8, RGB
    # Pasted photos, for cases whose truth is the source photo's landmarks moved by a known
    # similarity transform rather than MediaPipe's result on the case itself.
    placements: list[Placement] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Image building: pure numpy / scikit-image / Pillow, identical in both environments.
# ---------------------------------------------------------------------------------------------


def load_sources() -> dict[str, np.ndarray]:
    """The two real photos, RGB uint8."""
    import skimage.data
    from matplotlib import cbook
    from PIL import Image

    grace = Image.open(cbook.get_sample_data("grace_hopper.jpg")).convert("RGB")
    return {"astronaut": skimage.data.astronaut(), "grace_hopper": np.asarray(grace).copy()}


def _to_uint8(image_float: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(image_float), 0, 255).astype(np.uint8)


def rotate_about_center(rgb: np.ndarray, angle_deg: float) -> np.ndarray:
    """In-plane rotation by angle_deg (counter-clockwise on screen), same canvas size."""
    from skimage.transform import rotate

    # order=1: bilinear; mode="edge" so that the corners do not turn into black triangles
    # that a detector could mistake for structure.
    rotated = rotate(rgb.astype(np.float64), angle_deg, order=1, mode="edge", preserve_range=True)
    return _to_uint8(rotated)


def scaled(rgb: np.ndarray, scale: float) -> np.ndarray:
    from skimage.transform import rescale

    return _to_uint8(
        rescale(rgb.astype(np.float64), scale, order=1, channel_axis=2, anti_aliasing=scale < 1,
                preserve_range=True)
    )


def jpeg_roundtrip(rgb: np.ndarray, quality: int) -> np.ndarray:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="JPEG", quality=quality)
    buffer.seek(0)
    return np.asarray(Image.open(buffer).convert("RGB")).copy()


def paste(canvas: np.ndarray, rgb: np.ndarray, x_px: int, y_px: int) -> None:
    h, w = rgb.shape[:2]
    canvas[y_px : y_px + h, x_px : x_px + w] = rgb


def build_cases() -> list[Case]:
    sources = load_sources()
    cases: list[Case] = []
    for name, rgb in sources.items():
        cases.append(Case(name, rgb))
        for angle_deg in (30, -30):
            cases.append(Case(f"{name}_rot{angle_deg:+d}", rotate_about_center(rgb, angle_deg)))
        cases.append(Case(f"{name}_dark", _to_uint8(rgb.astype(np.float64) * 0.45)))
        cases.append(Case(f"{name}_bright", _to_uint8(rgb.astype(np.float64) * 1.35 + 40)))
        noise = np.random.default_rng(1234).normal(0.0, 14.0, size=rgb.shape)
        cases.append(Case(f"{name}_noisy", _to_uint8(rgb.astype(np.float64) + noise)))
        cases.append(Case(f"{name}_jpeg", jpeg_roundtrip(rgb, quality=12)))

    # Four faces in one image: a 2x2 mosaic of 400x400 versions of both photos and their
    # mirror images.
    tile_px = 400
    astro = scaled(sources["astronaut"], tile_px / 512)[:tile_px, :tile_px]
    grace_src = sources["grace_hopper"]
    grace = scaled(grace_src[: grace_src.shape[1]], tile_px / grace_src.shape[1])[:tile_px, :tile_px]
    mosaic = np.concatenate(
        [np.concatenate([astro, grace], axis=1), np.concatenate([grace[:, ::-1], astro[:, ::-1]], axis=1)],
        axis=0,
    )
    cases.append(Case("four_faces", np.ascontiguousarray(mosaic)))

    # Faces scaled into 1920x1080 canvases at known places. The scale is chosen so that the
    # face box (MediaPipe's detection box on the source, about 95 px wide on the astronaut
    # and 195 px on grace_hopper) becomes the wanted width; the test moves the source's
    # MediaPipe landmarks by the same similarity transform.
    def canvas_case(name: str, items: list[tuple[str, float, int, int]], crop_top_left_px=(0, 0),
                    crop_size_px: int | None = None) -> Case:
        canvas = np.full(CANVAS_1080P_HW + (3,), CANVAS_GRAY_LEVEL, np.uint8)
        placements = []
        crop_x_px, crop_y_px = crop_top_left_px
        for source, scale, x_px, y_px in items:
            src = sources[source][crop_y_px:, crop_x_px:]
            if crop_size_px is not None:
                src = src[:crop_size_px, :crop_size_px]
            small = scaled(src, scale)
            paste(canvas, small, x_px, y_px)
            actual_scale = small.shape[1] / src.shape[1]
            placements.append(Placement(source, actual_scale, x_px - crop_x_px * actual_scale,
                                        y_px - crop_y_px * actual_scale))
        return Case(name, canvas, placements)

    # ~380 px face: the astronaut's head (a 256 px crop) scaled by 4.
    cases.append(canvas_case("canvas1080_large", [("astronaut", 4.0, 500, 30)], (96, 16), 256))
    cases.append(canvas_case("canvas1080_medium", [("grace_hopper", 0.9, 300, 250)]))  # ~175 px
    # Small faces, about 70, 100 and 140 px wide.
    cases.append(
        canvas_case(
            "canvas1080_small",
            [
                ("astronaut", 0.74, 150, 600),
                ("grace_hopper", 0.52, 620, 380),
                ("astronaut", 1.47, 1100, 150),
            ],
        )
    )
    cases.append(canvas_case("canvas1080_tiny_only", [("grace_hopper", 0.36, 1500, 760)]))  # ~70 px
    return cases


def thumbnail(rgb: np.ndarray) -> list[int]:
    """A 16x16 gray thumbnail (block means), for checking that images rebuild identically."""
    gray = rgb.astype(np.float64).mean(axis=2)
    h, w = gray.shape
    rows = np.array_split(np.arange(h), THUMBNAIL_SIZE_PX)
    cols = np.array_split(np.arange(w), THUMBNAIL_SIZE_PX)
    return [int(round(gray[np.ix_(r, c)].mean())) for r in rows for c in cols]


# ---------------------------------------------------------------------------------------------
# Inside the mediapipe virtualenv.
# ---------------------------------------------------------------------------------------------


def run_mediapipe(output_dir: Path) -> None:
    import cv2
    import mediapipe as mp
    import PIL
    import skimage

    cases = build_cases()
    arrays: dict[str, np.ndarray] = {}
    records = []
    mesh_kwargs = dict(static_image_mode=True, refine_landmarks=True, max_num_faces=4,
                       min_detection_confidence=0.5)
    with mp.solutions.face_mesh.FaceMesh(**mesh_kwargs) as face_mesh, \
            mp.solutions.face_detection.FaceDetection(model_selection=0,
                                                      min_detection_confidence=0.5) as detector:
        for case in cases:
            h, w = case.rgb.shape[:2]
            mesh_result = face_mesh.process(case.rgb)
            landmarks_px = []
            for face in mesh_result.multi_face_landmarks or []:
                # MediaPipe's normalized landmarks: x/width, y/height, z on the scale of x.
                # Stored in pixels, z multiplied by the image width like x.
                landmarks_px.append([[p.x * w, p.y * h, p.z * w] for p in face.landmark])
            det_result = detector.process(case.rgb)
            boxes_px, keypoints_px, scores = [], [], []
            for det in det_result.detections or []:
                box = det.location_data.relative_bounding_box
                boxes_px.append([box.xmin * w, box.ymin * h, (box.xmin + box.width) * w,
                                 (box.ymin + box.height) * h])
                keypoints_px.append([[k.x * w, k.y * h] for k in det.location_data.relative_keypoints])
                scores.append(float(det.score[0]))
            arrays[f"{case.name}/landmarks_px"] = np.asarray(landmarks_px, np.float32).reshape(-1, 478, 3)
            arrays[f"{case.name}/boxes_px"] = np.asarray(boxes_px, np.float32).reshape(-1, 4)
            arrays[f"{case.name}/keypoints_px"] = np.asarray(keypoints_px, np.float32).reshape(-1, 6, 2)
            records.append({
                "name": case.name,
                "height_px": h,
                "width_px": w,
                "num_mesh_faces": len(landmarks_px),
                "num_detections": len(boxes_px),
                "detection_scores": scores,
                "placements": [vars(p) for p in case.placements],
                "thumbnail": thumbnail(case.rgb),
            })
            print(f"{case.name:28s} {w}x{h}: mesh faces {len(landmarks_px)}, detections {len(boxes_px)}")

    meta = {
        "made_by": "scripts/make_mediapipe_fixtures.py",
        "versions": {
            "mediapipe": mp.__version__,
            "numpy": np.__version__,
            "opencv": cv2.__version__,
            "scikit-image": skimage.__version__,
            "pillow": PIL.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "face_mesh": {k: v for k, v in mesh_kwargs.items()},
        "face_detection": {"model_selection": 0, "min_detection_confidence": 0.5},
        "units": "pixels of the case image; landmark z = MediaPipe's normalized z * image width",
        "cases": records,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(output_dir / f"{FIXTURE_STEM}.npz", **arrays)
    (output_dir / f"{FIXTURE_STEM}.json").write_text(json.dumps(meta, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# Outside: make the virtualenv, run this file inside it.
# ---------------------------------------------------------------------------------------------


def ensure_venv(venv_dir: Path) -> Path:
    python = venv_dir / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"mediapipe=={MEDIAPIPE_VERSION}",
         "scikit-image", "matplotlib", "pillow"],
        check=True,
    )
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "facecast-mediapipe-venv",
                        help="virtualenv for mediapipe (created if missing; kept for reruns)")
    parser.add_argument("--output-dir", type=Path, default=FIXTURE_DIR)
    parser.add_argument("--inside-venv", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside_venv:
        run_mediapipe(args.output_dir)
        return 0
    python = ensure_venv(args.venv)
    subprocess.run([str(python), str(Path(__file__).resolve()), "--inside-venv",
                    "--output-dir", str(args.output_dir)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
