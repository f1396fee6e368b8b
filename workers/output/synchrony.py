"""Live synchrony between people: windowed lagged cross-correlation of their face signals.

Issue 15, item 4. Runs in the output worker (the process that owns the LSL outlets and sees
every person's samples), as plain numpy on the CPU: no LSL, no GPU, no thread of its own. The
worker pushes each participant's signals as their samples are published and calls `update()`
at `SynchronyConfig.update_hz`; each update gives one row per pair of participants, and one
sample of the `Synchrony` stream whose layout `synchrony_layout()` fixes at start. The method,
its formulas and how to read the stream: docs/synchrony.md.

Note [Windowed lagged cross-correlation]
    facecast computes what rMEA's `MEAccf` computes (Kleinbub & Ramseyer 2021, Psychotherapy
    Research 31(6):817-830, doi:10.1080/10503307.2020.1844334; read: the CRAN reference of
    `MEAccf` and its source, R/rMEA_ccf.R of github.com/kleinbub/rMEA), on one window that ends
    at the newest data instead of a whole session cut into windows:

    - The block: the newest N = W + L samples of both people on a common grid (W window
      samples, L lag samples). At lag k >= 0 the pairs are (a[t], b[t + k]) for t = 0..W-1,
      at lag -k they are (a[t + k], b[t]): every lag's Pearson r has exactly W pairs, as in
      rMEA (`xRange`/`yRange` there). Lags run over -L..+L in steps of one sample.
    - Sign, rMEA's: a high r at a positive lag means b follows a: **lag_s > 0: person_a leads**
      (b does at t + lag what a did at t); lag_s < 0: person_b leads.
    - Missing data, rMEA's rule with our threshold: a person's signal with more than
      `max_missing_fraction` of the block missing gives NaN (rMEA: more than half); below it,
      r is taken over the pairs where both are present (at least 3, else NaN). A series
      constant over a lag's pairs has no r: NaN.
    - Fisher's z = atanh(r), bounded to +-10 (rMEA's `fisher.r2z`), and absolute values
      (rMEA's default `ABS = TRUE`: in-phase and anti-phase coupling both count) for the
      aggregate over signals; the per-signal peaks stay signed.

    What SUSY (Tschacher & Meier 2020, Psychotherapy Research, doi:10.1080/10503307.2019.1612114;
    read: the CRAN SUSY package's reference and its R/susy.R) adds is the surrogate control:
    every segment of a is correlated with every *other* segment of b ("segment shuffling"), and
    the effect size is ES = (mean |Z| real - mean |Z| surrogate) / SD of the surrogate profile
    over lags. Its constraint `segment >= 2 * maxlag` is ours too (`max_lag_s <= window_s / 2`).
    The ES itself is not computed live: see Note [No live surrogate effect size].

Note [No live surrogate effect size]
    SUSY's ES compares a session's matched segments with its k(k-1) unmatched pairs (k >= 2
    segments of 30 s in its examples; a segment may not exceed half the series): it is a
    statistic of a whole recording, not of the last 5 s. A live version would correlate the
    current window with earlier windows of the partner, which needs both people present for
    several windows back, multiplies the cost by the number of surrogates, and gives an ES
    from a handful of surrogates that swings more than the r it normalises. The stream's
    samples go into the XDF next to every person's Face stream, so SUSY (or rMEA) can be run
    on the recording afterwards with its own surrogates; the live stream says what the window
    shows now. docs/synchrony.md says how to judge a live r against chance.

Note [Common time base]
    Each person's samples come at their camera's frame rate with their capture timestamps
    (LSL clock), cameras differ in rate and drop frames. Every person is put on one grid of
    `rate_hz` instants, multiples of 1/rate_hz on the LSL clock (so all people share it,
    whatever camera they came from), by linear interpolation between the two samples around
    each instant. An instant whose two neighbours are more than `max_gap_s` apart (a face
    lost, frames dropped) is missing, never bridged; so is one after a person's newest sample.
    Interpolation keeps timing exact (bin averaging would move each bin's value to the mean
    time of the frames in it, which differs between cameras of different rates and would
    shift lags by a fraction of a step). The default 10 Hz: a lag resolution of 0.1 s against
    lags of up to +-5 s (what rMEA's reference says several authors report); every lab camera
    (15 fps and up) has at least one frame per step, so the grid never invents motion between
    frames; and the cost grows with the rate (the block's samples). Facial and head signals'
    frame-to-frame jitter above 5 Hz folds into the band at 10 Hz: it lowers r a little and
    moves no lag.
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from facecast.shared.face_schema import BLENDSHAPE_NAMES
from facecast.shared.version import __version__

HEAD_SIGNALS: tuple[str, ...] = ("head_yaw", "head_pitch", "head_roll")

# Head movement (nods, turns) and the expressions most studied for mimicry: smiles, mouth
# opening (speech), raised brows. Blinks are left out: a blink lasts about one grid step.
DEFAULT_SIGNALS: tuple[str, ...] = (
    "head_yaw", "head_pitch", "head_roll",
    "mouthSmileLeft", "mouthSmileRight", "jawOpen", "browInnerUp",
)  # fmt: skip

FISHER_Z_BOUND = 10.0  # rMEA's fisher.r2z bound
MIN_PAIRS = 3  # fewer pairs than this have no Pearson r worth a number

STREAM_TYPE = "Synchrony"
STREAM_NAME = "facecast synchrony"


def synchrony_source_id(host: str) -> str:
    return f"facecast-{host}-synchrony"


def blendshape_names() -> tuple[str, ...]:
    """MediaPipe's 52 blendshape names, the one list the Face streams are made from
    (facecast.shared.face_schema)."""
    return BLENDSHAPE_NAMES


def allowed_signals() -> tuple[str, ...]:
    return HEAD_SIGNALS + blendshape_names()


# ================================================================================================
# Config (shared/config.py holds it as the `synchrony` table)
# ================================================================================================


class SynchronyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The optional `facecast synchrony` stream (docs/synchrony.md). Errors name the key as
    `synchrony.<key>` so that shared.config's error walk passes them through unchanged."""

    enabled: Annotated[
        bool, msgspec.Meta(description="publish the Synchrony stream (pairs of participants)")
    ] = False
    window_s: Annotated[
        float,
        msgspec.Meta(ge=2, le=10, description="seconds of pairs each correlation is taken over "
                     "(the block is window_s + max_lag_s of data)"),
    ] = 5.0
    max_lag_s: Annotated[
        float,
        msgspec.Meta(ge=0, le=5, description="lags -max_lag_s..+max_lag_s are tried, one grid "
                     "step apart; at most window_s / 2 (SUSY's rule)"),
    ] = 2.0
    rate_hz: Annotated[
        float,
        msgspec.Meta(ge=5, le=30, description="the common grid every person is resampled to "
                     "(Note [Common time base]); the lag resolution "
                     "is 1 / rate_hz"),
    ] = 10.0
    update_hz: Annotated[
        float, msgspec.Meta(ge=2, le=10, description="Synchrony samples per second")
    ] = 4.0
    signals: Annotated[
        list[str],
        msgspec.Meta(min_length=1, max_length=55, description="which signals of each person "
                     "are correlated: head_yaw, head_pitch, head_roll and MediaPipe's blendshape "
                     "names (the Face stream's channel labels)"),
    ] = msgspec.field(default_factory=lambda: list(DEFAULT_SIGNALS))
    max_missing_fraction: Annotated[
        float,
        msgspec.Meta(ge=0, le=0.9, description="a person's signal missing in more than this "
                     "fraction of the block gives NaN (rMEA: 0.5)"),
    ] = 0.25
    max_gap_s: Annotated[
        float,
        msgspec.Meta(gt=0, le=1, description="samples further apart than this are not "
                     "interpolated across: the grid instants between them are missing"),
    ] = 0.25

    def __post_init__(self) -> None:
        problems = synchrony_config_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def window_samples(self) -> int:
        return round(self.window_s * self.rate_hz)

    @property
    def lag_samples(self) -> int:
        return round(self.max_lag_s * self.rate_hz)

    @property
    def block_samples(self) -> int:
        return self.window_samples + self.lag_samples


