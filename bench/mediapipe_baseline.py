"""MediaPipe CPU baseline for the whole-daemon bench: one MediaPipe process per camera.

    python bench/mediapipe_baseline.py --cameras 4 [--face-px 100 250] [--warmup-s 3]
                                       [--measure-s 10] [--out result.json]
    python bench/mediapipe_baseline.py --prepare-wheels .mp [--python-version 3.12]

This is how tools before facecast ran MediaPipe: one process per camera, each grabbing the
newest frame and calling MediaPipe's face mesh on it, single file. Every camera process here
renders facecast's synthetic 1920x1080 @ 30 fps camera
(`facecast.workers.capture.sources.SyntheticSource`:
the scene that the daemon's capture worker of the same camera id renders, paced the same way:
a frame the process is too busy to take is skipped and counted), converts it to RGB and runs
`mediapipe.solutions.face_mesh.FaceMesh(static_image_mode=False, refine_landmarks=True,
max_num_faces=2)` (mediapipe 0.10.21, the legacy solution: its .tflite models ship in the wheel,
no face_landmarker.task needed; the same models facecast ports to PyTorch). Reported over a
window of time after a warm-up (frames in it by when they were due), the same for every
camera, counted as bench/accounting.py defines for both sides (Note [One definition for both
sides]):

- frames due, frames published (here: `FaceMesh.process` returned on the frame), dropped = due −
  published (count and %); frames the source skipped while the process was busy, for reference;
- capture → result latency p50/p99: from the frame's capture stamp (`pylsl.local_clock()` at
  grab, before rendering, as in the daemon) to `FaceMesh.process` returning; the worst camera's;
- faces: every processed frame's results (their mesh turned into facecast's detector-style box)
  against the scene's ground truth, found/true by face width;
- CPU time of all camera processes (user + system, every thread) per second of the window, and
  the part of it spent rendering the synthetic frames (the daemon's capture workers pay that
  too); per published frame as well. The bench's own counting (boxes, matching) is timed and
  left out.

`--face-px 100 250` replaces the daemon scene's face sizes (about 420 px wide at 1080p, fixed in
`SyntheticScene`) by these widths, to show which faces MediaPipe's short-range detector misses.

Environment: the camera processes need mediapipe 0.10.21 and protobuf 4.25 besides facecast's
own (numpy 1.26 or 2.x, OpenCV, pylsl, msgspec); mediapipe's other requirements (matplotlib,
jax, opencv-contrib, sounddevice, sentencepiece, numpy<2) are not imported by the face mesh
(Note [Importing only the face mesh]). `--prepare-wheels DIR` downloads both wheels for a Python
version and strips mediapipe's to what the face mesh loads (about 12 MB instead of 34 MB), for
an offline host: `python3 -m pip install --no-index --no-deps --target /tmp/mp DIR/*.whl`, then
give `/tmp/mp` as `bench/pipeline.py --mediapipe-path` (or prepend it to PYTHONPATH).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import resource
import selectors
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np
import pylsl

import accounting  # bench/accounting.py: this script's folder is first on sys.path
from facecast.workers.capture.sources import SyntheticScene

WIDTH, HEIGHT, FPS = 1920, 1080, 30
MAX_FACES = 2
MEDIAPIPE_VERSION = "0.10.21"
PROTOBUF_VERSION = "4.25.9"  # mediapipe 0.10.21 asks for protobuf>=4.25.3,<5
DESCRIPTION = (f"MediaPipe {MEDIAPIPE_VERSION} FaceMesh(static_image_mode=False, refine_landmarks=True, "
               f"max_num_faces={MAX_FACES}) on the CPU, one process per camera")
# Files of the mediapipe wheel that the face mesh opens at run time besides Python modules and
# the bindings (found with strace on FaceMesh(refine_landmarks=True)).
FACE_MESH_ASSETS = (
    "mediapipe/modules/face_detection/face_detection_short_range.tflite",
    "mediapipe/modules/face_landmark/face_landmark_front_cpu.binarypb",
    "mediapipe/modules/face_landmark/face_landmark_with_attention.tflite",
)


# ---------------------------------------------------------------------------------------------
# Shared by both sides: the small-face scene (bench/pipeline.py uses it as well; what is counted
# and how is bench/accounting.py's).
# ---------------------------------------------------------------------------------------------


class FixedSizeScene(SyntheticScene):
    """The daemon's synthetic scene (same faces, path and wobble) with other face widths.

    Overrides SyntheticScene's private `_placements`, which both `render` and `faces_at` go
    through, so that the ground truth stays exact: each face is rescaled about its own centre.
    """

    def __init__(self, width: int, height: int, seed: str, face_px: list[float]) -> None:
        super().__init__(width, height, seed)
        self.face_px = list(face_px)

    def _placements(self, t_s: float):
        placements = []
        for (sprite, scale, offset_x, offset_y), face_px in zip(super()._placements(t_s), self.face_px):
            x1, y1, x2, y2 = sprite.face_box_px
            center_x, center_y = offset_x + scale * (x1 + x2) / 2, offset_y + scale * (y1 + y2) / 2
            new_scale = scale * face_px / self._base_face_px
            placements.append((sprite, new_scale, center_x - new_scale * (x1 + x2) / 2,
                               center_y - new_scale * (y1 + y2) / 2))
        return placements


# ---------------------------------------------------------------------------------------------
# Runs in each camera process (a child started by `run`, under the MediaPipe environment).
# ---------------------------------------------------------------------------------------------

# Note [Importing only the face mesh]
# `import mediapipe` runs mediapipe/__init__.py, which imports every legacy solution (their
# drawing utilities need matplotlib) and the Tasks API. The face mesh needs none of that: only
# mediapipe/python/__init__.py (the C++ bindings, numpy, protobuf) and solutions/face_mesh.py.
# So `mediapipe` and `mediapipe.python.solutions` are registered as bare packages (their
# __init__.py not run) before importing face_mesh; the computation is MediaPipe's own, unchanged
# (on the fixture images it gives the landmarks of tests/models/fixtures/mediapipe_faces.npz,
# made with a full install and numpy 1.26, to 1e-4 px, under numpy 2.4 and 2.5).


def import_face_mesh():
    import importlib
    import importlib.util
    import types

    def bare_package(name: str) -> None:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ImportError(f"{name} is not installed (see bench/mediapipe_baseline.py's docstring)")
        module = types.ModuleType(name)
        module.__spec__, module.__path__ = spec, list(spec.submodule_search_locations)
        sys.modules[name] = module

    bare_package("mediapipe")
    importlib.import_module("mediapipe.python")
    bare_package("mediapipe.python.solutions")
    return importlib.import_module("mediapipe.python.solutions.face_mesh")


def cpu_s() -> float:
    """User + system CPU seconds of this process, all threads (MediaPipe's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def camera_process(camera_id: str, face_px: list[float] | None, source_kind: str,
                   genlocked: bool = False) -> dict:
    """Render and measure frames until the window that "go" names is over; report on it."""
    import importlib.metadata

    from facecast.shared.config import CameraConfig
    from facecast.workers.capture.sources import open_source, synthetic_truth

    face_mesh = import_face_mesh()
    cv2.setNumThreads(1)  # as facecast's capture workers render (workers/capture/worker.py)
    # The daemon's capture worker of this camera id opens the same source: same frames, paced
    # the same way ("synthetic-replay": a loop rendered once, Note [Synthetic replay]).
    camera = CameraConfig(id=camera_id, source=source_kind, width=WIDTH, height=HEIGHT, fps=FPS,
                          phase=0.0 if genlocked else None)
    source = open_source(camera)
    truth = synthetic_truth(camera)  # when each frame was due (Note [Due, not stamped])
    if face_px:
        if source_kind != "synthetic":
            raise ValueError(f"--face-px needs the live synthetic source, not {source_kind!r}")
        source.scene = FixedSizeScene(WIDTH, HEIGHT, camera_id, face_px)
    with face_mesh.FaceMesh(static_image_mode=False, refine_landmarks=True, max_num_faces=MAX_FACES,
                            min_detection_confidence=0.5) as mesh:
        # The graph's first call loads the models and sets up XNNPACK: paid before "ready".
        mesh.process(cv2.cvtColor(source.scene.render(0.0), cv2.COLOR_BGR2RGB))
        print("ready", flush=True)
        # "go <start_ts_lsl> <frames per camera>": every camera starts together, and all share
        # one window of capture time (the frames before it are the warm-up).
        _, start_ts_lsl, frames_per_camera = sys.stdin.readline().split()
        window = accounting.Window(float(start_ts_lsl), int(frames_per_camera), FPS)
        latencies_ms: list[float] = []
        published_due_ts_lsl: set[float] = set()
        faces = accounting.FaceTally()
        render_cpu_s = accounting_cpu_s = 0.0
        cpu_at_start_s = skipped_at_start = None  # before reading the window's first frame
        while True:
            cpu_before_read_s, skipped_before_read = cpu_s(), source.frames_skipped
            render_started_cpu_s = time.thread_time()
            frame, capture_ts_lsl = source.read()  # waits for the frame's turn, then renders it
            render_done_cpu_s = time.thread_time()
            due_ts_lsl = float(accounting.due_ts_lsl(truth, capture_ts_lsl))
            if due_ts_lsl >= window.end_ts_lsl:
                break  # not processed: the window's CPU ends before this frame's read
            in_window = window.contains(due_ts_lsl)
            if in_window and cpu_at_start_s is None:
                cpu_at_start_s, skipped_at_start = cpu_before_read_s, skipped_before_read
            result = mesh.process(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            done_ts_lsl = pylsl.local_clock()
            if not in_window:
                continue
            render_cpu_s += render_done_cpu_s - render_started_cpu_s
            latencies_ms.append((done_ts_lsl - capture_ts_lsl) * 1e3)
            published_due_ts_lsl.add(due_ts_lsl)  # a frame shown twice counts once
            counting_started_cpu_s = time.thread_time()
            boxes = [accounting.mesh_box_px(np.array([(point.x * WIDTH, point.y * HEIGHT)
                                                      for point in face.landmark]))
                     for face in result.multi_face_landmarks or []]
            faces.add(source.ground_truth(capture_ts_lsl), boxes)
            accounting_cpu_s += time.thread_time() - counting_started_cpu_s
    if cpu_at_start_s is None:
        raise RuntimeError(f"camera {camera_id}: no frame was captured inside the window")
    return {
        "camera": camera_id,
        "mediapipe_version": importlib.metadata.version("mediapipe"),
        "window_s": window.length_s,
        "frames_published": len(published_due_ts_lsl),
        "lost_between": accounting.frames_lost_between(sorted(published_due_ts_lsl), FPS),
        "skipped_by_source": source.frames_skipped - skipped_at_start,
        # The bench's counting (boxes, matching) ran in this process but is not MediaPipe's cost.
        "cpu_s": cpu_before_read_s - cpu_at_start_s - accounting_cpu_s,
        "render_cpu_s": render_cpu_s,
        "accounting_cpu_s": accounting_cpu_s,
        "latency_p50_ms": float(np.percentile(latencies_ms, 50)) if latencies_ms else None,
        "latency_p99_ms": float(np.percentile(latencies_ms, 99)) if latencies_ms else None,
        "faces": faces.as_dict(),
    }


# ---------------------------------------------------------------------------------------------
# Runs in the bench: starts the camera processes, gathers and sums their reports.
# ---------------------------------------------------------------------------------------------


def _read_line_each(procs: list[subprocess.Popen], deadline_monotonic: float) -> list[str]:
    """One line of stdout from every process, or TimeoutError naming those that gave none."""
    lines: dict[int, str] = {}
    buffers = {p.stdout.fileno(): b"" for p in procs}
    index_of = {p.stdout.fileno(): k for k, p in enumerate(procs)}
    with selectors.DefaultSelector() as selector:
        for p in procs:
            selector.register(p.stdout, selectors.EVENT_READ)
        while len(lines) < len(procs):
            timeout_s = deadline_monotonic - time.monotonic()
            if timeout_s <= 0:
                break
            for key, _ in selector.select(timeout_s):
                fd = key.fd
                chunk = os.read(fd, 65536)
                buffers[fd] += chunk
                if b"\n" in buffers[fd] or not chunk:
                    lines[index_of[fd]] = buffers[fd].split(b"\n", 1)[0].decode()
                    selector.unregister(key.fileobj)
    if len(lines) < len(procs):
        missing = [k for k in range(len(procs)) if k not in lines]
        raise TimeoutError(f"camera processes {missing} said nothing in time")
    return [lines[k] for k in range(len(procs))]


def run(cameras: int, *, face_px: list[float] | None = None, source: str = "synthetic",
        warmup_s: float = 3.0, measure_s: float = 10.0, boot_timeout_s: float = 120.0,
        log_dir: Path | None = None, python: str = sys.executable,
        pythonpath: Sequence[str] = (), genlocked: bool = False) -> dict:
    """Start `cameras` camera processes (`python`, with `pythonpath` put before $PYTHONPATH),
    run them together, and sum their reports."""
    log_dir = log_dir or Path(tempfile.gettempdir()) / "facecast-bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    sizes = "-" + "-".join(f"{px:g}px" for px in face_px) if face_px else ""
    log_path = log_dir / f"mediapipe-{cameras}-{source}{sizes}.log"
    result: dict = {"cameras": cameras, "side": "mediapipe", "baseline": DESCRIPTION,
                    "source": source, "face_px": face_px, "log": str(log_path),
                    "phases": "genlocked" if genlocked else "free-running"}
    command = [python, str(Path(__file__).resolve()), "--camera-process", "--source", source] + (
        ["--face-px", *map(str, face_px)] if face_px else []) + (
        ["--genlocked"] if genlocked else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])]))
    procs: list[subprocess.Popen] = []
    reports: list[dict] = []
    with open(log_path, "w") as log:
        try:
            for k in range(cameras):
                procs.append(subprocess.Popen(command + ["--camera-id", f"cam{k:02d}"], env=env,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
            ready = _read_line_each(procs, time.monotonic() + boot_timeout_s)
            if any(line != "ready" for line in ready):
                raise RuntimeError(f"camera processes did not start: {ready}")
            window = accounting.Window.starting_at(pylsl.local_clock() + warmup_s, measure_s, FPS)
            for p in procs:
                p.stdin.write(f"go {window.start_ts_lsl!r} {window.frames_per_camera}\n".encode())
                p.stdin.flush()
            reports = [json.loads(line) for line in
                       _read_line_each(procs, time.monotonic() + warmup_s + window.length_s + 60.0)]
        except (OSError, RuntimeError, TimeoutError, json.JSONDecodeError) as exc:
            log.flush()
            tail = log_path.read_text(errors="replace").splitlines()[-8:]
            result["error"] = f"{exc} | " + " | ".join(tail)
            return result
        finally:
            # Bounded: after their report the processes end by themselves; on a failure (or a
            # straggler) they are killed, never left waiting for "go".
            deadline_monotonic = time.monotonic() + (10.0 if reports else 0.0)
            for p in procs:
                try:
                    p.wait(max(0.0, deadline_monotonic - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
    published = sum(r["frames_published"] for r in reports)
    cpu_s_total = sum(r["cpu_s"] for r in reports)
    render_cpu_s = sum(r["render_cpu_s"] for r in reports)
    faces = accounting.FaceTally()
    for r in reports:
        faces.merge(r["faces"])
    result.update({
        "mediapipe_version": reports[0]["mediapipe_version"],
        **accounting.frame_counts(cameras, window, published,
                                  sum(r["lost_between"] for r in reports)),
        "skipped_by_source": sum(r["skipped_by_source"] for r in reports),
        **accounting.worst_camera_latency((r["latency_p50_ms"], r["latency_p99_ms"])
                                          for r in reports),
        "cpu_cores_busy": round(cpu_s_total / window.length_s, 2),
        "render_cores_busy": round(render_cpu_s / window.length_s, 2),
        "cpu_ms_per_frame": round(1e3 * cpu_s_total / max(published, 1), 2),
        "render_cpu_ms_per_frame": round(1e3 * render_cpu_s / max(published, 1), 2),
        "faces": faces.summary(),
        "per_camera": reports,
    })
    return result


# ---------------------------------------------------------------------------------------------
# Wheels for an offline host (runs where the package index is).
# ---------------------------------------------------------------------------------------------


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _keep(name: str) -> bool:
    """Whether a file of the mediapipe wheel is kept: what the face mesh imports or opens."""
    if name.startswith(("mediapipe/tasks/", "mediapipe/model_maker/", "mediapipe/examples/")):
        return False
    if name.startswith("mediapipe/modules/"):
        return name.endswith(".py") or name in FACE_MESH_ASSETS
    return True


def strip_mediapipe_wheel(wheel: Path, dest_dir: Path) -> Path:
    """A copy of the wheel with only what the face mesh needs, and a RECORD to match. The build
    tag "1facemesh" in its name says that it is not the file PyPI serves."""
    name, version, rest = wheel.name.split("-", 2)
    out = dest_dir / f"{name}-{version}-1facemesh-{rest}"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        record = []
        for info in src.infolist():
            if info.is_dir() or info.filename == record_name or not _keep(info.filename):
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            record.append(f"{info.filename},{_record_hash(data)},{len(data)}")
        record.append(f"{record_name},,")
        dst.writestr(src.getinfo(record_name), "\n".join(record) + "\n",
                     compress_type=zipfile.ZIP_DEFLATED)
    return out


def prepare_wheels(dest_dir: Path, python_version: str) -> list[Path]:
    """Download mediapipe and protobuf for `python_version` (manylinux x86_64), strip mediapipe's."""
    abi = "cp" + python_version.replace(".", "")
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mpwheels-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", "--python-version", python_version,
                        "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
                        "--dest", tmp, f"mediapipe=={MEDIAPIPE_VERSION}",
                        f"protobuf=={PROTOBUF_VERSION}"], check=True)
        made = []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            if wheel.name.startswith("mediapipe-"):
                made.append(strip_mediapipe_wheel(wheel, dest_dir))
            else:
                made.append(dest_dir / wheel.name)
                made[-1].write_bytes(wheel.read_bytes())
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cameras", type=int, default=1)
    parser.add_argument("--face-px", type=float, nargs="+", metavar="PX",
                        help="face widths instead of the daemon scene's (one per face, two faces)")
    parser.add_argument("--source", choices=("synthetic", "synthetic-replay"), default="synthetic",
                        help="the cameras' source, as in facecast's config")
    parser.add_argument("--genlocked", action="store_true",
                        help="synthetic-replay cameras all at phase 0, capturing at one instant "
                        "(Note [Capture phases]); default: each at its own phase")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--boot-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, help="JSON results (default: stdout)")
    parser.add_argument("--prepare-wheels", type=Path, metavar="DIR",
                        help="only download and strip the wheels for an offline host into DIR")
    parser.add_argument("--python-version", default="3.12", help="with --prepare-wheels")
    parser.add_argument("--camera-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--camera-id", default="cam00", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare_wheels:
        for wheel in prepare_wheels(args.prepare_wheels, args.python_version):
            print(f"{wheel} ({wheel.stat().st_size / 2**20:.1f} MiB)")
        return 0
    if args.camera_process:
        report = camera_process(args.camera_id, args.face_px, args.source, args.genlocked)
        print(json.dumps(report), flush=True)
        return 0
    result = run(args.cameras, face_px=args.face_px, source=args.source, genlocked=args.genlocked,
                 warmup_s=args.warmup_s,
                 measure_s=args.measure_s, boot_timeout_s=args.boot_timeout_s)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
