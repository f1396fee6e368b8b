"""Issue 13 end to end: `facecast run` with config/default.toml (two synthetic cameras of real
face photos) and the models `facecast models install` installs, MediaPipe's face_landmarker.task
included, read by real pylsl inlets: every face found carries finite blendshapes and head
translation, and no channel of any stream is NaN in every sample (Note [No channel that is always
NaN]). The 478 landmarks are switched on (`output.landmarks = true`) so
that their channels are checked too. The daemon is `default_daemon`, shared with other files that
only watch it (Note [One daemon for several test files]).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from daemon_harness import Recorder
from facecast.models import assets
from facecast.workers.output.outlets import BLENDSHAPE_NAMES, face_channels

CAMERAS = ("synth0", "synth1")
MAX_FACES = 2
FACE_SAMPLES_WANTED = 60  # samples with a face, over all streams
WAIT_S = 120.0

pytestmark = pytest.mark.daemon


def test_every_face_has_blendshapes_and_head_translation_and_no_channel_is_always_nan(
        default_daemon):
    daemon = default_daemon
    try:
        # `status` says which face stack runs and where its bundle came from, as `doctor` does.
        face_models = daemon.status().face_models
        assert face_models.startswith("MediaPipe FaceLandmarker"), face_models
        assert assets.LANDMARKER_TASK_REQUIREMENT in face_models, face_models
        records = daemon.resolve("Face", count=len(CAMERAS) * MAX_FACES)
        assert len(records) == len(CAMERAS) * MAX_FACES
        labels = [label for label, _, _ in face_channels(landmarks=True)]
        for record in records:
            info = record.inlet.info(timeout=5)
            assert info.channel_count() == len(labels), "the bundle's channels are not published"
            facecast = info.desc().child("facecast")
            assert facecast.child("blendshapes").child_value("available") == "true"
            assert facecast.child("head_translation").child_value("available") == "true"
        recorder = Recorder(records)
        try:
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                with_face = sum(int(np.isfinite(s[0])) for r in records for s in list(r.samples))
                if with_face >= FACE_SAMPLES_WANTED:
                    break
                time.sleep(0.2)  # polling the recorder thread's lists, not a fixed wait
        finally:
            recorder.stop()
        samples = np.asarray([s for r in records for s in r.samples], dtype=np.float64)
        assert len(samples), daemon.log_tail()
        faces = samples[np.isfinite(samples[:, 0])]
        assert len(faces) >= FACE_SAMPLES_WANTED, (len(faces), daemon.log_tail())
    finally:
        daemon.close_inlets()  # the next user of the daemon opens its own

    at = {label: k for k, label in enumerate(labels)}
    translation = faces[:, [at["head_tx"], at["head_ty"], at["head_tz"]]]
    blendshapes = faces[:, at[BLENDSHAPE_NAMES[0]]:at[BLENDSHAPE_NAMES[-1]] + 1]
    assert np.isfinite(translation).all(), "a face without head translation"
    assert np.isfinite(blendshapes).all(), "a face without blendshapes"
    assert ((blendshapes >= 0) & (blendshapes <= 1)).all()
    # A photo face on a 640x360 frame: in front of the camera (OpenGL axes: z < 0), within
    # arm's length to a few meters.
    assert (translation[:, 2] < -20).all() and (translation[:, 2] > -400).all(), translation[:, 2]
    # Blendshapes move with the faces (the synthetic faces change scale and angle): not constant.
    assert blendshapes.std(axis=0).max() > 1e-3
    # Every channel is filled in some sample: a face's sample fills every one of them.
    always_nan = [labels[k] for k in range(len(labels)) if not np.isfinite(faces[:, k]).any()]
    assert not always_nan, f"channels NaN in every sample: {always_nan[:10]}"
    assert np.isfinite(faces).all(axis=1).mean() > 0.99
