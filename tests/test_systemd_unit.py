"""systemd/facecast.service: `systemd-analyze verify` accepts it, and it says what DESIGN §5 needs.

`systemd-analyze verify` loads the unit the way PID 1 would, without being PID 1: it reports
unknown keys, unparsable values and an ExecStart= that is not executable. It exits 0 even on
many of those (they are "ignoring" warnings), so the test reads its output, not only its status.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT_PATH = Path(__file__).resolve().parents[1] / "systemd" / "facecast.service"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian: package systemd)"
)


def _directives(text: str) -> dict[tuple[str, str], list[str]]:
    """(section, key) -> values in order; keys may repeat (Environment=)."""
    found: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw_line in text.splitlines():
        line = raw_line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a KEY=VALUE line in the unit: {raw_line!r}"
        found.setdefault((section, key.strip()), []).append(value.strip())
    return found


def _installed_executable() -> str:
    """An executable that exists here: the `facecast` console script, else this Python."""
    return shutil.which("facecast") or sys.executable


def _copy_with_exec_start(tmp_path: Path, text: str) -> Path:
    exec_start = re.search(r"^ExecStart=(\S+)(.*)$", text, re.M)
    assert exec_start, "the unit has no ExecStart= line"
    arguments = exec_start.group(2)
    text = text.replace(exec_start.group(0), f"ExecStart={_installed_executable()}{arguments}")
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    copy = unit_dir / UNIT_PATH.name
    copy.write_text(text)
    return copy


def _verify(unit: Path) -> tuple[int, str]:
    env = dict(os.environ, SYSTEMD_LOG_COLOR="0", SYSTEMD_PAGER="", SYSTEMD_LOG_LEVEL="info")
    completed = subprocess.run(
        # --man=no: do not run man(1) for Documentation= (not installed on CI images).
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    return completed.returncode, completed.stdout + completed.stderr


def _lines_about(output: str, unit: Path) -> list[str]:
    return [
        line for line in output.splitlines() if str(unit) in line or f"{unit.name}:" in line
    ]


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    unit = _copy_with_exec_start(tmp_path, UNIT_PATH.read_text())
    returncode, output = _verify(unit)
    assert returncode == 0, f"systemd-analyze verify failed ({returncode}):\n{output}"
    assert _lines_about(output, unit) == [], f"systemd-analyze verify complained:\n{output}"


@needs_systemd_analyze
def test_systemd_analyze_verify_would_notice_a_broken_unit(tmp_path: Path) -> None:
    """Guards the test above: verify really parses the unit in this environment."""
    text = UNIT_PATH.read_text().replace("WatchdogSec=30", "WatchdogSec=thirty\nNotAKey=1")
    unit = _copy_with_exec_start(tmp_path, text)
    _returncode, output = _verify(unit)
    complaints = "\n".join(_lines_about(output, unit))
    assert "thirty" in complaints and "NotAKey" in complaints, output


@needs_systemd_analyze
def test_systemd_analyze_verify_would_notice_a_missing_executable(tmp_path: Path) -> None:
    unit = _copy_with_exec_start(tmp_path, UNIT_PATH.read_text())
    missing = "ExecStart=/nonexistent/facecast"
    text = re.sub(r"^ExecStart=\S+", missing, unit.read_text(), flags=re.M)
    unit.write_text(text)
    returncode, output = _verify(unit)
    assert returncode != 0 and "/nonexistent/facecast" in output, output


def test_unit_has_the_directives_the_daemon_relies_on() -> None:
    directives = _directives(UNIT_PATH.read_text())

    def one(section: str, key: str) -> str:
        values = directives.get((section, key))
        assert values, f"[{section}] {key}= is missing from {UNIT_PATH.name}"
        assert len(values) == 1, f"[{section}] {key}= is set {len(values)} times"
        return values[0]

    assert one("Service", "Type") == "notify"
    assert one("Service", "NotifyAccess") == "main"
    assert one("Service", "WatchdogSec") == "30"
    assert one("Service", "Restart") == "on-failure"
    assert one("Service", "RestartSec")
    assert "2" in one("Service", "RestartPreventExitStatus").split()  # a bad config
    assert one("Service", "RuntimeDirectory") == "facecast"
    assert one("Service", "KillMode") == "mixed"
    assert one("Service", "TimeoutStopSec") == "10"
    # A promoted warm spare may take nice 0 back (Note [Spares at a lower priority]).
    assert one("Service", "LimitNICE") == "+0"
    assert one("Service", "User") == "facecast"
    assert set(one("Service", "SupplementaryGroups").split()) >= {"video", "render"}
    assert one("Service", "ExecStart") == (
        "/usr/local/bin/facecast run --config /etc/facecast/facecast.toml"
    )
    assert "network-online.target" in one("Unit", "After").split()
    assert "network-online.target" in one("Unit", "Wants").split()
    assert "LSLAPICFG=/etc/facecast/lsl_api.cfg" in directives[("Service", "Environment")]
    assert one("Install", "WantedBy") == "multi-user.target"

    # A dedicated user, not a dynamic one; and nothing that hides cameras or GPUs.
    for key, breaks in [
        ("DynamicUser", "a dedicated user owns the model cache and joins video/render"),
        ("PrivateDevices", "hides /dev/video* and /dev/nvidia*"),
        ("ProtectClock", "implies DeviceAllow=char-rtc, which closes every other device"),
        ("DeviceAllow", "turns the device policy into an allow-list"),
        ("MemoryDenyWriteExecute", "breaks JIT compilation (CUDA, torch)"),
        ("ProcSubset", "hides /proc/driver/nvidia from NVML"),
    ]:
        value = directives.get(("Service", key), ["no"])[-1]
        assert value in ("no", "false", ""), f"{key}={value}: {breaks}"
