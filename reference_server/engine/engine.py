"""The engine loop: schedule, move KV between tiers, run the model, sample, stream.

``Engine`` is single-threaded: every method is called on one thread (the "engine
thread"; :class:`~reference_server.engine.engine_loop.EngineLoop` owns one), except
:meth:`Engine.prepare_request`, which reads only immutable configuration and may run
on any thread. Observers (see :mod:`reference_server.engine.hooks`) are called on the
engine thread and must not block.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from reference_server.engine.block_manager import BlockManager
from reference_server.engine.cache_policies import (
    DropOnEvict,
    NoPrefetch,
    OffloadOnEvict,
    PrefetchWaitingPrefixes,
    WatermarkAdmission,
)
from reference_server.engine.config import EngineConfig
from reference_server.engine.hooks import (
    BatchEntry,
    EngineObserverProtocol,
    RequestAborted,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    RequestQueued,
    RequestScheduled,
    SpeculativeStep,
    StepEnd,
    StepStart,
    TierTransfer,
    TokenEmitted,
)
from reference_server.engine.observers import ObserverFanOut
from reference_server.engine.outputs import Completion, EngineStats, RequestOutput
from reference_server.engine.retention import SessionRetention
from reference_server.engine.scheduler import Scheduler, SchedulerOutput
from reference_server.engine.scheduling_policies import make_scheduling_policy
from reference_server.engine.sequence import FinishReason, PreemptionMode, Sequence, SequenceStatus, StopChecker
from reference_server.engine.speculative import SpecRequest, SpeculationPolicy, Speculator
from reference_server.model import (
    IncrementalDetokenizer,
    ModelConfig,
    ModelRunner,
    Sampler,
    SamplingParams,
    SeqChunk,
    Tokenizer,
    load_tokenizer,
    make_generator,
    seed_for_token,
)

__all__ = ["Engine"]


class Engine:
    """A continuous-batching LLM engine over a paged, tiered KV cache."""

    def __init__(self, config: EngineConfig, *, runner: ModelRunner | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        if runner is None:
            checkpoint = config.checkpoint_path  # a bundled model by name, too
            model_config = None if checkpoint else ModelConfig.preset(config.model)
            runner = ModelRunner(
                model_config, block_size=config.block_size, num_device_blocks=config.num_device_blocks,
                num_host_blocks=config.num_host_blocks, num_disk_blocks=config.num_disk_blocks,
                disk_path=config.disk_path, device=config.device, checkpoint=checkpoint, seed=config.seed)
        elif runner.block_size != config.block_size:
            raise ValueError(f"runner block_size {runner.block_size} != config block_size {config.block_size}")
        self.runner = runner
        self.model_config = runner.config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.checkpoint_path)
        self.max_model_len = config.resolve_max_model_len(self.model_config.max_position)
        self.block_manager = BlockManager(
            block_size=config.block_size, num_device_blocks=config.num_device_blocks,
            num_host_blocks=config.num_host_blocks, num_disk_blocks=config.num_disk_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            offload=OffloadOnEvict() if config.offload_on_evict else DropOnEvict(),
            admission=WatermarkAdmission(config.watermark_blocks))
        policy = make_scheduling_policy(
            config.scheduling_policy, weights={t.name: t.weight for t in config.tenants}, by=config.fair_share_by)
        prefetch = (PrefetchWaitingPrefixes(config.max_prefetch_blocks_per_step)
                    if config.prefetch_waiting else NoPrefetch())
        self.scheduler = Scheduler(
            block_manager=self.block_manager, policy=policy, tenants={t.name: t for t in config.tenants},
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=PreemptionMode(config.preemption_mode), prefetch=prefetch,
            retention=SessionRetention(self.block_manager, config.kv_retention, ttl_s=config.kv_retention_ttl_s,
                                       max_pinned_blocks=config.kv_retention_max_blocks))
        self.sampler = Sampler()
        self.speculator: Speculator | None = None
        if config.speculative is not None:
            self.speculator = Speculator(
                config.speculative, target=runner,
                policy=SpeculationPolicy(config.num_speculative_tokens, config.speculative_budget),
                draft_model=config.speculative_draft_model, exit_layer=config.speculative_exit_layer,
                ngram_min=config.speculative_ngram_min,
                seed=config.seed + 1)
        self._observers = ObserverFanOut()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._num_steps = 0
        self.num_scheduled_tokens_last_step = 0  # 0 = the last step ran nothing (e.g. quotas)
        self._next_seq_no = 0
        self._next_offline_id = 0
        self._counters = dict.fromkeys(
            ("finished", "aborted", "prompt_tokens", "generated"), 0)

    # ------------------------------------------------------------------ observers

    def add_observer(self, observer: EngineObserverProtocol) -> None:
        """Attach an :class:`~reference_server.engine.hooks.EngineObserver`. Engine thread."""
        self._observers.add(observer)

    def remove_observer(self, observer: EngineObserverProtocol) -> None:
        """Detach an observer; ``ValueError`` if it is not attached."""
        self._observers.remove(observer)

    # ------------------------------------------------------------------ requests

    def prepare_request(self, request_id: str, prompt: str | Seq[int], sampling: SamplingParams | Mapping[str, Any],
                        *, tenant: str | None = None, slo_class: str = "interactive",
                        arrival_ns: int | None = None, session: str = "") -> Sequence:
        """Validate and tokenize a request without touching engine state (any thread).
        Raises ``ValueError`` naming the problem."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if isinstance(sampling, Mapping):
            sampling = SamplingParams.from_dict(sampling)
        elif not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams or a dict, got {type(sampling).__name__}")
        tenant = self.config.default_tenant if tenant is None else tenant
        self.config.tenant(tenant)
        slo = self.config.slo_class(slo_class)
        token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens but the context window is {self.max_model_len} "
                             "tokens, and at least one must be left for output")
        now = time.monotonic_ns()  # engine monotonic clock, ns
        return Sequence(request_id, token_ids, sampling, seq_no=-1, tenant=tenant, slo_class=slo,
                        arrival_ns=now if arrival_ns is None else int(arrival_ns), max_len=self.max_model_len,
                        session=session or "")

    def _tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {t!r} is not an int in [0, {vocab})")
        return token_ids

    def add_request(self, request_id: str, prompt: str | Seq[int], sampling: SamplingParams | Mapping[str, Any],
                    *, tenant: str | None = None, slo_class: str = "interactive",
                    arrival_ns: int | None = None, session: str = "") -> None:
        """Validate and queue a request. ``ValueError`` (engine state untouched) on bad
        input: empty or too long prompt, bad sampling options, duplicate id, unknown
        tenant or SLO class. ``arrival_ns`` is on the engine monotonic clock."""
        seq = self.prepare_request(request_id, prompt, sampling, tenant=tenant, slo_class=slo_class,
                                   arrival_ns=arrival_ns, session=session)
        self.add_prepared(seq)

    def add_prepared(self, seq: Sequence) -> None:
        """Queue a request made by :meth:`prepare_request` (engine thread)."""
        if self.scheduler.get(seq.request_id) is not None:
            raise ValueError(f"duplicate request_id {seq.request_id!r}")
        seq.seq_no = self._next_seq_no
        self._next_seq_no += 1
        seq.stop = StopChecker(seq.sampling.stop)
        seq.generator = make_generator(seq.sampling.seed, self.runner.device)
        self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, prompt_ids=seq.token_ids)
        self.scheduler.add(seq)
        if self._observers:
            now = time.monotonic_ns()
            self._observers.on_request_added(RequestAdded(
                seq.request_id, seq.tenant, seq.slo_class.name, seq.arrival_ns, now, seq.num_prompt_tokens,
                seq.session))
            self._observers.on_request_queued(RequestQueued(seq.request_id, now, self.scheduler.num_waiting))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing its blocks in every tier. False if it
        is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._detok.pop(request_id, None)
        self._counters["aborted"] += 1
        if self._observers:
            self._observers.on_request_aborted(RequestAborted(request_id, seq.num_output_tokens, time.monotonic_ns()))
        return True

    def release_transferred(self, request_id: str, reason: str) -> Sequence:
        """End a running request that continues on another engine: free its blocks (full
        ones stay in the prefix cache), drop its detokenizer, and report ``RequestFinished``
        with ``reason``. Counted neither as finished nor as aborted. ``ValueError`` if it is
        not running. Engine thread, between steps."""
        seq = self.scheduler.running.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} is not running")
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._detok.pop(request_id, None)
        if self._observers:
            self._observers.on_request_finished(RequestFinished(
                request_id, self._num_steps, reason, seq.num_output_tokens, seq.num_cached_tokens,
                time.monotonic_ns()))
        return seq

    def replay_outputs(self, seq: Sequence, output_token_ids: Seq[int]) -> None:
        """Append output tokens produced elsewhere to ``seq`` (added, not yet scheduled) and
        push them through its detokenizer and stop checker, so the text it streams next
        continues the text already delivered. Engine thread."""
        detok, stop = self._detok[seq.request_id], seq.stop
        for token in output_token_ids:
            seq.token_ids.append(token)
            if stop is not None:
                stop.push(detok.push(token))

    def preempt(self, request_id: str, *, mode: str | None = None) -> str:
        """Preempt a running request now (``mode`` "swap" or "recompute"; default from
        the config). Returns the mode used; ``ValueError`` if it is not running."""
        used = self.scheduler.preempt(request_id, None if mode is None else PreemptionMode(mode))
        if self._observers:
            self._observers.on_request_preempted(RequestPreempted(
                request_id, self._num_steps, used.value, time.monotonic_ns()))
        return used.value

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, copy KV between tiers, run the mixed batch, sample,
        detokenize, finish. Returns one output per request that got a token."""
        self._num_steps += 1
        step, observed = self._num_steps, bool(self._observers)
        start_ns = time.monotonic_ns()  # engine monotonic clock, ns
        if observed:
            self._observers.on_step_start(StepStart(step, start_ns))
        plan = self.scheduler.schedule(start_ns, step=step)
        self.num_scheduled_tokens_last_step = sum(c.num_tokens for c in plan.chunks)
        if observed:
            self._emit_plan(plan, step)
        self._execute_copies(plan, step)
        draft_start_ns = time.monotonic_ns()
        spec: dict[str, SpecRequest] = {}  # the requests that speculate in this step, by id
        if self.speculator is not None:
            spec = self.speculator.draft_phase(plan, self.scheduler.running, self.block_manager)
        compute_start_ns = time.monotonic_ns()  # the draft phase's end: the target's (verify) pass begins
        sampled = self._run_model(plan, spec)
        compute_end_ns = time.monotonic_ns()
        self.scheduler.update(plan, sampled, compute_ns=compute_end_ns - compute_start_ns)
        if spec and observed:
            for req in spec.values():
                self._observers.on_speculative_step(SpeculativeStep(
                    req.seq.request_id, step, self.config.speculative or "", len(req.proposals), req.num_accepted,
                    req.first_token_index, draft_start_ns, compute_start_ns, compute_start_ns, compute_end_ns,
                    len(plan.chunks), len(spec)))
        outputs = self._process_samples(plan, step, compute_end_ns, spec)
        for retention_event in self.scheduler.retention.take_events():  # drained even when nobody listens
            if observed:
                self._observers.on_retention(retention_event)
        if observed:
            usage = self.block_manager.usage()
            self._observers.on_step_end(StepEnd(
                step, start_ns, compute_start_ns, compute_end_ns, time.monotonic_ns(),
                tuple(BatchEntry(c.request_id, c.num_tokens if c.is_prefill else 0,
                                 0 if c.is_prefill else c.num_tokens + len(spec[c.request_id].proposals)
                                 if c.request_id in spec else c.num_tokens) for c in plan.chunks),
                plan.num_waiting, plan.num_running, plan.num_preempted, usage.num_used, usage.num_total))
        return outputs

    def _emit_plan(self, plan: SchedulerOutput, step: int) -> None:
        """Hand the plan's own events (made by the scheduler) to observers, then one
        ``RequestScheduled`` per chunk."""
        for preempted in plan.preempted:
            self._observers.on_request_preempted(preempted)
        for resumed in plan.resumed:
            self._observers.on_request_resumed(resumed)
        for lookup in plan.cache_lookups:
            self._observers.on_cache_lookup(lookup)
        for evicted in plan.evictions:
            self._observers.on_evicted(evicted)
        now = time.monotonic_ns()
        for c in plan.chunks:
            self._observers.on_request_scheduled(RequestScheduled(
                c.request_id, step, now, c.start_pos, c.num_tokens, c.is_prefill))

    def _execute_copies(self, plan: SchedulerOutput, step: int) -> None:
        for op in plan.copy_ops:
            if not self._observers:
                self.runner.copy_blocks(op.src_tier, op.src_ids, op.dst_tier, op.dst_ids)
                continue
            start_ns = time.monotonic_ns()
            num_bytes = self.runner.copy_blocks(op.src_tier, op.src_ids, op.dst_tier, op.dst_ids)
            self._observers.on_tier_transfer(TierTransfer(
                op.kind, op.request_id, step, op.src_tier, op.dst_tier, op.num_blocks, num_bytes,
                start_ns, time.monotonic_ns()))

    def _run_model(self, plan: SchedulerOutput, spec: Mapping[str, SpecRequest]) -> dict[str, int]:
        """Forward the batch (a speculating request's chunk is its last token and its
        proposals, with logits for each); return the first new token of every sampling chunk."""
        if not plan.chunks:
            return {}
        running, bm = self.scheduler.running, self.block_manager
        chunks, samplers = [], []
        for c in plan.chunks:
            seq = running[c.request_id]
            tokens = tuple(seq.token_ids[c.start_pos:c.start_pos + c.num_tokens])
            req = spec.get(c.request_id)
            if req is not None:
                tokens += tuple(req.proposals)
            chunks.append(SeqChunk(tokens, c.start_pos, bm.block_table(c.request_id), want_logits=c.samples,
                                   num_logits=1 if req is None else len(tokens)))
            if c.samples:
                samplers.append(seq)
            if c.is_prefill:
                self._counters["prompt_tokens"] += c.num_tokens
        logits = self.runner.execute(chunks)  # (sampling rows: 1 per chunk, k + 1 per verify chunk, vocab)
        if not samplers:
            return {}
        plain_rows, plain, out, row = [], [], {}, 0
        for s in samplers:
            req = spec.get(s.request_id)
            if req is None:
                plain_rows.append(row)
                plain.append(s)
                row += 1
                continue
            assert self.speculator is not None
            self.speculator.accept(req, logits[row:row + len(req.proposals) + 1])
            out[s.request_id] = req.emitted[0]
            row += len(req.proposals) + 1
        for s in plain:  # token i's draws depend on (seed, i) only: handoff and resume reproduce them
            if s.generator is not None:
                s.generator.manual_seed(seed_for_token(s.sampling.seed, s.num_output_tokens))
        if plain:
            plain_logits = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
            tokens = self.sampler.sample(plain_logits, [s.sampling for s in plain], [s.generator for s in plain])
            out.update((s.request_id, t) for s, t in zip(plain, tokens))
        return out

    def _process_samples(self, plan: SchedulerOutput, step: int, sampled_ns: int,
                         spec: Mapping[str, SpecRequest]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for c in plan.chunks:
            if not c.samples:
                continue
            seq = self.scheduler.running[c.request_id]
            outputs.append(self._emit_token(seq, step, sampled_ns))
            req = spec.get(c.request_id)
            if req is None:
                continue
            for token in req.emitted[1:]:  # the step's further tokens, unless the request finished
                if seq.status is SequenceStatus.FINISHED:
                    break
                seq.num_computed_tokens += 1  # the token before it was an accepted proposal: its KV is valid
                seq.token_ids.append(token)
                outputs.append(self._emit_token(seq, step, sampled_ns))
            if seq.status is not SequenceStatus.FINISHED:
                self.block_manager.commit(seq)
        return outputs

    def _emit_token(self, seq: Sequence, step: int, sampled_ns: int) -> RequestOutput:
        token = seq.token_ids[-1]
        detok, stop = self._detok[seq.request_id], seq.stop
        assert stop is not None
        is_eos = token == self.model_config.eos_token_id and not seq.sampling.ignore_eos
        text, hit_stop = stop.push("" if is_eos else detok.push(token))
        reason = None
        if is_eos or hit_stop:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= seq.max_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            if not hit_stop:
                more, hit_stop = stop.push(detok.flush())
                text += more
            text += stop.flush()
        self._counters["generated"] += 1
        index = seq.num_output_tokens - 1
        emit_ns = time.monotonic_ns()  # engine monotonic clock: the token is handed out
        if self._observers:
            self._observers.on_token_emitted(TokenEmitted(
                seq.request_id, step, index, token, text, sampled_ns, emit_ns))
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._detok[seq.request_id]
            self._counters["finished"] += 1
            if self._observers:
                self._observers.on_request_finished(RequestFinished(
                    seq.request_id, step, reason.value, seq.num_output_tokens, seq.num_cached_tokens,
                    time.monotonic_ns()))
        return RequestOutput(
            seq.request_id, index, token, text, reason is not None, None if reason is None else reason.value,
            seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens, emit_ns)

    # ------------------------------------------------------------------ offline API, stats

    def generate(self, prompts: Seq[str | Seq[int]], sampling: SamplingParams | Seq[SamplingParams], *,
                 tenant: str | None = None, slo_class: str = "interactive") -> list[Completion]:
        """Run ``prompts`` to completion and return their completions in order. All
        prompts are validated before any is queued. Other queued requests are stepped
        along meanwhile, but their outputs are not returned (offline use only)."""
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of prompts, not one string")
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs, next_id = [], self._next_offline_id
        for prompt, p in zip(prompts, params):
            while self.scheduler.get(f"offline-{next_id}") is not None:
                next_id += 1
            seqs.append(self.prepare_request(f"offline-{next_id}", prompt, p, tenant=tenant, slo_class=slo_class))
            next_id += 1
        self._next_offline_id = next_id
        for seq in seqs:
            self.add_prepared(seq)
        pending = {s.request_id for s in seqs}
        while pending:
            for out in self.step():
                if out.finished:
                    pending.discard(out.request_id)
        return [Completion(s.request_id, tuple(s.token_ids[:s.num_prompt_tokens]), s.stop.text if s.stop else "",
                           tuple(s.output_token_ids), s.finish_reason.value if s.finish_reason else "abort",
                           s.num_cached_tokens) for s in seqs]

    def stats(self) -> EngineStats:
        """A snapshot of queues, blocks and counters (engine thread)."""
        bm, sch, c = self.block_manager, self.scheduler, self._counters
        usage = bm.usage()
        return EngineStats(
            num_steps=self._num_steps, num_waiting=sch.num_waiting, num_running=sch.num_running,
            num_preempted=sch.num_preempted, num_blocks_used=usage.num_used, num_blocks_cached=usage.num_cached,
            num_blocks_total=usage.num_total, num_prefix_query_tokens=bm.num_prefix_query_tokens,
            num_prefix_hit_tokens=bm.num_prefix_hit_tokens, num_prefix_hit_blocks=tuple(bm.num_hit_blocks),
            num_evicted_blocks=tuple(bm.num_evicted_blocks),
            num_transferred_blocks=tuple(bm.num_transferred_blocks.items()),
            num_preemptions_recompute=sch.num_preemptions[PreemptionMode.RECOMPUTE],
            num_preemptions_swap=sch.num_preemptions[PreemptionMode.SWAP],
            num_requests_finished=c["finished"], num_requests_aborted=c["aborted"],
            num_prompt_tokens_computed=c["prompt_tokens"], num_generated_tokens=c["generated"],
            num_observer_errors=self._observers.num_errors)

    def close(self) -> None:
        """Release the model's KV tiers (and disk files)."""
        self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
