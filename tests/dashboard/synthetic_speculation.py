"""Speculative decoding for the synthetic store (:mod:`synthetic_store`, ``write_run(speculative=True)``).

The engine speculates in some periods and not in others (one-second windows, each on with probability
one half, as an engine that turns speculation off under load does). In a window that is on, each request
allowed to speculate (70% of them; 80% of those draft with a small model, k = 4 proposals, the others with
n-gram lookup, k = 3) proposes k draft tokens per engine step and accepts a geometric prefix of them
(p = 0.35 for the model, 0.5 for n-grams), emitting accepted + 1 tokens, fewer at the request's end; the
other requests decode one token beside it (mixed batches). Times (ms, x ``slowdown`` like the compute stages):

* draft phase: 0.4 x k;
* verify pass: the plain step's decode.compute time + k x (0.3 + 0.04 x the decode batch around the token),
  cheap per token in small batches, dearer than plain decoding in large ones;
* each token after the step's first is sent 0.05 ms after the one before it.

Stage spans tile every token's interval as ``speculative_store`` describes: the first token of a speculative
step carries decode.queue, decode.draft, decode.verify and stream.send; the tokens after it only their own
stream.send; a plain token decode.queue, decode.compute and stream.send. Vectorised with numpy: one pass per
step of the longest request. Deterministic for a generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokentrace.schema import DraftSource

__all__ = ["SpecPlan", "plan_speculation", "FOLLOWER_SEND_NS"]

FOLLOWER_SEND_NS = 50_000  # a speculative step's later tokens: each sent this long after the one before
_MS = 1_000_000
_WINDOW_NS = 1_000 * _MS  # speculation is on or off per window of this length
_ALLOWED = 0.7  # share of requests allowed to speculate
_MODEL_SHARE = 0.8  # of those, the share drafting with a model (the others: n-gram lookup)
_K = {DraftSource.MODEL: 4, DraftSource.NGRAM: 3}  # proposals per step
_P_STOP = {DraftSource.MODEL: 0.35, DraftSource.NGRAM: 0.5}  # geometric: accepted = geometric(p) - 1, at most k


@dataclass(frozen=True, slots=True)
class SpecPlan:
    """Per token row (request-major, as ``synthetic_store`` lays tokens out): how the engine produced it."""

    head: np.ndarray  # bool: the token opens an engine step of its request (token 0, plain tokens, spec carriers)
    spec: np.ndarray  # bool: the token carries a speculative step
    k: np.ndarray  # int64 proposals of the step it carries (0 elsewhere)
    accepted: np.ndarray  # int64 accepted proposals of the step it carries
    source: np.ndarray  # int8 DraftSource of the step it carries
    draft_ns: np.ndarray  # int64 draft phase of the step it carries
    verify_ns: np.ndarray  # int64 verify pass of the step it carries

    def intervals(self, later: np.ndarray, dq: np.ndarray, dc: np.ndarray, ds: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
        """Each token's interval and its stream.send part (ns; 0 for token 0), from the plain draws ``dq``,
        ``dc``, ``ds`` (per token row)."""
        follower = later & ~self.head
        send = np.where(follower, FOLLOWER_SEND_NS, ds)
        middle = np.where(self.spec, self.draft_ns + self.verify_ns, dc)
        itl = np.where(follower, FOLLOWER_SEND_NS, dq + middle + ds)
        return np.where(later, itl, 0), np.where(later, send, 0)


def plan_speculation(rng: np.random.Generator, *, n_out: np.ndarray, later: np.ndarray, plain_start_ns: np.ndarray,
                     dc: np.ndarray, plain_batch: np.ndarray, slowdown: float) -> SpecPlan:
    """Which tokens speculate (see the module doc). ``plain_start_ns``: each token's start on the plain timeline
    (no speculation), which decides its window; ``dc``: its plain decode.compute time; ``plain_batch``: the
    decode tokens of its plain step."""
    n, rows = n_out.size, later.size
    allowed = rng.random(n) < _ALLOWED
    source = np.where(rng.random(n) < _MODEL_SHARE, int(DraftSource.MODEL), int(DraftSource.NGRAM))
    k_req = np.where(source == int(DraftSource.MODEL), _K[DraftSource.MODEL], _K[DraftSource.NGRAM])
    p_req = np.where(source == int(DraftSource.MODEL), _P_STOP[DraftSource.MODEL], _P_STOP[DraftSource.NGRAM])
    t0 = int(plain_start_ns.min()) if rows else 0
    on_window = rng.random(int((plain_start_ns.max() - t0) // _WINDOW_NS) + 1 if rows else 1) < 0.5
    head, spec = ~later, np.zeros(rows, dtype=bool)
    accepted = np.zeros(rows, dtype=np.int64)
    row_start = np.cumsum(n_out) - n_out
    pos = np.ones(n, dtype=np.int64)  # next token index of each request
    active = np.flatnonzero(n_out > 1)
    while active.size:  # one engine step of every unfinished request per pass
        row = row_start[active] + pos[active]
        on = allowed[active] & on_window[(plain_start_ns[row] - t0) // _WINDOW_NS]
        a = np.minimum(rng.geometric(p_req[active]) - 1, k_req[active])
        head[row] = True
        spec[row] = on
        accepted[row] = np.where(on, a, 0)
        pos[active] += np.where(on, np.minimum(a + 1, n_out[active] - pos[active]), 1)
        active = active[pos[active] < n_out[active]]
    req = np.repeat(np.arange(n), n_out)
    k = np.where(spec, k_req[req], 0)
    draft = (k * 0.4 * _MS * slowdown).astype(np.int64)
    verify = (dc + k * (0.3 + 0.04 * plain_batch) * _MS * slowdown).astype(np.int64)
    return SpecPlan(head=head, spec=spec, k=k.astype(np.int64), accepted=accepted,
                    source=np.where(spec, source[req], 0).astype(np.int8), draft_ns=np.where(spec, draft, 0),
                    verify_ns=np.where(spec, verify, 0))
