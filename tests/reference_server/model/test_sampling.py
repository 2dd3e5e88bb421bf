from __future__ import annotations

import pytest
import torch

from reference_server.model.sampling import Sampler, SamplingParams, make_generator, seed_for_token

torch.set_num_threads(1)
VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_draws_no_randomness() -> None:
    logits = _logits(4)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    got = Sampler().sample(logits, [SamplingParams()] * 4, [None] * 4)
    assert got == logits.argmax(-1).tolist()
    assert torch.equal(torch.get_rng_state(), state)


def test_seeded_rows_reproducible_regardless_of_batch() -> None:
    logits = _logits(3, seed=1)
    params = SamplingParams(temperature=1.0, seed=7)
    sampler = Sampler()
    runs = []
    for _ in range(2):
        gen = make_generator(7, "cpu")
        runs.append([sampler.sample(logits[1:2], [params], [gen])[0] for _ in range(20)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # it is really random, not argmax
    # the same row inside a bigger batch with other random rows gives the same stream
    gen = make_generator(7, "cpu")
    others = [SamplingParams(temperature=0.7), params, SamplingParams(top_k=3, temperature=2.0)]
    batched = [sampler.sample(logits, others, [None, gen, None])[1] for _ in range(20)]
    assert batched == runs[0]


def test_top_k_restricts_support() -> None:
    logits = _logits(1, seed=2)
    top3 = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=3)]
    gen = make_generator(0, "cpu")
    seen = {Sampler().sample(logits, params, [gen])[0] for _ in range(200)}
    assert seen <= top3 and len(seen) == 3


def test_top_p_restricts_support() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    params = [SamplingParams(temperature=1.0, top_p=0.8)]
    filtered, order = Sampler.filtered_probs(logits, params)
    # 0.5 + 0.3 reaches 0.8: only the first two stay, renormalised
    torch.testing.assert_close(filtered[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert order[0].tolist() == [0, 1, 2, 3]
    gen = make_generator(1, "cpu")
    seen = {Sampler().sample(logits, params, [gen])[0] for _ in range(200)}
    assert seen == {0, 1}


def test_top_p_one_keeps_full_support() -> None:
    logits = torch.zeros(1, VOCAB)
    filtered, _ = Sampler.filtered_probs(logits, [SamplingParams(temperature=1.0)])
    assert (filtered > 0).all()


def test_sampling_follows_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0]])  # p(1) = e / (1 + e) ~ 0.731
    gen = make_generator(3, "cpu")
    draws = [Sampler().sample(logits, [SamplingParams(temperature=1.0)], [gen])[0]
             for _ in range(2000)]
    assert abs(sum(draws) / len(draws) - 0.731) < 0.04


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError, match="2 logits rows"):
        Sampler().sample(_logits(2), [SamplingParams()], [None])


def test_make_generator_none_seed() -> None:
    assert make_generator(None, "cpu") is None
    assert isinstance(make_generator(5, torch.device("cpu")), torch.Generator)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"seed": -(1 << 63) - 1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_from_dict() -> None:
    params = SamplingParams.from_dict(
        {"max_tokens": 5, "temperature": 0.5, "stop": "\n", "seed": None})
    assert params == SamplingParams(max_tokens=5, temperature=0.5, stop=("\n",))
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    with pytest.raises(ValueError, match="frequency_penalty, logprobs"):
        SamplingParams.from_dict({"logprobs": 1, "frequency_penalty": 0.0})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2})
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams.from_dict(["max_tokens"])  # type: ignore[arg-type]


def test_seed_for_token_is_a_pure_64_bit_mix_of_seed_and_index() -> None:
    seeds = {seed_for_token(seed, index) for seed in range(-2, 40) for index in range(40)}
    assert len(seeds) == 42 * 40  # no two (seed, index) pairs share a stream
    assert all(0 <= s < 1 << 64 for s in seeds)
    assert seed_for_token(1234, 5) == seed_for_token(1234, 5)
    assert seed_for_token(2**63 + 5, 0) != seed_for_token(5, 0)
