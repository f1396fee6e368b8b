"""The participants' gallery (facecast.shared.gallery) and its commands (`facecast enroll`,
`facecast participants`): embeddings only, versioned, atomic, locked; enrolment from real photos
with clear errors for no face, several faces and unreadable files (issue 15 item 2)."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from facecast.daemon.cli import main as cli, doctor, status
from facecast.shared import gallery
from facecast.shared.transport.messages import DaemonStatus

PHOTOS = Path(__file__).resolve().parents[1] / "workers" / "capture" / "synthetic_faces"


def _vectors(seed: int, count: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.1, (count, 128)).astype(np.float32)


# --- the file ------------------------------------------------------------------------------------


def test_enrol_and_remove_change_the_revision_and_keep_only_embeddings(tmp_path: Path) -> None:
    path = tmp_path / "state" / "participants.json"
    assert gallery.load(path).revision == 0 and gallery.load(path).names == []
    first = gallery.enrol(path, "ada", _vectors(1))
    assert (first.revision, first.names) == (1, ["ada"])
    second = gallery.enrol(path, "ada", _vectors(2, 2))  # adds to ada's embeddings
    np.testing.assert_array_equal(second.embeddings["ada"],
                                  np.concatenate([_vectors(1), _vectors(2, 2)]))
    third = gallery.enrol(path, "ada", _vectors(3), replace=True)
    np.testing.assert_array_equal(third.embeddings["ada"], _vectors(3))
    gallery.enrol(path, "bo", _vectors(4))
    loaded = gallery.load(path)
    assert (loaded.revision, loaded.names) == (4, ["ada", "bo"])
    # Biometric data: private to the daemon's user, and nothing but names, vectors and times.
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    document = json.loads(path.read_text())
    assert document["format"] == "facecast-gallery" and document["format_version"] == 1
    assert set(document["participants"][0]) == {"name", "enrolments"}
    assert set(document["participants"][0]["enrolments"][0]) == {"embedding", "added_utc"}
    removed = gallery.remove(path, "ada")
    assert (removed.revision, removed.names) == (5, ["bo"])
    assert "ada" not in path.read_text()
    assert sorted(p.name for p in path.parent.iterdir()) == ["participants.json",
                                                             "participants.json.lock"]
    with pytest.raises(gallery.GalleryError, match=r"no participant 'ada' in .* \(enrolled: bo\)"):
        gallery.remove(path, "ada")


def test_concurrent_enrolments_lose_nobody(tmp_path: Path) -> None:
    path = tmp_path / "participants.json"
    names = [f"p{index}" for index in range(16)]
    start = threading.Barrier(len(names))

    def enrol(index: int) -> None:
        start.wait(timeout=30)
        gallery.enrol(path, names[index], _vectors(index))

    threads = [threading.Thread(target=enrol, args=(index,)) for index in range(len(names))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    loaded = gallery.load(path)
    assert loaded.names == sorted(names) and loaded.revision == len(names)


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"\x00garbage", "not a facecast gallery (not JSON"),
        (b'{"format": "other"}', 'not a facecast gallery (no "format": "facecast-gallery")'),
        (b'{"format": "facecast-gallery", "format_version": 7}',
         "gallery format_version 7 is not one this facecast reads (allowed: 1)"),
        (b'{"format": "facecast-gallery", "format_version": 1, "revision": 1, '
         b'"embedding_model": "arcface", "participants": []}',
         "embeddings of 'arcface', but facecast matches with"),
        (b'{"format": "facecast-gallery", "format_version": 1, "revision": 1, '
         b'"embedding_model": "dlib_face_recognition_resnet_model_v1", "participants": '
         b'[{"name": "a", "enrolments": [{"embedding": [1.0], "added_utc": ""}]}]}',
         "participants[0] ('a'): enrolments[0]: embedding of 1 values; allowed: exactly 128 "
         "finite numbers"),
    ],
)
def test_an_unusable_gallery_is_refused_with_the_reason(tmp_path: Path, content: bytes,
                                                        expected: str) -> None:
    path = tmp_path / "participants.json"
    path.write_bytes(content)
    with pytest.raises(gallery.GalleryError) as error:
        gallery.load(path)
    assert str(error.value).startswith(f"{path}: ") and expected in str(error.value)
    with pytest.raises(gallery.GalleryError):  # and never built upon
        gallery.enrol(path, "ada", _vectors(1))
    assert path.read_bytes() == content


def test_a_newer_writers_extra_fields_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "participants.json"
    gallery.enrol(path, "ada", _vectors(1))
    document = json.loads(path.read_text())
    document["written_by"] = "facecast 9"
    document["participants"][0]["consent_form"] = "F-12"
    path.write_text(json.dumps(document))
    assert gallery.load(path).names == ["ada"]


@pytest.mark.parametrize("name", ["", "a b", "x" * 33, "ünï", "a/b"])
def test_names_that_cannot_be_stream_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(gallery.GalleryError, match="1-32 of A-Z a-z 0-9 _ - allowed"):
        gallery.enrol(tmp_path / "g.json", name, _vectors(1))


def test_the_gallery_lives_in_the_state_directory(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/facecast")
    assert gallery.gallery_path() == Path("/var/lib/facecast/participants.json")
    assert gallery.gallery_path("/srv/lab/people.json") == Path("/srv/lab/people.json")
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert gallery.gallery_path() == tmp_path / "facecast" / "participants.json"


def test_status_and_doctor_name_the_gallery(tmp_path: Path) -> None:
    path = tmp_path / "participants.json"
    gallery.enrol(path, "ada", _vectors(1))
    result = doctor.check_participants(str(path))
    assert (result.state, result.detail) == (
        doctor.OK, f"gallery {path}: revision 1, 1 participant(s): ada")
    path.write_text("{}")
    assert doctor.check_participants(str(path)).state == doctor.WARN
    assert gallery.status_line(str(path)).startswith(f"gallery unusable: {path}: not a facecast")
    shown = status.render(DaemonStatus(reply_to="1", pid=1, uptime_s=1.0, config_path="c",
                                       ready=True, workers=[], cameras={}, stages={},
                                       participants=f"gallery {path}: no participants enrolled"))
    assert f"participants: gallery {path}: no participants enrolled" in shown.splitlines()


# --- enrolment from photos -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, Path]:
    from facecast.models import assets

    try:
        assets.face_embedding_model_path()
    except assets.ModelError as exc:
        pytest.skip(f"the face embedding network is not installed: {exc}")
    folder = tmp_path_factory.mktemp("photos")
    astronaut = cv2.imread(str(PHOTOS / "astronaut.png"))
    grace = cv2.imread(str(PHOTOS / "grace_hopper.png"))
    height = 300
    both = np.hstack([cv2.resize(image, (image.shape[1] * height // image.shape[0], height))
                      for image in (astronaut, grace)])
    made = {
        "astronaut": PHOTOS / "astronaut.png",
        "astronaut_larger": folder / "astronaut_larger.jpg",
        "grace": PHOTOS / "grace_hopper.png",
        "both": folder / "both.png",
        "nobody": folder / "nobody.png",
        "not_an_image": folder / "notes.jpg",
    }
    cv2.imwrite(str(made["astronaut_larger"]), cv2.resize(astronaut, None, fx=1.5, fy=1.5))
    cv2.imwrite(str(made["both"]), both)
    cv2.imwrite(str(made["nobody"]), np.full((300, 300, 3), 128, np.uint8))
    made["not_an_image"].write_text("not a photo")
    return made


def _facecast(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_enrol_from_photos_list_and_remove(photos, tmp_path: Path, capsys) -> None:
    path = tmp_path / "participants.json"
    code, out, err = _facecast(capsys, "enroll", "eileen", "--photo", str(photos["astronaut"]),
                               str(photos["astronaut_larger"]), "--gallery", str(path))
    assert code == 0, err
    assert f"enrolled eileen from 2 photo(s) (2 embedding(s) in all); gallery {path}, revision 1" \
        in out
    code, out, err = _facecast(capsys, "enroll", "grace", "--photo", str(photos["grace"]),
                               "--gallery", str(path))
    assert code == 0 and "look" not in err, err
    loaded = gallery.load(path)
    eileen, grace = loaded.embeddings["eileen"], loaded.embeddings["grace"]
    from facecast.models.face_embedding import SAME_PERSON_DISTANCE

    assert np.linalg.norm(eileen[0] - eileen[1]) < SAME_PERSON_DISTANCE  # one person, two photos
    assert np.linalg.norm(eileen[:, None] - grace[None], axis=-1).min() > SAME_PERSON_DISTANCE
    code, out, _ = _facecast(capsys, "participants", "--gallery", str(path))
    assert code == 0
    assert out.splitlines()[0] == f"gallery {path}: revision 2, 2 participant(s): eileen, grace"
    assert out.split()[-6:] == ["eileen", "2", "embedding(s)", "grace", "1", "embedding(s)"]
    code, out, _ = _facecast(capsys, "participants", "remove", "eileen", "--gallery", str(path))
    assert code == 0 and out.startswith("removed eileen and their embeddings")
    assert gallery.load(path).names == ["grace"]
    code, _, err = _facecast(capsys, "participants", "remove", "eileen", "--gallery", str(path))
    assert code == 2 and "no participant 'eileen'" in err


@pytest.mark.parametrize(
    "photo_names, expected",
    [
        (["both"], "both.png: 2 faces found; enrolment needs a photo of the one person alone"),
        (["nobody"], "nobody.png: no face found"),
        (["not_an_image"], "notes.jpg: not an image OpenCV can read (allowed: a photo file"),
        (["missing"], "missing.png: no such file (allowed: a photo file"),
        (["astronaut", "grace"], "do not show the same person (embedding distance"),
    ],
)
def test_enrolment_refuses_a_photo_it_cannot_use_and_enrols_nobody(
        photos, tmp_path: Path, capsys, photo_names: list[str], expected: str) -> None:
    path = tmp_path / "participants.json"
    files = [str(photos.get(name, tmp_path / f"{name}.png")) for name in photo_names]
    code, _, err = _facecast(capsys, "enroll", "ada", "--photo", *files, "--gallery", str(path))
    assert code == 2 and "facecast: nobody enrolled: " in err and expected in err, err
    assert not path.exists()


def test_a_bad_name_is_refused_before_any_photo_is_read(tmp_path: Path, capsys) -> None:
    code, _, err = _facecast(capsys, "enroll", "Dr. Who", "--photo", "x.png", "--gallery",
                             str(tmp_path / "g.json"))
    assert code == 2 and "participant name 'Dr. Who': 1-32 of A-Z a-z 0-9 _ - allowed" in err
    assert os.listdir(tmp_path) == []


# --- issue 21: whatever the file holds, a GalleryError naming it (Note [Gallery validation]) ---


def _document(participants, revision: int = 1) -> bytes:
    return json.dumps({"format": gallery.FORMAT, "format_version": gallery.FORMAT_VERSION,
                       "revision": revision, "embedding_model": gallery.EMBEDDING_MODEL,
                       "participants": participants}).encode()


def _enrolment(values=None, added_utc: str = "2026-11-25T10:00:00+00:00") -> dict:
    return {"embedding": [0.01] * 128 if values is None else values, "added_utc": added_utc}


@pytest.mark.parametrize(
    "content, expected",
    [
        # The file of issue 21: a second enrolment of 127 values (numpy raised ValueError).
        (_document([{"name": "ada", "enrolments": [_enrolment(), _enrolment([0.01] * 127)]}]),
         "participants[0] ('ada'): enrolments[1]: embedding of 127 values; allowed: exactly 128 "
         "finite numbers"),
        (_document([{"name": "ada", "enrolments": [_enrolment([0.01] * 129)]}]),
         "embedding of 129 values"),
        (_document([{"name": "ada", "enrolments": []}]),
         "participant 'ada' has no enrolment (at least one embedding each)"),
        (_document([{"name": "../x y", "enrolments": [_enrolment()]}]),
         "participants[0]: name '../x y': 1-32 of A-Z a-z 0-9 _ - allowed"),
        (_document([{"name": "ada", "enrolments": [_enrolment()]}] * 2),
         "participants[1]: participant 'ada' appears twice; each name once"),
        (_document([{"name": "ada", "enrolments": [_enrolment(added_utc="yesterday")]}]),
         "added_utc 'yesterday' is not an ISO 8601 date and time"),
        (_document([], revision=-1), "revision -1: a revision is 0 or more"),
        (_document([{"name": "ada", "enrolments": [_enrolment(["x"] * 128)]}]),
         "damaged gallery: Expected `float`, got `str`"),
        (b"[" * 100_000 + b"]" * 100_000, "damaged gallery: RecursionError"),
    ],
)
def test_every_field_of_the_gallery_is_checked(tmp_path: Path, content: bytes,
                                               expected: str) -> None:
    path = tmp_path / "participants.json"
    path.write_bytes(content)
    with pytest.raises(gallery.GalleryError) as error:
        gallery.load(path)
    assert str(error.value).startswith(f"{path}: ") and expected in str(error.value), error.value
    assert gallery.status_line(str(path)) == f"gallery unusable: {error.value}"
    with pytest.raises(gallery.GalleryError):  # and never built upon
        gallery.enrol(path, "bo", _vectors(1))
    assert path.read_bytes() == content


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_gallery_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, kind) -> None:
    path = tmp_path / "participants.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()  # a FIFO would hang a blocking read
    with pytest.raises(gallery.GalleryError, match=f"^{path}: "):
        gallery.load(path)


def test_participants_and_enroll_print_the_reason_not_a_traceback(tmp_path: Path,
                                                                 capsys) -> None:
    path = tmp_path / "participants.json"
    path.write_bytes(_document([{"name": "ada", "enrolments": [_enrolment(),
                                                               _enrolment([0.01] * 127)]}]))
    code, out, err = _facecast(capsys, "participants", "--gallery", str(path))
    assert (code, out) == (2, "")
    assert err == (f"facecast: {path}: participants[0] ('ada'): enrolments[1]: embedding of 127 "
                   "values; allowed: exactly 128 finite numbers\n"), err
    # Before a photo is read or a model loaded (seconds): the gallery could not take it.
    code, out, err = _facecast(capsys, "enroll", "bo", "--photo", str(tmp_path / "none.png"),
                               "--gallery", str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"facecast: nobody enrolled: {path}: participants[0] ('ada')"), err
    assert "Traceback" not in err
