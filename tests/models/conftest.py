"""Fixtures of the model tests: the installed MediaPipe models, real face photos, and the parity
table printed at the end of the session."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from litert_reference import PARITY_TABLE

from facecast.models import assets


@pytest.fixture(scope="session")
def installed_models() -> dict:
    """Every model of assets.MODELS, installed once per session (downloads the mediapipe wheel
    from PyPI unless $FACECAST_MODEL_DIR or the XDG cache already holds them)."""
    return assets.install()


@pytest.fixture(scope="session")
def model_dir(installed_models):
    return next(iter(installed_models.values())).parent


@pytest.fixture(scope="session")
def landmarker_bundle(installed_models, model_dir) -> assets.LandmarkerBundle:
    """MediaPipe's face_landmarker.task as `facecast models install` installs it, unpacked."""
    return assets.blendshape_model(installed_models[assets.LANDMARKER_TASK_NAME], model_dir)


@pytest.fixture(scope="session")
def photos() -> dict[str, np.ndarray]:
    """Real face photos, RGB uint8: scikit-image's astronaut and matplotlib's grace_hopper.

    A host without those packages (the offline GPU machine) can point $FACECAST_TEST_PHOTOS at
    an .npz of the same two arrays (astronaut, grace_hopper) saved where they are installed.
    """
    import os

    if os.environ.get("FACECAST_TEST_PHOTOS"):
        with np.load(os.environ["FACECAST_TEST_PHOTOS"]) as saved:
            return {name: saved[name] for name in ("astronaut", "grace_hopper")}
    import matplotlib.cbook
    import skimage.data

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as stream:
        encoded = np.frombuffer(stream.read(), np.uint8)
    grace_hopper = cv2.cvtColor(cv2.imdecode(encoded, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    return {"astronaut": skimage.data.astronaut(), "grace_hopper": grace_hopper}


def pytest_terminal_summary(terminalreporter):
    if not PARITY_TABLE:
        return
    terminalreporter.section("torch vs LiteRT: max relative error per model output")
    terminalreporter.write_line(f"{'model':30s} {'output':28s} {'max error':>10s} {'tolerance':>10s}")
    for (model, output), (error, tolerance) in sorted(PARITY_TABLE.items()):
        terminalreporter.write_line(f"{model:30s} {output[:28]:28s} {error:10.2e} {tolerance:10.2e}")
