"""The CPU priority of warm spares (Note [Spares at a lower priority]): the supervisor decides
whether spares may be lowered (`restore_permitted`, `SPARE_NICE_ENV` in a spare's environment);
a spare lowers itself first thing (`lower_this_process`) and a promoted one takes its priority
back (`restore_this_process`). And of one thread (`lower_this_thread`: `facecast analyze`'s
decoding threads, Note [Decoding at a lower priority]).

Runs in the supervisor (the decision), in every worker (the spare's side) and in `facecast
analyze`.

Note [Spares at a lower priority]
    Spares start when the daemon is READY (Note [Warm standby]) and spend seconds of CPU on
    Python, torch and the models; on 2 cores the four of them took the CPU from the running
    workers (capture→LSL p99 626-1,363 ms and 1.1 of 13.8 fps in the 10 s after READY, issue
    21). So a spare runs at nice +SPARE_NICE_INCREMENT from its first instruction until it is
    promoted; a promoted spare then gets the priority its workers have (the supervisor's nice),
    every thread of it (threads inherit a thread's nice when created, and torch's pools were
    created while it was low). Linux lets a process raise its priority again only within
    RLIMIT_NICE (it may go down to nice 20 - RLIMIT_NICE) or with CAP_SYS_NICE; a process at
    nice 0 with the usual RLIMIT_NICE of 0 cannot come back. A promoted worker stuck at +10
    would get a tenth of the CPU of its peers whenever the CPU is busy, for good: worse than
    a slow start. So the supervisor tries the way back once, with a thread of its own
    (`restore_permitted`), and where it is refused spares run at the normal priority, which
    the log says once and `facecast status` says on every spare's line. The systemd unit grants
    the way back (`LimitNICE=+0`); by hand, `ulimit -e 20` in the shell (within the hard
    limit) or a `nice` line for the user in /etc/security/limits.conf.
"""

from __future__ import annotations

import os
import resource
import threading

SPARE_NICE_ENV = "FACECAST_SPARE_NICE"  # a spare's environment: how much to lower itself
SPARE_NICE_INCREMENT = 10

_lowered_from: int | None = None  # this process's nice before it lowered itself


def current_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def restore_permitted() -> tuple[bool, str]:
    """Whether a process of this user, lowered by SPARE_NICE_INCREMENT, may go back to this
    process's nice; and, when not, why and what allows it. Tried, not computed: a thread of
    this process lowers itself by one step and goes back (CAP_SYS_NICE, containers and
    seccomp all count)."""
    base = current_nice()
    outcome: list[BaseException | None] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(base + 1, 19))
            os.setpriority(os.PRIO_PROCESS, tid, base)
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=probe, name="nice-probe")
    thread.start()
    thread.join(5.0)
    if outcome and outcome[0] is None:
        return True, ""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NICE)
    return False, (f"this user may not raise a process's priority back to nice {base} "
                   f"(RLIMIT_NICE {soft}: back to nice {20 - soft} at best, and no "
                   "CAP_SYS_NICE): a promoted spare would stay low; allow it with LimitNICE=+0 "
                   "(the systemd unit has it), `ulimit -e 20` or a 'nice' line in "
                   "/etc/security/limits.conf")


def lower_this_process(increment: int) -> None:
    """A spare, first thing: its main thread (and every thread it makes later) `increment`
    nicer. Remembers where it came from for `restore_this_process`."""
    global _lowered_from
    if increment <= 0:
        return
    _lowered_from = current_nice()
    os.setpriority(os.PRIO_PROCESS, 0, min(_lowered_from + increment, 19))


def lower_this_thread(increment: int) -> None:
    """The calling thread `increment` nicer, at most 19 (on Linux a thread is a task of its
    own); where there is no such call or it is refused, nothing."""
    try:
        thread_id = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread_id,
                       min(19, os.getpriority(os.PRIO_PROCESS, thread_id) + increment))
    except (AttributeError, OSError):  # no setpriority (Windows), or not allowed here
        pass


def restore_this_process() -> str:
    """A promoted spare: every thread back to the nice it started with; "" when done (or
    never lowered), else why not."""
    if _lowered_from is None:
        return ""
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, _lowered_from)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except PermissionError:
            return (f"runs at nice {current_nice()}, not {_lowered_from}: this user may not "
                    "raise a process's priority back (RLIMIT_NICE; Note [Spares at a lower "
                    "priority])")
    return ""
