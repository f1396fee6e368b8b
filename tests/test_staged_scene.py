"""Staged synthetic scenes (issue 15 item 5, Note [Staged scenes]):
who sits in which seat of which synthetic camera and when, from config, with a ground truth that
names the person and is a pure function of the capture time."""

from __future__ import annotations

import typing

import numpy as np
import pytest

from facecast.shared import config
from facecast.workers.capture import sources
from facecast.workers.capture.sources import SyntheticScene, open_source, synthetic_truth

# Two cameras, one person each, who swap cameras halfway through a 12 s cycle; grace_hopper
# leaves stg1's right seat for 2 s and comes back.
SWAP_SCENE = """
[[cameras]]
id = "stg0"
source = "synthetic"
width = 320
height = 240
fps = 20.0
[cameras.staging]
cycle_s = 12.0
appearances = [
  {photo = "astronaut", seat = 0, from_s = 0.0, until_s = 6.0},
  {photo = "grace_hopper", seat = 0, from_s = 6.0, until_s = 12.0},
]

[[cameras]]
id = "stg1"
source = "synthetic"
width = 320
height = 240
fps = 20.0
[cameras.staging]
cycle_s = 12.0
appearances = [
  {photo = "grace_hopper", seat = 1, from_s = 0.0, until_s = 3.0},
  {photo = "grace_hopper", seat = 1, from_s = 5.0, until_s = 6.0},
  {photo = "astronaut", seat = 1, from_s = 6.0, until_s = 12.0},
]
"""


def _names(scene: SyntheticScene, t_s: float) -> list[str]:
    return [face.name for face in scene.faces_at(t_s)]


def test_the_staged_truth_names_who_is_in_each_camera_at_any_capture_time() -> None:
    loaded = config.loads(SWAP_SCENE)
    left, right = (synthetic_truth(camera) for camera in loaded.cameras)
    cycle_start_s = 12.0 * 1000  # any multiple of cycle_s: capture times wrap around the script
    expected = {  # seconds into the cycle: (stg0, stg1)
        0.5: (["astronaut"], ["grace_hopper"]),
        4.0: (["astronaut"], []),  # grace_hopper has left stg1
        5.5: (["astronaut"], ["grace_hopper"]),  # and is back
        6.0: (["grace_hopper"], ["astronaut"]),  # the swap, in both cameras at once
        11.9: (["grace_hopper"], ["astronaut"]),
    }
    for into_cycle_s, (in_left, in_right) in expected.items():
        for cycles in (0, 1, 7):
            t_s = cycle_start_s + 12.0 * cycles + into_cycle_s
            assert (_names(left, t_s), _names(right, t_s)) == (in_left, in_right), into_cycle_s
    # A person keeps their seat's path: astronaut on the left in stg0, on the right in stg1.
    (in_stg0,) = left.faces_at(cycle_start_s + 1.0)
    (in_stg1,) = right.faces_at(cycle_start_s + 7.0)
    assert in_stg0.center_px[0] < 160 < in_stg1.center_px[0]


def test_staged_frames_show_the_named_person_and_an_empty_seat_shows_the_backdrop() -> None:
    loaded = config.loads(SWAP_SCENE)
    scene = SyntheticScene.for_camera(loaded.camera("stg1"))
    np.testing.assert_array_equal(scene.render(12.0 * 50 + 4.0), scene._background)
    for t_s, name in ((12.0 * 50 + 1.0, "grace_hopper"), (12.0 * 50 + 8.0, "astronaut")):
        frame = scene.render(t_s)
        (face,) = scene.faces_at(t_s)
        assert face.name == name
        size = int(round(face.size_px))
        x1, y1 = (int(round(v)) for v in face.box_px[:2])
        crop = frame[y1:y1 + size, x1:x1 + size]
        scores = {other: _correlation(crop, _photo_face(other, size)) for other in
                  ("astronaut", "grace_hopper")}
        assert scores[name] > 0.95 and max(scores.values()) == scores[name], (t_s, scores)


def test_a_staged_source_delivers_its_truth() -> None:
    camera = config.loads(SWAP_SCENE).camera("stg0")
    with open_source(camera) as source:
        frame, capture_ts_lsl = source.read()
    scene = synthetic_truth(camera)
    np.testing.assert_array_equal(frame, scene.render(capture_ts_lsl))
    assert source.ground_truth(capture_ts_lsl) == scene.faces_at(capture_ts_lsl)
    expected = "astronaut" if capture_ts_lsl % 12.0 < 6.0 else "grace_hopper"
    assert _names(scene, capture_ts_lsl) == [expected]


