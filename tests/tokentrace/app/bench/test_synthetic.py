"""Synthetic length distributions and shared system prompts."""

from __future__ import annotations

import numpy as np
import pytest

from tokentrace.app.bench.synthetic import LengthDist, SyntheticSpec, synthetic_requests


@pytest.mark.parametrize("spec, expected", [
    ("128", LengthDist("fixed", 128)),
    ("fixed:64", LengthDist("fixed", 64)),
    ("uniform:32-256", LengthDist("uniform", 32, 256)),
    ("lognormal:median=200,sigma=0.5,max=4096", LengthDist("lognormal", 200, 0.5, 4096)),
    ("pareto:min=50,alpha=1.5", LengthDist("pareto", 50, 1.5)),
])
def test_parse(spec, expected):
    assert LengthDist.parse(spec) == expected


@pytest.mark.parametrize("spec", ["normal:1", "uniform:300-20", "lognormal:sigma=1", "pareto:min=5,beta=2",
                                  "fixed:abc", "lognormal:median=100,sigma=-1"])
def test_bad_specs_raise_a_value_error_with_examples(spec):
    with pytest.raises(ValueError):
        LengthDist.parse(spec)


def test_distributions_have_their_shapes():
    rng = np.random.default_rng(0)
    assert set(LengthDist("fixed", 7).sample(100, rng)) == {7}
    u = LengthDist("uniform", 10, 20).sample(5000, rng)
    assert u.min() == 10 and u.max() == 20
    ln = LengthDist("lognormal", 200, 1.0).sample(20_000, rng)
    assert np.median(ln) == pytest.approx(200, rel=0.05)
    assert ln.mean() > 1.4 * np.median(ln)  # right-skewed: mean = median * exp(sigma^2 / 2)
    p = LengthDist("pareto", 50, 1.5).sample(20_000, rng)
    assert p.min() >= 50
    assert np.percentile(p, 99.9) > 20 * np.median(p)  # heavy tail


def test_max_clamps_and_every_length_is_positive():
    rng = np.random.default_rng(1)
    v = LengthDist("pareto", 1, 0.5, max=300).sample(5000, rng)
    assert v.max() == 300 and v.min() >= 1
    assert "clamped at 300" in LengthDist("pareto", 1, 0.5, max=300).describe()


def test_shared_system_prompts_share_and_count():
    spec = SyntheticSpec(LengthDist("fixed", 20), LengthDist("fixed", 5), num_system_prompts=3,
                         system_prompt_share=0.6, system_prompt_tokens=50)
    reqs = synthetic_requests(spec, 2000, seed=4)
    systems = [r.system for r in reqs]
    with_system = [s for s in systems if s]
    assert len(set(with_system)) == 3
    assert all(len(s) == 50 for s in with_system)
    assert len(with_system) / len(reqs) == pytest.approx(0.6, abs=0.04)
    assert all(len(r.prompt) == 20 and r.max_tokens == 5 for r in reqs)
    assert reqs[0].num_prompt_tokens == len(reqs[0].system) + 20
    assert len({r.prompt for r in reqs}) == len(reqs)  # the user parts differ


def test_same_seed_same_requests():
    spec = SyntheticSpec(LengthDist("uniform", 5, 50), LengthDist("uniform", 1, 9))
    assert synthetic_requests(spec, 20, seed=9) == synthetic_requests(spec, 20, seed=9)
    assert synthetic_requests(spec, 20, seed=9) != synthetic_requests(spec, 20, seed=10)


def test_share_without_prompts_is_rejected():
    with pytest.raises(ValueError, match="num_system_prompts"):
        SyntheticSpec(system_prompt_share=0.5)
