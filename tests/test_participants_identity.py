"""Who each tracked face is (facecast.workers.inference.identity), on real frames of staged
synthetic
scenes with the real face stack and embedding network, no daemon: the schedule (Note [Identity
per track]), confirmation before a rename, one face per name, the gallery re-read when its file
changes (Note [Gallery reload]), the seat map without embeddings (Note [Seat map])."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from facecast.shared import config as config_mod
from facecast.shared import gallery
from facecast.workers.inference import identity
from facecast.workers.inference.identity import (
    EmbeddingIdentities,
    FrameFaces,
    Identity,
    identities_for,
)
from facecast.workers.capture.sources import SyntheticScene

PHOTOS = Path(__file__).resolve().parents[1] / "workers" / "capture" / "synthetic_faces"
WIDTH, HEIGHT = 640, 360


@pytest.fixture(scope="module")
def stack():
    """The enrolment's face stack and embedding network (daemon/cli/participants.py), loaded
    once."""
    from facecast.daemon.cli import participants
    from facecast.models import assets

    try:
        assets.face_embedding_model_path()
    except assets.ModelError as exc:
        pytest.skip(f"the face embedding network is not installed: {exc}")
    torch.set_num_threads(1)
    return participants._photo_embedder(config_mod.ModelsConfig())


@pytest.fixture
def enrolled(stack, tmp_path: Path) -> Path:
    path = tmp_path / "participants.json"
    gallery.enrol(path, "eileen", stack.embed(PHOTOS / "astronaut.png")[None])
    gallery.enrol(path, "grace", stack.embed(PHOTOS / "grace_hopper.png")[None])
    return path


def _scene(*appearances: tuple[str, int]) -> SyntheticScene:
    staging = config_mod.StagingConfig(cycle_s=100.0, appearances=[
        config_mod.StagedAppearance(photo=photo, seat=seat, from_s=0.0, until_s=100.0)
        for photo, seat in appearances])
    return SyntheticScene(WIDTH, HEIGHT, seed="idt0", staging=staging)


def _frame(stack, scene: SyntheticScene, t_s: float, track_ids: list[int],
           camera_id: str = "idt0") -> FrameFaces:
    pixels = scene.render(t_s)
    faces = sorted(stack.pipeline([pixels])[0], key=lambda face: face.box[0])  # left to right
    assert len(faces) == len(track_ids), f"{len(faces)} faces at {t_s}"
    return FrameFaces(camera_id=camera_id, capture_ts_lsl=t_s, tensor=torch.from_numpy(pixels),
                      track_ids=track_ids,
                      boxes_px=[face.box for face in faces],
                      landmarks_px=[face.landmarks for face in faces])


def _participants(path: Path, **options) -> config_mod.ParticipantsConfig:
    return config_mod.ParticipantsConfig(enabled=True, gallery=str(path), **options)


def test_tracks_are_named_on_their_first_frame_then_embedded_on_a_schedule(stack, enrolled):
    who = EmbeddingIdentities(_participants(enrolled, embed_interval_s=2.0), stack.embedder)
    both = _scene(("astronaut", 0), ("grace_hopper", 1))
    first = who.identify([_frame(stack, both, 1000.0, [7, 8])])[0]
    assert [name for name, _ in first] == ["eileen", "grace"]
    assert all(0.2 < confidence <= 1.0 for _, confidence in first), first
    assert who.embeddings_computed == 2
    for t_s in (1000.5, 1001.0, 1001.9):  # within the interval: no embedding, same names
        assert [n for n, _ in who.identify([_frame(stack, both, t_s, [7, 8])])[0]] == [
            "eileen", "grace"]
    assert who.embeddings_computed == 2
    who.identify([_frame(stack, both, 1002.0, [7, 8])])
    assert who.embeddings_computed == 4


def test_a_track_that_changes_person_is_renamed_only_once_confirmed(stack, enrolled):
    who = EmbeddingIdentities(_participants(enrolled, embed_interval_s=1.0), stack.embedder)
    eileen, grace = _scene(("astronaut", 0)), _scene(("grace_hopper", 0))
    assert who.identify([_frame(stack, eileen, 500.0, [3])])[0][0].participant == "eileen"
    # The same track now shows grace (a tracker that jumped to another face): one disagreeing
    # embedding is not enough, the second, CONFIRM_AFTER_S later, renames it.
    assert who.identify([_frame(stack, grace, 501.0, [3])])[0][0].participant == "eileen"
    assert who.identify([_frame(stack, grace, 501.1, [3])])[0][0].participant == "eileen"
    renamed = who.identify([_frame(stack, grace, 501.0 + identity.CONFIRM_AFTER_S, [3])])
    assert renamed[0][0].participant == "grace"


def test_one_name_is_worn_by_one_face(stack, enrolled):
    who = EmbeddingIdentities(_participants(enrolled), stack.embedder)
    twice = _scene(("astronaut", 0))
    named = who.identify([_frame(stack, twice, 10.0, [1]), _frame(stack, twice, 10.0, [2], "idt1")])
    assert sorted(i.participant for frame in named for i in frame) == ["", "eileen"]


def test_unknown_beyond_the_match_distance_and_with_an_empty_gallery(stack, enrolled, tmp_path):
    only_grace = tmp_path / "grace_only.json"
    gallery.enrol(only_grace, "grace", gallery.load(enrolled).embeddings["grace"])
    who = EmbeddingIdentities(_participants(only_grace), stack.embedder)
    scene = _scene(("astronaut", 0), ("grace_hopper", 1))
    assert who.identify([_frame(stack, scene, 20.0, [1, 2])])[0] == [
        identity.UNKNOWN, who._identity(2)]
    assert who._identity(2).participant == "grace"
    nobody = EmbeddingIdentities(_participants(tmp_path / "none.json"), stack.embedder)
    assert nobody.identify([_frame(stack, scene, 20.0, [1, 2])])[0] == [identity.UNKNOWN] * 2
    assert nobody.embeddings_computed == 0  # nothing to match: nothing embedded


def test_a_changed_gallery_file_is_read_again(stack, enrolled):
    who = EmbeddingIdentities(_participants(enrolled), stack.embedder)
    clock = [time.monotonic()]  # moved on by hand: the test never waits for the watch
    who._now_monotonic = lambda: clock[0]
    scene = _scene(("astronaut", 0))
    assert who.identify([_frame(stack, scene, 30.0, [1])])[0][0].participant == "eileen"
    gallery.remove(enrolled, "eileen")
    clock[0] += identity.GALLERY_CHECK_S
    assert who.identify([_frame(stack, scene, 30.1, [1])])[0][0] == identity.UNKNOWN
    assert who.gallery_revision == 3
    gallery.enrol(enrolled, "ada", stack.embed(PHOTOS / "astronaut.png")[None])
    clock[0] += identity.GALLERY_CHECK_S
    assert who.identify([_frame(stack, scene, 30.2, [1])])[0][0].participant == "ada"
    Path(enrolled).write_text("{broken")
    clock[0] += identity.GALLERY_CHECK_S
    assert who.identify([_frame(stack, scene, 30.3, [1])])[0][0].participant == "ada"
    assert "not a facecast gallery" in who.trouble()


def test_the_seat_map_names_faces_by_place_without_any_embedding(stack, tmp_path):
    participants = config_mod.ParticipantsConfig(
        enabled=True, identify="seats", seats=[
            config_mod.SeatConfig(participant="left_chair", camera="idt0", region=(0, 0, 0.5, 1)),
            config_mod.SeatConfig(participant="right_chair", camera="idt0",
                                  region=(0.5, 0, 1, 1)),
            config_mod.SeatConfig(participant="elsewhere", camera="idt1")])
    who = identities_for(participants, torch.device("cpu"), str(tmp_path / "no-models"))
    assert isinstance(who, identity.SeatIdentities) and "no face embeddings" in who.describe()
    scene = _scene(("astronaut", 0), ("grace_hopper", 1))
    assert who.identify([_frame(stack, scene, 40.0, [1, 2])])[0] == [
        Identity("left_chair", 1.0), Identity("right_chair", 1.0)]
    assert who.identify([_frame(stack, scene, 40.0, [3, 4], "idt1")])[0] == [
        Identity("elsewhere", 1.0), identity.UNKNOWN]  # the largest face in the seat


def test_without_the_network_nobody_is_named_and_the_worker_says_why(tmp_path):
    who = identities_for(config_mod.ParticipantsConfig(enabled=True), torch.device("cpu"),
                         str(tmp_path))
    assert isinstance(who, identity.NoIdentities)
    assert who.trouble().startswith("participants cannot be named: ")
    off = identities_for(config_mod.ParticipantsConfig(), torch.device("cpu"), None)
    assert off.trouble() == "" and isinstance(off, identity.NoIdentities)


def test_matcher_takes_each_participants_nearest_enrolment() -> None:
    vectors = np.eye(4, 128, dtype=np.float32)
    current = gallery.Gallery(Path("g"), 1, {"a": vectors[:2], "b": vectors[2:3]})
    matcher = identity.Matcher(current, match_distance=0.6)
    near_a = vectors[1].copy()
    near_a[5] += 0.1
    (a, da), (b, db), (nobody, dn) = matcher.match(np.stack([near_a, vectors[2], vectors[3]]))
    assert (a, b, nobody) == ("a", "b", "")
    assert da == pytest.approx(0.1) and db == 0.0
    assert dn == pytest.approx(np.sqrt(2), rel=1e-5)
    assert matcher.confidence("b", 0.0) == 1.0 and matcher.confidence("b", 0.3) == 0.5
    assert matcher.confidence("", 0.1) == 0.0


# --- what crosses process boundaries, and reloads -------------------------------------------------


def test_a_result_from_a_sender_without_names_reads_as_unknown() -> None:
    import msgspec

    from facecast.shared.transport import messages

    old = {"type": "faces", "v": 1, "id": "1-1", "camera_id": "idt0", "frame_seq": 1,
           "capture_ts_lsl": 2.0, "faces": [{"track_id": 4, "presence": 1.0, "score": 1.0,
                                             "box_px": [0, 0, 1, 1],
                                             "head_pose_deg": [0, 0, 0]}]}
    (face,) = messages.decode(msgspec.msgpack.encode(old)).faces
    assert (face.participant, face.identity_confidence) == ("", 0.0)


def test_a_changed_participants_table_reassigns_the_workers_that_read_it() -> None:
    from facecast.daemon import layout

    text = ('[participants]\nenabled = {enabled}\n[[cameras]]\nid = "idt0"\n'
            'source = "synthetic"\n')
    old = config_mod.loads(text.format(enabled="false"))
    new = config_mod.loads(text.format(enabled="true"))
    change = layout.reload_plan(old, new, 0)
    reassigned = {spec.role for spec in change.reassign}
    assert reassigned == {"roi_landmark", "output"}, change
    assert not change.restart and not change.stop


# --- participant streams' source camera (Note [Participant streams]) -----------------------------


def test_a_participant_stream_follows_the_largest_face_and_leaves_a_camera_that_lost_them():
    from facecast.shared.transport.messages import FaceResult, FaceResults
    from facecast.workers.output import participant_streams
    from facecast.workers.output.outlets import FaceSample, MarkerOutlet

    text = ('[daemon]\nhost_name = "idt-{}"\n[participants]\nenabled = true\nidentify = "seats"\n'
            '[[participants.seats]]\nparticipant = "ann"\ncamera = "idt0"\n'
            '[[cameras]]\nid = "idt0"\nsource = "synthetic"\n'
            '[[cameras]]\nid = "idt1"\nsource = "synthetic"\n').format(time.monotonic_ns())
    loaded = config_mod.loads(text)
    markers = MarkerOutlet(loaded.host())
    streams = participant_streams.ParticipantStreams(loaded, loaded.host(), markers, "")
    ann = streams.people["ann"]

    def frame(camera: str, ts: float, width: float | None) -> None:
        faces = [] if width is None else [FaceResult(
            track_id=1, presence=1.0, score=1.0, box_px=(10.0, 10.0, 10.0 + width, 10.0 + width),
            head_pose_deg=(0.0, 0.0, 0.0), participant="ann", identity_confidence=1.0)]
        samples = [FaceSample(track_id=1, presence=1.0, box_px=f.box_px) for f in faces]
        streams.on_result(FaceResults(camera_id=camera, frame_seq=1, capture_ts_lsl=ts,
                                      faces=faces), samples)

    frame("idt0", 100.0, 100.0)
    assert ann.source_camera == "idt0" and ann.newest_ts == 100.0
    frame("idt1", 100.1, 120.0)  # larger, but not by SWITCH_LARGER
    assert ann.source_camera == "idt0"
    frame("idt1", 100.2, 130.0)  # 1.3 times as wide
    assert ann.source_camera == "idt1"
    frame("idt0", 100.15, 200.0)  # older than the stream's newest sample: switches, not pushed
    assert ann.source_camera == "idt0" and ann.newest_ts == 100.2
    frame("idt0", 100.3, None)  # the source loses them: NaN sample, source kept for a while
    assert ann.source_camera == "idt0" and ann.newest_ts == 100.3
    frame("idt1", 100.4, 50.0)  # smaller, but the source saw them 0.25 s ago: kept
    assert ann.source_camera == "idt0"
    frame("idt1", 100.8, 50.0)  # the source has not shown them for 0.65 s
    assert ann.source_camera == "idt1" and ann.newest_ts == 100.8
    streams.close()
    markers.close()
