"""FrameHops (shared/stats.py, Note [Latency accounted]): a frame's latency split into the hops
between its stamps, whose means add up to the mean latency."""

from __future__ import annotations

import pytest

from facecast.shared.stats import FrameHops

HOP_NAMES = [f"hop {number}: {hop}" for number, hop in enumerate(FrameHops.HOPS, start=1)]
TOTAL = f"hop total: {FrameHops.TOTAL}"


def stamps(start_s: float, hops_ms: list[float]) -> tuple[float, ...]:
    out = [start_s]
    for hop_ms in hops_ms:
        out.append(out[-1] + hop_ms / 1e3)
    return tuple(out)


def test_each_hop_is_timed_and_their_means_add_up_to_the_mean_latency():
    hops = FrameHops()
    frames = [[1, 2, 3, 4, 5, 6, 7], [2, 0.5, 1, 8, 0.25, 3, 1], [10, 1, 1, 1, 1, 1, 40]]
    for index, hops_ms in enumerate(frames):
        assert hops.add(stamps(100.0 + index, hops_ms))
    timings = hops.timings()
    assert list(timings) == [*HOP_NAMES, TOTAL]
    for number, name in enumerate(HOP_NAMES):
        expected = sorted(frame[number] for frame in frames)
        assert timings[name].p50_ms == pytest.approx(expected[1], abs=1e-3)
        assert timings[name].mean_ms == pytest.approx(sum(expected) / 3, abs=1e-3)
        assert timings[name].count == 3
    assert timings[TOTAL].mean_ms == pytest.approx(sum(map(sum, frames)) / 3, abs=1e-3)
    assert sum(timings[name].mean_ms for name in HOP_NAMES) == pytest.approx(
        timings[TOTAL].mean_ms, abs=0.01)


def test_a_frame_with_a_missing_stamp_is_left_out_whole():
    hops = FrameHops()
    unstamped = list(stamps(50.0, [1] * 7))
    unstamped[2] = 0.0  # a sender that does not stamp "picked up"
    assert not hops.add(tuple(unstamped))
    assert hops.timings() == {}
    assert hops.add(stamps(50.0, [1] * 7))
    assert {timing.count for timing in hops.timings().values()} == {1}


def test_stamps_of_another_length_are_refused():
    with pytest.raises(ValueError, match="8 stamps"):
        FrameHops().add((1.0, 2.0, 3.0))


def test_latency_windows_report_their_last_values_alone_and_many_windows_at_once():
    """A window keeps its last `size` values (an older one leaves it); window_timings gives each
    window's own figures however many values each holds, None for an empty one."""
    from facecast.shared.stats import LatencyWindow, window_timings
    from facecast.shared.transport.messages import StageTiming

    windows = [LatencyWindow(4), LatencyWindow(4), LatencyWindow(4)]
    for value in (100.0, 1.0, 2.0, 3.0, 4.0):  # 100 has left the window
        windows[0].add_ms(value)
    for value in (5.0, 7.0):
        windows[1].add_ms(value)
    timings = window_timings(windows)
    assert timings[0] == StageTiming(p50_ms=2.5, p99_ms=3.97, count=5, mean_ms=2.5)
    assert timings[1] == StageTiming(p50_ms=6.0, p99_ms=6.98, count=2, mean_ms=6.0)
    assert timings[2] is None
    assert [window.timing() for window in windows] == timings


def test_the_hops_are_of_the_last_frames_and_the_count_of_every_frame():
    """The stamps' ring keeps its last `size` frames: an older frame's hops leave the figures,
    while the count says how many frames were added in all."""
    hops = FrameHops(size=2)
    for hops_ms in ([100] * 7, [1] * 7, [3] * 7):  # the 100 ms frame leaves the ring
        assert hops.add(stamps(10.0, hops_ms))
    timings = hops.timings()
    for name in HOP_NAMES:
        assert (timings[name].p50_ms, timings[name].mean_ms, timings[name].count) == (2.0, 2.0, 3)
    assert timings[TOTAL].mean_ms == pytest.approx(14.0, abs=1e-3)
    assert timings[TOTAL].p99_ms == pytest.approx(20.86, abs=1e-3)
