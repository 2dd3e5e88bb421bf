"""The step-time model's forms on constructed steps: a step time that grows less than linearly with the batch
is fitted with a bend, which beats a line on steps the fit never saw; a linear one stays linear; a device
slowed by a factor scales every step and gap."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analyzers.whatif.models import (
    STEP_FORMS,
    StepTimeModel,
    choose_form,
    heldout_errors,
    nonnegative_lstsq,
    seq_knots,
    step_features,
)
from analyzers.whatif.trace import StepRows
from tokentrace.schema import Role

MS = 1_000_000


def _steps(n: np.ndarray, p: np.ndarray, dur: np.ndarray) -> StepRows:
    """Steps of ``n`` sequences, ``p`` of their tokens prefill (one prefilling sequence), the rest decodes (each
    with a context of 40-160 tokens, drawn from the batch size so that it is reproducible)."""
    d = n - (p > 0)
    ctx = d * (40 + (n * 37) % 120)
    f = lambda v: np.asarray(v, dtype=float)  # noqa: E731
    return StepRows(np.zeros(n.size, "int64"), np.full(n.size, int(Role.COLOCATED)), f(dur), np.full(n.size, 2e5),
                    f(p), f(d), f(n), f(ctx), np.ones(n.size, dtype=bool))


def _concave(n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The shape measured on the reference server's small model (26 ms at 1 sequence, 66 at 8, 73 at 13):
    26 ms + 19.2 ms x ln(sequences), plus 0.1 ms per prefill token."""
    return 26 * MS + 19.2 * MS * np.log(n) + 0.1 * MS * p


