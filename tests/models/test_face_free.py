"""Only faces are seen (issue 24, item 5): on footage without a face, facecast reports none, as
MediaPipe does. Photos without a face from the sample data, moving and MPEG-4 compressed
(tests/footage.py), through the face stack with a detection pass on every frame and tracking
between, on the CPU and (marker gpu) on CUDA with graphs as the daemon runs it."""

from __future__ import annotations

import pytest
import torch

from facecast.models import assets
from facecast.models.pipeline import FacePipeline
from footage import FACE_FREE_PHOTOS, make_face_free_clip, read_clip

FRAMES = 30


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, list]:
    folder = tmp_path_factory.mktemp("face-free")
    return {name: read_clip(make_face_free_clip(folder / f"{name}.mp4", name, frames=FRAMES))
            for name in FACE_FREE_PHOTOS}


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")]),
])
def test_no_face_is_reported_in_footage_without_one(device, clips, installed_models):
    torch.set_num_threads(1)  # as the other model tests: 2 cores shared with a busy process
    on_gpu = device == "cuda"
    pipeline = FacePipeline(device=device, max_faces=2, detect_interval_frames=1,
                            face_landmarker_task=installed_models[assets.LANDMARKER_TASK_NAME],
                            cuda_graphs=on_gpu)
    found = {}
    for name, frames in clips.items():
        assert len(frames) == FRAMES, name
        faces = [len(pipeline.track([frame], [name])[0]) for frame in frames]
        found[name] = sum(faces)
    # Every clip, the rocket included: its 32-35 px full-range-only "face" is narrower than
    # FULL_RANGE_ONLY_MIN_WIDTH_PX (Note [Faces only the full-range detector sees]).
    assert not any(found.values()), found  # faces reported per clip


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")]),
])
def test_small_faces_only_the_full_range_detector_sees_are_still_found(device, installed_models):
    """The other side of Note [Faces only the full-range detector sees]: the real 70 and 100 px
    faces (of photos) in a 1080p frame, which the short-range detector misses, are still found by
    the full-range detector over the whole frame (Note [The full-range detector over the whole
    frame]), and the 160 and 250 px ones too; nothing else is."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from accounting import FaceTally  # the benchmark's own definition of a found face
    from mediapipe_baseline import FixedSizeScene

    torch.set_num_threads(1)
    on_gpu = device == "cuda"
    pipeline = FacePipeline(device=device, max_faces=2, detect_interval_frames=1,
                            face_landmarker_task=installed_models[assets.LANDMARKER_TASK_NAME],
                            cuda_graphs=on_gpu)
    tally = FaceTally()
    for widths_px in ([100.0, 250.0], [70.0, 160.0]):
        scene = FixedSizeScene(1920, 1080, "cam00", widths_px)
        for k in range(6):
            t_s = k / 30
            found = pipeline.track([scene.render(t_s)], ["cam00"])[0]
            tally.add(scene.faces_at(t_s), [face.box for face in found])
        pipeline.reset()
    summary = tally.summary()
    assert summary["found_pct_by_width"] == {"<150 px": 100.0, "150-300 px": 100.0}, summary
    assert summary["extra"] == 0, summary
