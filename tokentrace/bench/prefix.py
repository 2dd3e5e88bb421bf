"""The best prefix-cache hits a server can get on a replayed Mooncake trace.

Computed from the trace alone (hash ids and prompt lengths), in the server's terms:
tokens served from its prefix cache, counted in whole KV blocks of ``server_block_size``
tokens, as a vLLM-style cache counts them (only full blocks are cached; at least one
prompt token is always computed).

Prompts are built by :func:`tokentrace.bench.workloads.build_prompt`: block ``k`` of a prompt
is ``block_tokens`` characters that depend on ``hash_ids[k]`` only (a shorter last block is
a prefix of the full one), so two prompts agree on exactly the characters covered by
their common hash-id prefix. A server tokenizer that adds ``bos_tokens`` tokens in front
shifts every block by that much; with one byte-level token per character the hits are
exact for a cache that never evicts, served one request after another.
"""

from __future__ import annotations

from typing import Sequence

from tokentrace.bench.workloads import TraceRequest

__all__ = ["best_prefix_hit_tokens"]


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
