"""Test-session setup that has to happen before any test module imports pylsl.

liblsl reads $LSLAPICFG once per process, when it first initialises, so the loopback-only LSL
configuration (DESIGN §4) is put in place here, at import time: every stream the tests (and the
daemons they start, which inherit the variable) create stays on this machine, resolves only via
127.0.0.1, and is invisible to other sessions thanks to a unique SessionID. A value already set
by the caller (CI) wins.
"""

from __future__ import annotations

import atexit
import os
import shutil
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


if "LSLAPICFG" not in os.environ:
    os.environ["LSLAPICFG"] = _loopback_lsl_config()


# --- real producer/consumer processes for the transport tests (tests/peers.py) ---


import pytest  # noqa: E402

from peers import Peers  # noqa: E402


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
