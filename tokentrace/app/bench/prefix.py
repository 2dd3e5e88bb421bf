"""The best prefix-cache hits a server can get on a replayed Mooncake trace.

Computed from the trace alone (hash ids and prompt lengths), in the server's terms:
tokens served from its prefix cache, counted in whole KV blocks of ``server_block_size``
tokens, as a vLLM-style cache counts them (only full blocks are cached; at least one
prompt token is always computed).

Prompts are built by :func:`tokentrace.app.bench.workloads.build_prompt`: block ``k`` of a prompt
is ``block_tokens`` characters that depend on ``hash_ids[k]`` only (a shorter last block is
a prefix of the full one), so two prompts agree on exactly the characters covered by
their common hash-id prefix. A server tokenizer that adds ``bos_tokens`` tokens in front
shifts every block by that much; with one byte-level token per character the hits are
exact for a cache that never evicts, served one request after another.
"""

from __future__ import annotations

from typing import Sequence

from tokentrace.app.bench.workloads import TraceRequest, best_prefix_hit_rate

__all__ = ["best_prefix_hit_tokens", "prefix_bound", "PREFIX_BOUND_KEY", "ASSUMED_BOS_TOKENS"]

PREFIX_BOUND_KEY = "prefix_bound"
"""Key of :func:`prefix_bound` in the plan's config (the run manifest's ``config.bench``); the cache
analyzer (``analyzers.cache.PREFIX_BOUND_KEY``) reads it there."""
ASSUMED_BOS_TOKENS = 1  # the reference server's byte tokenizer adds one bos token per prompt


def best_prefix_hit_tokens(requests: Sequence[TraceRequest], *, block_tokens: int, server_block_size: int,
                           bos_tokens: int = 0) -> list[int]:
    """Per request, the prompt tokens an unbounded prefix cache serves (in send order).

    Request ``b`` can reuse the full server blocks it shares with an earlier request
    ``a``: their common characters (common hash-id blocks, cut at either prompt's end)
    plus the ``bos_tokens``; only blocks ``a``'s prompt filled completely were cached,
    and ``b`` computes at least its last prompt token. ``ValueError`` for bad sizes.
    """
    if block_tokens < 1 or server_block_size < 1 or bos_tokens < 0:
        raise ValueError("block_tokens and server_block_size must be >= 1, bos_tokens >= 0")
    bs = server_block_size
    out: list[int] = []
    # (hash ids, prompt chars) of earlier requests, indexed by their first hash id
    earlier: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    for req in requests:
        n_chars = req.num_prompt_tokens
        limit_blocks = (n_chars + bos_tokens - 1) // bs  # at least one token left to compute
        best = 0
        for ids, a_chars in earlier.get(req.hash_ids[0], []) if req.hash_ids else []:
            common = _common_prefix(ids, req.hash_ids)
            shared_chars = min(common * block_tokens, a_chars, n_chars)
            blocks = min((shared_chars + bos_tokens) // bs, (a_chars + bos_tokens) // bs, limit_blocks)
            best = max(best, blocks)
        out.append(best * bs)
        if req.hash_ids:
            earlier.setdefault(req.hash_ids[0], []).append((req.hash_ids, n_chars))
    return out


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_bound(requests: Sequence[TraceRequest], *, block_tokens: int,
                 server_block_size: int | None) -> dict[str, float | int]:
    """The best achievable prefix hit rates of a replayed trace, for the run manifest.

    ``best_block_hit_rate``: share of the trace's prompt blocks whose hash-id prefix appeared
    before (tokenizer-free). With ``server_block_size``, ``best_token_hit_rate``: the tokens an
    unbounded cache serves (:func:`best_prefix_hit_tokens`, whole server blocks) over all prompt
    tokens, for a byte-level tokenizer adding :data:`ASSUMED_BOS_TOKENS` (the reference server's).
    """
    out: dict[str, float | int] = {"best_block_hit_rate": best_prefix_hit_rate(requests),
                                   "trace_block_tokens": block_tokens}
    if server_block_size:
        best = best_prefix_hit_tokens(requests, block_tokens=block_tokens, server_block_size=server_block_size,
                                      bos_tokens=ASSUMED_BOS_TOKENS)
        prompt = sum(r.num_prompt_tokens + ASSUMED_BOS_TOKENS for r in requests)
        out.update(best_token_hit_rate=sum(best) / prompt if prompt else 0.0, server_block_size=server_block_size,
                   assumed_bos_tokens=ASSUMED_BOS_TOKENS)
    return out
