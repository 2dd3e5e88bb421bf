"""Multi-turn sessions for the synthetic store (:mod:`synthetic_store`, ``write_run(sessions=True)``).

A share of the requests become turns of sessions of 2 to 8 turns, one tenant and SLO class per session.
Turn k's prompt is turn k - 1's prompt, its answer and new tokens (the request's own prompt draw), so the
prefix the previous turn computed is *carried*: floor((prompt + output - 1) / 16) blocks of 16 tokens (the
last sampled token is never fed back), as the reference engine's ``carry`` event reports it. The engine's
retention policy, per SLO class:

* ``interactive`` sessions (a person reading; think time lognormal, median 3 s): each finished turn's blocks
  are pinned on the device (``retain`` ``[finish, release)``), released by the next turn's admission or a
  10 s TTL. Within the TTL every carried token is reused from the device tier; after it the blocks are
  ordinary cached blocks that LRU eviction takes (kept with probability exp(-(think - TTL) / 20 s), else a
  random leading part of them survives);
* ``batch`` sessions (agent loops; tool calls of median 0.5 s): each finished turn's blocks are dropped at
  the turn's end (``drop``), so the next turn computes its carried prefix again (all lost).

The next turn's admission reports the carry (``carry``, same engine step as the request's ``hit`` events);
its cached tokens are the reused ones. A turn arrives after the previous one finished and the think time
passed (:func:`session_arrivals`). Deterministic for a generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokentrace.schema import CacheEventKind

__all__ = ["SessionPlan", "plan_sessions", "session_arrivals", "session_cache_events", "BLOCK_TOKENS", "TTL_NS"]

BLOCK_TOKENS = 16  # tokens per KV block, as the synthetic cache events count them
TTL_NS = 10 * 10**9  # how long an interactive turn's blocks stay pinned
_S = 10**9
_LOSS_SCALE_S = 20.0  # past the TTL, a turn's blocks survive LRU eviction with probability exp(-excess / this)
_INTERACTIVE = 0  # index of the interactive SLO class in synthetic_store.SLO_CLASSES


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """The session turns of a synthetic run, one entry per turn, session-major and in turn order."""

    members: np.ndarray  # int64 request index of each turn
    session: np.ndarray  # int64 session number
    turn: np.ndarray  # int32 0-based turn
    think_ns: np.ndarray  # int64 think time before the turn (0 for turn 0), before the previous turn's margin
    carried_blocks: np.ndarray  # int64 blocks carried from the previous turn (0 for turn 0)
    reused_blocks: np.ndarray  # int64 carried blocks the device still held at admission
    computed_blocks: np.ndarray  # int64 full blocks the turn leaves computed at its end
    kept: np.ndarray  # bool: the turn's blocks are pinned at its end (else dropped)
    next_turn: np.ndarray  # int64 request index of the session's next turn, -1 for the last turn

    @property
    def later(self) -> np.ndarray:
        """Turns after the first (those with a carry)."""
        return self.turn > 0


def plan_sessions(rng: np.random.Generator, *, share: float, n_out: np.ndarray, prompt: np.ndarray,
                  cached: np.ndarray, tenant_idx: np.ndarray, slo_idx: np.ndarray) -> SessionPlan:
    """Pick ``share`` of the requests as session turns and make them so: ``prompt``, ``cached``, ``tenant_idx``
    and ``slo_idx`` are rewritten in place for the turns (see the module doc)."""
    n = n_out.size
    sizes = 2 + np.minimum(rng.poisson(2.0, size=max(1, int(share * n) // 2)), 6)  # turns per session, 2..8
    sizes = sizes[np.cumsum(sizes) <= int(share * n)]
    m = int(sizes.sum())
    session = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
    chosen = rng.choice(n, size=m, replace=False).astype(np.int64)
    order = np.lexsort((chosen, session))  # within a session, the earliest drawn request is turn 0
    members = chosen[order]
    starts = np.cumsum(sizes) - sizes  # position of each session's turn 0
    turn = (np.arange(m) - np.repeat(starts, sizes)).astype(np.int32)
    first = members[starts]
    tenant_idx[members] = np.repeat(tenant_idx[first], sizes)
    slo_idx[members] = np.repeat(slo_idx[first], sizes)

    # turn k's prompt: the session's new tokens so far plus every earlier answer
    new_tokens = prompt[members]
    answers = n_out[members]
    grown = _segment_cumsum(new_tokens, sizes) + _segment_cumsum(answers, sizes) - answers
    prompt[members] = grown
    later = turn > 0
    computed = (grown + answers - 1) // BLOCK_TOKENS
    carried = np.zeros(m, dtype=np.int64)
    carried[later] = np.minimum(computed[np.flatnonzero(later) - 1], (grown[later] - 1) // BLOCK_TOKENS)

    interactive = slo_idx[members] == _INTERACTIVE
    think_s = np.where(interactive, np.exp(rng.normal(np.log(3.0), 1.0, size=m)),
                       np.exp(rng.normal(np.log(0.5), 0.8, size=m)))
    think_ns = np.where(later, (think_s * _S).astype(np.int64), 0)
    excess_s = np.maximum(think_ns - TTL_NS, 0) / _S
    survives = rng.random(m) < np.exp(-excess_s / _LOSS_SCALE_S)
    part = (carried * rng.random(m)).astype(np.int64)
    reused = np.where(interactive, np.where(survives, carried, part), 0)
    cached[members] = np.where(later, reused * BLOCK_TOKENS, cached[members])
    next_turn = np.where(np.roll(later, -1) & (np.arange(m) < m - 1), np.roll(members, -1), -1)
    return SessionPlan(members=members, session=session, turn=turn, think_ns=think_ns, carried_blocks=carried,
                       reused_blocks=reused, computed_blocks=computed.astype(np.int64), kept=interactive,
                       next_turn=next_turn.astype(np.int64))


def session_arrivals(plan: SessionPlan, arrival: np.ndarray, max_duration_ns: np.ndarray) -> None:
    """Rewrite ``arrival`` (ns, in place) of every later turn: the previous turn's arrival, an upper bound of its
    duration (``max_duration_ns`` per request) and the think time, so a turn never arrives before the one
    before it finished."""
    m = plan.members.size
    if not m:
        return
    starts = np.flatnonzero(~plan.later)
    sizes = np.diff(np.append(starts, m))
    gap = np.zeros(m, dtype=np.int64)
    gap[1:] = max_duration_ns[plan.members[:-1]] + plan.think_ns[1:]
    gap[starts] = 0
    arrival[plan.members] = np.repeat(arrival[plan.members[starts]], sizes) + _segment_cumsum(gap, sizes)


def _segment_cumsum(x: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Cumulative sum of ``x`` restarting at each of the consecutive segments of ``sizes``."""
    cum = np.cumsum(x)
    ends = np.cumsum(sizes)
    before = np.concatenate([[0], cum[ends[:-1] - 1]]) if sizes.size else np.zeros(0, dtype=cum.dtype)
    return cum - np.repeat(before, sizes)


