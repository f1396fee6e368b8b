"""Faces on real-looking footage through the daemon's CUDA path, frame by frame against the CPU
stack (issue 24, item 0; marker gpu).

What synthetic scenes of small pasted photos hid: on real video the CUDA daemon lost the face for
seconds while the CPU stack found it in every frame. The cause was the detection worker's first
passes over detector batch shapes it had not prepared (Note [Warm shapes]): a file camera
configured without its size delivers frames of another
size than the config's, and with graphs off nothing was prepared at all. Until its first
detection the roi_landmark worker has no face to follow, so every frame of those seconds was
published without one.

Each clip plays as a looped file camera, its size left to the file as a lab user writes it. The
test reads the camera's Face stream (with landmarks) and its frame-index stream from the moment
they exist, before READY, and asks of every frame published from FIRST_FACE_S after the first:
a face, and landmarks within LANDMARK_PX of the CPU stack's on the same frame of the file
(`frame_seq` modulo the file's length: a file camera publishes every frame of the file, in
order). The made clip runs everywhere; $FACECAST_REAL_FOOTAGE names more video files (the real
clip of ../shared/footage on the GPU machine).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from daemon_harness import Daemon, Recorder
from facecast.shared.transport.cuda_driver import cuda_unavailable_reason
from facecast.workers.output.outlets import FACE_LANDMARK_COUNT, face_channels
from footage import make_face_clip, read_clip

pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

# The first frames of a stream may go without a face: the roi_landmark worker asks for a
# detection on its first frame and follows the face from the frame it gets one for (and a
# frame size no graph was captured for costs that capture once). Measured on the H100
# (2026-11-25): with graphs the very first frame had its face; eager, the first face came 0.64 s
# after the first frame, while the warm spares booted beside it. Issue 24's item 5 (a new face
# within 100 ms) is the goal beyond this test.
FIRST_FACE_S = 1.0
RECORD_S = 6.0
# Per frame, the median distance of the 478 landmarks from the CPU stack's (pixels of a 640x360
# frame; the face is ~150 px high). The daemon follows the face from the frame it last measured,
# which under the newest-frame policy need not be the frame before, so its ROI (and landmarks)
# may differ a little from the CPU's run over every frame.
LANDMARK_PX = 1.5
VARIANTS = {  # name: (cuda_graphs, half)
    "eager-fp32": (False, False),
    "graphs-fp32": (True, False),
    "eager-fp16": (False, True),
    "graphs-fp16": (True, True),
}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[Path]:
    reason = cuda_unavailable_reason()
    if reason:
        pytest.skip(f"needs CUDA: {reason}")
    made = make_face_clip(tmp_path_factory.mktemp("footage") / "astronaut.mp4")
    extra = [Path(p) for p in os.environ.get("FACECAST_REAL_FOOTAGE", "").split(os.pathsep) if p]
    return [made, *extra]


@pytest.fixture(scope="module")
def cpu_landmarks(clips) -> dict[str, list[np.ndarray | None]]:
    """Per clip, per frame of the file: the CPU stack's landmarks (x, y) of the face, tracked
    through the loop once so that frame 0 is measured as a looping camera meets it."""
    from facecast.models import assets
    from facecast.models.pipeline import FacePipeline

    pipeline = FacePipeline(device="cpu", max_faces=1,
                            face_landmarker_task=assets.landmarker_bundle(None).path)
    found = {}
    for clip in clips:
        frames = read_clip(clip)
        pipeline.reset()
        measured = [pipeline.track([frame], ["clip"])[0] for frame in frames + frames]
        found[clip.name] = [faces[0].landmarks[:, :2] if faces else None
                            for faces in measured[len(frames):]]
        assert all(lm is not None for lm in found[clip.name]), f"{clip.name}: the CPU misses faces"
    return found


def _config(clips: list[Path], cuda_graphs: bool, half: bool) -> str:
    lines = ["[daemon]", 'transport = "cuda_ipc"', "", "[models]", 'device = "cuda"',
             f"cuda_graphs = {str(cuda_graphs).lower()}", f"half = {str(half).lower()}", "",
             "[output]", "max_faces = 1", "landmarks = true", "", "[web]", "enabled = false", ""]
    for index, clip in enumerate(clips):
        # No width, height or fps: the file's own (the config's defaults are another size).
        lines += ["[[cameras]]", f'id = "clip{index}"', f'source = "{clip}"', ""]
    return "\n".join(lines)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_daemon_finds_the_face_in_every_frame_as_the_cpu_stack(variant, clips, cpu_landmarks,
                                                                       tmp_path):
    cuda_graphs, half = VARIANTS[variant]
    labels = [label for label, _, _ in face_channels(landmarks=True)]
    first_x = labels.index("landmark000_x")
    daemon = Daemon(tmp_path, config_text=_config(clips, cuda_graphs, half))
    try:
        # From the moment the streams exist (the output worker makes them before READY).
        faces = daemon.resolve("Face", count=len(clips), timeout_s=180)
        frame_index = daemon.resolve("VideoExternal", count=len(clips), timeout_s=60)
        recorder = Recorder(faces + frame_index)
        assert daemon.notify.wait_for("READY=1", timeout_s=180), daemon.log_tail()
        deadline = time.monotonic() + 120
        while not all(len(r.timestamps) and r.timestamps[-1] - r.timestamps[0] >= RECORD_S
                      for r in faces):
            assert time.monotonic() < deadline, daemon.log_tail()
            time.sleep(0.1)
        recorder.stop()
    finally:
        daemon.close()

    problems = []
    for index, clip in enumerate(clips):
        face = next(r for r in faces if f"-clip{index}-face" in r.source_id)
        frames = next(r for r in frame_index if f"-clip{index}-frames" in r.source_id)
        seq_at = {ts: int(sample[0]) for ts, sample in zip(frames.timestamps, frames.samples)}
        reference = cpu_landmarks[clip.name]
        first_ts = face.timestamps[0]
        judged = missed = unmatched = 0
        distances = []
        for ts, sample in zip(face.timestamps, face.samples):
            if ts < first_ts + FIRST_FACE_S:
                continue
            judged += 1
            points = np.asarray(sample[first_x:first_x + 3 * FACE_LANDMARK_COUNT]).reshape(-1, 3)
            if not np.isfinite(points).all():
                missed += 1
                continue
            if ts not in seq_at:
                unmatched += 1  # a frame-index sample the inlet has not pulled: not judged
                continue
            cpu = reference[seq_at[ts] % len(reference)]
            distances.append(float(np.median(np.linalg.norm(points[:, :2] - cpu, axis=1))))
        distances = np.asarray(distances)
        summary = (f"{clip.name} ({variant}): {judged} frames judged, {missed} without a face, "
                   f"{unmatched} not in the frame index; landmarks vs the CPU per frame: median "
                   f"{np.median(distances) if len(distances) else float('nan'):.3f} px, max "
                   f"{distances.max() if len(distances) else float('nan'):.3f} px")
        print(summary)
        if judged < 0.8 * 30 * (RECORD_S - FIRST_FACE_S) or missed or len(distances) < 0.9 * judged \
                or (distances > LANDMARK_PX).any():
            problems.append(summary)
    assert not problems, problems
