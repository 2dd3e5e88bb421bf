"""Speculative decoding: propose k tokens cheaply, verify them in the target's one pass.

A step with speculation runs in two phases (the engine times both and reports them to
observers as :class:`~reference_server.engine.hooks.SpeculativeStep`, one per request):

1. **draft**: for each decode request the policy lets speculate, a draft source proposes
   up to k tokens: a draft model with its own KV cache, the target's first layers
   (early exit), or n-gram lookup in the request's own context (prompt lookup: the tokens
   that followed the latest earlier occurrence of the context's last 3 tokens, else its last
   2, down to ``speculative_ngram_min``; a lone repeated token is a weak cue, so the default
   minimum is 2);
2. **verify**: the target's usual batched forward pass, in which a speculating request's
   chunk is its last token plus its k proposals (k + 1 positions, logits for each). The
   first proposals that the target agrees with are accepted, and the target's own token
   at the first disagreement (or after the last proposal) is emitted too, so a step emits
   ``accepted + 1`` tokens.

Acceptance keeps the output distribution the target's. Greedy requests accept a proposal
when it is the target's argmax, so their output is exactly plain greedy decoding. Sampled
requests follow the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023):
proposal ``d`` drawn from the draft's distribution ``q`` is accepted with probability
``min(1, p(d) / q(d))`` under the target's ``p`` (both after temperature, top-k, top-p);
at the first rejection the emitted token is drawn from ``norm(max(0, p - q))``, and when
all are accepted a bonus token from ``p`` at the next position. N-gram proposals are
deterministic, so ``q`` is a point mass: accept with probability ``p(d)``, on rejection
draw from ``p`` without ``d``.

KV: the target's cache gets slots for the k + 1 positions before drafting; the verify pass
writes all of them, but only accepted positions count as computed
(``num_computed_tokens``), so a rejected position's KV is overwritten by the next step and
never enters the prefix cache (only blocks full of computed tokens are keyed).

The policy (:class:`SpeculationPolicy`) turns speculation down as the batch grows: a
budget of proposed tokens per step is shared by the step's decode requests,
``k = min(num_speculative_tokens, budget // num_decodes)``, so a large batch, whose
verify pass is already compute-bound, speculates less and finally not at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from reference_server.engine.block_manager import BlockManager
from reference_server.engine.config import EngineConfig
from reference_server.engine.scheduler import SchedulerOutput
from reference_server.engine.sequence import Sequence
from reference_server.model import ModelConfig, ModelRunner, Sampler, SamplingParams, seed_for_token
from reference_server.model.bundled import resolve_checkpoint
from reference_server.model.draft import DraftInput, DraftModel, EarlyExitDraft

__all__ = ["SpecRequest", "SpeculationPolicy", "Speculator", "accept_greedy", "accept_sampled",
           "check_speculative_options", "ngram_proposals"]

NGRAM_MAX = 3  # longest suffix n-gram looked up (then shorter ones, down to the engine's minimum)


@dataclass(slots=True)
class SpecRequest:
    """One request speculating in this step (engine thread scratch state)."""

    seq: Sequence
    k: int  # tokens to propose (after the policy and the request's limits)
    first_token_index: int  # output index of the first token the step emits
    proposals: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # (len(proposals), vocab) q rows; None = point masses
    emitted: list[int] = field(default_factory=list)
    num_accepted: int = 0


@dataclass(frozen=True, slots=True)
class SpeculationPolicy:
    """How many tokens each decode request proposes in a step of ``num_decodes`` decodes."""

    num_speculative_tokens: int
    budget: int  # proposed tokens per step over the batch

    def k_for(self, num_decodes: int) -> int:
        """Proposals per request in a step with ``num_decodes`` decode requests (0 = plain)."""
        if num_decodes <= 0:
            return 0
        return min(self.num_speculative_tokens, self.budget // num_decodes)


def ngram_proposals(token_ids: Seq[int], k: int, *, max_n: int = NGRAM_MAX, min_n: int = 1) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence of
    the context's last n tokens (longest n first); [] when no suffix recurs."""
    tokens = list(token_ids)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest occurrence first, not the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def _vocab_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Filtered probabilities ``(rows, vocab)`` in vocabulary order (temperature, top-k, top-p)."""
    probs, order = Sampler.filtered_probs(logits.float(), [params] * logits.shape[0])
    return torch.zeros_like(probs).scatter_(1, order, probs)


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=gen).item())


def accept_greedy(proposals: Seq[int], target_logits: torch.Tensor) -> list[int]:
    """Tokens a greedy request emits: proposals while they are the target's argmax, then
    the target's own token. ``target_logits``: ``(len(proposals) + 1, vocab)``."""
    best = target_logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for proposal, target in zip(proposals, best):
        if proposal != target:
            break
        out.append(proposal)
    out.append(best[len(out)])
    return out