def synchrony_config_problems(config: SynchronyConfig) -> list[str]:
    """Every rule of the table that msgspec's per-field bounds cannot say, each naming its key."""
    problems = []
    for key, seconds in (("window_s", config.window_s), ("max_lag_s", config.max_lag_s)):
        samples = seconds * config.rate_hz
        if abs(samples - round(samples)) > 1e-6:
            problems.append(
                f"synchrony.{key}: {seconds:g} s is not a whole number of grid steps at "
                f"synchrony.rate_hz = {config.rate_hz:g} ({samples:.4g} steps; allowed: a "
                f"multiple of {1 / config.rate_hz:.4g} s)")
    if config.max_lag_s > config.window_s / 2:
        problems.append(
            f"synchrony.max_lag_s: {config.max_lag_s:g} s is more than half of synchrony.window_s "
            f"({config.window_s:g} s; allowed: up to {config.window_s / 2:g} s, SUSY's rule that a "
            "window holds at least twice the largest lag)")
    allowed = allowed_signals()
    for name in config.signals:
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append(
                f"synchrony.signals: {name!r} is not a signal (allowed: {', '.join(HEAD_SIGNALS)} "
                f"or a blendshape name of the Face stream, e.g. jawOpen, mouthSmileLeft, "
                f"browInnerUp{hint})")
    repeated = sorted({name for name in config.signals if config.signals.count(name) > 1})
    if repeated:
        problems.append(f"synchrony.signals: {', '.join(map(repr, repeated))} listed twice; "
                        "each signal once")
    return problems


