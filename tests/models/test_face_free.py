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
    known = {name: found.pop(name) for name in KNOWN_FALSE_FACES}
    assert not any(found.values()), found  # faces reported per clip
    if any(known.values()):
        pytest.xfail(f"known false faces, issue 24 item 5: {known} ({KNOWN_FALSE_FACES})")
    pytest.fail(f"the known false faces are gone ({known}): remove them from KNOWN_FALSE_FACES")


# Open (issue 24, item 5), measured on the CPU 2026-11-25: in the rocket clip facecast's
# full-range detector (which MediaPipe's FaceLandmarker does not run: facecast adds it, with
# tiles, for small faces) finds a 30 px "face" at score 0.61-0.75 in 10 of 30 frames, and the
# mesh's presence passes one of them (0.63 against min_presence 0.5); MediaPipe's short-range
# detector finds nothing there. A test that xfails while the false face is there and fails the
# day it is gone, so that this entry is removed with the fix.
KNOWN_FALSE_FACES = {"rocket": "a full-range-only detection whose mesh presence passes 0.5"}
