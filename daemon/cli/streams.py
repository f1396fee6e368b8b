"""`facecast streams`: the facecast LSL streams this machine can see, with their real rates.

Runs on the CLI side and only as an LSL consumer, exactly like LabRecorder would: it resolves
every stream on the network (within what lsl_api.cfg allows), keeps those whose source_id starts
with "facecast-" (DESIGN §4: `facecast-<host>-<camera>-face<k>`, `-pose`, `-markers`), opens an
inlet on each and counts the samples that arrive during `--wait` seconds. A measured rate well
below the nominal one means frames are being dropped somewhere between camera and outlet; a
rate of 0 on a Face stream means its camera is not delivering.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

FACECAST_SOURCE_PREFIX = "facecast-"
DEFAULT_WAIT_S = 2.0
DEFAULT_RESOLVE_WAIT_S = 2.0
OPEN_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.01


@dataclass
class StreamRate:
    """One row of the table."""

    name: str
    type: str
    source_id: str
    channel_count: int
    nominal_rate_hz: float  # 0: irregular (LSL's IRREGULAR_RATE)
    hostname: str
    measured_rate_hz: float | None = None  # None: no inlet could be opened
    error: str = ""


def find_streams(resolve_wait_s: float = DEFAULT_RESOLVE_WAIT_S) -> tuple[list, int]:
    """(facecast's stream infos sorted by host and source_id, how many other streams were seen)."""
    import pylsl

    # Note [Resolving for a fixed time]
    #     `--resolve-wait` is how long the command listens for streams, and it should take that
    #     long. liblsl 1.18's one-shot resolve (pylsl.resolve_streams, lsl_resolve_all) often
    #     returns 5 s after its wait_time when nothing answers (0.5 s asked: 5.5 s measured on
    #     loopback, in four runs of four; whether it happens depends on the machine's LSL
    #     traffic), so an empty network cost 5.5 s, not the 0.5 s asked for. A continuous
    #     resolver (the console worker's) sends the same queries in the background and hands
    #     over what answered when asked: 0.5 s measured in every run.
    resolver = pylsl.ContinuousResolver()
    try:
        time.sleep(resolve_wait_s)  # the listening time the user asked for
        infos = resolver.results()
    finally:
        del resolver  # its background queries end with it
    ours = [info for info in infos if info.source_id().startswith(FACECAST_SOURCE_PREFIX)]
    ours.sort(key=lambda info: (info.hostname(), info.source_id()))
    return ours, len(infos) - len(ours)


def measure_rates(infos: list, wait_s: float = DEFAULT_WAIT_S) -> list[StreamRate]:
    """Open an inlet on every stream, then count what arrives on all of them during `wait_s`."""
    import pylsl

    rows = [StreamRate(info.name(), info.type(), info.source_id(), info.channel_count(),
                       info.nominal_srate(), info.hostname()) for info in infos]
    inlets: list = [None] * len(infos)
    try:
        for index, info in enumerate(infos):
            # Room for the whole window so that nothing is dropped while we poll other inlets.
            inlet = pylsl.StreamInlet(info, max_buflen=max(1, int(wait_s) + 2),
                                      processing_flags=pylsl.proc_none)
            try:
                inlet.open_stream(timeout=OPEN_TIMEOUT_S)
            except RuntimeError as exc:  # pylsl's TimeoutError/LostError: resolvable, unreachable
                rows[index].error = f"could not open an inlet: {type(exc).__name__}: {exc}"
                continue
            inlets[index] = inlet
        # A new inlet receives only samples pushed after it connected, but the inlets opened first
        # have been collecting while the later ones connected: start every count from empty.
        for inlet in inlets:
            if inlet is not None:
                _drain(inlet)
        counts = [0] * len(infos)
        started_monotonic = time.monotonic()
        while time.monotonic() - started_monotonic < wait_s:
            for index, inlet in enumerate(inlets):
                if inlet is not None:
                    counts[index] += _drain(inlet)
            time.sleep(POLL_INTERVAL_S)
        elapsed_s = time.monotonic() - started_monotonic
        for index, inlet in enumerate(inlets):
            if inlet is not None:
                rows[index].measured_rate_hz = counts[index] / elapsed_s
    finally:
        for inlet in inlets:
            if inlet is not None:
                inlet.close_stream()
    return rows


def _drain(inlet) -> int:
    """Pull everything queued in the inlet now; return how many samples that was."""
    total = 0
    while True:
        _, timestamps = inlet.pull_chunk(timeout=0.0, max_samples=1024)
        total += len(timestamps)
        if len(timestamps) < 1024:
            return total


def format_table(rows: list[StreamRate]) -> str:
    header = ("name", "type", "source_id", "channels", "nominal Hz", "measured Hz", "host")
    table = [header] + [
        (row.name, row.type, row.source_id, str(row.channel_count),
         "irregular" if row.nominal_rate_hz == 0 else f"{row.nominal_rate_hz:.1f}",
         "n/a" if row.measured_rate_hz is None else f"{row.measured_rate_hz:.1f}",
         row.hostname)
        for row in rows
    ]
    widths = [max(len(line[column]) for line in table) for column in range(len(header))]
    numeric = {3, 4, 5}
    text = []
    for line in table:
        cells = [cell.rjust(width) if column in numeric else cell.ljust(width)
                 for column, (cell, width) in enumerate(zip(line, widths))]
        text.append("  ".join(cells).rstrip())
    text += [f"{row.source_id}: {row.error}" for row in rows if row.error]
    return "\n".join(text)


def positive_seconds(text: str) -> float:
    """argparse type: seconds, > 0 (also for `facecast cameras`)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", metavar="S", type=positive_seconds, default=DEFAULT_WAIT_S,
                        help="seconds to count samples on each stream (default: %(default)s)")
    parser.add_argument("--resolve-wait", metavar="S", type=positive_seconds,
                        default=DEFAULT_RESOLVE_WAIT_S,
                        help="seconds to look for streams on the network (default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    infos, others = find_streams(args.resolve_wait)
    if not infos:
        from facecast.daemon.cli.doctor import lsl_config_in_effect

        config_text, _ = lsl_config_in_effect()
        print(f"no facecast streams visible from this machine after {args.resolve_wait:g} s "
              f"({others} other LSL stream(s) seen); is the daemon running (`facecast status`)? "
              f"LSL config: {config_text}")
        return 1
    rows = measure_rates(infos, args.wait)
    print(format_table(rows))
    return 0
