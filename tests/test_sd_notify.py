"""sd_notify over a real AF_UNIX datagram socket, as systemd itself would receive it."""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import uuid
from pathlib import Path

import pytest

from facecast.daemon.sd_notify import Notifier


def _receiver(address: str | bytes) -> socket.socket:
    """A datagram socket like systemd's: bound, with SO_PASSCRED to see the sender's pid."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(2.0)
    return sock


def _receive(sock: socket.socket) -> tuple[str, int]:
    """One datagram's text and the pid the kernel vouches for (what NotifyAccess=main checks)."""
    creds_size = struct.calcsize("3i")
    data, ancillary, _flags, _address = sock.recvmsg(4096, socket.CMSG_SPACE(creds_size))
    sender_pid = -1
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            sender_pid = array.array("i", payload[:creds_size])[0]
    return data.decode(), sender_pid


def _assert_nothing_more(sock: socket.socket) -> None:
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        sock.recv(4096)


def _exercise(notifier: Notifier, receiver: socket.socket) -> None:
    assert notifier.enabled
    assert notifier.ready() is True
    assert notifier.status("2 cameras, 30.0 fps") is True
    assert notifier.watchdog() is True
    assert notifier.status("line one\nline two") is True
    assert notifier.ready(status="reloaded") is True
    assert notifier.stopping() is True
    received = [_receive(receiver) for _ in range(6)]
    assert [text for text, _pid in received] == [
        "READY=1",
        "STATUS=2 cameras, 30.0 fps",
        "WATCHDOG=1",
        "STATUS=line one line two",  # a newline would smuggle in another assignment
        "READY=1\nSTATUS=reloaded",
        "STOPPING=1",
    ]
    assert {pid for _text, pid in received} == {os.getpid()}
    _assert_nothing_more(receiver)


def test_messages_and_order_on_a_path_socket(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with _receiver(str(path)) as receiver:
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        _exercise(notifier, receiver)
        notifier.close()


def test_messages_and_order_on_an_abstract_socket() -> None:
    name = f"facecast-test-{uuid.uuid4().hex}"
    with _receiver(b"\0" + name.encode()) as receiver:
        with Notifier({"NOTIFY_SOCKET": "@" + name}) as notifier:
            _exercise(notifier, receiver)


def test_reads_os_environ_and_unsets_it_for_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "notify.sock"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    with _receiver(str(path)) as receiver, Notifier(unset_environment=True) as notifier:
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            assert name not in os.environ
        assert notifier.watchdog_interval_s() == 15.0
        assert notifier.extend_timeout(2.5) is True
        assert _receive(receiver)[0] == "EXTEND_TIMEOUT_USEC=2500000"


def test_no_socket_means_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert notifier.watchdog_interval_s() is None


def test_unsupported_socket_kind_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        notifier = Notifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert "vsock:2:1234" in caplog.text


def test_send_failure_never_raises_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gone.sock"  # systemd went away: nobody is bound here
    notifier = Notifier({"NOTIFY_SOCKET": str(path)})
    with caplog.at_level(logging.DEBUG, logger="facecast.daemon.sd_notify"):
        assert notifier.ready() is False
        assert notifier.watchdog() is False
        assert notifier.stopping() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(path) in warnings[0].getMessage()

    # The manager comes back: sends work again, and a later failure is reported again.
    with _receiver(str(path)) as receiver:
        assert notifier.watchdog() is True
        assert _receive(receiver)[0] == "WATCHDOG=1"
    path.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="facecast.daemon.sd_notify"):
        assert notifier.watchdog() is False
    assert len(caplog.records) == 1
    notifier.close()


@pytest.mark.parametrize(
    ("environ", "expected_interval_s"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "1000"}, 0.0005),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "self"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "other"}, None),  # meant for another pid
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], expected_interval_s: float | None) -> None:
    environ = dict(environ)
    if environ.get("WATCHDOG_PID") == "self":
        environ["WATCHDOG_PID"] = str(os.getpid())
    elif environ.get("WATCHDOG_PID") == "other":
        environ["WATCHDOG_PID"] = str(os.getpid() + 1)
    assert Notifier(environ).watchdog_interval_s() == expected_interval_s


def test_extend_timeout_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="extra_s"):
        Notifier({}).extend_timeout(0)


def test_a_listener_that_stops_reading_never_blocks_the_sender(tmp_path):
    """systemd always reads; a stuck or test listener may not. The daemon's loop must not hang."""
    import socket as socket_mod
    import time as time_mod

    from facecast.daemon.sd_notify import Notifier

    path = tmp_path / "notify.sock"
    listener = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM)
    listener.bind(str(path))
    try:
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        started = time_mod.monotonic()
        sent = [notifier.status(f"tick {k}") for k in range(500)]  # never read
        assert time_mod.monotonic() - started < 2.0
        assert sent[0] is True and sent[-1] is False  # the queue filled; later ones dropped
        notifier.close()
    finally:
        listener.close()