def _draw(rng: np.random.Generator, count: int, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    n = rng.integers(low, high + 1, count)
    p = np.where(rng.random(count) < 0.2, rng.integers(16, 128, count), 0)
    return n, p


def _relative_errors(m: StepTimeModel, n: np.ndarray, p: np.ndarray, truth: np.ndarray) -> np.ndarray:
    s = _steps(n, p, truth)
    pred = m.features(s.num_prefill_tokens, s.num_decode_tokens, s.num_seqs, s.decode_context) @ np.asarray(
        m.coefficients)
    return np.abs(pred - truth) / truth


def test_a_step_time_concave_in_the_batch_is_fitted_with_a_bend_that_beats_a_line_on_held_out_steps():
    rng = np.random.default_rng(5)
    n, p = _draw(rng, 300, 4, 13)  # the run covered 4-13 sequences per step
    noise = np.exp(rng.normal(0, 0.02, n.size))  # a machine's multiplicative variation
    steps = _steps(n, p, _concave(n, p) * noise)
    everything = np.ones(n.size, dtype=bool)
    chosen = StepTimeModel.fit(steps, everything)
    line = StepTimeModel.fit(steps, everything, "linear")
    heldout = dict(chosen.heldout)
    assert set(heldout) == set(STEP_FORMS)
    assert chosen.form != "linear" and heldout[chosen.form] < 0.98 * heldout["linear"], heldout
    assert chosen.mape < line.mape
    # steps the fit never saw: inside the covered batch sizes, and below them (max_num_seqs 2 from this run)
    for low, high in ((4, 13), (1, 3)):
        n2, p2 = _draw(rng, 200, low, high)
        truth = _concave(n2, p2)
        bent, straight = _relative_errors(chosen, n2, p2, truth), _relative_errors(line, n2, p2, truth)
        assert bent.mean() < 0.5 * straight.mean(), (low, high, bent.mean(), straight.mean())
    # the bend is a slower growth: one more sequence costs less at 12 than at 4
    at = [chosen.duration_ns(0, k, k, 80 * k) for k in (4, 5, 12, 13)]
    assert at[1] - at[0] > at[3] - at[2] > 0


def test_every_form_gives_the_same_step_time_through_features_and_duration():
    rng = np.random.default_rng(9)
    n, p = _draw(rng, 200, 1, 16)
    steps = _steps(n, p, _concave(n, p))
    for form in STEP_FORMS:
        m = StepTimeModel.fit(steps, np.ones(n.size, dtype=bool), form)
        assert m.form == form and len(m.coefficients) == m.features(0, 1, 1).shape[1]
        assert all(len(a) == len(m.coefficients) for a in m.alternatives)
        x = m.features(steps.num_prefill_tokens, steps.num_decode_tokens, steps.num_seqs, steps.decode_context)
        rows = [m.duration_ns(a, b, c, e) for a, b, c, e in zip(steps.num_prefill_tokens, steps.num_decode_tokens,
                                                                 steps.num_seqs, steps.decode_context)]
        assert x @ np.asarray(m.coefficients) == pytest.approx(rows, rel=1e-9)
        assert min(m.coefficients) >= 0
        assert m.with_coefficients(m.coefficients) == m


def test_linear_steps_keep_the_linear_form():
    rng = np.random.default_rng(2)
    n, p = _draw(rng, 200, 1, 16)
    steps = _steps(n, p, 5 * MS + 2 * MS * n + 0.1 * MS * p)
    m = StepTimeModel.fit(steps, np.ones(n.size, dtype=bool))
    assert m.form == "linear" and m.concave_ns == () and m.mape == pytest.approx(0, abs=1e-9)
    assert (m.intercept_ns, m.per_seq_ns + m.per_decode_token_ns) == pytest.approx((5 * MS, 2 * MS), rel=1e-6)


def test_a_piecewise_step_time_is_recovered_at_its_knots():
    """Flat up to 5 sequences (a device not yet busy), then 3 ms per sequence: the piecewise form bends upward."""
    n = np.tile(np.arange(1, 11), 30)
    p = np.zeros(n.size, dtype=int)
    steps = _steps(n, p, 20 * MS + 3 * MS * np.maximum(n - 5, 0))
    assert seq_knots(n) == (5.0, 8.0)  # the 40th and 80th percentile of the batch sizes
    m = StepTimeModel.fit(steps, np.ones(n.size, dtype=bool))
    assert m.form == "piecewise" and m.knots == (5.0, 8.0)
    assert [m.duration_ns(0, k, k, 0) / MS for k in (1, 5, 6, 10, 14)] == pytest.approx(
        [20, 20, 23, 35, 47], rel=1e-6)


def test_held_out_errors_need_enough_steps_and_the_choice_needs_a_clear_gain():
    rng = np.random.default_rng(1)
    n, p = _draw(rng, 12, 1, 8)
    f = lambda v: np.asarray(v, dtype=float)  # noqa: E731
    assert heldout_errors(f(p), f(n), f(n), f(n), f(_concave(n, p)), (3.0,)) == {}
    assert choose_form({}) == "linear"
    assert choose_form({"linear": 0.20, "log": 0.199, "piecewise": 0.197}) == "linear"  # within 2%
    assert choose_form({"linear": 0.20, "log": 0.15, "piecewise": 0.17}) == "log"
    assert choose_form({"linear": 0.20, "log": 0.15, "piecewise": 0.148}) == "log"  # the simpler bend, within 2%
    assert choose_form({"linear": 0.20, "log": 0.15, "piecewise": 0.12}) == "piecewise"
    assert choose_form({"linear": 1e-12, "piecewise": 1e-14}) == "linear"  # the line is already exact
    with pytest.raises(ValueError, match="step-time form"):
        step_features(0, 1, 1, 0, "cubic")


def test_a_device_that_slow_scales_every_step_and_gap():
    rng = np.random.default_rng(4)
    n, p = _draw(rng, 120, 2, 12)
    m = StepTimeModel.fit(_steps(n, p, _concave(n, p) * np.exp(rng.normal(0, 0.05, n.size))),
                          np.ones(n.size, dtype=bool))
    slow = m.scaled(1.5)
    for k in (1, 6, 20):
        assert slow.duration_ns(32, k, k + 1, 100 * k) == pytest.approx(1.5 * m.duration_ns(32, k, k + 1, 100 * k))
        assert slow.busy_gap_ns(k) == pytest.approx(1.5 * m.busy_gap_ns(k))
    assert slow.gaps == pytest.approx([1.5 * g for g in m.gaps])
    assert np.asarray(slow.alternatives) == pytest.approx(1.5 * np.asarray(m.alternatives))
    assert slow.ratios == m.ratios and slow.form == m.form


def test_nonnegative_least_squares_is_optimal_under_its_constraint():
    """Lawson and Hanson's conditions: no coefficient below 0, a zero gradient on the free ones and no descent
    direction on the ones held at 0."""
    rng = np.random.default_rng(8)
    for _ in range(50):
        x, y = rng.random((30, 6)), rng.normal(size=30)
        c = nonnegative_lstsq(x, y)
        grad = x.T @ (y - x @ c)
        assert (c >= 0).all()
        assert np.allclose(grad[c > 0], 0, atol=1e-8) and (grad[c == 0] <= 1e-8).all()
    assert math.isfinite(nonnegative_lstsq(np.zeros((5, 2)), np.ones(5)).sum())
