"""`facecast enroll NAME --photo FILE...` or `--camera CAM`, `facecast participants [remove
NAME]`: the gallery from the command line (README "Participants").

Runs on the CLI side only, on the CPU: enrolment detects and measures the face in each photo
with the daemon's own face stack (the same detector, mesh and face_landmarker.task choice as
the roi_landmark worker, so that enrolment chips are cut like the run-time ones) and embeds it
with facecast.models.face_embedding; only the embeddings reach the gallery (Note [What the
gallery keeps]). `--camera` takes the frames of a running daemon's
camera for a few seconds instead of photos, read from its ring as the web console reads them
(a consumer on the CPU; Note [Enrolment from a camera]). A running daemon reads the gallery
again when the file changes (Note [Gallery reload]).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

from facecast.shared import config as config_mod
from facecast.shared import gallery

# The detector keeps at most this many faces per photo: enough to tell "several" from "one".
_FACES_LOOKED_FOR = 4


# Note [Enrolment from a camera]
#     `facecast enroll NAME --camera CAM` attaches to the running daemon's ring of CAM like any
#     consumer (FrameSubscriber on the CPU, as the web console does; nothing changes for the
#     daemon's workers), and for `--seconds` takes a frame every CAMERA_FRAME_EVERY_S, measures
#     and embeds it here with the same stack as photos. Every frame must show exactly one face
#     (the person to enrol, alone in view), and every embedding must be of the same person
#     (each pair within the same-person distance): a person who walks out and another who
#     walks in are refused, not averaged. All the embeddings are kept, at most
#     CAMERA_EMBEDDINGS_KEPT spread over the take. Frames whose slot was overwritten while read
#     are skipped. Pixels never leave this process and are not kept.
CAMERA_FRAME_EVERY_S = 0.3
CAMERA_EMBEDDINGS_KEPT = 5
CAMERA_FIRST_FRAME_TIMEOUT_S = 5.0


class EnrolmentError(ValueError):
    """A photo that cannot enrol anyone; the text names the file and what was wrong."""


def add_enroll_arguments(parser) -> None:
    parser.add_argument("name", help="the participant's name (1-32 of A-Z a-z 0-9 _ -; it "
                        "becomes the stream name `facecast <name>`)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--photo", nargs="+", metavar="FILE",
                        help="photos with this person's face, alone (JPEG, PNG, ... as OpenCV "
                        "reads them); only their embeddings are kept, never the photos")
    source.add_argument("--camera", metavar="CAM",
                        help="take the face in view of this camera of the running daemon (the "
                        "person alone in view, for --seconds)")
    parser.add_argument("--seconds", type=float, default=3.0, metavar="S",
                        help="--camera: how long to take frames (default 3)")
    parser.add_argument("--runtime-dir", default="",
                        help="--camera: the daemon's runtime directory (default: the config's, "
                        "else where a daemon runs)")
    parser.add_argument("--replace", action="store_true",
                        help="replace the person's embeddings (default: add to them)")
    _add_common(parser)


def add_participants_arguments(parser) -> None:
    parser.add_argument("action", nargs="?", choices=["list", "remove"], default="list",
                        help="list (the default) the enrolled participants, or remove one: "
                        "delete their embeddings for good")
    parser.add_argument("name", nargs="?", help="remove: the participant")
    _add_common(parser)


def _add_common(parser) -> None:
    parser.add_argument("--config", help="the daemon's config file, for participants.gallery and "
                        "the models (default: $FACECAST_CONFIG, else /etc/facecast/facecast.toml "
                        "if it exists, else the defaults)")
    parser.add_argument("--gallery", default=None, metavar="FILE",
                        help="the gallery file (overrides the config's participants.gallery)")


def _settings(args) -> tuple[config_mod.ModelsConfig, Path]:
    from facecast.daemon.cli.run import config_path

    path = config_path(getattr(args, "config", None))
    if path is None:
        models, participants = config_mod.ModelsConfig(), config_mod.ParticipantsConfig()
    else:
        loaded = config_mod.load(path)
        models, participants = loaded.models, loaded.participants
    return models, gallery.gallery_path(getattr(args, "gallery", None) or participants.gallery)


class PhotoEmbedder:
    """The face stack and the embedding network on the CPU, loaded once for several photos."""

    def __init__(self, models: config_mod.ModelsConfig) -> None:
        import torch

        from facecast.models import assets, tflite_convert
        from facecast.models.face_embedding import FaceEmbedder
        from facecast.models.pipeline import FacePipeline

        model_dir = models.dir or None

        def load(name: str) -> torch.nn.Module:
            return tflite_convert.convert(assets.model_path(name, model_dir))

        # As facecast.workers.inference.pipelines.build_pipeline: the configured face_landmarker.task,
        # else the installed one; without one, the attention mesh.
        task = assets.landmarker_bundle(models.face_landmarker_task or None, model_dir).path
        self.pipeline = FacePipeline("cpu", max_faces=_FACES_LOOKED_FOR, load_model=load,
                                     face_landmarker_task=task or None)
        self.embedder = FaceEmbedder.from_model_dir(model_dir, "cpu")

    def embed(self, photo: Path) -> np.ndarray:
        """The (128,) embedding of the one face in `photo`; EnrolmentError otherwise."""
        import cv2

        image = cv2.imread(str(photo), cv2.IMREAD_COLOR)
        if image is None:
            why = "no such file" if not photo.exists() else "not an image OpenCV can read"
            raise EnrolmentError(f"{photo}: {why} (allowed: a photo file such as JPEG or PNG)")
        return self.embed_image(image, str(photo), "a photo of the one person alone (crop the "
                                "others out)")

    def embed_image(self, image: np.ndarray, what: str, needs: str) -> np.ndarray:
        """The (128,) embedding of the one face in a BGR image; EnrolmentError naming `what`."""
        import torch

        from facecast.models.roi import FrameBatch

        faces = self.pipeline([image])[0]
        if not faces:
            raise EnrolmentError(f"{what}: no face found (needs a face turned to the camera, at "
                                 "least ~60 px wide)")
        if len(faces) > 1:
            raise EnrolmentError(f"{what}: {len(faces)} faces found; enrolment needs {needs}")
        landmarks = torch.as_tensor(faces[0].landmarks)[None]
        vectors = self.embedder.embed_landmarks(
            FrameBatch([image], "cpu"), torch.zeros(1, dtype=torch.long), landmarks)
        return vectors[0].numpy().astype(np.float32)


@functools.lru_cache(maxsize=1)
def _photo_embedder(models: config_mod.ModelsConfig) -> PhotoEmbedder:
    # One load per process (a CLI call enrols once; the tests call it many times).
    return PhotoEmbedder(models)


def _camera_frames(args, seconds: float):
    """Note [Enrolment from a camera]: BGR frames (copies) of the daemon's camera, one every
    CAMERA_FRAME_EVERY_S for `seconds`, as (capture_ts_lsl, frame)."""
    import time

    import zmq

    from facecast.daemon.cli.control_client import NotRunning, request, runtime_dir_of
    from facecast.daemon.cli.run import config_path
    from facecast.shared.transport.messages import StatusRequest
    from facecast.shared.transport.subscriber import FrameSubscriber

    path = config_path(getattr(args, "config", None))
    loaded = config_mod.load(path) if path is not None else None
    runtime_dir = runtime_dir_of(loaded, args.runtime_dir)
    try:
        status = request(runtime_dir, StatusRequest(), 5.0)
    except NotRunning as exc:
        raise EnrolmentError(f"--camera needs a running daemon: {exc}") from None
    if args.camera not in status.cameras:
        raise EnrolmentError(f"camera {args.camera!r} is not one of the running daemon's "
                             f"(allowed: {', '.join(sorted(status.cameras)) or 'none'})")
    with zmq.Context() as context:
        subscriber = FrameSubscriber(context, runtime_dir, [args.camera], device="cpu")
        try:
            started_monotonic = time.monotonic()
            next_take_monotonic = started_monotonic
            first_deadline_monotonic = started_monotonic + CAMERA_FIRST_FRAME_TIMEOUT_S
            taken = []
            while True:
                now = time.monotonic()
                if taken and now - started_monotonic >= seconds:
                    return taken
                if not taken and now > first_deadline_monotonic:
                    raise EnrolmentError(f"camera {args.camera}: no frame within "
                                         f"{CAMERA_FIRST_FRAME_TIMEOUT_S:g} s (is it delivering? "
                                         "see `facecast status`)")
                for frame in subscriber.receive(timeout_ms=100):
                    if now < next_take_monotonic:
                        continue
                    pixels = frame.tensor.numpy().copy()
                    taken.append((frame.message.capture_ts_lsl, pixels))
                    next_take_monotonic = now + CAMERA_FRAME_EVERY_S
        finally:
            subscriber.close()


def _embed_camera(args, embedder: PhotoEmbedder) -> np.ndarray:
    frames = _camera_frames(args, args.seconds)
    what = [f"camera {args.camera} at {capture_ts_lsl:.2f}" for capture_ts_lsl, _ in frames]
    vectors = np.stack([embedder.embed_image(pixels, label, "the one person alone in view")
                        for label, (_, pixels) in zip(what, frames)])
    _check_one_person(what, vectors)
    keep = np.unique(np.linspace(0, len(vectors) - 1, CAMERA_EMBEDDINGS_KEPT).round().astype(int))
    return vectors[keep]


def enroll_main(args) -> int:
    try:
        gallery.check_name(args.name)
        models, path = _settings(args)
        gallery.load(path)  # one that cannot take the enrolment: said before the models load
    except (config_mod.ConfigError, gallery.GalleryError) as exc:
        print(f"facecast: nobody enrolled: {exc}", file=sys.stderr)
        return 2
    if args.camera and not 0.5 <= args.seconds <= 60:
        print(f"facecast: --seconds {args.seconds:g}: allowed 0.5 to 60", file=sys.stderr)
        return 2
    unreadable = [photo for photo in args.photo or [] if not Path(photo).is_file()]
    if unreadable:  # before the models load (seconds)
        print(f"facecast: nobody enrolled: {unreadable[0]}: no such file (allowed: a photo file "
              "such as JPEG or PNG)", file=sys.stderr)
        return 2
    from facecast.models import assets

    try:
        embedder = _photo_embedder(models)
    except assets.ModelError as exc:
        print(f"facecast: cannot enrol: {exc}", file=sys.stderr)
        return 1
    try:
        if args.camera:
            vectors = _embed_camera(args, embedder)
            taken = f"{len(vectors)} frame(s) of camera {args.camera}"
        else:
            vectors = np.stack([embedder.embed(Path(photo)) for photo in args.photo])
            _check_one_person(args.photo, vectors)
            taken = f"{len(vectors)} photo(s)"
        updated = gallery.enrol(path, args.name, vectors, replace=args.replace)
    except (EnrolmentError, gallery.GalleryError, config_mod.ConfigError) as exc:
        print(f"facecast: nobody enrolled: {exc}", file=sys.stderr)
        return 2
    count = len(updated.embeddings[args.name])
    print(f"enrolled {args.name} from {taken} ({count} embedding(s) in all); "
          f"gallery {updated.path}, revision {updated.revision}; the "
          f"{'frames' if args.camera else 'photos'} were not kept")
    for other, distance in _look_alikes(updated, args.name):
        print(f"facecast: warning: {args.name} looks like {other} (distance {distance:.2f} < "
              f"{_same_person_distance():g}): they may be confused", file=sys.stderr)
    print("a running daemon with participants.enabled names them within a few seconds")
    return 0


def _same_person_distance() -> float:
    from facecast.models.face_embedding import SAME_PERSON_DISTANCE

    return SAME_PERSON_DISTANCE


def _check_one_person(photos: list[str], vectors: np.ndarray) -> None:
    """Photos (or frames) of one enrolment that show different people would name both with
    one name."""
    limit = _same_person_distance()
    for i in range(len(vectors)):
        for j in range(i):
            distance = float(np.linalg.norm(vectors[i] - vectors[j]))
            if distance >= limit:
                raise EnrolmentError(f"{photos[j]} and {photos[i]} do not show the same person "
                                     f"(embedding distance {distance:.2f} >= {limit:g})")


def _look_alikes(current: gallery.Gallery, name: str) -> list[tuple[str, float]]:
    mine = current.embeddings[name]
    found = []
    for other, theirs in current.embeddings.items():
        if other == name:
            continue
        distance = float(np.linalg.norm(mine[:, None] - theirs[None], axis=-1).min())
        if distance < _same_person_distance():
            found.append((other, distance))
    return found


def participants_main(args) -> int:
    try:
        _, path = _settings(args)
        if args.action == "remove":
            if not args.name:
                raise gallery.GalleryError("participants remove: which participant? (facecast "
                                           "participants remove NAME)")
            updated = gallery.remove(path, args.name)
            print(f"removed {args.name} and their embeddings; gallery {updated.path}, revision "
                  f"{updated.revision}")
            return 0
        if args.name:
            raise gallery.GalleryError(f"participants list takes no name (got {args.name!r}); "
                                       "to delete one: facecast participants remove NAME")
        current = gallery.load(path)
    except (config_mod.ConfigError, gallery.GalleryError) as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        return 2
    print(current.describe())
    for name in current.names:
        print(f"  {name:<32} {len(current.embeddings[name])} embedding(s)")
    return 0
