"""Routing decisions, table-driven over hand-made candidates."""

from __future__ import annotations

import pytest

from reference_server.serving.router import Candidate, Router

BS = 4
SHARED = list(range(1, 17))  # four full blocks of block size 4
OTHER = list(range(100, 116))


def c(name: str, inflight: int = 0, waiting: int = 0, used: int = 0, total: int = 10) -> Candidate:
    return Candidate(name, inflight, waiting, used, total)


@pytest.mark.parametrize("policy, candidates, expected", [
    ("round_robin", [c("a"), c("b"), c("c")], ["a", "b", "c", "a"]),
    ("round_robin", [c("a", inflight=9), c("b")], ["a", "b", "a", "b"]),  # ignores load
    ("load_aware", [c("a", inflight=2), c("b", inflight=1), c("c", inflight=3)], ["b", "b"]),
    ("load_aware", [c("a", waiting=4), c("b", inflight=1)], ["b"]),  # 4 waiting weigh 2
    ("load_aware", [c("a", used=9), c("b", used=1)], ["b"]),  # KV occupancy breaks the tie
    ("load_aware", [c("b"), c("a")], ["a"]),  # equal load: by name, deterministic
])
def test_choice_sequence(policy, candidates, expected):
    router = Router(policy, block_size=BS)
    assert [router.choose(candidates, OTHER)[0] for _ in expected] == expected


@pytest.mark.parametrize("holder_inflight, other_inflight, expected", [
    (0, 0, "holder"),  # prefix wins
    (3, 0, "holder"),  # still within the balance slack of 4
    (6, 0, "other"),  # too loaded: load wins
])
def test_prefix_aware_sends_shared_prefix_where_it_is_cached(holder_inflight, other_inflight, expected):
    router = Router("prefix_aware", block_size=BS)
    router.record("holder", SHARED + [77, 78])
    cands = [c("other", other_inflight), c("holder", holder_inflight)]
    name, scores = router.choose(cands, SHARED + [1, 2, 3])
    assert name == expected
    assert dict(scores)["holder"] == -4.0 and dict(scores)["other"] == 0.0


def test_prefix_aware_prefers_the_longest_match_and_falls_back_to_load():
    router = Router("prefix", block_size=BS)
    router.record("two", SHARED[:8])
    router.record("four", SHARED)
    assert router.choose([c("two"), c("four")], SHARED)[0] == "four"
    assert router.choose([c("two", inflight=1), c("four", inflight=2)], OTHER)[0] == "two"  # no match: load
    assert router.choose([c("two"), c("four")], SHARED, use_prefix=False)[0] == "four"  # load only: equal, by name
    router.forget("four")
    assert router.choose([c("two"), c("four")], SHARED)[0] == "two"


def test_prefix_sets_are_bounded_lru():
    router = Router("prefix_aware", block_size=BS, max_tracked_blocks=4)
    router.record("a", SHARED)
    router.record("a", OTHER)  # evicts SHARED's four blocks
    assert router.choose([c("b"), c("a", inflight=1)], SHARED)[0] == "b"
    assert router.choose([c("b"), c("a", inflight=1)], OTHER)[0] == "a"


def test_bad_policy_and_no_candidates():
    with pytest.raises(ValueError, match="unknown router policy"):
        Router("random")
    with pytest.raises(ValueError, match="no candidates"):
        Router("load").choose([], SHARED)