def accept_sampled(proposals: Seq[int], p: torch.Tensor, q: torch.Tensor | None,
                   gen: torch.Generator | None) -> list[int]:
    """Tokens a sampled request emits under the rejection rule (module docstring).

    ``p``: target probabilities ``(len(proposals) + 1, vocab)``; ``q``: draft probabilities
    ``(len(proposals), vocab)``, or None for deterministic proposals (point masses)."""
    out: list[int] = []
    device = p.device
    for i, d in enumerate(proposals):
        q_d = 1.0 if q is None else float(q[i, d])
        p_d = float(p[i, d])
        u = float(torch.rand((), generator=gen, device=device))
        if q_d > 0 and u < min(1.0, p_d / q_d):
            out.append(d)
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is right
            residual = p[i]
        out.append(_draw(residual / residual.sum(), gen))
        return out
    out.append(_draw(p[len(proposals)], gen))
    return out


class Speculator:
    """The engine's speculative decoding: policy, draft source, acceptance. Engine thread."""

    def __init__(self, source: str, *, target: ModelRunner, policy: SpeculationPolicy,
                 draft_model: str = "trained-draft", exit_layer: int = 2, ngram_min: int = 2,
                 num_draft_blocks: int | None = None, seed: int = 0) -> None:
        self.source = source
        self.policy = policy
        self.ngram_min = ngram_min
        self.target = target
        self.draft: DraftModel | EarlyExitDraft | None = None
        if source == "model":
            self.draft = DraftModel(_draft_runner(target, draft_model, num_draft_blocks, seed))
        elif source == "early_exit":
            self.draft = EarlyExitDraft(target, exit_layer)
        elif source != "ngram":
            raise ValueError(f"unknown speculative source {source!r}; known: model, ngram, early_exit")

    def draft_phase(self, plan: SchedulerOutput, running: Mapping[str, Sequence],
                    block_manager: BlockManager) -> dict[str, SpecRequest]:
        """The draft phase of a step: which decode requests speculate (the policy's k for the
        step's decode count, cut by each request's limits and free blocks) and their proposals,
        by request id. Requests left out, or for which nothing was proposed, decode plainly."""
        self.release_finished(running)
        decodes = [c for c in plan.chunks if c.samples and not c.is_prefill and c.num_tokens == 1]
        k = self.policy.k_for(len(decodes))
        if k == 0:
            return {}
        reqs = []
        for c in decodes:
            seq = running[c.request_id]
            req = SpecRequest(seq, self.limit(seq, k), first_token_index=seq.num_output_tokens)
            # room for the last token and k proposals in the target's cache (and the draft's)
            if req.k and self.reserve_draft(req) and block_manager.allocate_lookahead_slots(seq, 1 + req.k):
                reqs.append(req)
        if not reqs:
            return {}
        tables = {r.seq.request_id: block_manager.block_table(r.seq.request_id) for r in reqs}
        return {r.seq.request_id: r for r in self.propose(reqs, tables)}

    def release_finished(self, running: Mapping[str, Sequence]) -> None:
        """Forget draft state of requests that are no longer running (finished, aborted,
        preempted: a resumed request catches up again)."""
        if isinstance(self.draft, DraftModel):
            self.draft.release_all_but(lambda key, owner: running.get(key) is owner)

    def limit(self, seq: Sequence, k: int) -> int:
        """``k`` cut so that the step emits no more than the request may still produce."""
        left_out = seq.sampling.max_tokens - seq.num_output_tokens
        left_ctx = min(seq.max_len, self.target.config.max_position) - seq.num_tokens
        return max(0, min(k, left_out - 1, left_ctx - 1))

    def reserve_draft(self, req: SpecRequest) -> bool:
        """Room in the draft model's own cache (always True for other sources)."""
        if not isinstance(self.draft, DraftModel):
            return True
        seq = req.seq
        return self.draft.reserve(seq.request_id, seq, seq.num_tokens + req.k - 1)

    def propose(self, reqs: list[SpecRequest], block_tables: Mapping[str, tuple[int, ...]]) -> list[SpecRequest]:
        """Fill each request's proposals (and draft probabilities for sampled requests);
        returns those that got at least one proposal (n-gram lookup may find none)."""
        for req in reqs:
            seq = req.seq
            if seq.generator is not None and not seq.sampling.is_greedy:
                # this step's draws depend on (seed, first token index) only
                seq.generator.manual_seed(seed_for_token(seq.sampling.seed, seq.num_output_tokens))
        if self.draft is None:
            for req in reqs:
                req.proposals = ngram_proposals(req.seq.token_ids, req.k, min_n=self.ngram_min)
            return [r for r in reqs if r.proposals]
        inputs = [DraftInput(r.seq.request_id, r.seq, r.seq.token_ids, block_tables[r.seq.request_id], r.k)
                  for r in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]

        def pick(logits: torch.Tensor, positions: Seq[int], round_no: int) -> list[int]:
            out = logits.argmax(dim=-1).tolist()
            for row, pos in enumerate(positions):
                seq = reqs[pos].seq
                if seq.sampling.is_greedy:
                    continue
                q = _vocab_probs(logits[row:row + 1], seq.sampling)[0]
                probs[pos].append(q)
                out[row] = _draw(q, seq.generator)
            return out

        proposals = self.draft.propose(inputs, pick)
        for req, props, q_rows in zip(reqs, proposals, probs):
            req.proposals = props
            req.draft_probs = torch.stack(q_rows) if q_rows else None
        return reqs

    def accept(self, req: SpecRequest, target_logits: torch.Tensor) -> None:
        """Decide the request's emitted tokens from its ``k + 1`` verify rows."""
        seq = req.seq
        if seq.sampling.is_greedy:
            req.emitted = accept_greedy(req.proposals, target_logits)
        else:
            p = _vocab_probs(target_logits, seq.sampling)
            q = req.draft_probs if self.draft is not None else None
            req.emitted = accept_sampled(req.proposals, p, q, seq.generator)
        req.num_accepted = len(req.emitted) - 1
        if isinstance(self.draft, DraftModel):
            self.draft.rollback(seq.request_id, seq.num_tokens + req.num_accepted)