def effective_signals(
    signals: Sequence[str], blendshapes_available: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(signals the stream carries, signals left out). Without face_landmarker.task there are
    no blendshapes, and a channel that would be NaN forever is not published (Note [No channel
    that is always NaN])."""
    if blendshapes_available:
        return tuple(signals), ()
    kept = tuple(name for name in signals if name in HEAD_SIGNALS)
    return kept, tuple(name for name in signals if name not in HEAD_SIGNALS)


def signal_columns(signals: Sequence[str], face_channel_labels: Sequence[str]) -> np.ndarray:
    """Where each signal sits in a Face stream sample (`face_channels()` labels), so that the
    output worker can push `face_sample[columns]` for a person."""
    position = {label: index for index, label in enumerate(face_channel_labels)}
    missing = [name for name in signals if name not in position]
    if missing:
        raise ValueError(f"signals {missing} are not channels of the Face stream (its channels: "
                         f"{', '.join(face_channel_labels[:12])}, ...)")
    return np.array([position[name] for name in signals], dtype=np.intp)


# ================================================================================================
# The stream's layout (what the output worker creates its outlet from)
# ================================================================================================

# Note [Synchrony channels]
#     Per pair of participants, in `itertools.combinations(participants, 2)` order: first the
#     aggregate over signals (sync_r, sync_lag_s), then each signal's own peak (<signal>_r,
#     <signal>_lag_s). Both, because each answers a question the other cannot: the aggregate is
#     the one number per pair a dashboard or an experiment's trigger wants (how coupled are
#     these two now, who leads), and it is steadier than any one signal (a mean over signals of
#     |Fisher z| at each lag); the per-signal peaks keep what the aggregate throws away, the
#     sign (mimicry in phase or in anti-phase) and the signal (nodding together, smiling
#     together), and they are what an analysis of the XDF needs. The cost is channels:
#     pairs x (2 + 2 x signals) floats, 16 per pair with the 7 default signals, 448 for 8
#     participants (28 pairs) at 4 Hz: a few KiB/s, nothing for LSL. The layout is fixed when
#     the outlet is made (an LSL stream's channels cannot change), so it takes the participant
#     list known then; a participant enrolled later needs a new outlet.

PAIR_MEASURES: tuple[tuple[str, str, str, str], ...] = (
    # (measure suffix, unit, type, meaning)
    ("sync_r", "none", "Correlation",
     "tanh of the peak over lags of the mean |Fisher z| over signals: 0..1, unsigned"),
    ("sync_lag_s", "seconds", "Lag",
     "the lag of that peak; > 0: person_a leads, < 0: person_b leads"),
)
SIGNAL_MEASURES: tuple[tuple[str, str, str, str], ...] = (
    ("r", "none", "Correlation",
     "this signal's Pearson r at the lag of its largest |r|, signed (-1..1)"),
    ("lag_s", "seconds", "Lag",
     "that lag; > 0: person_a leads, < 0: person_b leads"),
)


def check_participants(participants: Sequence[str]) -> tuple[str, ...]:
    names = tuple(participants)
    if len(names) < 2:
        raise ValueError(f"synchrony needs at least 2 participants, got {list(names)}")
    bad = [name for name in names
           if not isinstance(name, str) or not name or ":" in name or name != name.strip()
           or any(character.isspace() for character in name)]
    if bad:
        raise ValueError(f"participant names {bad!r} cannot label synchrony channels (allowed: "
                         "non-empty, no ':' and no whitespace)")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"participants {repeated} listed twice")
    return names


def participant_pairs(participants: Sequence[str]) -> list[tuple[str, str]]:
    return list(itertools.combinations(check_participants(participants), 2))


def synchrony_channels(
    participants: Sequence[str], signals: Sequence[str]
) -> list[dict[str, str]]:
    """The stream's channels in sample order: label, unit, type and what the label encodes
    (person_a, person_b, signal: "all" for the aggregate, measure), so that no reader has to
    parse a label. Labels are `<person_a>:<person_b>:<measure>`."""
    channels = []
    for person_a, person_b in participant_pairs(participants):
        for suffix, unit, kind, _ in PAIR_MEASURES:
            channels.append({"label": f"{person_a}:{person_b}:{suffix}", "unit": unit,
                             "type": kind, "person_a": person_a, "person_b": person_b,
                             "signal": "all", "measure": suffix})
        for signal in signals:
            for suffix, unit, kind, _ in SIGNAL_MEASURES:
                channels.append({"label": f"{person_a}:{person_b}:{signal}_{suffix}",
                                 "unit": unit, "type": kind, "person_a": person_a,
                                 "person_b": person_b, "signal": signal, "measure": suffix})
    return channels


@dataclass(frozen=True)
class SynchronyLayout:
    """Everything the output worker needs for the outlet: `pylsl.StreamInfo(name, stream_type,
    channel_count, nominal_srate, cf_float32, source_id)`, then `desc` written into
    `info.desc()` with `fill_desc`."""

    name: str
    stream_type: str
    source_id: str
    channel_count: int
    nominal_srate: float
    channel_format: str
    participants: tuple[str, ...]
    signals: tuple[str, ...]
    channels: list[dict[str, str]]
    desc: dict[str, Any]


def synchrony_layout(
    host: str,
    participants: Sequence[str],
    config: SynchronyConfig,
    *,
    blendshapes_missing_reason: str = "",
) -> SynchronyLayout:
    """The `Synchrony` stream: name, type, source_id, channels and metadata, without LSL.

    `blendshapes_missing_reason`: non-empty when the Face streams have no blendshapes (no
    face_landmarker.task); the blendshape signals are then left out and the metadata says why.
    """
    if not host:
        raise ValueError("host must be non-empty")
    names = check_participants(participants)
    signals, left_out = effective_signals(config.signals, not blendshapes_missing_reason)
    if not signals:
        raise ValueError(
            f"none of synchrony.signals ({', '.join(config.signals)}) can be measured: they are "
            f"all blendshapes, and blendshapes are not available ({blendshapes_missing_reason}); "
            f"add one of {', '.join(HEAD_SIGNALS)}")
    channels = synchrony_channels(names, signals)
    rate = config.rate_hz
    block_s = config.block_samples / rate
    method = {
        "name": "windowed lagged cross-correlation",
        "follows": "rMEA MEAccf (Kleinbub & Ramseyer 2021), one window ending at the newest data",
        "correlation": f"Pearson r over exactly {config.window_samples} pairs per lag "
                       "(pairwise complete), lags -L..+L in steps of one grid sample",
        "peak_per_signal": "the lag of the largest |r|; the signed r there (ties: smallest |lag|)",
        "aggregate": "per lag, the mean over signals of |atanh(r)| (bounded to 10, rMEA's r2Z "
                     "and ABS); its peak over lags, back to r by tanh",
        "lag_sign": "lag_s > 0: person_a leads (person_b does at t + lag_s what person_a did "
                    "at t); lag_s < 0: person_b leads",
        "missing": f"NaN where a person's signal misses more than {config.max_missing_fraction:g}"
                   f" of the block, or fewer than {MIN_PAIRS} pairs remain, or it is constant; "
                   "every channel of a pair NaN while either person is absent",
        "resampling": f"linear interpolation onto a {rate:g} Hz grid of the LSL clock; no "
                      f"bridging of gaps over {config.max_gap_s:g} s",
        "surrogates": "none live (Note [No live surrogate effect size]); run SUSY on the "
                      "recording for effect sizes",
    }
    desc: dict[str, Any] = {
        "channels": {"channel": channels},
        "acquisition": {"manufacturer": "facecast", "model": "facecast synchrony",
                        "version": __version__},
        "facecast": {
            "host": host,
            "participants": {"participant": list(names)},
            "signals": {"signal": list(signals)},
            "signals_left_out": {"signal": list(left_out)},
            "signals_left_out_reason": blendshapes_missing_reason if left_out else "",
            "window_s": f"{config.window_s:g}",
            "window_samples": str(config.window_samples),
            "max_lag_s": f"{config.max_lag_s:g}",
            "lag_samples": str(config.lag_samples),
            "rate_hz": f"{rate:g}",
            "block_s": f"{block_s:g}",
            "update_hz": f"{config.update_hz:g}",
            "max_missing_fraction": f"{config.max_missing_fraction:g}",
            "max_gap_s": f"{config.max_gap_s:g}",
            "method": method,
            "timestamps": "the newest grid instant of the block (LSL clock, the capture time "
                          f"base); the block covers the {config.block_samples} grid instants up "
                          f"to it, {block_s:g} s",
            "references": {"reference": [
                "Kleinbub JR, Ramseyer FT (2021). rMEA: An R package to assess nonverbal "
                "synchronization in motion energy analysis time-series. Psychotherapy "
                "Research 31(6):817-830. doi:10.1080/10503307.2020.1844334",
                "Tschacher W, Meier D (2020). Psychotherapy Research. "
                "doi:10.1080/10503307.2019.1612114 (SUSY: Surrogate Synchrony, R package SUSY)",
            ]},
            "documentation": "docs/synchrony.md",
        },
    }
    return SynchronyLayout(
        name=STREAM_NAME,
        stream_type=STREAM_TYPE,
        source_id=synchrony_source_id(host),
        channel_count=len(channels),
        nominal_srate=float(config.update_hz),
        channel_format="float32",
        participants=names,
        signals=signals,
        channels=channels,
        desc=desc,
    )


def fill_desc(element: Any, mapping: Mapping[str, Any]) -> None:
    """Write a layout's `desc` into an LSL XML element (`info.desc()`, duck-typed: anything with
    `append_child(name)` and `append_child_value(name, text)`). A str is a text child, a mapping
    a child element, a list repeated children of one name."""
    for name, value in mapping.items():
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, Mapping):
                fill_desc(element.append_child(name), item)
            else:
                element.append_child_value(name, str(item))


# ================================================================================================
# The computation
# ================================================================================================


# Note [Lagged sums by FFT]
#     Pearson r at a lag needs six sums over the W pairs of that lag: the count n, sum a, sum
#     a^2, sum b, sum b^2, sum ab, each over the pairs where both are present (zero-filled
#     values times presence masks). At lag k >= 0 each is sum_t x[t] y[t + k] over t < W with x
#     one person's first W samples (mask, value or value^2) and y the other's whole block: a
#     cross-correlation, for every k at once by FFT, exact for k = 0..L when x is zero past W
#     and the transform is at least W + L long (nothing wraps). Lag -k of (a, b) is lag k of
#     (b, a). So: one set of transforms per person and signal, one product and one inverse per
#     ordered pair, signal and sum: O(pairs x signals x N log N) instead of the direct
#     O(pairs x signals x L x W), which at the config's largest (10 s window, +-5 s, 30 Hz:
#     300 pairs x 301 lags) took 0.3 s per update for 8 people and 7 signals (docs/benchmarks.md,
#     "Synchrony"). Values are centred on each person's block mean first, so that the one-pass
#     formula r = (n Sab - Sa Sb) / sqrt((n Saa - Sa^2)(n Sbb - Sb^2)) does not cancel (a head
#     turned 40 degrees away moves by 2); the FFT's rounding then stays near 1e-15 of the
#     signal's own spread (tests compare with a direct loop to 1e-10).

# The six sums as (x-side, y-side) pairs of {0: mask, 1: value, 2: value^2}, in the order
# n, Sa, Saa, Sb, Sbb, Sab (a is the x-side person).
_X_SIDE = np.array([0, 1, 2, 0, 0, 1])
_Y_SIDE = np.array([0, 0, 0, 1, 2, 1])
# Lag -k of (a, b) is lag k of (b, a): the same sums with a's and b's roles swapped.
_SWAPPED = np.array([0, 3, 4, 1, 2, 5])


def pairwise_lagged_correlations(
    series: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    window_samples: int,
    lag_samples: int,
) -> np.ndarray:
    """Pearson r of person first[i] with person second[i], every signal, lags -L..+L (Note
    [Windowed lagged cross-correlation], Note [Lagged sums by FFT]).

    series: (people, signals, W + L), NaN where missing. Returns (pairs, signals, 2L + 1), lag
    index L + k for lag k (k > 0: second follows first), NaN where fewer than MIN_PAIRS pairs
    are present or a series is constant over them.
    """
    window, lag = int(window_samples), int(lag_samples)
    people, signal_count, length = series.shape
    if length != window + lag:
        raise ValueError(f"series must have {window + lag} samples (window + lag), got {length}")
    present = np.isfinite(series)
    count = present.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        block_mean = np.where(present, series, 0.0).sum(axis=-1) / count
    block_mean = np.where(count > 0, block_mean, 0.0)
    centred = np.where(present, series - block_mean[..., None], 0.0)
    mask = present.astype(np.float64)
    sides = np.stack([mask, centred, centred * centred], axis=2)  # (people, signals, 3, N)
    size = 1 << max(1, (length - 1).bit_length())  # a power of two >= W + L: no wrap
    y_spectra = np.fft.rfft(sides, n=size, axis=-1)
    x_part = sides.copy()
    x_part[..., window:] = 0.0
    x_spectra = np.conj(np.fft.rfft(x_part, n=size, axis=-1))

    # Ordered pairs: (first, second) for lags 0..L, (second, first) for lags 0..-L.
    x_people = np.concatenate([first, second])
    y_people = np.concatenate([second, first])
    products = x_spectra[x_people][:, :, _X_SIDE] * y_spectra[y_people][:, :, _Y_SIDE]
    sums = np.fft.irfft(products, n=size, axis=-1)[..., : lag + 1]  # (2 pairs, S, 6, L + 1)
    pair_count = first.size
    forward = sums[:pair_count]
    backward = sums[pair_count:][:, :, _SWAPPED, ::-1]  # lags -L..0, as (first, second) sums
    lagged = np.concatenate([backward[..., :-1], forward], axis=-1)  # (pairs, S, 6, 2L + 1)
    n, s_a, s_aa, s_b, s_bb, s_ab = (lagged[:, :, index] for index in range(6))
    n = np.rint(n)
    spread_a = n * s_aa - s_a * s_a  # n^2 x the variance of a over the lag's pairs
    spread_b = n * s_bb - s_b * s_b
    # A constant series leaves only rounding in its spread: no r, rather than noise / noise.
    mean_a = block_mean[first][..., None]
    mean_b = block_mean[second][..., None]
    flat = ((spread_a <= (n * 1e-7 * mean_a) ** 2 + 1e-300)
            | (spread_b <= (n * 1e-7 * mean_b) ** 2 + 1e-300))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (n * s_ab - s_a * s_b) / np.sqrt(spread_a * spread_b)
    r[(n < MIN_PAIRS) | flat] = np.nan
    return np.clip(r, -1.0, 1.0)


def lagged_correlations(
    a_block: np.ndarray, b_block: np.ndarray, window_samples: int, lag_samples: int
) -> np.ndarray:
    """Pearson r of a_block with b_block at lags -L..+L, series by series: both (..., W + L),
    NaN where missing; returns (..., 2L + 1), lag index L + k for lag k (k > 0: b follows a).
    The pairwise function for two series sets (tests, one dyad)."""
    a_block = np.asarray(a_block, dtype=np.float64)
    b_block = np.asarray(b_block, dtype=np.float64)
    if a_block.shape != b_block.shape:
        raise ValueError(f"blocks must have one shape, got {a_block.shape} and {b_block.shape}")
    leading, length = a_block.shape[:-1], a_block.shape[-1]
    series = np.stack([a_block.reshape(-1, length), b_block.reshape(-1, length)])
    r = pairwise_lagged_correlations(series, np.array([0]), np.array([1]), window_samples,
                                     lag_samples)
    return r[0].reshape(*leading, -1)


def peak_of(values: np.ndarray, lags_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value at the lag of the largest |value| over the last axis, that lag), NaN where all are
    NaN; ties go to the smallest |lag| (the lag axis is searched in order of |lag|)."""
    order = np.argsort(np.abs(lags_s), kind="stable")
    ordered = values[..., order]
    magnitude = np.where(np.isnan(ordered), -1.0, np.abs(ordered))
    best = np.argmax(magnitude, axis=-1)
    value = np.take_along_axis(ordered, best[..., None], axis=-1)[..., 0]
    lag = lags_s[order][best]
    lag = np.where(np.isnan(value), np.nan, lag)
    return value, lag


