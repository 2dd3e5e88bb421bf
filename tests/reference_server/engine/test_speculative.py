"""Speculative decoding in the engine: exact greedy outputs, the target's distribution when
sampling, KV rollback, mixed batches and the batch-size policy."""

from __future__ import annotations

import math

import pytest
import torch

from reference_server.engine import Engine, EngineConfig, RecordingObserver
from reference_server.engine.hooks import SpeculativeStep
from reference_server.engine.speculative import (
    SpeculationPolicy,
    accept_greedy,
    accept_sampled,
    check_speculative_options,
    ngram_proposals,
)
from reference_server.model import Sampler, SamplingParams, SeqChunk

PROMPTS = ["the cat sat on the mat and the cat sat on the", "hello hello hello world", "abcabcabcabc", "x",
           "a longer prompt about nothing in particular, to fill a few blocks of the cache"]
SOURCES = ("model", "ngram", "early_exit")


def config(source: str | None, **kw) -> EngineConfig:
    # the tiny preset as the target, and as the draft with other random weights (seed + 1): a
    # draft that is often wrong, so rejections and rollbacks happen
    base = dict(model="tiny", device="cpu", block_size=4, num_device_blocks=256, speculative=source,
                speculative_draft_model="tiny", speculative_exit_layer=1)
    return EngineConfig(**{**base, **kw})


def run(cfg: EngineConfig, prompts, sampling) -> tuple[list[tuple[int, ...]], list[SpeculativeStep]]:
    engine = Engine(cfg)
    obs = RecordingObserver()
    engine.add_observer(obs)
    outs = [c.token_ids for c in engine.generate(prompts, sampling)]
    return outs, obs.of_type(SpeculativeStep)


GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy() -> list[tuple[int, ...]]:
    return run(config(None), PROMPTS, GREEDY)[0]


@pytest.mark.parametrize("source", SOURCES)
def test_greedy_speculative_output_is_exactly_plain_greedy(source: str, plain_greedy) -> None:
    outs, steps = run(config(source), PROMPTS, GREEDY)
    assert outs == plain_greedy
    assert steps, "nothing speculated"
    assert all(s.source == source and 0 <= s.num_accepted <= s.num_proposed <= 4 for s in steps)
    assert any(s.num_accepted < s.num_proposed for s in steps)  # rejections happened (and were rolled back)
    if source != "model":  # the random tiny draft model rarely agrees with its target; the others do
        assert any(s.num_accepted > 0 for s in steps)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_output_does_not_depend_on_k(k: int, plain_greedy) -> None:
    assert run(config("ngram", num_speculative_tokens=k), PROMPTS, GREEDY)[0] == plain_greedy


def test_max_tokens_and_eos_cut_a_step_short(plain_greedy) -> None:
    short = SamplingParams(max_tokens=7, ignore_eos=True)
    outs, steps = run(config("ngram"), PROMPTS, short)
    assert outs == [o[:7] for o in plain_greedy]
    assert all(s.first_token_index + s.num_proposed < 7 for s in steps)  # never proposes past max_tokens


# ---------------------------------------------------------------------- KV rollback


def _kv(runner, block_table, num_positions: int) -> torch.Tensor:
    """Every layer's cached K and V of positions [0, num_positions) ``(layers, 2, positions, ...)``."""
    bs = runner.block_size
    slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(num_positions)])
    layers = []
    for k_cache, v_cache in runner.storage.layer_caches():
        flat_k, flat_v = k_cache.reshape(-1, *k_cache.shape[2:]), v_cache.reshape(-1, *v_cache.shape[2:])
        layers.append(torch.stack([flat_k[slots], flat_v[slots]]))
    return torch.stack(layers)


