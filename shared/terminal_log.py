"""Where the daemon's log lines go when `facecast run` runs at a terminal (Note [A terminal is not
a log]): set up by `facecast run` for the supervisor's process (`split_for_terminal`), and by each
worker from its environment (`configure_worker`).

Runs in the supervisor's process (through `facecast run`) and in every worker.

Note [A terminal is not a log]
    At a terminal, the first 20 s of `facecast run` were about 40 INFO lines (every worker
    started, booted, attached a ring; a line per spare) between the cameras' status lines, so
    that what a person looks for (is it working, is anything wrong) scrolled away. Under systemd
    (or with stderr not a terminal) nothing changes: every line at `daemon.log_level` goes to
    stderr, the journal. At a terminal, without `--log-level`, the full log at that level goes
    to `facecast.log` in the runtime directory (0600, this run's, every process appending)
    and the terminal shows warnings and errors, the few milestones a person waits for
    (`MILESTONES`: ready, reload, recording, stopping, stopped) and the status line per camera
    every 2 s; the first line says where the log is. `--log-level LEVEL` puts every line of
    that level on the terminal again.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_FILE_ENV = "FACECAST_LOG_FILE"  # workers: append the full log here
TERMINAL_LEVEL = logging.WARNING
LOG_FILE_NAME = "facecast.log"
# (logger, what the line starts with): the INFO lines a person at the terminal waits for.
MILESTONES = (
    ("facecast.daemon.supervisor", ("ready in ", "SIGHUP: reloading", "SIGINT: stopping",
                                    "SIGTERM: stopping", "--duration reached")),
    ("facecast.daemon.reload", ("reloaded ",)),
    ("facecast.daemon.recordings", ("recording ",)),
    ("facecast.daemon.shutdown", ("stopped in ",)),
)


class _TerminalFilter(logging.Filter):
    """Warnings and errors, and the milestones."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= TERMINAL_LEVEL:
            return True
        for name, prefixes in MILESTONES:
            if record.name == name:
                return record.getMessage().startswith(prefixes)
        return False


def _handlers(path: str, mode: str) -> list[logging.Handler]:
    to_file = logging.FileHandler(path, mode=mode, encoding="utf-8")
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.addFilter(_TerminalFilter())
    return [to_file, to_terminal]


def split_for_terminal(runtime_dir: str, level: str, fresh: bool = True) -> str:
    """`facecast run` at a terminal: the full log to the runtime directory's facecast.log (0600;
    emptied first when `fresh`: not while another daemon there may be writing it), the
    terminal's share to stderr; the workers follow through the environment. Returns the path."""
    path = os.path.join(runtime_dir, LOG_FILE_NAME)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if fresh else os.O_APPEND)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    os.close(fd)
    root = logging.getLogger()
    formatter = root.handlers[0].formatter if root.handlers else None
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in _handlers(path, "a"):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level.upper())
    os.environ[LOG_FILE_ENV] = path
    return path


def configure_worker(level: str) -> None:
    """A worker's logging: to stderr (the daemon's), or split as `facecast run` split its own."""
    path = os.environ.get(LOG_FILE_ENV)
    if not path:
        logging.basicConfig(level=level.upper())
        return
    try:
        handlers = _handlers(path, "a")
    except OSError as exc:  # the runtime directory went away: stderr has everything
        logging.basicConfig(level=level.upper())
        logging.getLogger(__name__).warning("cannot append to %s (%s); logging to stderr",
                                            path, exc)
        return
    logging.basicConfig(level=level.upper(), handlers=handlers)