@dataclass(frozen=True)
class PairResult:
    """One pair's result of one update. All NaN while either person is absent (`present`
    False). r_by_signal / lag_s_by_signal follow `SynchronyEngine.signals`."""

    person_a: str
    person_b: str
    present: bool
    sync_r: float
    sync_lag_s: float
    r_by_signal: np.ndarray
    lag_s_by_signal: np.ndarray

    def leader(self) -> str | None:
        """Who leads at the aggregate peak: person_a, person_b, or None (lag 0 or no result)."""
        if not math.isfinite(self.sync_lag_s) or self.sync_lag_s == 0:
            return None
        return self.person_a if self.sync_lag_s > 0 else self.person_b


@dataclass(frozen=True)
class SynchronyUpdate:
    """One update: `timestamp_lsl` (the block's newest grid instant: the sample's timestamp),
    one row per pair, and `sample`, the rows in `synchrony_channels()` order (float32)."""

    timestamp_lsl: float
    rows: list[PairResult]
    sample: np.ndarray


class _PersonSamples:
    """One person's raw samples (timestamps in LSL seconds, values per signal), appended in
    chunks as pushed and joined once per update."""

    def __init__(self, signal_count: int) -> None:
        self.timestamps_lsl = np.empty(0)
        self.values = np.empty((0, signal_count))
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []

    def append(self, timestamps_lsl: np.ndarray, values: np.ndarray) -> None:
        self._chunks.append((timestamps_lsl, values))

    def joined(self) -> tuple[np.ndarray, np.ndarray]:
        if self._chunks:
            timestamps = np.concatenate([self.timestamps_lsl] + [t for t, _ in self._chunks])
            values = np.concatenate([self.values] + [v for _, v in self._chunks])
            self._chunks.clear()
            steps = np.diff(timestamps)
            if np.any(steps <= 0):
                # Out of order (a participant's camera changed) or repeated: sort, and of equal
                # timestamps keep the one pushed last.
                order = np.argsort(timestamps, kind="stable")
                timestamps, values = timestamps[order], values[order]
                keep = np.append(np.diff(timestamps) > 0, True)
                timestamps, values = timestamps[keep], values[keep]
            self.timestamps_lsl, self.values = timestamps, values
        return self.timestamps_lsl, self.values

    def drop_before(self, oldest_lsl: float) -> None:
        first = np.searchsorted(self.timestamps_lsl, oldest_lsl, side="left")
        self.timestamps_lsl = self.timestamps_lsl[first:]
        self.values = self.values[first:]


