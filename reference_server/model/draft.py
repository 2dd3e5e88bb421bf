"""Draft models of speculative decoding: who proposes tokens, and where their KV lives.

Two kinds run a model autoregressively, one token per round, for a batch of requests:

* :class:`DraftModel`: a separate (smaller) model with its **own** paged KV cache and its
  own block allocator. Its KV follows each request lazily: a round first computes the
  tokens the draft has not seen (the prompt on a request's first speculative step, after
  that the tokens the target emitted since), so it needs nothing from prefill, prefix
  caching or a KV transfer. After the target's verify pass the engine calls
  :meth:`DraftModel.rollback` so the draft keeps only positions it computed for accepted
  tokens; rejected positions are overwritten later. A request's draft blocks are freed by
  :meth:`DraftModel.release` (the engine releases requests that are no longer running).
* :class:`EarlyExitDraft`: the target's own first ``num_layers`` layers (self-speculative
  early exit). It reads and writes the target's KV cache in those layers, at positions the
  verify pass then rewrites with all layers, so it needs no cache of its own.

Both return, per round, logits ``(num_requests_in_round, vocab)``; the engine picks the
tokens (:mod:`reference_server.engine.speculative`). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from reference_server.model.runner import ModelRunner, SeqChunk

__all__ = ["DraftInput", "DraftModel", "EarlyExitDraft", "PickTokens"]

PickTokens = Callable[[torch.Tensor, Sequence[int], int], list[int]]
"""``pick(logits (n, vocab), request positions in the batch, round) -> n token ids``."""


@dataclass(frozen=True, slots=True)
class DraftInput:
    """One request to draft for: ``key`` names it (with ``owner``, the object whose
    identity says it is the same request), ``token_ids`` its whole context (prompt and
    outputs; the last one has no KV in the target yet), ``block_table`` the target's
    blocks (early exit writes there), ``k`` how many tokens to propose."""

    key: str
    owner: object
    token_ids: Sequence[int]
    block_table: tuple[int, ...]
    k: int


class _DraftState:
    __slots__ = ("owner", "blocks", "num_computed")

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.blocks: list[int] = []
        self.num_computed = 0  # leading context tokens whose KV is in the draft's cache


def _rounds(inputs: Sequence[DraftInput], first: list[SeqChunk], run: Callable[[list[SeqChunk]], torch.Tensor],
            next_chunk: Callable[[int, int, int], SeqChunk], pick: PickTokens) -> list[list[int]]:
    """The autoregressive loop shared by both drafts: round 0 runs ``first`` (one chunk per
    input), each later round one token per input that still wants more."""
    proposals: list[list[int]] = [[] for _ in inputs]
    active = list(range(len(inputs)))
    chunks = first
    for round_no in range(max(i.k for i in inputs)):
        logits = run(chunks)  # (len(active), vocab)
        for pos, token in zip(active, pick(logits, active, round_no)):
            proposals[pos].append(token)
        active = [pos for pos in active if len(proposals[pos]) < inputs[pos].k]
        if not active:
            break
        chunks = [next_chunk(pos, len(proposals[pos]), proposals[pos][-1]) for pos in active]
    return proposals


class DraftModel:
    """A draft model with its own KV cache; see the module docstring. ``runner`` holds its
    weights and its KV blocks, which this class hands out to requests (any block size)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self._free: list[int] = list(range(runner.storage.num_blocks(0) - 1, -1, -1))
        self._states: dict[str, _DraftState] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_computed(self, key: str) -> int:
        """Context tokens of ``key`` whose KV the draft holds (0 for an unknown request)."""
        state = self._states.get(key)
        return 0 if state is None else state.num_computed

    def _state(self, key: str, owner: object) -> _DraftState:
        state = self._states.get(key)
        if state is not None and state.owner is not owner:  # the id was reused by a new request
            self.release(key)
            state = None
        if state is None:
            state = self._states[key] = _DraftState(owner)
        return state

    def reserve(self, key: str, owner: object, num_positions: int) -> bool:
        """Blocks for positions ``[0, num_positions)`` of ``key``; False (nothing changed) if
        the draft's cache has too few free blocks."""
        state = self._state(key, owner)
        needed = -(-num_positions // self.block_size) - len(state.blocks)
        if needed > len(self._free):
            return False
        for _ in range(max(0, needed)):
            state.blocks.append(self._free.pop())
        return True

    def release(self, key: str) -> None:
        """Free every draft block of ``key`` (unknown keys are ignored)."""
        state = self._states.pop(key, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    def release_all_but(self, live: Callable[[str, object], bool]) -> None:
        """Release every request for which ``live(key, owner)`` is False."""
        for key in [k for k, s in self._states.items() if not live(k, s.owner)]:
            self.release(key)

    def rollback(self, key: str, num_valid: int) -> None:
        """Keep only the first ``num_valid`` positions of ``key``'s draft KV as computed."""
        state = self._states.get(key)
        if state is not None:
            state.num_computed = min(state.num_computed, num_valid)

    def propose(self, inputs: Sequence[DraftInput], pick: PickTokens) -> list[list[int]]:
        """``inputs[i].k`` tokens for each input (each must have been :meth:`reserve`\\ d for
        ``len(token_ids) + k - 1`` positions). Round 0 catches each request's draft KV up
        with its context; the draft's computed count then covers every position it wrote."""
        states = [self._states[i.key] for i in inputs]
        first = []
        for inp, state in zip(inputs, states):
            n = len(inp.token_ids)
            start = min(state.num_computed, n - 1)  # at least the last token: its logits propose
            first.append(SeqChunk(tuple(inp.token_ids[start:]), start, tuple(state.blocks)))

        def next_chunk(pos: int, num_proposed: int, last: int) -> SeqChunk:
            # the proposal before ``last`` sits at position len(context) + num_proposed - 1
            return SeqChunk((last,), len(inputs[pos].token_ids) + num_proposed - 1, tuple(states[pos].blocks))

        proposals = _rounds(inputs, first, self.runner.execute, next_chunk, pick)
        for inp, state, props in zip(inputs, states, proposals):
            state.num_computed = len(inp.token_ids) + len(props) - 1  # the last proposal has no KV
        return proposals


class EarlyExitDraft:
    """The target's first ``num_layers`` layers as the draft; see the module docstring."""

    def __init__(self, runner: ModelRunner, num_layers: int) -> None:
        if not 1 <= num_layers < runner.config.num_layers:
            raise ValueError(
                f"early exit needs 1 <= layers < {runner.config.num_layers} (the target's), got {num_layers}")
        self.runner = runner
        self.num_layers = num_layers

    def propose(self, inputs: Sequence[DraftInput], pick: PickTokens) -> list[list[int]]:
        """``inputs[i].k`` tokens each; the target's block tables must already cover
        ``len(token_ids) + k - 1`` positions (the verify pass needs them anyway)."""
        first = [SeqChunk((i.token_ids[-1],), len(i.token_ids) - 1, i.block_table) for i in inputs]

        def run(chunks: list[SeqChunk]) -> torch.Tensor:
            return self.runner.execute(chunks, num_layers=self.num_layers)

        def next_chunk(pos: int, num_proposed: int, last: int) -> SeqChunk:
            inp = inputs[pos]
            return SeqChunk((last,), len(inp.token_ids) + num_proposed - 1, inp.block_table)

        return _rounds(inputs, first, run, next_chunk, pick)