def _fresh_kv(runner, tokens: list[int], free_block: int) -> torch.Tensor:
    """The KV a single prefill of ``tokens`` writes (into blocks from ``free_block`` on)."""
    bs = runner.block_size
    table = tuple(range(free_block, free_block + -(-len(tokens) // bs)))
    runner.execute([SeqChunk(tuple(tokens), 0, table)])
    return _kv(runner, table, len(tokens))


@pytest.mark.parametrize("source", ["model", "early_exit"])
def test_after_rejections_the_cached_kv_is_that_of_the_accepted_tokens(source: str) -> None:
    engine = Engine(config(source, num_device_blocks=64, enable_prefix_caching=False))
    obs = RecordingObserver()
    engine.add_observer(obs)
    engine.add_request("r", PROMPTS[0], GREEDY)
    while len(obs.of_type(SpeculativeStep)) < 6:
        engine.step()
    assert any(s.num_accepted < s.num_proposed for s in obs.of_type(SpeculativeStep))
    seq = engine.scheduler.running["r"]
    n = seq.num_computed_tokens
    assert n == seq.num_tokens - 1  # every emitted token but the last has its KV; no rejected position counts
    cached = _kv(engine.runner, engine.block_manager.block_table("r"), n)
    fresh = _fresh_kv(engine.runner, seq.token_ids[:n], free_block=48)
    torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
    if source == "model":  # the draft's own cache holds the draft's KV of what it computed, nothing rejected
        draft = engine.speculator.draft
        m = draft.num_computed("r")
        assert 0 < m <= seq.num_tokens - 1
        cached = _kv(draft.runner, tuple(draft._states["r"].blocks), m)
        fresh = _fresh_kv(draft.runner, seq.token_ids[:m], free_block=48)
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)


def test_draft_blocks_are_released_when_requests_finish() -> None:
    engine = Engine(config("model"))
    draft = engine.speculator.draft
    total = draft.num_free_blocks
    engine.generate(PROMPTS[:3], GREEDY)
    engine.add_request("next", "abc", SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert draft.num_free_blocks == total  # released at the next speculative step


# ---------------------------------------------------------------------- sampling: the target's distribution


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's chi-square test (regularized upper incomplete gamma)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("q", [[0.1, 0.6, 0.1, 0.2, 0.0], None])
def test_rejection_rule_emits_tokens_distributed_as_the_target(q) -> None:
    """Hand-made p and q over five tokens: whatever the draft proposes, the first emitted token
    is distributed as p[0]; the second (when the first was accepted) as p[1]."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6], [0.2, 0.2, 0.2, 0.2, 0.2]])
    qt = None if q is None else torch.tensor([q, [0.0, 0.0, 0.5, 0.5, 0.0]])
    gen = torch.Generator().manual_seed(1)
    first, second = [0] * 5, [0] * 5
    num = 6000
    for _ in range(num):
        if qt is None:
            proposals = [1, 4]  # deterministic (n-gram): q is a point mass
        else:
            proposals = [int(torch.multinomial(qt[i], 1, generator=gen)) for i in range(2)]
        out = accept_sampled(proposals, p, qt, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert first[3] == first[4] == 0  # never a token the target gives probability 0
    assert _chi_square_p(first[:3], [num * x for x in (0.5, 0.3, 0.2)]) > 1e-3
    n2 = sum(second)
    assert n2 > 500
    assert _chi_square_p(second, [n2 * x for x in p[1].tolist()]) > 1e-3


def _target_distribution(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> dict[tuple, float]:
    """Exact probability of every 3-token continuation under the target (dense forward passes)."""
    model = engine.runner.model

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model.forward_dense(torch.tensor(ids))[-1:]
        p, order = Sampler.filtered_probs(logits, [params])
        return torch.zeros_like(p).scatter_(1, order, p)[0]

    out = {}
    p0 = probs(prompt_ids)
    for a in torch.nonzero(p0).flatten().tolist():
        p1 = probs(prompt_ids + [a])
        for b in torch.nonzero(p1).flatten().tolist():
            p2 = probs(prompt_ids + [a, b])
            for c in torch.nonzero(p2).flatten().tolist():
                out[(a, b, c)] = float(p0[a] * p1[b] * p2[c])
    return out


# early exit: a draft close enough to the target that proposals are accepted about half the time
# (the tiny random draft model's top 3 rarely meet its target's), so both branches of the rule count
@pytest.mark.parametrize("source", ["early_exit", "ngram"])
def test_sampled_speculative_outputs_follow_the_target_distribution(source: str) -> None:
    """Token 0 comes from prefill, tokens 1 and 2 from a speculative step of one proposal (accepted
    or replaced; token 2 is its bonus token, or a plain step's): the triple is distributed as the
    target's."""
    params = dict(max_tokens=3, temperature=1.5, top_k=3, ignore_eos=True)
    cfg = config(source, num_device_blocks=2048, max_num_seqs=256, speculative_budget=4096,
                 num_speculative_tokens=1, speculative_ngram_min=1)
    engine = Engine(cfg)
    obs = RecordingObserver()
    engine.add_observer(obs)
    # n-gram: every byte occurs in the prompt, so the lookup always proposes; the draft model keeps
    # a short prompt (its own cache has no prefix sharing: 256 long prompts would not fit)
    prompt = [256, *range(256), *b"abab"] if source == "ngram" else [256, *b"abab"]
    num = 1500
    outs = engine.generate([prompt] * num, [SamplingParams(seed=i, **params) for i in range(num)])
    steps = obs.of_type(SpeculativeStep)
    assert len(steps) > num / 2  # most token-1s came out of a speculative step
    counts: dict[tuple, int] = {}
    for c in outs:
        counts[c.token_ids] = counts.get(c.token_ids, 0) + 1
    exact = _target_distribution(engine, prompt, SamplingParams(**params))
    assert set(counts) <= set(exact)  # nothing the target would never emit
    keys = sorted(exact)
    assert _chi_square_p([counts.get(k, 0) for k in keys], [num * exact[k] for k in keys]) > 1e-3
    assert math.isclose(sum(exact.values()), 1.0, abs_tol=1e-5)


def test_seeded_sampled_speculation_is_reproducible() -> None:
    sp = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    first = run(config("model"), PROMPTS[:4], sp)[0]
    assert run(config("model"), PROMPTS[:4], sp)[0] == first


# ---------------------------------------------------------------------- mixed batches and the policy


@pytest.mark.parametrize("num_decodes, k", [(0, 0), (1, 4), (2, 4), (3, 4), (4, 4), (5, 3), (8, 2), (9, 1),
                                            (16, 1), (17, 0), (64, 0)])
def test_policy_shrinks_k_as_the_batch_grows(num_decodes: int, k: int) -> None:
    assert SpeculationPolicy(num_speculative_tokens=4, budget=16).k_for(num_decodes) == k


def test_budget_zero_turns_speculation_off() -> None:
    assert SpeculationPolicy(4, 0).k_for(1) == 0
    outs, steps = run(config("ngram", speculative_budget=0), PROMPTS, GREEDY)
    assert steps == []


def test_engine_turns_speculation_down_as_its_batch_grows(plain_greedy) -> None:
    """Budget 8, k 4: one or two decodes propose 4 each, four propose 2, five propose 1 (8 // 5),
    more than eight speculate not at all; the outputs are plain greedy's all along."""
    prompts = PROMPTS + [f"{p} again" for p in PROMPTS]  # 10 requests, admitted together, finishing apart
    sp = [SamplingParams(max_tokens=3 * (i + 1), ignore_eos=True) for i in range(10)]
    outs, steps = run(config("early_exit", speculative_budget=8), prompts, sp)
    assert outs[:5] == [o[:3 * (i + 1)] for i, o in enumerate(plain_greedy)]
    by_step: dict[int, list[SpeculativeStep]] = {}
    for s in steps:
        by_step.setdefault(s.step, []).append(s)
    assert by_step
    seen_k = set()
    for events in by_step.values():
        num_decodes = events[0].batch_size  # all decodes here (prompts are admitted in one step)
        k = SpeculationPolicy(4, 8).k_for(num_decodes)
        assert k > 0  # no speculative step with more than 8 decodes
        assert all(e.num_proposed <= k for e in events)
        seen_k.add(k)
    assert {1, 4} <= seen_k  # shrunk while ten ran, full once few were left


def test_a_batch_mixes_speculative_and_plain_requests(plain_greedy) -> None:
    """Requests with one token left never speculate (nothing to propose), n-gram misses decode
    plainly, prefill chunks share the verify pass: steps where only some sequences speculated."""
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (32, 2, 32, 32, 32)]
    outs, steps = run(config("ngram"), PROMPTS, sp)
    assert outs == [o[:n.max_tokens] for o, n in zip(plain_greedy, sp)]
    assert any(s.num_spec_seqs < s.batch_size for s in steps)
    assert all(s.num_spec_seqs >= 1 for s in steps)


# ---------------------------------------------------------------------- proposals and acceptance, by hand


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 1, 2], 3, [3, 1, 2]),  # suffix [1, 2] seen at 0: what followed it
    ([1, 2, 3, 4, 1, 2], 2, [3, 4]),
    ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, [7, 1]),  # the latest earlier occurrence wins
    ([1, 2, 3], 4, []),  # nothing recurs
    ([7, 7], 3, [7]),  # the unigram
    ([4, 5, 6, 4, 5, 6], 8, [4, 5, 6]),  # the continuation runs up to the context's end
])
def test_ngram_proposals(tokens, k, expected) -> None:
    assert ngram_proposals(tokens, k, min_n=1) == expected


