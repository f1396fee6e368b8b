"""Another facecast daemon publishing under this daemon's stream ids, found through LSL at
`facecast run` (issue 21). Runs on the CLI side, before the supervisor starts.

Note [One daemon per stream id]
    Every stream's source_id is `facecast-<host>-...` (DESIGN §8), and LabRecorder and pylsl
    inlets recover a stream by its source_id. Two daemons with the same `daemon.host_name` (or
    the same machine name: the systemd unit and a manual run with another runtime directory,
    whose locks do not meet) would publish the same ids, and `facecast streams` listed every
    stream twice while recordings took whichever answered first. So `facecast run` asks LSL for
    a stream of this host's Markers id before it starts anything and refuses to start when one
    answers, saying where it runs (its machine, and the pid and runtime directory that its
    Markers stream's metadata names). The question costs up to PEER_RESOLVE_TIMEOUT_S when no
    other daemon is there; one that is there answers within milliseconds on an idle machine.
    On a loaded one it may take longer: with 0.3 s, on the 2-core machine with four processes
    busy on its two cores (2026-11-27), tests/test_second_daemon.py's second daemon once ran
    on for 120 s instead of being refused, which is what a missed answer does (it passed alone
    under the same load, three times). A second at every start buys that margin.
"""

from __future__ import annotations

PEER_RESOLVE_TIMEOUT_S = 1.0
PEER_INFO_TIMEOUT_S = 2.0


def markers_source_id(host: str) -> str:
    return f"facecast-{host}-markers"


def other_daemon(host: str) -> str | None:
    """Where another daemon that publishes as `host` runs (a sentence), or None."""
    import pylsl

    found = pylsl.resolve_bypred(f"source_id='{markers_source_id(host)}'", minimum=1,
                                 timeout=PEER_RESOLVE_TIMEOUT_S)
    if not found:
        return None
    info = found[0]
    where = f"on machine {info.hostname()!r}"
    try:  # its metadata says which process and runtime directory (the resolve does not)
        inlet = pylsl.StreamInlet(info)
        try:
            facecast = inlet.info(timeout=PEER_INFO_TIMEOUT_S).desc().child("facecast")
            pid, runtime_dir = facecast.child_value("pid"), facecast.child_value("runtime_dir")
        finally:
            inlet.close_stream()
        if pid:
            where += f", pid {pid}"
        if runtime_dir:
            where += f", runtime directory {runtime_dir}"
    except (pylsl.util.TimeoutError, RuntimeError):  # noqa: PERF203 - the resolve said enough
        pass
    return where