def resample(
    timestamps_lsl: np.ndarray, values: np.ndarray, grid_lsl: np.ndarray, max_gap_s: float
) -> np.ndarray:
    """Linear interpolation of (n,) timestamps / (n, S) values onto `grid_lsl`, (S, G) out, NaN
    where an instant has no sample at or before it, none at or after it within `max_gap_s`
    of that one, or a NaN value on either side (Note [Common time base])."""
    signal_count = values.shape[1]
    out = np.full((signal_count, grid_lsl.size), np.nan)
    count = timestamps_lsl.size
    if count == 0:
        return out
    after = np.searchsorted(timestamps_lsl, grid_lsl, side="right")  # first sample > instant
    before = after - 1
    has_before = before >= 0
    before_c = np.clip(before, 0, count - 1)
    after_c = np.clip(after, 0, count - 1)
    exact = has_before & (timestamps_lsl[before_c] == grid_lsl)
    span = timestamps_lsl[after_c] - timestamps_lsl[before_c]
    bracketed = has_before & (after < count) & (span <= max_gap_s)
    usable = exact | bracketed
    with np.errstate(invalid="ignore", divide="ignore"):
        weight = np.where(bracketed & ~exact, (grid_lsl - timestamps_lsl[before_c]) / span, 0.0)
    low = values[before_c]
    high = values[after_c]
    # weight 0 must not bring in the far side's NaN (an exact hit next to a missing value).
    interpolated = np.where(weight[:, None] > 0, low + weight[:, None] * (high - low), low)
    out[:, usable] = interpolated[usable].T
    return out


