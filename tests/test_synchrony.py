"""Synchrony between people (facecast.workers.output.synchrony; docs/synchrony.md): the lag of a
known
delay is recovered within one grid sample, with rMEA's sign convention (Note [Windowed lagged
cross-correlation]), whatever the cameras' rates and drops (Note [Common time base]); absent
partners give NaN; the stream's layout and the config's errors.

Pure numpy and one pylsl.StreamInfo (no outlet, no network): fast, no daemon.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pylsl
import pytest

from facecast.workers.output.synchrony import (
    DEFAULT_SIGNALS,
    SynchronyConfig,
    SynchronyEngine,
    fill_desc,
    lagged_correlations,
    signal_columns,
    synchrony_layout,
)
from facecast.workers.output.outlets import face_channels

T0_LSL = 5000.0  # LSL times of a machine up for a while: far from 0, as in the daemon
SIGNALS = ["head_yaw", "head_pitch", "jawOpen"]


def smooth_noise(rng: np.random.Generator, seconds: float, signal_count: int,
                 resolution_hz: float = 240.0) -> tuple[np.ndarray, np.ndarray]:
    """A behaviour-like random signal known at `resolution_hz`: white noise low-passed to a few
    Hz (a Hann window of 0.25 s), so that a camera at any rate can sample it by lookup."""
    count = int(seconds * resolution_hz)
    kernel = np.hanning(int(0.25 * resolution_hz))
    kernel /= kernel.sum()
    noise = rng.normal(size=(count + kernel.size, signal_count))
    values = np.stack([np.convolve(noise[:, c], kernel, mode="valid")[:count]
                       for c in range(signal_count)], axis=1)
    return np.arange(count) / resolution_hz, values / values.std(axis=0)


class Source:
    """One underlying behaviour, seen by cameras at their own rates, drops and jitter."""

    def __init__(self, seed: int, seconds: float = 40.0, signal_count: int = len(SIGNALS)):
        self.times_s, self.values = smooth_noise(np.random.default_rng(seed), seconds,
                                                 signal_count)

    def camera(self, fps: float, start_s: float, end_s: float, *, delay_s: float = 0.0,
               noise: float = 0.05, drop_fraction: float = 0.0, jitter_s: float = 0.0,
               seed: int = 0, scale: float = 1.0, offset: float = 0.0):
        """(timestamps_lsl, values) of a camera filming someone who does at t what this source
        did at t - delay_s. Timestamps are the capture times (jittered), values the behaviour
        at the true instant, plus measurement noise."""
        rng = np.random.default_rng(seed)
        true_s = np.arange(start_s, end_s, 1.0 / fps)
        if jitter_s:
            true_s = true_s + rng.uniform(-jitter_s, jitter_s, true_s.size)
        if drop_fraction:
            true_s = true_s[rng.random(true_s.size) >= drop_fraction]
        values = np.stack([np.interp(true_s - delay_s, self.times_s, self.values[:, c])
                           for c in range(self.values.shape[1])], axis=1)
        values = offset + scale * (values + noise * rng.normal(size=values.shape))
        return T0_LSL + true_s, values


def config(**fields) -> SynchronyConfig:
    fields.setdefault("signals", SIGNALS)
    return SynchronyConfig(**fields)


# ------------------------------------------------------------------------------------------------
# The lag and who leads
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delay_s", [0.8, -0.5, 0.0, 1.9, 0.33])
def test_a_known_delay_is_recovered_within_one_sample_and_its_sign_names_the_leader(delay_s):
    # bob does what ann did delay_s earlier: ann leads for delay_s > 0 (lag_s > 0), bob for < 0.
    # 0.33 s is not a whole number of 10 Hz grid steps: the nearest step is within one.
    source = Source(seed=1)
    settings = config(window_s=5, max_lag_s=2, rate_hz=10)
    engine = SynchronyEngine(settings, ["ann", "bob"])
    engine.push("ann", *source.camera(30, 2, 20, seed=2))
    engine.push("bob", *source.camera(30, 2, 20, delay_s=delay_s, seed=3))
    result = engine.update(T0_LSL + 20)
    (row,) = result.rows
    step_s = 1 / settings.rate_hz
    assert row.present
    assert abs(row.sync_lag_s - delay_s) <= step_s + 1e-9, row
    np.testing.assert_array_less(np.abs(row.lag_s_by_signal - delay_s), step_s + 1e-9)
    # In phase: positive r; an off-grid delay (0.33 s) costs a little of it.
    assert row.sync_r > 0.85
    assert np.all(row.r_by_signal > 0.85)
    expected_leader = None if abs(delay_s) < step_s / 2 else ("ann" if delay_s > 0 else "bob")
    assert row.leader() == expected_leader


def test_swapping_the_pair_flips_the_sign_and_anti_phase_keeps_its_sign():
    # The same two people in the other order: the lag changes sign, the leader stays.
    # An inverted follower (one who turns left when the other turns right): r < 0 per signal,
    # and the aggregate, which counts |z| (rMEA's ABS), still finds the coupling and its lag.
    source = Source(seed=4)
    settings = config(window_s=6, max_lag_s=3)
    forward = SynchronyEngine(settings, ["ann", "bob"])
    backward = SynchronyEngine(settings, ["bob", "ann"])
    ann = source.camera(25, 0, 20, seed=5)
    bob = source.camera(25, 0, 20, delay_s=1.2, seed=6, scale=-1.0, offset=30.0)
    for engine in (forward, backward):
        engine.push("ann", *ann)
        engine.push("bob", *bob)
    (row_forward,) = forward.update(T0_LSL + 20).rows
    (row_backward,) = backward.update(T0_LSL + 20).rows
    assert row_forward.sync_lag_s == pytest.approx(1.2, abs=0.1 + 1e-9)
    assert row_backward.sync_lag_s == pytest.approx(-row_forward.sync_lag_s)
    assert row_forward.leader() == row_backward.leader() == "ann"
    assert np.all(row_forward.r_by_signal < -0.9)
    assert row_forward.sync_r > 0.9
    np.testing.assert_allclose(row_backward.r_by_signal, row_forward.r_by_signal)


def test_independent_people_give_small_correlations():
    # Two unrelated behaviours over 10 s at 30 Hz (300 pairs per lag): chance |r| at one lag is
    # about 1 / sqrt(300) = 0.06 for white noise, more for smooth signals; the peak over 61 lags
    # stays far below a coupled pair's > 0.9.
    settings = config(window_s=10, max_lag_s=1, rate_hz=30)
    engine = SynchronyEngine(settings, ["ann", "bob"])
    engine.push("ann", *Source(seed=7).camera(30, 0, 30, seed=8))
    engine.push("bob", *Source(seed=9).camera(30, 0, 30, seed=10))
    (row,) = engine.update(T0_LSL + 30).rows
    assert row.present
    assert row.sync_r < 0.35, row
    assert np.all(np.abs(row.r_by_signal) < 0.4), row


def test_vectorised_correlations_match_a_loop_over_rmeas_definition():
    # Pearson r at each lag over exactly W pairs, (a[t], b[t + k]) for k >= 0 and
    # (a[t + k], b[t]) for -k, pairwise complete: the straightforward loop, on data with holes,
    # against the FFT sums (Note [Lagged sums by FFT]).
    rng = np.random.default_rng(11)
    window, lag = 40, 7
    a = rng.normal(size=(3, 2, window + lag))
    b = rng.normal(size=(3, 2, window + lag)) + 0.5 * a
    a[0, 0, 5:9] = np.nan
    b[1, 1, 30:35] = np.nan
    r = lagged_correlations(a, b, window, lag)
    assert r.shape == (3, 2, 2 * lag + 1)
    for index in np.ndindex(3, 2):
        for k in range(-lag, lag + 1):
            x = a[index][max(-k, 0):max(-k, 0) + window]
            y = b[index][max(k, 0):max(k, 0) + window]
            both = np.isfinite(x) & np.isfinite(y)
            expected = np.corrcoef(x[both], y[both])[0, 1]
            assert r[index][lag + k] == pytest.approx(expected, abs=1e-10)


def test_a_constant_series_has_no_correlation():
    a = np.full((1, 30), 0.25)
    b = np.random.default_rng(12).normal(size=(1, 30))
    assert np.all(np.isnan(lagged_correlations(a, b, 25, 5)))
    a = np.full((1, 30), 1e6) + np.linspace(0, 1, 30)  # large mean, real spread: a number
    assert np.all(np.isfinite(lagged_correlations(a, b, 25, 5)))


# ------------------------------------------------------------------------------------------------
# Cameras of different rates, drops, jitter, order
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fps_a, fps_b", [(30, 15), (25, 60), (12, 30)])
def test_different_rates_dropped_frames_and_jitter_still_recover_the_lag(fps_a, fps_b):
    source = Source(seed=13)
    engine = SynchronyEngine(config(window_s=8, max_lag_s=2), ["ann", "bob"])
    engine.push("ann", *source.camera(fps_a, 0, 20, drop_fraction=0.1, jitter_s=0.004, seed=14))
    engine.push("bob", *source.camera(fps_b, 0, 20, delay_s=-0.7, drop_fraction=0.1,
                                      jitter_s=0.004, seed=15))
    (row,) = engine.update(T0_LSL + 19.9).rows
    assert row.present
    assert abs(row.sync_lag_s - (-0.7)) <= 0.1 + 1e-9, row
    np.testing.assert_array_less(np.abs(row.lag_s_by_signal + 0.7), 0.1 + 1e-9)
    assert row.leader() == "bob"
    assert row.sync_r > 0.85


def test_samples_pushed_out_of_order_or_twice_give_the_same_result():
    source = Source(seed=16)
    settings = config()
    ann = source.camera(30, 0, 15, seed=17)
    bob = source.camera(30, 0, 15, delay_s=0.4, seed=18)
    in_order = SynchronyEngine(settings, ["ann", "bob"])
    shuffled = SynchronyEngine(settings, ["ann", "bob"])
    in_order.push("ann", *ann)
    in_order.push("bob", *bob)
    order = np.random.default_rng(19).permutation(ann[0].size)
    for chunk in np.array_split(order, 7):  # chunks in random order, each one shuffled
        shuffled.push("ann", ann[0][chunk], ann[1][chunk])
    shuffled.push("bob", *bob)
    shuffled.push("bob", bob[0][-40:], bob[1][-40:])  # the newest frames again
    expected = in_order.update(T0_LSL + 15).sample
    np.testing.assert_array_equal(shuffled.update(T0_LSL + 15).sample, expected)


# ------------------------------------------------------------------------------------------------
# Absent partners and the window's boundaries
# ------------------------------------------------------------------------------------------------


def grid_camera(source: Source, first_step: int, last_step: int, rate_hz: float, **kwargs):
    """Samples exactly on the grid's instants (steps / rate_hz): which grid instants a person
    covers is then exact, for the boundary tests."""
    steps = np.arange(first_step, last_step + 1)
    timestamps = steps / rate_hz
    true_s = timestamps - T0_LSL
    delay_s = kwargs.get("delay_s", 0.0)
    values = np.stack([np.interp(true_s - delay_s, source.times_s, source.values[:, c])
                       for c in range(source.values.shape[1])], axis=1)
    return timestamps, values


def test_a_partner_never_seen_or_gone_gives_nan_and_the_others_go_on():
    source = Source(seed=20)
    settings = config(window_s=5, max_lag_s=2)  # block: 7 s
    engine = SynchronyEngine(settings, ["ann", "bob", "cat", "dan"])
    engine.push("ann", *source.camera(30, 0, 20, seed=21))
    engine.push("bob", *source.camera(30, 0, 20, delay_s=0.5, seed=22))
    engine.push("cat", *source.camera(30, 0, 16, seed=23))  # left 4 s before the update
    # dan: never seen.
    result = engine.update(T0_LSL + 20)
    rows = {(row.person_a, row.person_b): row for row in result.rows}
    assert [pair for pair in rows] == [("ann", "bob"), ("ann", "cat"), ("ann", "dan"),
                                       ("bob", "cat"), ("bob", "dan"), ("cat", "dan")]
    assert rows["ann", "bob"].present and rows["ann", "bob"].sync_r > 0.9
    for pair, row in rows.items():
        if pair != ("ann", "bob"):
            assert not row.present, pair
            assert math.isnan(row.sync_r) and math.isnan(row.sync_lag_s), pair
            assert np.all(np.isnan(row.r_by_signal)) and np.all(np.isnan(row.lag_s_by_signal))
            assert row.leader() is None
    per_pair = 2 + 2 * len(SIGNALS)
    assert result.sample.shape == (6 * per_pair,) and result.sample.dtype == np.float32
    assert np.all(np.isfinite(result.sample[:per_pair]))
    assert np.all(np.isnan(result.sample[per_pair:]))


def test_missing_fraction_boundary_and_the_block_edges():
    # 10 Hz, window 5 s + lag 2 s: a block of 70 grid instants ending at the newest step at or
    # before now. bob's samples stop early: 17 missing instants (24.3%) are within
    # max_missing_fraction = 0.25, 18 (25.7%) are not.
    source = Source(seed=24)
    settings = config(window_s=5, max_lag_s=2, rate_hz=10, max_missing_fraction=0.25)
    newest_step = round((T0_LSL + 20) * 10)
    now_lsl = newest_step / 10 + 0.0999  # anywhere before the next step: the same block
    results = {}
    for missing in (17, 18):
        engine = SynchronyEngine(settings, ["ann", "bob"])
        engine.push("ann", *grid_camera(source, newest_step - 69, newest_step, 10))
        engine.push("bob", *grid_camera(source, newest_step - 69, newest_step - missing, 10,
                                        delay_s=0.3))
        update = engine.update(now_lsl)
        assert update.timestamp_lsl == newest_step / 10
        results[missing] = update.rows[0]
    assert results[17].present and results[17].sync_lag_s == pytest.approx(0.3)
    assert not results[18].present and math.isnan(results[18].sync_r)
    # ann's first sample is the block's first instant: one step later and ann misses 1 of 70
    # (still present); samples before the block do not count.
    engine = SynchronyEngine(settings, ["ann", "bob"])
    engine.push("ann", *grid_camera(source, newest_step - 68, newest_step, 10))
    engine.push("bob", *grid_camera(source, newest_step - 200, newest_step, 10, delay_s=0.3))
    (row,) = engine.update(now_lsl).rows
    assert row.present and row.sync_lag_s == pytest.approx(0.3)


def test_only_the_newest_block_counts_and_memory_stays_bounded():
    # Coupled for the first 20 s, then each on their own: an update inside the coupled part
    # sees it, one 7 s (a block) after its end no longer does; old samples are let go.
    coupled, other = Source(seed=25, seconds=60), Source(seed=26, seconds=60)
    settings = config(window_s=5, max_lag_s=2)
    engine = SynchronyEngine(settings, ["ann", "bob"])
    ann_t, ann_v = coupled.camera(30, 0, 40, seed=27)
    bob_t, bob_v = coupled.camera(30, 0, 40, delay_s=0.6, seed=28)
    _, bob_alone = other.camera(30, 0, 40, seed=29)
    bob_v = np.where((bob_t - T0_LSL >= 20)[:, None], bob_alone, bob_v)
    sync_r_by_second = {}
    for second in range(1, 41):
        ann_chunk = (ann_t >= T0_LSL + second - 1) & (ann_t < T0_LSL + second)
        bob_chunk = (bob_t >= T0_LSL + second - 1) & (bob_t < T0_LSL + second)
        engine.push("ann", ann_t[ann_chunk], ann_v[ann_chunk])
        engine.push("bob", bob_t[bob_chunk], bob_v[bob_chunk])
        for quarter in range(4):  # 4 Hz
            (row,) = engine.update(T0_LSL + second - 0.75 + quarter * 0.25).rows
        sync_r_by_second[second] = row.sync_r
        assert max(engine.buffered_samples().values()) <= (7 + 0.25 + 1) * 30 + 1
    assert sync_r_by_second[19] > 0.9 and sync_r_by_second[15] > 0.9
    assert sync_r_by_second[28] < 0.5 and sync_r_by_second[40] < 0.5


# ------------------------------------------------------------------------------------------------
# Inputs, layout, config
# ------------------------------------------------------------------------------------------------


def test_push_refuses_what_it_cannot_use():
    engine = SynchronyEngine(config(), ["ann", "bob"])
    with pytest.raises(ValueError, match=r"'eve' is not a participant .*ann, bob"):
        engine.push("eve", [1.0], [[0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"shape \(2, 3\) .*head_yaw, head_pitch, jawOpen"):
        engine.push("ann", [1.0, 2.0], [[0.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="finite"):
        engine.push("ann", [1.0, math.nan], np.zeros((2, 3)))
    with pytest.raises(ValueError, match="listed twice"):
        SynchronyEngine(config(), ["ann", "ann"])
    with pytest.raises(ValueError, match="no ':'"):
        SynchronyEngine(config(), ["ann", "b:b"])


def test_signal_columns_pick_the_face_stream_channels():
    labels = [label for label, _, _ in face_channels(landmarks=False)]
    columns = signal_columns(SIGNALS, labels)
    assert [labels[index] for index in columns] == SIGNALS
    without_blendshapes = [label for label, _, _ in face_channels(False, blendshapes=False)]
    with pytest.raises(ValueError, match=r"\['jawOpen'\] are not channels of the Face stream"):
        signal_columns(SIGNALS, without_blendshapes)


def test_stream_layout_channels_and_metadata():
    settings = SynchronyConfig(window_s=6, max_lag_s=1.5, rate_hz=10, update_hz=4)
    layout = synchrony_layout("labpc", ["ann", "bob", "cat"], settings)
    assert (layout.name, layout.stream_type, layout.source_id) == (
        "facecast synchrony", "Synchrony", "facecast-labpc-synchrony")
    assert layout.nominal_srate == 4.0 and layout.channel_format == "float32"
    per_pair = 2 + 2 * len(DEFAULT_SIGNALS)
    assert layout.channel_count == 3 * per_pair == len(layout.channels)
    labels = [channel["label"] for channel in layout.channels]
    assert labels[:4] == ["ann:bob:sync_r", "ann:bob:sync_lag_s", "ann:bob:head_yaw_r",
                          "ann:bob:head_yaw_lag_s"]
    assert labels[per_pair] == "ann:cat:sync_r" and labels[-1] == "bob:cat:browInnerUp_lag_s"
    assert {channel["unit"] for channel in layout.channels} == {"none", "seconds"}
    facecast = layout.desc["facecast"]
    assert facecast["window_s"] == "6" and facecast["max_lag_s"] == "1.5"
    assert facecast["block_s"] == "7.5" and facecast["rate_hz"] == "10"
    assert "person_a leads" in facecast["method"]["lag_sign"]
    assert "rMEA" in facecast["method"]["follows"]
    # The engine's sample has the layout's channels, in its order.
    engine = SynchronyEngine(settings, layout.participants, layout.signals)
    assert engine.channel_count == layout.channel_count
    # The description goes into a real LSL stream info (no outlet: nothing on the network).
    info = pylsl.StreamInfo(layout.name, layout.stream_type, layout.channel_count,
                            layout.nominal_srate, pylsl.cf_float32, layout.source_id)
    fill_desc(info.desc(), layout.desc)
    xml = info.as_xml()
    assert xml.count("<channel>") == layout.channel_count
    assert "<label>bob:cat:jawOpen_r</label>" in xml
    assert "<person_a>bob</person_a>" in xml and "<window_s>6</window_s>" in xml
    assert "doi:10.1080/10503307.2020.1844334" in xml


def test_without_blendshapes_the_stream_carries_head_signals_only_and_says_why():
    layout = synchrony_layout("labpc", ["ann", "bob"], SynchronyConfig(),
                              blendshapes_missing_reason="no face_landmarker.task")
    assert layout.signals == ("head_yaw", "head_pitch", "head_roll")
    assert layout.channel_count == 2 + 2 * 3
    assert layout.desc["facecast"]["signals_left_out"]["signal"] == [
        "mouthSmileLeft", "mouthSmileRight", "jawOpen", "browInnerUp"]
    assert layout.desc["facecast"]["signals_left_out_reason"] == "no face_landmarker.task"
    with pytest.raises(ValueError, match="none of synchrony.signals .* add one of head_yaw"):
        synchrony_layout("labpc", ["ann", "bob"], SynchronyConfig(signals=["jawOpen"]),
                         blendshapes_missing_reason="no bundle")


@pytest.mark.parametrize("fields, message", [
    ({"window_s": 1}, r"Expected `float` >= 2.0 - at `\$.window_s`"),
    ({"window_s": 12}, r"Expected `float` <= 10.0 - at `\$.window_s`"),
    ({"rate_hz": 100}, r"Expected `float` <= 30.0 - at `\$.rate_hz`"),
    ({"update_hz": 1}, r"Expected `float` >= 2.0 - at `\$.update_hz`"),
    ({"max_lag_s": 3, "window_s": 5},
     r"synchrony.max_lag_s: 3 s is more than half of synchrony.window_s \(5 s; allowed: up to "
     r"2.5 s"),
    ({"window_s": 5.05},
     r"synchrony.window_s: 5.05 s is not a whole number of grid steps at synchrony.rate_hz = 10 "
     r"\(50.5 steps; allowed: a multiple of 0.1 s\)"),
    ({"signals": ["jawOpn"]},
     r"synchrony.signals: 'jawOpn' is not a signal \(allowed: head_yaw, head_pitch, head_roll "
     r"or a blendshape name .*did you mean jawOpen"),
    ({"signals": ["head_yaw", "head_yaw"]}, r"synchrony.signals: 'head_yaw' listed twice"),
    ({"signals": []}, r"Expected `array` of length >= 1 - at `\$.signals`"),
    ({"window": 5}, r"Object contains unknown field `window`"),
])
def test_bad_config_is_refused_naming_the_key_and_what_is_allowed(fields, message):
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(fields, SynchronyConfig)


def test_the_default_config_is_valid_and_decodes_from_toml():
    settings = msgspec.toml.decode(
        b'enabled = true\nwindow_s = 4\nmax_lag_s = 1.5\nsignals = ["head_pitch", "jawOpen"]\n',
        type=SynchronyConfig)
    assert (settings.window_samples, settings.lag_samples, settings.block_samples) == (40, 15, 55)
    assert SynchronyConfig().signals == list(DEFAULT_SIGNALS)