def test_without_staging_the_scene_is_the_two_faces_as_before() -> None:
    camera = config.CameraConfig(id="stg2", source="synthetic", width=320, height=240)
    staged_alike = config.CameraConfig(
        id="stg2", source="synthetic", width=320, height=240,
        staging=config.StagingConfig(cycle_s=5.0, appearances=[
            config.StagedAppearance(photo="astronaut", seat=0, from_s=0.0, until_s=5.0),
            config.StagedAppearance(photo="grace_hopper", seat=1, from_s=0.0, until_s=5.0)]))
    for t_s in (3.0, 1234.5):
        plain, staged = synthetic_truth(camera), synthetic_truth(staged_alike)
        assert _names(plain, t_s) == ["astronaut", "grace_hopper"]
        assert plain.faces_at(t_s) == staged.faces_at(t_s)
        np.testing.assert_array_equal(plain.render(t_s), staged.render(t_s))


def test_the_config_offers_exactly_the_photos_the_source_ships() -> None:
    assert set(typing.get_args(config.SyntheticPhoto)) == {p.name for p in sources._PHOTOS}


_CAMERA = '[[cameras]]\nid = "stg3"\nsource = "synthetic"\n[cameras.staging]\ncycle_s = 10.0\n'


@pytest.mark.parametrize(
    "staging, expected",
    [
        ('appearances = [{photo = "ada", seat = 0, from_s = 0.0, until_s = 5.0}]',
         "cameras[0].staging.appearances[0].photo: Invalid enum value 'ada' (allowed: "
         "'astronaut', 'grace_hopper'"),
        ('appearances = [{photo = "astronaut", seat = 2, from_s = 0.0, until_s = 5.0}]',
         "cameras[0].staging.appearances[0].seat: Expected `int` <= 1"),
        ('appearances = [{photo = "astronaut", seat = 0, from_s = 4.0, until_s = 12.0}]',
         "appearances[0] (astronaut, seat 0): needs from_s < until_s <= cycle_s (10), got "
         "from_s = 4, until_s = 12"),
        ('appearances = [{photo = "astronaut", seat = 0, from_s = 0.0, until_s = 5.0},\n'
         '  {photo = "grace_hopper", seat = 0, from_s = 4.0, until_s = 8.0}]',
         "appearances[1] (grace_hopper, seat 0) overlaps appearances[0] (astronaut) in seat 0: "
         "one face per seat"),
        ('appearances = [{photo = "astronaut", seat = 0, from_s = 0.0, until_s = 5.0},\n'
         '  {photo = "astronaut", seat = 1, from_s = 4.0, until_s = 8.0}]',
         "astronaut cannot sit in two seats at once"),
        ('appearances = [{photo = "astronaut", seat = 0, from_s = 0.0, until_s = 5.0, '
         'wave = 1}]', "cameras[0].staging.appearances[0].wave: unknown key (allowed here: photo, "
         "seat, from_s, until_s)"),
    ],
)
def test_bad_staging_names_the_key_and_what_is_allowed(staging: str, expected: str) -> None:
    with pytest.raises(config.ConfigError) as error:
        config.loads(_CAMERA + staging, origin="lab.toml")
    assert expected in str(error.value)


def test_only_synthetic_sources_can_be_staged_and_a_replay_within_its_loop() -> None:
    with pytest.raises(config.ConfigError) as error:
        config.loads(_CAMERA.replace('"synthetic"', '"lab.mp4"'), origin="lab.toml")
    assert "camera 'stg3' has source 'lab.mp4'; only the synthetic sources can be staged" \
        in str(error.value)
    with pytest.raises(config.ConfigError) as error:
        config.loads(_CAMERA.replace('"synthetic"', '"synthetic-replay"'), origin="lab.toml")
    assert "camera 'stg3' has source 'synthetic-replay', whose replayed loop shows 30 frames " \
           "(1 s at 30 fps) of scene time, back and forth: a script of cycle_s = 10 s does " \
           "not fit in it; use cycle_s <= 1, or source = \"synthetic\"" in str(error.value)


def _photo_face(name: str, size_px: int) -> np.ndarray:
    import cv2

    photo = sources._photo_bgr(name)
    (box,) = [p.face_box_px for p in sources._PHOTOS if p.name == name]
    x1, y1, x2, y2 = (int(round(v)) for v in box)
    return cv2.resize(photo[y1:y2, x1:x2], (size_px, size_px), interpolation=cv2.INTER_AREA)


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64).ravel() - a.mean()
    b = b.astype(np.float64).ravel() - b.mean()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
