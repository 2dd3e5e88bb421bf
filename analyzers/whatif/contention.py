"""Whether a run's engine steps ran slower while the serving process carried more load.

A reference server's engine thread shares its process (and, on a small machine, its CPU cores) with the
gateway's event loop, which relays every token to its client. If that relay took CPU from the engine in
proportion to the load, a step would run slower, for the same batch, while more streams are open or more tokens
are relayed per second, and a replay at another rate would need a contention term. This module measures, per
engine step, the load the process carried at the time (:func:`step_load`), and how the step's measured time over
its modelled time varies with it (:func:`load_relation`): the check the benchmark prints before any such term is
modelled (docs/whatif.md, "Is the machine's change of speed the load's own contention?").

The load, per step (all on the run's reference clock, from the raw tables):

* ``in_flight``: requests open at the step's midpoint (arrived, last token not yet delivered to the client);
* ``relayed_per_s``: tokens delivered to clients within ``window_ns`` around the step's midpoint, per second
  (a window of fixed length, not the step's own: a long step would otherwise hold more tokens by its length);
* ``loop_lag_share``: the share of the step's time during which a traced event loop ran late (``loop_lags``).

A slow machine relays fewer tokens per second for the same work, so ``relayed_per_s`` falls as steps slow
whatever the cause; a contention effect shows as the opposite: the ratio rising with the load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analyzers.source import Source
from analyzers.timing import TOKEN_END, request_table, token_times
from analyzers.whatif.models import StepTimeModel
from analyzers.whatif.trace import StepRows
from tokentrace.schema import LOOP_LAGS, col

__all__ = ["StepLoad", "LoadRelation", "step_load", "step_ratios", "load_relation", "spearman", "within_run_lines",
           "WINDOW_NS"]

WINDOW_NS = 1_000_000_000
"""Length of the window around each step's midpoint over which relayed tokens are counted (1 s)."""


@dataclass(frozen=True, slots=True)
class StepLoad:
    """The load the serving process carried during each engine step (one entry per step of the run's ``steps``)."""

    in_flight: np.ndarray  # requests open at the step's midpoint
    relayed_per_s: np.ndarray  # tokens delivered to clients per second, in the window around the midpoint
    loop_lag_share: np.ndarray  # share of the step's time an event loop of the run ran late, 0-1


@dataclass(frozen=True, slots=True)
class LoadRelation:
    """How the steps' measured / modelled time goes with one load measure."""

    rank_correlation: float  # Spearman's, of the ratio against the load
    quartiles: tuple[tuple[float, float, float, int], ...]  # per quartile of the load: (low, high, median ratio, steps)
    slope: float  # of ln(ratio) per unit of load (least squares): the ratio at load x is exp(slope * x) times


def step_load(src: Source, steps: StepRows, *, window_ns: int = WINDOW_NS) -> StepLoad:
    """Per step of ``steps`` (read from ``src`` by :func:`analyzers.whatif.trace.read_trace`), the load the process
    carried then (see the module's docstring). ``ValueError`` when the steps have no start times."""
    if steps.start_ns is None:
        raise ValueError("the steps have no start times: the load during each step cannot be placed")
    c = col
    tt = token_times(src)
    delivered = np.sort(src.df(f"SELECT {TOKEN_END} AS t FROM {tt} WHERE {TOKEN_END} IS NOT NULL")["t"]
                        .to_numpy(float))
    req = src.df(f"""SELECT f.{c.ARRIVAL_NS} AS a, MAX(t.{TOKEN_END}) AS e FROM {request_table(src)} f
                     JOIN {tt} t USING ({c.REQUEST_ID}) WHERE f.{c.ARRIVAL_NS} IS NOT NULL
                     GROUP BY f.{c.REQUEST_ID}, f.{c.ARRIVAL_NS}""")
    lags = src.df(f"SELECT {c.START_NS} AS s, {c.END_NS} AS e FROM {LOOP_LAGS.name} ORDER BY {c.START_NS}")
    start, end = steps.start_ns, steps.start_ns + steps.duration_ns
    mid = (start + end) / 2
    arrived = np.searchsorted(np.sort(req["a"].to_numpy(float)), mid, side="right")
    finished = np.searchsorted(np.sort(req["e"].to_numpy(float)), mid, side="right")
    half = window_ns / 2
    relayed = (np.searchsorted(delivered, mid + half) - np.searchsorted(delivered, mid - half)) * 1e9 / window_ns
    ls, le = lags["s"].to_numpy(float), lags["e"].to_numpy(float)
    late = np.array([np.clip(np.minimum(le, b) - np.maximum(ls, a), 0.0, None).sum() / max(b - a, 1.0)
                     for a, b in zip(start, end)]) if ls.size else np.zeros(start.size)
    return StepLoad((arrived - finished).astype(float), relayed.astype(float), np.clip(late, 0.0, 1.0))


def step_ratios(model: StepTimeModel, steps: StepRows) -> np.ndarray:
    """Each step's measured time over the time ``model`` gives it (NaN where the model gives none)."""
    pred = model.features(steps.num_prefill_tokens, steps.num_decode_tokens, steps.num_seqs,
                          steps.decode_context) @ np.asarray(model.coefficients)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(pred > 0, steps.duration_ns / pred, np.nan)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (ties ranked by order; NaN when either side is constant or has < 3 values)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if a.size < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)).astype(float), np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def load_relation(ratio: np.ndarray, load: np.ndarray) -> LoadRelation:
    """The steps' ``ratio`` (measured / modelled) against ``load``: rank correlation, median ratio per quartile of
    the load, and the least-squares slope of ln(ratio) on the load."""
    ratio, load = np.asarray(ratio, float), np.asarray(load, float)
    ok = np.isfinite(ratio) & (ratio > 0) & np.isfinite(load)
    r, x = ratio[ok], load[ok]
    if r.size < 4:
        return LoadRelation(float("nan"), (), float("nan"))
    order = np.argsort(x, kind="stable")
    quartiles = tuple((float(x[q].min()), float(x[q].max()), float(np.median(r[q])), int(q.size))
                      for q in np.array_split(order, 4) if q.size)
    slope = float(np.polyfit(x, np.log(r), 1)[0]) if np.ptp(x) > 0 else float("nan")
    return LoadRelation(spearman(r, x), quartiles, slope)


def within_run_lines(load: StepLoad, steps: StepRows, model: StepTimeModel) -> list[str]:
    """The check within one run, in words: its decode-only steps' measured / modelled time (``model``) against
    each load measure (rank correlation, median ratio per quartile of the load); how many streams were open beyond
    the engine's running sequences (a stream the gateway relays while its request is not in the engine's batch);
    and whether the event loop's lag itself went with the load."""
    dec = steps.num_prefill_tokens == 0
    ratio = step_ratios(model, steps)[dec]
    out = []
    for what in ("in_flight", "relayed_per_s", "loop_lag_share"):
        r = load_relation(ratio, getattr(load, what)[dec])
        out.append(f"{what}: Spearman {r.rank_correlation:+.2f}; " + ", ".join(
            f"{lo:.3g}-{hi:.3g}: {m:.2f} ({k})" for lo, hi, m, k in r.quartiles))
    outside = load.in_flight - steps.num_seqs
    out.append(f"streams in flight beyond the engine's running sequences: median {np.median(outside):g}, most "
               f"{outside.max(initial=0):g}; loop-lag share against the load, Spearman: in_flight "
               f"{spearman(load.loop_lag_share, load.in_flight):+.2f}, relayed_per_s "
               f"{spearman(load.loop_lag_share, load.relayed_per_s):+.2f}")
    return out
