"""Third-party log lines (liblsl, OpenCV, FFmpeg) stay off facecast's terminal unless --verbose
(facecast.shared.third_party_logs, Note [liblsl's log level]).

The commands run in processes of their own, as a user runs them: liblsl and OpenCV read their
settings once per process. liblsl prints an INFO line when it loads its configuration
(`api_config.cpp ... INFO| ...`, in colour on a terminal), and a camera URL where nothing listens
makes FFmpeg print `[tcp @ 0x...] Connection ... refused` and OpenCV `[ WARN:0@...]`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtsp_peer import free_port

from facecast.shared import third_party_logs

REPO = Path(__file__).resolve().parent.parent
# What liblsl's and OpenCV's own lines carry and facecast's never do.
FOREIGN_MARKS = ("INFO|", "WARN|", "api_config.cpp", "[ WARN:", "[tcp @", "\x1b[")


def _facecast(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "facecast.daemon.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def user_env(tmp_path) -> dict[str, str]:
    """A user's loopback lsl_api.cfg without a [log] section, and a runtime dir of the test's."""
    config = tmp_path / "lsl_api.cfg"
    config.write_text(Path(os.environ["LSLAPICFG"]).read_text())
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("OPENCV_", "RUNTIME_DIRECTORY"))}
    env.update(LSLAPICFG=str(config), XDG_RUNTIME_DIR=str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir()
    return env


def _foreign_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines()
            if any(mark in line for mark in FOREIGN_MARKS)]


@pytest.mark.parametrize("command", [
    ("streams", "--resolve-wait", "0.3", "--wait", "0.3"),
    ("cameras", "--probe", "http://127.0.0.1:{port}/cam.mjpg", "--timeout", "3"),
])
def test_commands_print_only_facecasts_lines_unless_verbose(command, user_env):
    command = tuple(part.format(port=free_port()) for part in command)
    quiet = _facecast(*command, env=user_env)
    assert quiet.stdout, quiet
    assert _foreign_lines(quiet) == [], quiet
    verbose = _facecast(*command, "--verbose", env=user_env)
    assert _foreign_lines(verbose), verbose  # the libraries do talk: the check above can fail


def test_the_users_lsl_config_is_copied_with_a_log_level_never_edited(tmp_path, monkeypatch):
    original = tmp_path / "lab.cfg"
    text = "[lab]\nKnownPeers = {10.0.0.2}\nSessionID = lab7\n[log]\nfile = /var/log/lsl.log\n"
    original.write_text(text)
    monkeypatch.setenv("LSLAPICFG", str(original))
    copy = third_party_logs.quiet_lsl(tmp_path)
    assert os.environ["LSLAPICFG"] == str(copy) and copy.parent == tmp_path
    assert original.read_text() == text
    lines = copy.read_text().splitlines()
    assert lines[0].startswith("; facecast: copy of ")  # a comment in liblsl's reader
    assert "\n".join(lines[1:]).startswith(text.rstrip())
    assert lines[-2:] == ["[log]", "level = -2"]
    # Same content, same file: a second command (or the daemon) does not add another.
    monkeypatch.setenv("LSLAPICFG", str(original))
    assert third_party_logs.quiet_lsl(tmp_path) == copy
    assert len(list(tmp_path.glob("lsl_api-*.cfg"))) == 1


def test_a_log_level_the_user_chose_is_kept(tmp_path, monkeypatch):
    original = tmp_path / "lab.cfg"
    original.write_text("[log]\nlevel = 3\n")
    monkeypatch.setenv("LSLAPICFG", str(original))
    assert third_party_logs.quiet_lsl(tmp_path) is None
    assert os.environ["LSLAPICFG"] == str(original)


def test_without_any_lsl_config_the_copy_holds_only_the_log_level(tmp_path, monkeypatch):
    monkeypatch.delenv("LSLAPICFG")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    if Path("/etc/lsl_api/lsl_api.cfg").is_file():
        pytest.skip("/etc/lsl_api/lsl_api.cfg exists here: liblsl would read it")
    copy = third_party_logs.quiet_lsl(tmp_path)
    assert copy.read_text().splitlines()[1:] == ["", "", "[log]", "level = -2"]
    assert "liblsl's defaults" in third_party_logs.generated_from(copy)


def test_opencv_levels_the_user_set_win(monkeypatch):
    monkeypatch.setenv("OPENCV_LOG_LEVEL", "DEBUG")
    monkeypatch.delenv("OPENCV_FFMPEG_LOGLEVEL", raising=False)
    third_party_logs.quiet_opencv()
    assert os.environ["OPENCV_LOG_LEVEL"] == "DEBUG"
    assert os.environ["OPENCV_FFMPEG_LOGLEVEL"] == third_party_logs.FFMPEG_QUIET_LEVEL