class SynchronyEngine:
    """Incremental windowed lagged cross-correlation for a fixed set of participants.

    `push(person, timestamps_lsl, values)` as their samples are published (values (n, S) in
    `signals` order, NaN where a value is missing); `update(now_lsl)` at `config.update_hz`,
    where `now_lsl` is the LSL time up to which every present person's samples have been
    pushed (in the output worker: the capture timestamp of the newest frame it has published
    from every camera). Grid instants after a person's newest sample count as missing.
    """

    def __init__(
        self,
        config: SynchronyConfig,
        participants: Sequence[str],
        signals: Sequence[str] | None = None,
    ) -> None:
        self.config = config
        self.participants = check_participants(participants)
        self.signals = tuple(config.signals if signals is None else signals)
        unknown = [name for name in self.signals if name not in allowed_signals()]
        if not self.signals or unknown:
            raise ValueError(f"signals must be a non-empty subset of head_yaw, head_pitch, "
                             f"head_roll and the blendshape names; unknown: {unknown}")
        self.pairs = participant_pairs(self.participants)
        index = {name: position for position, name in enumerate(self.participants)}
        self._pair_a = np.array([index[a] for a, _ in self.pairs], dtype=np.intp)
        self._pair_b = np.array([index[b] for _, b in self.pairs], dtype=np.intp)
        self.window_samples = config.window_samples
        self.lag_samples = config.lag_samples
        self.block_samples = config.block_samples
        self.rate_hz = float(config.rate_hz)
        self.lags_s = np.arange(-self.lag_samples, self.lag_samples + 1) / self.rate_hz
        self._samples = {name: _PersonSamples(len(self.signals)) for name in self.participants}
        self.channel_count = len(self.pairs) * (2 + 2 * len(self.signals))

    def push(self, person: str, timestamps_lsl: Sequence[float] | np.ndarray,
             values: Sequence[Sequence[float]] | np.ndarray) -> None:
        """Samples of one person: timestamps (n,) on the LSL clock, values (n, S)."""
        samples = self._samples.get(person)
        if samples is None:
            raise ValueError(f"{person!r} is not a participant of this synchrony stream "
                             f"(participants: {', '.join(self.participants)})")
        # Copies: the caller may reuse its buffers before the next update reads these.
        timestamps = np.array(timestamps_lsl, dtype=np.float64).reshape(-1)
        array = np.array(values, dtype=np.float64)
        if array.ndim == 1 and timestamps.size == 1:
            array = array[None, :]
        if array.shape != (timestamps.size, len(self.signals)):
            raise ValueError(f"values for {timestamps.size} timestamps must have shape "
                             f"({timestamps.size}, {len(self.signals)}) (one column per signal: "
                             f"{', '.join(self.signals)}), got {array.shape}")
        if not np.all(np.isfinite(timestamps)):
            raise ValueError(f"timestamps of {person!r} must be finite LSL times")
        if timestamps.size:
            samples.append(timestamps, array)

    def buffered_samples(self) -> dict[str, int]:
        """Raw samples kept per person: bounded by the block (plus max_gap_s and what arrived
        since the last update), whatever the run's length."""
        return {name: samples.joined()[0].size for name, samples in self._samples.items()}

    def grid(self, now_lsl: float) -> np.ndarray:
        """The block's grid instants: the newest multiple of 1 / rate_hz at or before now_lsl
        and the block_samples - 1 before it."""
        if not math.isfinite(now_lsl):
            raise ValueError(f"now_lsl must be a finite LSL time, got {now_lsl!r}")
        # A now_lsl one rounding short of an instant (step / rate_hz) is that instant.
        newest_step = math.floor(now_lsl * self.rate_hz + 1e-6)
        steps = np.arange(newest_step - self.block_samples + 1, newest_step + 1)
        return steps / self.rate_hz

    def update(self, now_lsl: float) -> SynchronyUpdate:
        grid_lsl = self.grid(now_lsl)
        signal_count = len(self.signals)
        series = np.empty((len(self.participants), signal_count, self.block_samples))
        for position, name in enumerate(self.participants):
            samples = self._samples[name]
            timestamps, values = samples.joined()
            series[position] = resample(timestamps, values, grid_lsl, self.config.max_gap_s)
            # What the next block can still need: its first instant is later than this one's.
            samples.drop_before(grid_lsl[0] - self.config.max_gap_s)
        missing = np.isnan(series).mean(axis=-1)  # (people, signals)
        series[missing > self.config.max_missing_fraction] = np.nan
        present = ~np.all(missing > self.config.max_missing_fraction, axis=-1)

        r = pairwise_lagged_correlations(series, self._pair_a, self._pair_b,
                                         self.window_samples, self.lag_samples)  # (pairs, S, K)
        r_peak, lag_peak = peak_of(r, self.lags_s)
        with np.errstate(divide="ignore", invalid="ignore"):  # atanh(1) = inf; no signal: 0/0
            z = np.minimum(np.arctanh(np.abs(r)), FISHER_Z_BOUND)
            counted = np.isfinite(z)
            z_mean = np.where(counted, z, 0.0).sum(axis=1) / counted.sum(axis=1)  # (pairs, K)
        z_peak, sync_lag = peak_of(z_mean, self.lags_s)
        sync_r = np.tanh(z_peak)

        pair_present = present[self._pair_a] & present[self._pair_b]
        rows = []
        sample = np.full(self.channel_count, np.nan, dtype=np.float32)
        per_pair = 2 + 2 * signal_count
        for index, (person_a, person_b) in enumerate(self.pairs):
            if not pair_present[index]:
                nan = np.full(signal_count, np.nan)
                rows.append(PairResult(person_a, person_b, False, math.nan, math.nan, nan,
                                       nan.copy()))
                continue
            rows.append(PairResult(person_a, person_b, True, float(sync_r[index]),
                                   float(sync_lag[index]), r_peak[index].copy(),
                                   lag_peak[index].copy()))
            at = index * per_pair
            sample[at] = sync_r[index]
            sample[at + 1] = sync_lag[index]
            sample[at + 2:at + per_pair:2] = r_peak[index]
            sample[at + 3:at + per_pair:2] = lag_peak[index]
        return SynchronyUpdate(float(grid_lsl[-1]), rows, sample)
