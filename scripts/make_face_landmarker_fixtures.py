"""Make the MediaPipe FaceLandmarker reference fixtures (run once, by hand; the result is committed).

What it does
------------
1. Builds the test images (``build_cases``): scikit-image's astronaut and matplotlib's
   grace_hopper, and transformed versions of them (scaled down and up, rotated ±25°, mirrored,
   and a 2x2 mosaic of four faces). The image helpers are scripts/make_mediapipe_fixtures.py's,
   imported by path, so both fixture sets are built from the same pixels.
2. Creates a throwaway virtualenv with ``mediapipe==0.10.21`` (never the project's environment:
   it pins its own OpenCV and numpy), re-runs this very script inside it with ``--inside-venv``,
   and there runs MediaPipe's tasks API: ``vision.FaceLandmarker`` in IMAGE mode with
   ``output_face_blendshapes=True`` and ``output_facial_transformation_matrixes=True``, on the
   ``face_landmarker.task`` bundle that ``facecast models install`` installs (same SHA-256).
3. Writes ``tests/models/fixtures/mediapipe_face_landmarker.npz`` (per case: landmarks in pixels
   with z multiplied by the image width like x, the 52 blendshape scores, the 4x4 facial
   transformation matrices; float32) and ``mediapipe_face_landmarker.json`` (case list, face
   counts, thumbnails, versions).

MediaPipe is never a runtime or test dependency: tests/models/test_face_landmarker_accuracy.py
rebuilds the images with ``build_cases`` (this file must stay importable without mediapipe) and
compares a thumbnail of each with the one written here.

Usage::

    python scripts/make_face_landmarker_fixtures.py [--venv /tmp/facecast-mediapipe-venv]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MEDIAPIPE_VERSION = "0.10.21"
REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIR = REPO_ROOT / "tests" / "models" / "fixtures"
FIXTURE_STEM = "mediapipe_face_landmarker"
MAX_FACES = 4


def _image_helpers():
    """scripts/make_mediapipe_fixtures.py, imported by path (scripts/ is not a package)."""
    name = "make_mediapipe_fixtures"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass
class Case:
    name: str
    rgb: np.ndarray  # HxWx3 uint8, RGB


def build_cases() -> list[Case]:
    helpers = _image_helpers()
    sources = helpers.load_sources()
    cases = []
    for name, rgb in sources.items():
        cases.append(Case(name, rgb))
        # Scaled: the astronaut's face is ~95 px wide at full size, grace_hopper's ~195 px.
        for scale in (0.6, 1.6):
            cases.append(Case(f"{name}_x{scale:g}", helpers.scaled(rgb, scale)))
        for angle_deg in (25, -25):
            cases.append(Case(f"{name}_rot{angle_deg:+d}", helpers.rotate_about_center(rgb, angle_deg)))
        cases.append(Case(f"{name}_mirror", np.ascontiguousarray(rgb[:, ::-1])))
    tile_px = 400
    astro = helpers.scaled(sources["astronaut"], tile_px / 512)[:tile_px, :tile_px]
    grace_src = sources["grace_hopper"]
    grace = helpers.scaled(grace_src[: grace_src.shape[1]], tile_px / grace_src.shape[1])[:tile_px, :tile_px]
    mosaic = np.concatenate(
        [np.concatenate([astro, grace], axis=1), np.concatenate([grace[:, ::-1], astro[:, ::-1]], axis=1)],
        axis=0,
    )
    cases.append(Case("four_faces", np.ascontiguousarray(mosaic)))
    return cases


def thumbnail(rgb: np.ndarray) -> list[int]:
    return _image_helpers().thumbnail(rgb)


# ---------------------------------------------------------------------------------------------
# Inside the mediapipe virtualenv.
# ---------------------------------------------------------------------------------------------


def run_mediapipe(output_dir: Path, task_path: Path) -> None:
    import mediapipe as mp
    from mediapipe.tasks import python as mp_tasks
    from mediapipe.tasks.python import vision

    options = vision.FaceLandmarkerOptions(
        base_options=mp_tasks.BaseOptions(model_asset_path=str(task_path)),
        running_mode=vision.RunningMode.IMAGE, num_faces=MAX_FACES,
        output_face_blendshapes=True, output_facial_transformation_matrixes=True)
    arrays: dict[str, np.ndarray] = {}
    records = []
    names: list[str] = []
    with vision.FaceLandmarker.create_from_options(options) as landmarker:
        for case in build_cases():
            h, w = case.rgb.shape[:2]
            result = landmarker.detect(mp.Image(image_format=mp.ImageFormat.SRGB,
                                                data=np.ascontiguousarray(case.rgb)))
            landmarks = [[[p.x * w, p.y * h, p.z * w] for p in face] for face in result.face_landmarks]
            blendshapes = [[c.score for c in face] for face in result.face_blendshapes]
            if result.face_blendshapes:
                names = [c.category_name for c in result.face_blendshapes[0]]
            arrays[f"{case.name}/landmarks_px"] = np.asarray(landmarks, np.float32).reshape(-1, 478, 3)
            arrays[f"{case.name}/blendshapes"] = np.asarray(blendshapes, np.float32).reshape(-1, 52)
            arrays[f"{case.name}/matrices"] = np.asarray(
                result.facial_transformation_matrixes, np.float32).reshape(-1, 4, 4)
            records.append({"name": case.name, "height_px": h, "width_px": w,
                            "num_faces": len(landmarks), "thumbnail": thumbnail(case.rgb)})
            print(f"{case.name:24s} {w}x{h}: {len(landmarks)} face(s)")
    import cv2
    import PIL
    import skimage

    meta = {
        "made_by": "scripts/make_face_landmarker_fixtures.py",
        "versions": {"mediapipe": mp.__version__, "numpy": np.__version__, "opencv": cv2.__version__,
                     "scikit-image": skimage.__version__, "pillow": PIL.__version__,
                     "python": platform.python_version(), "platform": platform.platform()},
        "face_landmarker": {"running_mode": "IMAGE", "num_faces": MAX_FACES,
                            "output_face_blendshapes": True,
                            "output_facial_transformation_matrixes": True,
                            "task_sha256": _sha256(task_path)},
        "units": "landmarks: pixels of the case image, z = MediaPipe's normalized z * image width; "
                 "matrices: MediaPipe's facial transformation matrix (canonical face model to "
                 "camera space, centimeters)",
        "blendshape_names": names,
        "cases": records,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(output_dir / f"{FIXTURE_STEM}.npz", **arrays)
    (output_dir / f"{FIXTURE_STEM}.json").write_text(json.dumps(meta, indent=1) + "\n")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Outside: the bundle, the virtualenv, then this file inside it.
# ---------------------------------------------------------------------------------------------


def ensure_venv(venv_dir: Path) -> Path:
    """The same virtualenv (mediapipe==MEDIAPIPE_VERSION) as make_mediapipe_fixtures.py's."""
    return _image_helpers().ensure_venv(venv_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "facecast-mediapipe-venv",
                        help="virtualenv for mediapipe (created if missing; kept for reruns)")
    parser.add_argument("--output-dir", type=Path, default=FIXTURE_DIR)
    parser.add_argument("--task", type=Path, default=None,
                        help="face_landmarker.task (default: the one `facecast models install` installs)")
    parser.add_argument("--inside-venv", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside_venv:
        run_mediapipe(args.output_dir, args.task)
        return 0
    task = args.task
    if task is None:
        from facecast.models import assets

        task = assets.install_landmarker_task()
    python = ensure_venv(args.venv)
    subprocess.run([str(python), str(Path(__file__).resolve()), "--inside-venv", "--task", str(task),
                    "--output-dir", str(args.output_dir)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