def check_speculative_options(config: EngineConfig) -> None:
    """What can be checked of ``config``'s speculative options before any model is built (a
    launcher's command line): the early-exit layer against the target's depth, the draft
    model's name. ``ValueError`` naming the option."""
    if config.speculative == "early_exit":
        checkpoint = config.checkpoint_path
        target = ModelConfig.from_hf_config(checkpoint) if checkpoint else ModelConfig.preset(config.model)
        if not 1 <= config.speculative_exit_layer < target.num_layers:
            raise ValueError(f"early exit needs 1 <= speculative_exit_layer < {target.num_layers} (the target's "
                             f"layers), got {config.speculative_exit_layer}")
    if config.speculative == "model":
        name = config.speculative_draft_model
        if resolve_checkpoint(name, None) is None and name not in ModelConfig.preset_names():
            ModelConfig.from_hf_config(name)  # a checkpoint folder, or ValueError naming what is missing


def _draft_runner(target: ModelRunner, name: str, num_blocks: int | None, seed: int) -> ModelRunner:
    """The draft model's runner: its own weights and KV cache, on the target's device."""
    checkpoint = resolve_checkpoint(name, None)  # a bundled model
    config: ModelConfig | None = None
    if checkpoint is None and name in ModelConfig.preset_names():
        config = ModelConfig.preset(name)  # seeded random weights (tests)
    elif checkpoint is None:
        checkpoint = name  # a checkpoint folder
    runner = ModelRunner(config, block_size=target.block_size,
                         num_device_blocks=num_blocks or target.storage.num_blocks(0),
                         device=target.device, checkpoint=checkpoint, seed=seed)
    if runner.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft model {name!r} has vocabulary {runner.config.vocab_size}, "
                         f"the target {target.config.vocab_size}: they must share the tokenizer")
    return runner