def session_cache_events(plan: SessionPlan, *, lookup_ns: np.ndarray, finish_ns: np.ndarray,
                         admission_step: np.ndarray, t0: int, step_ns: int) -> dict[str, np.ndarray]:
    """The retention policy's cache events: ``carry`` at each later turn's admission (at its lookup time and
    engine step), ``retain`` of each interactive turn's blocks from its finish to the next turn's admission or
    the TTL, ``drop`` of each batch turn's blocks at its finish. Columns: request (index), kind, blocks,
    start, end (ns), step (engine steps: ``(t - t0) // step_ns``, as the synthetic steps are)."""
    later = plan.later
    carry_req = plan.members[later]
    kept = plan.kept & (plan.computed_blocks > 0)
    retain_req = plan.members[kept]
    nxt = plan.next_turn[kept]
    release = finish_ns[retain_req] + TTL_NS
    has_next = nxt >= 0
    release[has_next] = np.minimum(release[has_next], lookup_ns[nxt[has_next]])
    dropped = ~plan.kept & (plan.computed_blocks > 0)
    drop_req = plan.members[dropped]
    drop_at = finish_ns[drop_req]
    kinds = np.concatenate([np.full(carry_req.size, int(CacheEventKind.CARRY)),
                            np.full(retain_req.size, int(CacheEventKind.RETAIN)),
                            np.full(drop_req.size, int(CacheEventKind.DROP))])
    start = np.concatenate([lookup_ns[carry_req], finish_ns[retain_req], drop_at])
    end = np.concatenate([lookup_ns[carry_req], release, drop_at])
    step = np.concatenate([admission_step[carry_req], (release - t0) // step_ns, (drop_at - t0) // step_ns])
    return {"request": np.concatenate([carry_req, retain_req, drop_req]), "kind": kinds,
            "blocks": np.concatenate([plan.carried_blocks[later], plan.computed_blocks[kept],
                                      plan.computed_blocks[dropped]]),
            "start": start, "end": end, "step": step.astype(np.int64)}
