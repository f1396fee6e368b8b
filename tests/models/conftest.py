"""Fixtures of the model tests: the installed MediaPipe models, real face photos, and the parity
table printed at the end of the session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from footage import face_photos
from litert_reference import PARITY_TABLE

from facecast.models import assets


@pytest.fixture(scope="session")
def installed_models() -> dict:
    """Every model of assets.MODELS and face_landmarker.task, installed once per session
    (downloads the mediapipe wheel from PyPI unless $FACECAST_MODEL_DIR or the XDG cache
    already holds them). dlib's embedding network is `embedding_network`'s: only its own tests
    need its 31 MB (the offline GPU machine is sent no more than it needs)."""
    return assets.install(embeddings=False)


@pytest.fixture(scope="session")
def embedding_network(model_dir) -> Path:
    """dlib's face embedding network, installed beside the other models."""
    return assets.install_face_embedding_model(model_dir)


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


def pytest_terminal_summary(terminalreporter):
    if not PARITY_TABLE:
        return
    terminalreporter.section("torch vs LiteRT: max relative error per model output")
    terminalreporter.write_line(f"{'model':30s} {'output':28s} {'max error':>10s} {'tolerance':>10s}")
    for (model, output), (error, tolerance) in sorted(PARITY_TABLE.items()):
        terminalreporter.write_line(f"{model:30s} {output[:28]:28s} {error:10.2e} {tolerance:10.2e}")