@pytest.mark.parametrize("tokens, min_n, expected", [
    ([1, 2, 3, 9, 3], 1, [9, 3]),  # only the unigram [3] recurs
    ([1, 2, 3, 9, 3], 2, []),  # too weak a cue at minimum 2
    ([1, 2, 3, 9, 2, 3], 2, [9, 2]),  # the bigram [2, 3] recurs
    ([1, 2, 3, 9, 2, 3], 3, []),
])
def test_ngram_minimum_suffix(tokens, min_n, expected) -> None:
    assert ngram_proposals(tokens, 2, min_n=min_n) == expected


@pytest.mark.parametrize("proposals, argmaxes, emitted", [
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all accepted, plus the bonus token
    ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # first disagreement: the target's token, then stop
    ([5], [1, 2], [1]),
])
def test_greedy_acceptance(proposals, argmaxes, emitted) -> None:
    logits = torch.zeros(len(argmaxes), 10)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    assert accept_greedy(proposals, logits) == emitted


def test_bad_speculative_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="early exit needs"):
        Engine(config("early_exit", speculative_exit_layer=2))  # tiny has 2 layers
    with pytest.raises(ValueError, match="early exit needs"):  # checked before any model is built, too
        check_speculative_options(config("early_exit", speculative_exit_layer=2))
    with pytest.raises(ValueError, match="no config.json"):
        check_speculative_options(config("model", speculative_draft_model="/no/such/draft"))
    check_speculative_options(config("model", speculative_draft_model="trained-draft"))  # bundled: fine
