"""Fixtures of the model tests: where the installed models are, real face photos, and the parity
table printed at the end of the session. The models themselves are tests/conftest.py's
`installed_models` and `embedding_network`, installed once per session for every test."""

from __future__ import annotations

import numpy as np
import pytest

from footage import face_photos
from litert_reference import PARITY_TABLE

from facecast.models import assets


@pytest.fixture(scope="session")
def model_dir(installed_models):
    return next(iter(installed_models.values())).parent


@pytest.fixture(scope="session")
def landmarker_bundle(installed_models, model_dir) -> assets.LandmarkerBundle:
    """MediaPipe's face_landmarker.task as `facecast models install` installs it, unpacked."""
    return assets.blendshape_model(installed_models[assets.LANDMARKER_TASK_NAME], model_dir)


@pytest.fixture(scope="session")
def photos() -> dict[str, np.ndarray]:
    """Real face photos, RGB uint8: scikit-image's astronaut and matplotlib's grace_hopper
    (tests/footage.py)."""
    return face_photos()


@pytest.fixture
def without_tf32():
    """float32 convolutions and matrix products in float32 on a GPU (cuDNN's default rounds
    their inputs to TF32's 10-bit mantissa: two inputs a rounding apart can come out 1e-3
    apart), for comparisons of float32 arithmetic; as it was afterwards."""
    import torch

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def pytest_terminal_summary(terminalreporter):
    if not PARITY_TABLE:
        return
    terminalreporter.section("torch vs LiteRT: max relative error per model output")
    terminalreporter.write_line(f"{'model':30s} {'output':28s} {'max error':>10s} {'tolerance':>10s}")
    for (model, output), (error, tolerance) in sorted(PARITY_TABLE.items()):
        terminalreporter.write_line(f"{model:30s} {output[:28]:28s} {error:10.2e} {tolerance:10.2e}")
