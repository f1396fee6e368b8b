"""`facecast run`: the daemon in the foreground (what systemd runs, DESIGN §5).

CLI side up to `Supervisor.run()`: the config is validated before anything starts (exit 2 naming
the key), the models are checked (and, outside systemd, installed when missing: the daemon
itself never reaches the network), and another daemon on the same runtime directory is refused.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from facecast.shared import config as config_mod

log = logging.getLogger(__name__)

DEFAULT_CONFIG_PATHS = ("/etc/facecast/facecast.toml",)


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="config file (default: $FACECAST_CONFIG, else "
                        + ", ".join(DEFAULT_CONFIG_PATHS) + ")")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="stop in order after S seconds (tests, benchmarks)")
    parser.add_argument("--status-every", type=float, metavar="S",
                        help="print one status line per camera every S seconds "
                        "(default: every 2 s when stderr is a terminal)")
    parser.add_argument("--no-install", action="store_true",
                        help="do not download missing models; fail instead")


def config_path(given: str | None) -> Path | None:
    if given:
        return Path(given)
    if os.environ.get("FACECAST_CONFIG"):
        return Path(os.environ["FACECAST_CONFIG"])
    return next((Path(p) for p in DEFAULT_CONFIG_PATHS if Path(p).is_file()), None)


def _ensure_models(config: config_mod.Config, allow_install: bool) -> str:
    """"" when the models are in place, else why the daemon cannot start."""
    from facecast.models import assets

    model_dir = config.models.dir or None
    missing = sorted(set(assets.MODELS) - set(assets.installed(model_dir)))
    if not missing:
        _ensure_landmarker_task(config, allow_install)
        _ensure_embedding_network(config, allow_install)
        return ""
    if not allow_install:
        return (f"models missing in {assets.resolve_model_dir(model_dir)}: {', '.join(missing)}; "
                f"run `{assets.INSTALL_COMMAND}`")
    print(f"facecast: models missing ({', '.join(missing)}); installing them "
          f"(`{assets.INSTALL_COMMAND}`)", file=sys.stderr)
    try:
        # The face embedding network (~100 MB) apart, below: only participants use it, and a
        # failure to fetch it must not keep the daemon from starting.
        assets.install(model_dir, embeddings=False)
    except assets.ModelError as exc:
        return str(exc)
    _ensure_embedding_network(config, allow_install)
    return ""


def _ensure_embedding_network(config: config_mod.Config, allow_install: bool) -> None:
    """dlib's face embedding network is needed only to name participants by their faces
    (`participants.identify = "embeddings"`): installed here when it is missing, and a failure
    only costs the names (the roi_landmark worker says so: a marker and status trouble)."""
    from facecast.models import assets

    participants = config.participants
    if not (participants.enabled and participants.identify == "embeddings") or not allow_install:
        return
    model_dir = config.models.dir or None
    try:
        assets.face_embedding_model_path(model_dir)
        return
    except assets.ModelError:
        pass
    print(f"facecast: {assets.FACE_EMBEDDING_FILE} missing (participants.identify = "
          f'"embeddings"); installing it (`{assets.INSTALL_COMMAND}`)', file=sys.stderr)
    try:
        assets.install_face_embedding_model(model_dir)
    except (assets.ModelError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"facecast: running without naming participants: {exc}", file=sys.stderr)


def _ensure_landmarker_task(config: config_mod.Config, allow_install: bool) -> None:
    """face_landmarker.task (blendshapes, head translation) is optional: installed here when it
    is missing and installing is allowed, and a failure only costs those channels."""
    from facecast.models import assets

    model_dir = config.models.dir or None
    if (config.models.face_landmarker_task or not allow_install
            or assets.landmarker_bundle(None, model_dir).available):
        return
    print(f"facecast: {assets.LANDMARKER_TASK_FILE} missing; installing it "
          f"(`{assets.INSTALL_COMMAND}`)", file=sys.stderr)
    try:
        assets.install_landmarker_task(model_dir)
    except (assets.ModelError, OSError) as exc:
        print(f"facecast: running without blendshapes and head translation: {exc}", file=sys.stderr)


def main(args) -> int:
    path = config_path(args.config)
    if path is None:
        print("facecast: no config file: pass --config FILE (config/default.toml in the "
              "repository runs two synthetic cameras on any machine)", file=sys.stderr)
        return 2
    try:
        config = config_mod.load(path)
    except config_mod.ConfigError as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        return 2
    level = getattr(args, "log_level_explicit", None) or config.daemon.log_level
    logging.getLogger().setLevel(level.upper())
    # Before any worker starts: they inherit the environment that quiets liblsl and OpenCV.
    from facecast.daemon import runtime_dir
    from facecast.shared import third_party_logs

    try:
        private_runtime_dir = runtime_dir.for_daemon(config.daemon.runtime_dir)
    except runtime_dir.UnsafeRuntimeDir as exc:  # Note [Private files]: refused, with why
        print(f"facecast: {exc}", file=sys.stderr)
        return 1
    third_party_logs.quiet(private_runtime_dir, verbose=getattr(args, "verbose", False))
    # Under systemd the daemon never downloads (DESIGN §3): only an interactive run installs.
    under_systemd = bool(os.environ.get("NOTIFY_SOCKET") or os.environ.get("INVOCATION_ID"))
    problem = _ensure_models(config, allow_install=not (args.no_install or under_systemd))
    if problem:
        print(f"facecast: {problem}", file=sys.stderr)
        return 1

    from facecast.daemon.cli import lsl_peers

    other = lsl_peers.other_daemon(config.host())  # Note [One daemon per stream id]
    if other:
        print(f"facecast: another facecast daemon already publishes streams as host "
              f"{config.host()!r} ({other}); a second one would publish the same stream ids, "
              "and recordings could not tell them apart. Stop that one (`facecast stop` with "
              "its config), or give this one another daemon.host_name", file=sys.stderr)
        return 1

    from facecast.daemon.runtime_dir import AlreadyRunning
    from facecast.daemon.supervisor import Supervisor

    status_every_s = args.status_every
    if status_every_s is None and sys.stderr.isatty():
        status_every_s = 2.0
    if sys.stderr.isatty() and not getattr(args, "log_level_explicit", None):
        # Note [A terminal is not a log].
        from facecast.shared import terminal_log

        held, _pid = runtime_dir.lock_owner(private_runtime_dir)  # a daemon there: refused below
        log_path = terminal_log.split_for_terminal(str(private_runtime_dir), level,
                                                   fresh=not held)
        every = f" and each camera's status every {status_every_s:g} s" if status_every_s else ""
        print(f"facecast: the full log is in {log_path}; here: warnings, errors, when it is "
              f"ready{every} (`--log-level info` shows every line here)", file=sys.stderr,
              flush=True)
    if config.web.enabled:
        print(f"facecast: {console_announcement(config)}", file=sys.stderr, flush=True)
    supervisor = Supervisor(config, str(path), duration_s=args.duration,
                            status_every_s=status_every_s)
    try:
        return supervisor.run()
    except AlreadyRunning as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        return 1


def console_announcement(config: config_mod.Config) -> str:
    """Where the web console will be (README "Web console"); it starts once the daemon is READY
    (Note [Console after READY])."""
    web = config.web
    if web.port == 0:
        where = f"on a free port of {web.host} (`facecast status` shows which)"
    else:
        host = f"[{web.host}]" if ":" in web.host else web.host
        where = f"at http://{host}:{web.port}/"
    # Every request needs the token, on loopback too (Note [Console security]).
    access = "every request needs the token; " + ("control allowed" if web.allow_control
                                                   else "read-only")
    return f"web console {where} once the daemon is ready ({access})"
