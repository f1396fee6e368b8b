"""systemd's notify protocol (sd_notify(3)), spoken directly over $NOTIFY_SOCKET.

Runs in the supervisor only: the unit says `NotifyAccess=main`, so messages from any other
process of the service are ignored by systemd anyway. Construct the `Notifier` with
`unset_environment=True` before spawning workers so that they do not inherit the socket.

The protocol: each message is one datagram of newline-separated `KEY=VALUE` assignments sent to
the AF_UNIX SOCK_DGRAM socket named by $NOTIFY_SOCKET; a name starting with `@` is in the
abstract namespace (the `@` stands for a leading NUL byte). Without $NOTIFY_SOCKET (not started by
systemd, or `Type=` is not notify) every call is a no-op. A failed send never raises: a daemon
must not die because its service manager went away; the first failure is logged as a warning,
repeats at debug level until a send succeeds again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

_ENV_SOCKET = "NOTIFY_SOCKET"
_ENV_WATCHDOG_USEC = "WATCHDOG_USEC"
_ENV_WATCHDOG_PID = "WATCHDOG_PID"


class Notifier:
    """Sends READY=1, WATCHDOG=1, STATUS=, STOPPING=1 ... to systemd; a no-op outside systemd.

    `environ` defaults to `os.environ` (tests pass a dict). With `unset_environment=True` the
    three variables are removed from it after reading, as sd_notify(3)'s `unset_environment`
    does, so that child processes do not talk to systemd in the daemon's name.
    """

    def __init__(
        self,
        environ: MutableMapping[str, str] | None = None,
        *,
        unset_environment: bool = False,
    ) -> None:
        env = os.environ if environ is None else environ
        self._socket_name = env.get(_ENV_SOCKET, "")
        self._watchdog_usec_text = env.get(_ENV_WATCHDOG_USEC, "")
        self._watchdog_pid_text = env.get(_ENV_WATCHDOG_PID, "")
        if unset_environment:
            for name in (_ENV_SOCKET, _ENV_WATCHDOG_USEC, _ENV_WATCHDOG_PID):
                env.pop(name, None)
        self._address = _socket_address(self._socket_name)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # the health loop and the main loop may both send
        self._failing = False

    # --- what the supervisor calls -------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """True when there is a notify socket to talk to."""
        return self._address is not None

    def ready(self, status: str | None = None) -> bool:
        """READY=1 (with an optional STATUS= in the same datagram): start-up is complete."""
        return self._send(["READY=1"] + ([_status_field(status)] if status is not None else []))

    def status(self, text: str) -> bool:
        """STATUS=<one line> shown by `systemctl status`; newlines are folded into spaces."""
        return self._send([_status_field(text)])

    def watchdog(self) -> bool:
        """WATCHDOG=1: the daemon is healthy; send it every `watchdog_interval_s()` seconds."""
        return self._send(["WATCHDOG=1"])

    def reloading(self) -> bool:
        """RELOADING=1: a config reload started; send `ready()` when it is done."""
        return self._send(["RELOADING=1"])

    def stopping(self) -> bool:
        """STOPPING=1: an orderly shutdown began."""
        return self._send(["STOPPING=1"])

    def extend_timeout(self, extra_s: float) -> bool:
        """EXTEND_TIMEOUT_USEC=: ask for `extra_s` more seconds to finish starting or stopping."""
        if not extra_s > 0:
            raise ValueError(f"extend_timeout: extra_s must be > 0 seconds, got {extra_s!r}")
        return self._send([f"EXTEND_TIMEOUT_USEC={int(extra_s * 1_000_000)}"])

    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

        None when the watchdog is off: no $WATCHDOG_USEC, or $WATCHDOG_PID names another process
        (the variables were meant for a parent or child), or the values are not numbers.
        """
        if not self._watchdog_usec_text:
            return None
        if self._watchdog_pid_text:
            try:
                watchdog_pid = int(self._watchdog_pid_text)
            except ValueError:
                log.warning("ignoring $WATCHDOG_PID=%r: not a process id", self._watchdog_pid_text)
                return None
            if watchdog_pid != os.getpid():
                return None
        try:
            watchdog_usec = int(self._watchdog_usec_text)
        except ValueError:
            log.warning(
                "ignoring $WATCHDOG_USEC=%r: not a whole number of microseconds",
                self._watchdog_usec_text,
            )
            return None
        if watchdog_usec <= 0:
            return None
        return watchdog_usec / 1_000_000 / 2

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the datagram ----------------------------------------------------------------------------

    def _send(self, fields: list[str]) -> bool:
        """Send one datagram; True when it was sent, False when disabled or it failed."""
        if self._address is None:
            return False
        message = "\n".join(fields).encode("utf-8", errors="replace")
        with self._lock:
            try:
                if self._sock is None:
                    # Non-blocking: a listener that stops reading (a full queue) must never stall
                    # the supervisor's loop; the datagram is dropped and the failure logged.
                    kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                    self._sock = socket.socket(socket.AF_UNIX, kind)
                self._sock.sendto(message, self._address)
            except OSError as exc:
                if not self._failing:
                    log.warning(
                        "cannot notify systemd through $NOTIFY_SOCKET=%s (%s); carrying on, "
                        "further failures are logged at debug level",
                        self._socket_name,
                        exc,
                    )
                else:
                    log.debug("sd_notify %r failed: %s", fields, exc)
                self._failing = True
                return False
            if self._failing:
                log.info("notifying systemd works again")
                self._failing = False
            return True


def _socket_address(name: str) -> str | bytes | None:
    """$NOTIFY_SOCKET as an AF_UNIX address; None when unset or of a kind this does not speak."""
    if not name:
        return None
    if name.startswith("@"):
        return b"\0" + name[1:].encode()  # abstract namespace: no file, a leading NUL byte
    if name.startswith("/"):
        return name
    # systemd >= 254 may also hand out `vsock:CID:PORT` (for VMs); facecast runs on the host.
    log.warning(
        "ignoring $NOTIFY_SOCKET=%r: only absolute paths and @abstract names are supported", name
    )
    return None


def _status_field(text: str) -> str:
    """One assignment per line is the protocol, so a status must not contain a newline."""
    return "STATUS=" + " ".join(str(text).splitlines())
