"""Speculative decoding analyses over small hand-made stores with hand-computed answers.

The store of :func:`_mixed` (times in ms, one colocated engine):

* request 1 (tenant a) speculates with a draft model in three steps (k = 3 each): step 1 accepts 2 and emits
  tokens 1-3 in a batch of two (request 2 decodes plainly beside it: a mixed batch), step 2 accepts 0 and emits
  token 4, step 3 accepts all 3 but the request finishes after 2 tokens (5 and 6): it ends mid-step;
* request 2 (tenant b) decodes plainly (tokens 1 and 2 in steps 1 and 2);
* request 3 (tenant c) speculates once with n-gram lookup (k = 2, accepts 1: tokens 1 and 2, batch of 3), then
  decodes token 3 plainly.

    step  request  k  a  tokens  draft  verify  engine step  batch
    1     1        3  2  1-3     2 ms   4 ms    10-16 ms     2
    2     1        3  0  4       2 ms   4 ms    20-26 ms     2
    3     1        3  3  5-6     2 ms   4 ms    30-36 ms     1
    4     3        2  1  1-2     1 ms   4 ms    40-45 ms     3

Delivered tokens (ITL in brackets): request 1: 10, 16 (6), 16.5 (0.5), 17 (0.5), 26 (9), 36 (10), 36.5 (0.5);
request 2: 9, 16 (7), 26 (10); request 3 (arrives at 30): 38, 45 (7), 45.5 (0.5), 50 (4.5). Plain decode.compute
spans: 4 ms each for request 2's tokens 1 and 2 and request 3's token 3 (engine step 5: 45-50 ms, 3 sequences,
no speculation).
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
from handmade import HandMade

import tokentrace
from analyzers import speculative
from tokentrace.schema import Stage, col

pytestmark = pytest.mark.timeout(60)


def _mixed() -> HandMade:
    h = HandMade()
    h.request(1, 0, 37, tenant="a").request(2, 0, 27, tenant="b").request(3, 30, 51, tenant="c")
    h.tokens(1, [10, 16, 16.5, 17, 26, 36, 36.5], steps=[0, 1, 1, 1, 2, 3, 3])
    h.tokens(2, [9, 16, 26], steps=[0, 1, 2])
    h.tokens(3, [38, 45, 45.5, 50], steps=[0, 4, 4, 5])
    for step, (start, end, seqs) in enumerate([(10, 16, 2), (20, 26, 2), (30, 36, 1), (40, 45, 3), (45, 50, 3)], 1):
        h.step(step, start, end, seqs=seqs)
    h.spec_step(1, 1, proposed=3, accepted=2, first=1, draft=(10, 12), verify=(12, 16), batch=2)
    h.spec_step(1, 2, proposed=3, accepted=0, first=4, draft=(20, 22), verify=(22, 26), batch=2)
    h.spec_step(1, 3, proposed=3, accepted=3, first=5, draft=(30, 32), verify=(32, 36), batch=1)
    h.spec_step(3, 4, proposed=2, accepted=1, first=1, draft=(40, 41), verify=(41, 45), batch=3, source=1)
    h.span(2, Stage.DECODE_COMPUTE, 12, 16, 1).span(2, Stage.DECODE_COMPUTE, 22, 26, 2)
    h.span(3, Stage.DECODE_COMPUTE, 46, 50, 3)
    return h


@pytest.fixture(scope="module")
def report() -> speculative.SpecReport:
    return _mixed().analysis().speculation()


# (table of the report, column) -> expected values, row by row
EXPECTED: dict[tuple[str, str], list] = {
    ("summary", "draft_sources"): ["model, ngram"],
    ("summary", "num_requests"): [2],
    ("summary", "num_steps"): [4],
    ("summary", col.NUM_PROPOSED): [11],
    ("summary", col.NUM_ACCEPTED): [6],
    ("summary", "num_emitted"): [3 + 1 + 2 + 2],  # the finished request's last step emitted 2, not a + 1 = 4
    ("summary", "acceptance_rate"): [6 / 11],
    ("summary", "mean_accepted_per_step"): [1.5],
    ("summary", "mean_tokens_per_step"): [2.0],
    # position j: steps with k >= j, those with a >= j; conditional on a >= j - 1
    ("by_position", "position"): [1, 2, 3],
    ("by_position", "num_steps"): [4, 4, 3],
    ("by_position", col.NUM_ACCEPTED): [3, 2, 1],
    ("by_position", "acceptance_rate"): [3 / 4, 2 / 4, 1 / 3],
    ("by_position", "conditional_acceptance_rate"): [3 / 4, 2 / 3, 1 / 2],
    ("accepted_per_step", col.NUM_ACCEPTED): [0, 1, 2, 3],
    ("accepted_per_step", "num_steps"): [1, 1, 1, 1],
    ("accepted_per_step", "share"): [0.25] * 4,
    ("by_request", col.REQUEST_KEY): ["r1", "r3"],
    ("by_request", col.TENANT): ["a", "c"],
    ("by_request", "acceptance_rate"): [5 / 9, 1 / 2],
    ("by_request", "num_emitted"): [6, 2],
    ("by_request", "draft_share"): [6 / 18, 1 / 5],
    ("by_tenant", col.TENANT): ["a", "c"],
    ("by_tenant", "num_steps"): [3, 1],
    ("by_tenant", "acceptance_rate"): [5 / 9, 1 / 2],
    ("by_batch_acceptance", "batch_size_lo"): [1, 2, 3],
    ("by_batch_acceptance", "batch_size_hi"): [1, 2, 4],
    ("by_batch_acceptance", "acceptance_rate"): [3 / 3, 2 / 6, 1 / 2],
    ("by_batch_acceptance", "mean_tokens_per_step"): [2.0, 2.0, 2.0],
    ("cost", "draft_ms"): [7.0],
    ("cost", "verify_ms"): [16.0],
    ("cost", "plain_compute_ms"): [12.0],
    ("cost", "draft_share"): [7 / 23],
    ("cost", "draft_share_of_decode"): [7 / 35],
    ("cost", "spec_share_of_decode"): [23 / 35],
    ("rejected", "num_rejected"): [1 + 3 + 0 + 1],
    ("rejected", "rejected_share"): [5 / 11],
    ("rejected", "rejected_draft_ms"): [2 * 1 / 3 + 2 * 3 / 3 + 0 + 1 * 1 / 2],
    ("rejected", "rejected_draft_share"): [(2 / 3 + 2 + 0.5) / 7],
    ("rejected", "verify_positions"): [4 + 4 + 4 + 3],
    ("rejected", "wasted_verify_positions"): [1 + 3 + 2 + 1],  # k + 1 - emitted
    ("rejected", "wasted_verify_ms"): [4 * 1 / 4 + 4 * 3 / 4 + 4 * 2 / 4 + 4 * 1 / 3],
    ("itl", "mode"): ["speculative", "plain"],
    ("itl", "num_steps"): [4, 3],
    ("itl", "num_tokens"): [8, 3],
    ("itl", "tokens_per_step"): [2.0, 1.0],
    ("itl", "mean_itl_ms"): [34 / 8, 21.5 / 3],
    ("itl", "p50_itl_ms"): [(0.5 + 6) / 2, 7.0],  # sorted: 0.5 x4, 6, 7, 9, 10 | 4.5, 7, 10
    ("itl", "p99_itl_ms"): [9 + 0.93 * 1, 7 + 0.98 * 3],
    ("itl", "mean_carrier_itl_ms"): [(6 + 9 + 10 + 7) / 4, 21.5 / 3],
    ("itl", "mean_step_ms"): [23 / 4, 17 / 3],
    ("itl", "ms_per_token"): [23 / 8, 17 / 3],  # amortized: engine step time over the tokens it emitted
    ("by_batch", "batch_size_hi"): [1, 2, 4],
    ("by_batch", "spec_tokens"): [2, 4, 2],
    ("by_batch", "plain_tokens"): [0, 2, 1],
    ("by_batch", "spec_mean_itl_ms"): [10.5 / 2, 16 / 4, 7.5 / 2],
    ("by_batch", "plain_mean_itl_ms"): [math.nan, 8.5, 4.5],
    ("by_batch", "spec_ms_per_token"): [6 / 2, 12 / 4, 5 / 2],
    ("by_batch", "plain_ms_per_token"): [math.nan, 6.0, 5.0],
    ("by_batch", "slower"): [False, False, False],  # too few tokens to judge
    # plain tokens: request 3's token 3 in step 5 (no speculation) | request 2's in the mixed steps 1 and 2
    ("neighbours", "step"): ["no speculation in the step", "beside speculating requests"],
    ("neighbours", "num_tokens"): [1, 2],
    ("neighbours", "mean_itl_ms"): [4.5, (7 + 10) / 2],
    ("neighbours", "p99_itl_ms"): [4.5, 7 + 0.99 * 3],
    ("neighbours", "mean_step_ms"): [5.0, 6.0],
}


@pytest.mark.parametrize("table,column", list(EXPECTED))
def test_hand_computed_figures(report, table, column):
    got = getattr(report, table)[column].tolist()
    want = EXPECTED[(table, column)]
    assert len(got) == len(want), (table, column, got)
    for g, w in zip(got, want):
        if isinstance(w, float) and math.isnan(w):
            assert g is None or math.isnan(g), (table, column, got)
        elif isinstance(w, float):
            assert g == pytest.approx(w, rel=1e-9), (table, column, got)
        else:
            assert g == w, (table, column, got)


def test_acceptance_by_draft_source_and_bad_grouping():
    a = _mixed().analysis()
    by_source = a.acceptance(by=col.DRAFT_SOURCE)
    assert by_source[col.DRAFT_SOURCE].tolist() == ["model", "ngram"]
    assert by_source["acceptance_rate"].tolist() == pytest.approx([5 / 9, 1 / 2])
    overall = a.acceptance()
    assert overall["acceptance_rate"].tolist() == pytest.approx([6 / 11])
    with pytest.raises(ValueError, match="by must be one of"):
        a.acceptance(by="colour")


def test_a_request_without_token_rows_counts_a_plus_one_emitted():
    h = HandMade().request(1, 0, 20)
    h.spec_step(1, 1, proposed=4, accepted=2, first=1, draft=(1, 2), verify=(2, 5), batch=1)
    r = h.analysis().speculation()
    assert r.summary["num_emitted"].tolist() == [3]
    assert r.rejected["wasted_verify_positions"].tolist() == [5 - 3]
    assert r.itl.empty  # no delivered token to measure


def test_a_run_without_speculation_gives_empty_tables_not_errors():
    h = HandMade().request(1, 0, 20).tokens(1, [5, 10, 15], steps=[0, 1, 2]).step(1, 5, 10).step(2, 10, 15)
    for store in (h, HandMade()):
        r = store.analysis().speculation()
        assert r.is_empty
        frames = [name for name in r.__slots__ if isinstance(getattr(r, name), pd.DataFrame)]
        assert len(frames) == 11
        for name in frames:
            assert len(getattr(r, name)) == 0, name
        assert len(r.slower_batches) == 0
        for by in (None, *speculative.GROUPINGS):
            assert len(store.analysis().acceptance(by=by)) == 0


def _bins_store() -> HandMade:
    """Two batch-size bins with 20 speculative and 20 plain decode tokens each.

    Batch 8 (bin 5-8): speculative steps emit 2 tokens with ITLs 20 and 2 ms (mean 11, sample variance
    81 x 20 / 19); plain tokens alternate 3 and 5 ms (mean 4, variance 20 / 19). Batch 2: speculative ITLs 4 and
    0.5 (mean 2.25), plain 6 ms each: speculation is faster there.
    """
    h = HandMade()
    for rid, spec, batch, gaps in ((10, True, 8, (20, 2)), (11, False, 8, (3, 5)), (12, True, 2, (4, 0.5)),
                                   (13, False, 2, (6, 6))):
        h.request(rid, 0, 1000)
        times, steps, t = [10.0], [0], 10.0
        for i in range(20):
            t += gaps[i % 2]
            times.append(t)
            steps.append(rid * 100 + (i // 2 if spec else i))
        h.tokens(rid, times, steps=steps)
        for s in sorted(set(steps[1:])):
            h.step(s, 0, 1, seqs=batch)
            if spec:
                first = 1 + 2 * (s - rid * 100)
                h.spec_step(rid, s, proposed=1, accepted=1, first=first, draft=(0, 0.2), verify=(0.2, 1), batch=batch)
    return h


def test_batch_sizes_where_speculation_is_slower_are_flagged():
    df = _bins_store().analysis().speculation().by_batch
    assert df["batch_size_lo"].tolist() == [2, 5] and df["batch_size_hi"].tolist() == [2, 8]
    assert df["spec_tokens"].tolist() == [20, 20] and df["plain_tokens"].tolist() == [20, 20]
    assert df["spec_mean_itl_ms"].tolist() == pytest.approx([2.25, 11.0])
    assert df["plain_mean_itl_ms"].tolist() == pytest.approx([6.0, 4.0])
    assert df["itl_delta_ms"].tolist() == pytest.approx([-3.75, 7.0])
    se = math.sqrt((81 * 20 / 19) / 20 + (20 / 19) / 20)  # Welch: sqrt(var_s / n_s + var_p / n_p), ms
    assert df["p_value"].iloc[1] == pytest.approx(math.erfc(7.0 / se / math.sqrt(2)))
    assert df["slower"].tolist() == [False, True]
    assert df["spec_ms_per_token"].tolist() == pytest.approx([0.5, 0.5])  # 1 ms steps, 2 tokens each
    assert df["plain_ms_per_token"].tolist() == pytest.approx([1.0, 1.0])


def test_slower_needs_enough_tokens_and_a_real_effect():
    a = _bins_store().analysis()
    assert not a.speculation(min_tokens=21).by_batch["slower"].any()  # 20 tokens a side: not judged
    assert a.speculation(min_tokens=21).by_batch["p_value"].isna().all()
    assert not a.speculation(min_effect_ms=7.5).by_batch["slower"].any()  # 7 ms is under the minimum effect
    for bad in ({"min_tokens": 1}, {"min_effect_ms": -1.0}):
        with pytest.raises(ValueError):
            a.speculation(**bad)


def test_from_parquet_through_the_run_facade(tmp_path):
    store = _mixed().write(tmp_path / "store")
    run = tokentrace.open(store)
    r = run.analyze().speculation()
    assert r.summary["acceptance_rate"].tolist() == pytest.approx([6 / 11])
    assert r.itl["ms_per_token"].tolist() == pytest.approx([23 / 8, 17 / 3])



def test_a_real_engine_run_adds_up(tmp_path):
    """The reference engine, speculating with n-gram lookup and traced: every output token is token 0, a plain
    decode token or one a speculative step emitted, and the figures agree with each other."""
    import torch

    from reference_server.engine.config import EngineConfig
    from reference_server.engine.engine import Engine
    from reference_server.model import SamplingParams

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=128, speculative="ngram"))
    handle = tokentrace.instrument(engine, store=tmp_path, run="real")
    num_requests, max_tokens = 4, 16
    for i in range(num_requests):
        engine.add_request(f"r{i}", f"the cat sat on the mat, the cat sat on the mat {i}", SamplingParams(
            max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    handle.close()
    engine.close()
    r = tokentrace.open(tmp_path).analyze().speculation()
    assert not r.is_empty
    s = r.summary.iloc[0]
    itl = r.itl.set_index("mode")
    plain = int(itl.loc["plain", "num_tokens"]) if "plain" in itl.index else 0
    assert int(s["num_emitted"]) + plain + num_requests == num_requests * max_tokens  # every token, once
    assert int(itl.loc["speculative", "num_tokens"]) == int(s["num_emitted"])
    assert int(s["num_emitted"]) <= int(s[col.NUM_ACCEPTED]) + int(s["num_steps"])
    assert r.accepted_per_step["num_steps"].sum() == s["num_steps"]
    assert r.by_position["num_steps"].iloc[0] <= s["num_steps"]  # the steps that proposed a first token
    assert r.by_tenant["num_steps"].sum() == r.by_request["num_steps"].sum() == s["num_steps"]
    assert 0 <= r.cost["draft_share_of_decode"].iloc[0] <= r.cost["draft_share"].iloc[0] <= 1
