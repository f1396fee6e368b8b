"""face_landmarker.task's models converted to torch, against LiteRT on the CPU: the v2 landmarker
(face_landmarks_detector.tflite) and the blendshape model (face_blendshapes.tflite), as
tests/models/test_convert_parity.py does for the other models (≤ 1e-4 relative; the table of
maxima is printed at the end of the session).

Inputs are run through torch as ONE batch (so batching is checked too) and through LiteRT one at
a time: for the landmarker a random image and the two photos' faces, for the blendshape model
the 146-landmark input of every face MediaPipe found in the fixtures (real expressions, at
several image sizes) and random points.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from facecast.models import blendshapes as blendshapes_mod
from facecast.models import face_landmarker
from facecast.models.tflite_convert import convert

from litert_reference import PARITY_TABLE, relative_error, run_litert
from test_convert_parity import _face_crop, _to_model_input, convert_as_prepared

TOLERANCE = 1e-4
FIXTURES = Path(__file__).parent / "fixtures"


def _check(name: str, path: Path, samples: list[np.ndarray], cpu_kernels: bool = False) -> None:
    module = convert_as_prepared(path, name, cpu_kernels)
    with torch.no_grad():
        batched = module(torch.from_numpy(np.concatenate(samples)))
    failures = []
    for position, output_name in enumerate(module.output_names):
        errors = []
        for index, sample in enumerate(samples):
            expected = run_litert(path, [sample])[position]
            actual = batched[position][index:index + 1].numpy().reshape(expected.shape)
            errors.append(relative_error(actual, expected))
        PARITY_TABLE[(f"{name} cpu kernels" if cpu_kernels else name, f"{position}:{output_name}")] = (
            max(errors), TOLERANCE)
        if max(errors) > TOLERANCE:
            failures.append(f"output {position} {output_name!r}: max error {max(errors):.2e}")
    assert not failures, f"{name}: " + "; ".join(failures)


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["conv2d", "cpu_kernels"])
def test_v2_landmarker_matches_litert(landmarker_bundle, photos, cpu_kernels):
    path = landmarker_bundle.face_landmarks_detector
    shape = (1, face_landmarker.INPUT_PX, face_landmarker.INPUT_PX, 3)
    samples = [np.random.default_rng(0).uniform(0, 1, size=shape).astype(np.float32)]
    samples += [_to_model_input(_face_crop(photo, name), shape, (0.0, 1.0))
                for name, photo in photos.items()]
    _check("face_landmarks_detector", path, samples, cpu_kernels)
    # The decoding's premise: the photos' faces are present and their landmarks are inside the crop.
    module = convert(path).eval()
    with torch.no_grad():
        landmarks, presence = face_landmarker.decode(module(torch.from_numpy(np.concatenate(samples[1:]))))
    assert (presence > 0.9).all(), presence
    assert landmarks.shape == (2, 478, 3)
    assert (landmarks[..., :2] > 0).all() and (landmarks[..., :2] < face_landmarker.INPUT_PX).all()


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["conv2d", "cpu_kernels"])
def test_blendshape_model_matches_litert(landmarker_bundle, cpu_kernels):
    arrays = np.load(FIXTURES / "mediapipe_face_landmarker.npz")
    faces = np.concatenate([arrays[key] for key in arrays.files if key.endswith("/landmarks_px")])
    inputs = blendshapes_mod.model_input(torch.from_numpy(faces)).numpy()
    samples = [face[None] for face in inputs]
    samples.append(np.random.default_rng(1).uniform(0, 640, size=(1, 146, 2)).astype(np.float32))
    assert len(samples) >= 10
    _check("face_blendshapes", landmarker_bundle.face_blendshapes, samples, cpu_kernels)


def test_blendshape_input_is_mediapipes_subset_in_pixels():
    landmarks = torch.arange(478 * 3, dtype=torch.float32).reshape(1, 478, 3)
    picked = blendshapes_mod.model_input(landmarks)
    assert picked.shape == (1, 146, 2)
    # x, y of landmarks 0, 1, 4 ... 477, in that order.
    assert picked[0, :3].tolist() == [[0.0, 1.0], [3.0, 4.0], [12.0, 13.0]]
    assert picked[0, -1].tolist() == [477 * 3.0, 477 * 3.0 + 1]
    with pytest.raises(ValueError, match="478"):
        blendshapes_mod.model_input(landmarks[:, :468])


def test_blendshape_names_are_the_ones_mediapipe_reports():
    import json

    from facecast.workers.output.outlets import BLENDSHAPE_NAMES as CHANNEL_NAMES

    meta = json.loads((FIXTURES / "mediapipe_face_landmarker.json").read_text())
    assert list(blendshapes_mod.BLENDSHAPE_NAMES) == meta["blendshape_names"] == list(CHANNEL_NAMES)
