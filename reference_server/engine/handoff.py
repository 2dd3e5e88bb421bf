"""Moving a request between engines: prefill/decode handoff and resume after a failure.

Three operations on an :class:`~reference_server.engine.engine.Engine`, all on its
engine thread (between steps), made by :class:`~reference_server.engine.engine_loop.EngineLoop`
for the serving layer's workers:

* :func:`export_prefilled`: a request whose prefill just produced its first token gives
  up its place: the device blocks holding its computed KV are read out as bytes
  (``KVStorage.export_blocks`` layout) and the request leaves the engine, its blocks
  released (full blocks stay in the prefix cache, so a later request with the same
  prefix still hits them here).
* :func:`admit_prefilled`: the other side. A request prepared with
  ``Engine.prepare_request`` enters the engine already running: its blocks are
  allocated, the transferred bytes written into them, its output tokens so far appended,
  and decoding continues from the last one, exactly as if it had been prefilled here
  (greedy and seeded output is identical to serving it on one engine).
* :func:`resume`: a request continues after ``output_token_ids`` were already delivered
  elsewhere (its worker died): it is queued with those tokens appended and recomputes
  prompt and tokens as one prefill (like a recompute-preempted request), then samples
  output token ``len(output_token_ids)``.

Detokenizer and stop-string state are replayed over the carried tokens in every case,
so streamed text continues where the other engine left off.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from reference_server.engine.engine import Engine
from reference_server.engine.prefix_cache import PrefixMatch
from reference_server.engine.sequence import Sequence

__all__ = ["HANDOFF_FINISH_REASON", "PrefilledKV", "admit_prefilled", "export_prefilled", "resume"]

HANDOFF_FINISH_REASON = "transferred"
"""``RequestFinished.reason`` reported by the prefill engine when a request leaves it for
a decode engine (it did not stop, was not cut by length and was not aborted)."""


@dataclass(frozen=True, slots=True)
class PrefilledKV:
    """A prefilled request's state as it leaves an engine."""

    request_id: str
    num_computed_tokens: int  # tokens whose KV is in ``data``: prompt + outputs except the last
    output_token_ids: tuple[int, ...]  # outputs so far (the last one has no KV yet)
    num_cached_tokens: int  # prompt tokens this engine served from its prefix cache
    num_blocks: int
    data: bytes  # KVStorage.export_blocks layout (L, 2, num_blocks, block_size, n_kv, hd)


def export_prefilled(engine: Engine, request_id: str) -> PrefilledKV:
    """Read out a running request's computed KV and remove it from ``engine``.

    ``ValueError`` if the request is not running or has no output token yet. Engine
    thread, between steps (before the next ``step`` can reuse its blocks)."""
    seq = engine.scheduler.running.get(request_id)
    if seq is None or seq.num_output_tokens == 0:
        raise ValueError(f"request {request_id!r} is not running with a sampled token")
    table = engine.block_manager.block_table(request_id)
    num_blocks = -(-seq.num_computed_tokens // engine.config.block_size)
    data = engine.runner.storage.export_blocks(table[:num_blocks])
    state = PrefilledKV(request_id, seq.num_computed_tokens, tuple(seq.output_token_ids), seq.num_cached_tokens,
                        num_blocks, data)
    engine.release_transferred(request_id, HANDOFF_FINISH_REASON)
    return state


def admit_prefilled(engine: Engine, seq: Sequence, output_token_ids: Seq[int], data: bytes) -> bool:
    """Start ``seq`` (fresh from ``prepare_request``, prompt tokens only) as a running
    request whose KV for prompt + ``output_token_ids[:-1]`` is ``data``.

    Returns False, changing nothing, when the device tier has no room now (try again
    after a step). ``ValueError`` on a duplicate id, no output token, or a byte count
    that does not match. Engine thread, between steps."""
    if not output_token_ids:
        raise ValueError("admit_prefilled needs at least one output token")
    _check_tokens(engine, output_token_ids)
    bm = engine.block_manager
    num_computed = seq.num_prompt_tokens + len(output_token_ids) - 1
    if engine.scheduler.get(seq.request_id) is not None:
        raise ValueError(f"duplicate request_id {seq.request_id!r}")
    blocks = bm.allocate_new(seq, PrefixMatch((), bm.block_size), num_computed)
    if blocks is None:
        return False
    try:
        engine.runner.storage.import_blocks(blocks.block_ids, data)
        engine.add_prepared(seq)
    except Exception:
        bm.free(seq)
        raise
    engine.replay_outputs(seq, output_token_ids)
    seq.num_computed_tokens = num_computed
    seq.prefill_end = num_computed  # the next chunk is a decode of the last output token
    engine.scheduler.start_running(seq)
    bm.commit(seq)  # key its full blocks: later requests with this prefix share them
    return True


def resume(engine: Engine, seq: Sequence, output_token_ids: Seq[int]) -> None:
    """Queue ``seq`` (fresh from ``prepare_request``) with ``output_token_ids`` already
    produced elsewhere; its next token is output number ``len(output_token_ids)``.
    ``ValueError`` on a duplicate id or when the carried tokens reach ``max_tokens`` or
    the context window. Engine thread."""
    num_out = len(output_token_ids)
    if num_out >= seq.sampling.max_tokens or seq.num_prompt_tokens + num_out >= seq.max_len:
        raise ValueError(f"request {seq.request_id!r} has no output tokens left to generate")
    _check_tokens(engine, output_token_ids)
    engine.add_prepared(seq)
    engine.replay_outputs(seq, output_token_ids)


def _check_tokens(engine: Engine, token_ids: Seq[int]) -> None:
    vocab = engine.model_config.vocab_size
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"output token {token!r} is not an int in [0, {vocab})")
