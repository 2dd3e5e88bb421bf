"""Cost models fitted to the run's own trace: engine step time, the gap between steps, and stage costs.

* :class:`StepTimeModel`: ``duration = c0 + c_p * prefill tokens + c_d * decode tokens + c_s * sequences
  + c_c * decode context`` (ns; decode context: the summed length of the sequences that decode in the step,
  which attention reads), plus, in the forms that bend with the batch (:data:`STEP_FORMS`), a term in
  ln(sequences) or a cost per sequence of its own in each segment of the batch sizes the run covered
  (:func:`step_features`). A step's time often grows less than linearly with its batch (the small model's
  matrix products use the CPU better on more rows; a GPU's decode step is bound by reading the weights), and
  sometimes the other way on a busy machine: the form is the one with the least error on held-out steps of
  the run itself (:func:`heldout_errors`, :func:`choose_form`). Fitted on the run's ``steps`` by least squares
  on the *relative* error with every coefficient kept >= 0 (:func:`relative_fit`): each step's error divided
  by its modelled duration, so that the fit gives each kind of step its mean time. Relative, because a shared
  machine's variation is multiplicative: an absolute fit lets the few long prefill steps, and the
  slow bursts, decide the fixed cost, and on the reference server put 1.4-2.4x the measured time on the
  small decode steps of the same run; divided by the measured duration instead, a fit is biased low, the more
  the more a kind of step varies (decode steps 0.68-0.76x their mean, prefill steps 0.87-0.96x, on the
  benchmark's runs). One per engine role present, plus
  one over all steps (used for a role the run did not have). The model keeps the ratio of each fitted
  step's measured to modelled duration: a replay multiplies each simulated step by one of them drawn at
  random (seeded), so the run's own step-to-step variation (a busy machine's, a noisy neighbour's) is
  replayed too, and with it the queueing it causes, not only the mean. Slow steps come in bursts (another
  process holding the CPU for a while): ``persistence`` is the lag-1 autocorrelation of the log ratios in
  step order, and a replay keeps its current ratio for the next step with that probability, so its slow
  periods last as long as the run's did. Where the variation is additive instead (a fixed stall, a garbage
  collection, a kernel compiled once, whatever the step's size) the replay adds a measured residual
  (measured - modelled) instead of multiplying by a ratio. A shared machine's speed also changes over seconds
  (another process holds the CPU for a while, then leaves it), and which requests were decoding then decides
  whose TPOT is long: ``timeline`` replays, at each moment of the replay, the ratio of the run's own step at
  that moment (:attr:`StepTimeModel.ratio_start_ns`), so the run's slow periods fall on the requests they fell
  on; drawn at random, they put the replay's per-request TPOT tail elsewhere. ``variation`` says which, chosen by
  :func:`analyzers.whatif.predict.fit_whatif` as the one that replays the run itself better. The gap from a step's end to the next
  step's start while the engine is busy (token hand-out, scheduling) is ``g0 + g_s * sequences``, fitted
  the same way on gaps shorter than the busy cut-off (``BUSY_GAP_FACTOR`` x the median gap): a longer
  gap is the engine idling for work, which the simulator produces itself.
* :class:`StageCosts`: what happens outside the engine, replayed from the run: the gateway's time before a
  request reaches its engine (each request keeps its own), the delivery lag after the engine emits a
  token (median, first visible token and later tokens apart), and the prefill -> decode hand-over
  (linear in prompt tokens, when the run was disaggregated).

Each model carries its own error on the rows it was fitted to (:attr:`StepTimeModel.mape`), the batch sizes
its steps covered (:attr:`StepTimeModel.seqs_low` / ``seqs_high``: the 5th and 95th percentile of sequences
per step) and refits on resampled steps (:attr:`StepTimeModel.alternatives`: blocks of consecutive steps
drawn with replacement, so a slow burst stays whole): a fixed cost and a cost per sequence that the run's
batch sizes cannot tell apart come out far apart in them, which is how a prediction that leaves the covered
batch sizes states its uncertainty (:meth:`analyzers.whatif.predict.WhatIf.predict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from analyzers.whatif.trace import RunTrace, StepRows
from tokentrace.schema import Role, col

__all__ = ["StepTimeModel", "StageCosts", "FittedModels", "fit_models", "nonnegative_lstsq", "relative_fit",
           "step_features", "seq_knots", "heldout_errors", "choose_form", "VARIATIONS", "STEP_FORMS", "NUM_RESAMPLES",
           "NUM_FOLDS", "FORM_MARGIN", "MIN_KIND_STEPS"]

VARIATIONS = ("ratio", "residual", "timeline")
"""How a replay varies each step's modelled duration: multiply by a measured ratio drawn at random, add a measured
residual, or multiply by the ratio of the run's own step at the same time of the run (its slow periods in place)."""
STEP_FORMS = ("linear", "log", "piecewise")
"""Step-time model forms: linear in tokens, sequences and context, plus (``log``) a term in ln(sequences) or
(``piecewise``) slopes that fall at knots over the batch sizes the run covered (:func:`step_features`)."""
NUM_FOLDS = 5
"""Blocks of consecutive steps held out in turn to compare the forms (:func:`heldout_errors`)."""
FORM_MARGIN = 0.02
"""A concave form is chosen over the linear one when its held-out error is at least this much (relative) lower."""
NUM_RESAMPLES = 40
"""Refits of a step-time model on resampled steps (:attr:`StepTimeModel.alternatives`)."""
_BLOCK = 8  # consecutive steps per resampled block
MIN_KIND_STEPS = 5
"""A replay varies a step by the ratios of the run's steps of its kind (with or without prefill) when the run had
at least this many of that kind (:meth:`StepTimeModel.variation_pools`)."""
_REWEIGHTS = 8  # at most this many rounds of reweighting by the modelled time in :func:`relative_fit`
_SETTLED = 1e-3  # ... stopped when no coefficient moved by more than this share of the largest (3-4 rounds)
_MU_FLOOR = 0.05  # a row's modelled time is taken as at least this share of the median step when reweighting


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares coefficients of ``y ~ x`` with every coefficient >= 0 (Lawson and Hanson's active set)."""
    num = x.shape[1]
    coef = np.zeros(num)
    free = np.zeros(num, dtype=bool)
    scale = max(float(np.abs(x.T @ y).max(initial=0.0)), 1e-300)
    for _ in range(3 * num + 3):
        grad = x.T @ (y - x @ coef)
        grad[free] = -np.inf
        j = int(np.argmax(grad))
        if free.all() or grad[j] <= 1e-12 * scale:
            break
        free[j] = True
        while True:
            sol = np.zeros(num)
            sol[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
            bad = free & (sol <= 0)
            if not bad.any():
                coef = sol
                break
            step = np.min(coef[bad] / np.maximum(coef[bad] - sol[bad], 1e-300))
            coef = coef + step * (sol - coef)
            free &= coef > 1e-12 * max(float(np.abs(coef).max()), 1.0)
            coef[~free] = 0.0
            if not free.any():
                break
    return coef


def relative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients ``c >= 0`` of ``y ~ x @ c`` whose error is weighed relative to each row's *modelled* time: the
    mean of ``y`` given ``x`` when ``y`` varies by a factor around it (rows with ``y <= 0`` left out).

    Started from :func:`nonnegative_lstsq` on ``(x @ c - y) / y``, then reweighted by the model's own time
    (:data:`_REWEIGHTS` rounds of ``(x @ c - y) / (x @ c_prev)``, a gamma regression with an identity link). The
    first alone is biased low, to about ``exp(-2 sigma^2)`` of the mean for a log-normal spread ``sigma`` (a slow
    step weighs less than a fast one): on the reference server's steps it put 0.68-0.76x their mean on decode steps, whose
    relative spread is widest, and 0.87-0.96x on prefill steps. Reweighted, each kind of step is modelled at
    its mean, so a replay's queueing sees the run's throughput."""
    ok = y > 0
    if not ok.any():
        return nonnegative_lstsq(x, y)
    x, y = x[ok], y[ok]
    c = nonnegative_lstsq(x / y[:, None], np.ones(y.size))
    floor = _MU_FLOOR * float(np.median(y))
    for _ in range(_REWEIGHTS):
        mu = np.maximum(x @ c, floor)
        nxt = nonnegative_lstsq(x / mu[:, None], y / mu)
        done = float(np.abs(nxt - c).max(initial=0.0)) <= _SETTLED * max(float(np.abs(nxt).max(initial=0.0)), 1e-300)
        c = nxt
        if done:
            break
    return c


def step_features(num_prefill_tokens: Any, num_decode_tokens: Any, num_seqs: Any, decode_context: Any,
                  form: str = "linear", knots: tuple[float, ...] = ()) -> np.ndarray:
    """The step-time model's regressors, one row per step: ``1, prefill tokens, decode tokens, sequences, decode
    context``, then the terms of ``form`` (:data:`STEP_FORMS`). ``log``: ``ln(sequences)`` (with a coefficient
    >= 0, the step time grows more slowly as the batch grows); ``piecewise``: the sequences split at ``knots``
    into segments, the sequences column holding those up to the first knot and one more column per segment
    (``clip(sequences - k_i, 0, k_{i+1} - k_i)``), so that each segment has its own cost per sequence, >= 0:
    the step time bends at each knot, up or down, as the run's steps do."""
    p, d, n, ctx = (np.atleast_1d(np.asarray(v, dtype=float)) for v in
                    (num_prefill_tokens, num_decode_tokens, num_seqs, decode_context))
    cols = [np.ones_like(n), p, d, n, ctx]
    if form == "log":
        cols.append(np.log(np.maximum(n, 1.0)))
    elif form == "piecewise":
        segments = [np.clip(n - a, 0.0, b - a) for a, b in zip((0.0, *knots), (*knots, math.inf))]
        cols[3] = segments[0]
        cols.extend(segments[1:])
    elif form != "linear":
        raise ValueError(f"step-time form must be one of {', '.join(STEP_FORMS)}, got {form!r}")
    return np.column_stack(cols)


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Step duration and busy gap (ns) of one engine role."""

    intercept_ns: float
    per_prefill_token_ns: float
    per_decode_token_ns: float
    per_seq_ns: float
    per_context_token_ns: float
    gap_ns: float
    gap_per_seq_ns: float
    num_steps: int
    mape: float  # mean absolute percentage error of the duration on the fitted steps (0.1 = 10%)
    ratios: tuple[float, ...] = (1.0,)  # measured / modelled duration of each fitted step
    gaps: tuple[float, ...] = ()  # measured busy gaps (ns); empty: the fitted gap alone
    persistence: float = 0.0  # lag-1 autocorrelation of the log ratios, in [0, 0.95]
    residuals: tuple[float, ...] = ()  # measured - modelled duration of each fitted step (ns)
    variation: str = "ratio"  # how a replay varies a step: one of VARIATIONS
    seqs_low: float = 0.0  # 5th percentile of the fitted steps' sequences
    seqs_high: float = math.inf  # 95th percentile
    alternatives: tuple[tuple[float, ...], ...] = ()  # :attr:`coefficients` refitted on resampled steps
    form: str = "linear"  # one of STEP_FORMS: the concave terms after the linear ones
    concave_ns: tuple[float, ...] = ()  # "log": the cost per ln(sequences); "piecewise": per sequence past each knot
    knots: tuple[float, ...] = ()  # form "piecewise": the batch sizes (sequences) where the cost per sequence changes
    heldout: tuple[tuple[str, float], ...] = ()  # (form, mean relative error on held-out steps) per form tried
    other_fits: tuple[tuple[str, tuple[float, ...], tuple[float, ...]], ...] = ()  # (form, knots, coefficients)
    ratio_prefill: tuple[bool, ...] = ()  # per ratio: its step carried prefill tokens (empty: not known)
    residual_prefill: tuple[bool, ...] = ()  # per residual: likewise
    ratio_start_ns: tuple[float, ...] = ()  # per ratio: when its step started (reference clock); empty: not known

    def variation_pools(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """The measured ratios (sorted) and residuals a replay draws from, each as (steps without prefill tokens,
        steps with): a step is varied as the run's steps of its kind were (a prefill step's time varies
        relatively less than a short decode step's); all of them where a kind had fewer than
        :data:`MIN_KIND_STEPS` steps."""
        out = []
        for values, kinds in ((self.ratios, self.ratio_prefill), (self.residuals, self.residual_prefill)):
            v = np.asarray(values, dtype=float)
            k = np.asarray(kinds, dtype=bool)
            pools = []
            for want in (False, True):
                sel = v[k == want] if k.size == v.size else v[:0]
                pools.append(np.sort(sel if sel.size >= MIN_KIND_STEPS else v))
            out.append(tuple(pools))
        return out[0], out[1]

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.intercept_ns, self.per_prefill_token_ns, self.per_decode_token_ns, self.per_seq_ns,
                self.per_context_token_ns, *self.concave_ns)

    def with_coefficients(self, c: tuple[float, ...]) -> StepTimeModel:
        """The same model (form, variation, gaps) with other step-time coefficients (:attr:`coefficients`)."""
        return replace(self, intercept_ns=c[0], per_prefill_token_ns=c[1], per_decode_token_ns=c[2],
                       per_seq_ns=c[3], per_context_token_ns=c[4], concave_ns=tuple(c[5:]))

    def scaled(self, factor: float) -> StepTimeModel:
        """The same model on a device ``factor`` times as slow: every step time and busy gap multiplied."""
        return replace(self.with_coefficients(tuple(factor * v for v in self.coefficients)),
                       gap_ns=factor * self.gap_ns, gap_per_seq_ns=factor * self.gap_per_seq_ns,
                       gaps=tuple(factor * g for g in self.gaps), residuals=tuple(factor * r for r in self.residuals),
                       alternatives=tuple(tuple(factor * v for v in a) for a in self.alternatives),
                       other_fits=tuple((f, k, tuple(factor * v for v in c)) for f, k, c in self.other_fits))

    def other_forms(self) -> list[StepTimeModel]:
        """The same model (variation, gaps) with each other form tried, fitted to the same steps (no refits)."""
        return [replace(self, form=form, knots=knots, alternatives=(), other_fits=()).with_coefficients(c)
                for form, knots, c in self.other_fits]

    def features(self, num_prefill_tokens: Any, num_decode_tokens: Any, num_seqs: Any,
                 decode_context: Any = 0) -> np.ndarray:
        """:func:`step_features` of this model's form: ``features(...) @ coefficients`` is the step time."""
        return step_features(num_prefill_tokens, num_decode_tokens, num_seqs, decode_context, self.form, self.knots)

    def duration_ns(self, num_prefill_tokens: int, num_decode_tokens: int, num_seqs: int,
                    decode_context: int = 0) -> float:
        out = (self.intercept_ns + self.per_prefill_token_ns * num_prefill_tokens
               + self.per_decode_token_ns * num_decode_tokens + self.per_context_token_ns * decode_context)
        if self.form == "piecewise":
            edges = (0.0, *self.knots, math.inf)
            return out + sum(c * min(max(num_seqs - a, 0.0), b - a) for c, a, b in
                             zip((self.per_seq_ns, *self.concave_ns), edges, edges[1:]))
        out += self.per_seq_ns * num_seqs
        if self.form == "log":
            out += self.concave_ns[0] * math.log(max(num_seqs, 1))
        return out

    def busy_gap_ns(self, num_seqs: int) -> float:
        return self.gap_ns + self.gap_per_seq_ns * num_seqs

    def describe(self) -> str:
        """The step-time formula in words (ms and us)."""
        if self.form == "piecewise":
            edges = (0, *self.knots)
            seqs = ", ".join(f"{c / 1e3:.1f} us per sequence {f'{a:g}-{b:g}' if b < math.inf else f'beyond {a:g}'}"
                             for c, a, b in zip((self.per_seq_ns, *self.concave_ns), edges, (*self.knots, math.inf)))
        else:
            seqs = f"{self.per_seq_ns / 1e3:.1f} us per sequence"
            if self.form == "log":
                seqs += f" + {self.concave_ns[0] / 1e6:.2f} ms x ln(sequences)"
        return (f"{self.intercept_ns / 1e6:.2f} ms + {self.per_prefill_token_ns / 1e3:.1f} us per prefill token + "
                f"{self.per_decode_token_ns / 1e3:.1f} us per decode token + {seqs} + "
                f"{self.per_context_token_ns / 1e3:.2f} us per token of decode context")

    @classmethod
    def fit(cls, steps: StepRows, mask: np.ndarray, form: str | None = None) -> StepTimeModel:
        """Fit on the steps in ``mask``; ``form`` None: the one of :data:`STEP_FORMS` with the least held-out
        error (:func:`heldout_errors`), linear unless another beats it by :data:`FORM_MARGIN`."""
        p, d, n = steps.num_prefill_tokens[mask], steps.num_decode_tokens[mask], steps.num_seqs[mask]
        ctx = steps.decode_context[mask]
        y = steps.duration_ns[mask]
        knots = seq_knots(n)
        heldout = heldout_errors(p, d, n, ctx, y, knots)
        if form is None:
            form = choose_form(heldout)
        x = step_features(p, d, n, ctx, form, knots)
        c = relative_fit(x, y)
        pred = x @ c
        others = tuple((f, knots if f == "piecewise" else (),
                        tuple(float(v) for v in relative_fit(step_features(p, d, n, ctx, f, knots), y)))
                       for f in heldout if f != form)
        ok = y > 0
        mape = float(np.mean(np.abs(pred[ok] - y[ok]) / y[ok])) if ok.any() else float("nan")
        good = pred > 0
        ratios = tuple(float(r) for r in np.clip(y[good] / pred[good], 0.05, 20.0)) or (1.0,)
        ratio_prefill = tuple(bool(v) for v in p[good] > 0) if good.any() else ()
        persistence = _lag1(np.log(np.asarray(ratios)))
        gaps = steps.gap_ns[mask]
        busy = np.isfinite(gaps) & (gaps >= 0) & steps.busy_after[mask]
        g0 = gs = 0.0
        if busy.sum() >= 2:
            g0, gs = nonnegative_lstsq(np.column_stack([np.ones(busy.sum()), n[busy]]), gaps[busy])
        lo, hi = (float(v) for v in np.percentile(n, [5, 95])) if n.size else (0.0, math.inf)
        return cls(float(c[0]), float(c[1]), float(c[2]), float(c[3]), float(c[4]), float(g0), float(gs),
                   int(mask.sum()), mape, ratios, tuple(float(g) for g in gaps[busy]), persistence,
                   tuple(float(r) for r in y - pred), "ratio", lo, hi, _resampled_fits(x, y), form,
                   tuple(float(v) for v in c[5:]), knots if form == "piecewise" else (),
                   tuple(heldout.items()), others, ratio_prefill, tuple(bool(v) for v in p > 0),
                   () if steps.start_ns is None else tuple(float(v) for v in steps.start_ns[mask][good]))


def seq_knots(num_seqs: np.ndarray) -> tuple[float, ...]:
    """The piecewise form's knots: the 40th and 80th percentile of the steps' sequences, rounded, kept where they
    lie strictly between the smallest and the largest batch (empty: too few batch sizes to bend)."""
    n = np.asarray(num_seqs, dtype=float)
    if n.size == 0:
        return ()
    lo, hi = float(n.min()), float(n.max())
    return tuple(float(k) for k in np.unique(np.round(np.percentile(n, [40, 80]))) if lo < k < hi)


def heldout_errors(p: np.ndarray, d: np.ndarray, n: np.ndarray, ctx: np.ndarray, y: np.ndarray,
                   knots: tuple[float, ...]) -> dict[str, float]:
    """Each form's mean relative error on held-out steps: the steps cut into :data:`NUM_FOLDS` blocks of
    consecutive steps, each predicted by a fit on the others (consecutive steps share the machine's state, so
    a block is held out whole). Forms that cannot be told apart on these steps are left out (no knots: no
    piecewise; one batch size: no log); empty with fewer than ``4 * NUM_FOLDS`` steps."""
    ok = y > 0
    p, d, n, ctx, y = p[ok], d[ok], n[ok], ctx[ok], y[ok]
    if y.size < 4 * NUM_FOLDS:
        return {}
    forms = ["linear"]
    if np.unique(n).size >= 3:
        forms.append("log")
    if knots:
        forms.append("piecewise")
    fold = np.arange(y.size) * NUM_FOLDS // y.size
    out = {}
    for form in forms:
        x = step_features(p, d, n, ctx, form, knots)
        err = np.empty(y.size)
        for k in range(NUM_FOLDS):
            test = fold == k
            err[test] = np.abs(x[test] @ relative_fit(x[~test], y[~test]) - y[test]) / y[test]
        out[form] = float(np.mean(err))
    return out


def choose_form(heldout: dict[str, float]) -> str:
    """The form whose held-out error is least, preferring the simpler (in :data:`STEP_FORMS` order): a form replaces
    the simpler one chosen so far only when its error is lower by :data:`FORM_MARGIN` of that one's (a bend that
    does not clearly help is not worth its extrapolation; steps a line already fits exactly need none)."""
    chosen = "linear"
    if chosen not in heldout:
        return chosen
    for form in STEP_FORMS[1:]:
        if form in heldout and heldout[form] < heldout[chosen] - max(FORM_MARGIN * heldout[chosen], 1e-6):
            chosen = form
    return chosen


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Costs outside the engine (ns)."""

    first_delivery_ns: float  # engine emit of token 0 -> its visible delivery to the client stream
    delivery_ns: float  # engine emit -> delivery of tokens 1..n
    handoff_ns: float  # prefill engine's first token -> decode engine (fixed part); NaN: not measured
    handoff_per_token_ns: float  # ... per prompt token

    @property
    def has_handoff(self) -> bool:
        return bool(np.isfinite(self.handoff_ns))

    def handoff(self, num_prompt_tokens: int) -> float:
        if not self.has_handoff:
            return 0.0
        return self.handoff_ns + self.handoff_per_token_ns * num_prompt_tokens


@dataclass(frozen=True, slots=True)
class FittedModels:
    """The step-time model of each role (and over all steps) and the stage costs."""

    step: dict[Role, StepTimeModel]
    all_steps: StepTimeModel
    stages: StageCosts

    def for_role(self, role: Role) -> StepTimeModel:
        return self.step.get(role, self.all_steps)

    def with_variation(self, variation: str) -> FittedModels:
        """The same models, replayed with ``variation`` (one of :data:`VARIATIONS`)."""
        if variation not in VARIATIONS:
            raise ValueError(f"variation must be one of {', '.join(VARIATIONS)}, got {variation!r}")
        return FittedModels({r: replace(m, variation=variation) for r, m in self.step.items()},
                            replace(self.all_steps, variation=variation), self.stages)


def fit_models(trace: RunTrace) -> FittedModels:
    """Fit every model to ``trace`` (the run's own steps and spans)."""
    steps = trace.steps
    per_role = {}
    for role in np.unique(steps.role):
        mask = steps.role == role
        if mask.sum() >= 4:
            per_role[Role(int(role))] = StepTimeModel.fit(steps, mask)
    all_steps = StepTimeModel.fit(steps, np.ones(steps.role.size, dtype=bool))
    return FittedModels(per_role, all_steps, _stage_costs(trace))


def _resampled_fits(x: np.ndarray, y: np.ndarray) -> tuple[tuple[float, ...], ...]:
    """:data:`NUM_RESAMPLES` relative fits, each on blocks of :data:`_BLOCK` consecutive steps drawn with
    replacement (seeded); empty when there are too few steps to resample."""
    num_blocks = y.size // _BLOCK
    if num_blocks < 4:
        return ()
    rng = np.random.default_rng(0)
    starts = np.arange(num_blocks) * _BLOCK
    out = []
    for _ in range(NUM_RESAMPLES):
        rows = (rng.choice(starts, num_blocks)[:, None] + np.arange(_BLOCK)).ravel()
        out.append(tuple(float(v) for v in relative_fit(x[rows], y[rows])))
    return tuple(out)


def _lag1(v: np.ndarray) -> float:
    """Lag-1 autocorrelation of ``v``, clipped to [0, 0.95]; 0 when it cannot be estimated."""
    if v.size < 8 or float(np.std(v)) == 0.0:
        return 0.0
    r = float(np.corrcoef(v[:-1], v[1:])[0, 1])
    return float(np.clip(r, 0.0, 0.95)) if np.isfinite(r) else 0.0


def _median(v: np.ndarray) -> float:
    v = v[np.isfinite(v)]
    return float(np.median(np.clip(v, 0, None))) if v.size else 0.0


def _stage_costs(trace: RunTrace) -> StageCosts:
    h = trace.handoff
    handoff, per_token = float("nan"), 0.0
    if len(h):
        y = h["handoff_ns"].to_numpy(float)
        x = h[col.NUM_PROMPT_TOKENS].to_numpy(float)
        ok = np.isfinite(y) & (y >= 0)
        if ok.sum() >= 2:
            handoff, per_token = nonnegative_lstsq(np.column_stack([np.ones(ok.sum()), x[ok]]), y[ok])
        elif ok.any():
            handoff = float(y[ok][0])
    return StageCosts(_median(trace.first_delivery_lag_ns), _median(trace.delivery_lag_ns),
                      float(handoff), float(per_token))
