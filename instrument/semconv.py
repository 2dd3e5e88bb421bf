"""OpenTelemetry attribute and span names used by the OTel export and the OTLP ingest.

One place for every name, with its unit. ``gen_ai.*`` names follow the
OpenTelemetry GenAI semantic conventions where they define one, and vLLM's
tracing (``vllm/tracing.py``) for the per-request latency breakdown they do not
define; ``tokentrace.*`` names are ours.
"""

from __future__ import annotations

__all__ = [
    "LLM_REQUEST_SPAN", "TOKEN_EVENT", "GEN_AI_OPERATION_NAME", "GEN_AI_SYSTEM", "GEN_AI_REQUEST_ID",
    "GEN_AI_USAGE_INPUT_TOKENS", "GEN_AI_USAGE_OUTPUT_TOKENS", "GEN_AI_USAGE_PROMPT_TOKENS",
    "GEN_AI_USAGE_COMPLETION_TOKENS", "GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS",
    "GEN_AI_SERVER_TIME_TO_FIRST_TOKEN", "GEN_AI_SERVER_REQUEST_DURATION",
    "GEN_AI_LATENCY_TIME_IN_QUEUE", "GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN", "GEN_AI_LATENCY_E2E",
    "GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL", "GEN_AI_LATENCY_TIME_IN_MODEL_DECODE", "ERROR_TYPE",
    "TT_RUN_ID", "TT_TENANT", "TT_SLO_CLASS", "TT_SESSION", "TT_SESSION_TURN", "GEN_AI_CONVERSATION_ID", "TT_STATUS", "TT_STAGE", "TT_TOKEN_INDEX", "TT_ENGINE_STEP",
    "TT_INSTANCE_ID", "TT_BYTES", "TT_KV_TIER", "TT_BATCH_SIZE", "SERVICE_NAME",
    "SERVICE_INSTANCE_ID", "HOST_NAME", "PROCESS_PID", "VLLM_PROCESS_ID", "TT_INSTANCE_NAME", "TT_INSTANCE_ROLE",
    "GEN_AI_USAGE_CACHE_READ_DOT_INPUT_TOKENS", "GEN_AI_RESPONSE_FINISH_REASONS", "GEN_AI_RESPONSE_FINISH_REASON",
    "GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE", "TT_FIRST_CONTENT_UNIX_NS", "TT_TOKEN_TIME", "TT_REQUEST_EVENT", "TT_INSTANCE_SPAN",
    "TT_ARRIVAL_UNIX_NS", "TT_FIRST_TOKEN_UNIX_NS", "TT_FINISH_UNIX_NS",
    "GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME", "GEN_AI_LATENCY_PER_TOKEN_SCHEDULED_TIME",
    "GEN_AI_ITERATION_PER_TOKEN_BATCH_SIZE", "GEN_AI_ITERATION_PER_TOKEN_CACHED_TOKENS",
    "VLLM_LIFECYCLE_SPANS", "VLLM_STEP_SPANS", "SGLANG_RID", "SGLANG_STAGES", "TT_ENGINE_CONFIG_KEYS",
]

LLM_REQUEST_SPAN = "llm_request"
"""Name of the per-request span (vLLM's name, so tools built for vLLM traces find ours)."""
TOKEN_EVENT = "tokentrace.token"
"""Span event: one output token delivered (timestamp: sent, else emitted)."""

SERVICE_NAME = "service.name"
"""Resource attribute: the traced service."""
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
"""Semconv: the operation, e.g. ``text_completion``."""
GEN_AI_SYSTEM = "gen_ai.system"
"""Semconv: the serving system, e.g. ``vllm``; ours: ``tokentrace``."""
GEN_AI_REQUEST_ID = "gen_ai.request.id"
"""vLLM: the server's request id string (our ``requests.request_key``)."""
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
"""Semconv: prompt tokens (count)."""
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
"""Semconv: output tokens (count)."""
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
"""Deprecated semconv name vLLM still sends: prompt tokens (count)."""
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
"""Deprecated semconv name vLLM still sends: output tokens (count)."""
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read_input_tokens"
"""Semconv: prompt tokens served from a cache (count)."""
GEN_AI_SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
"""Semconv metric name, used here as a span attribute: time to first token (s, float)."""
GEN_AI_SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"
"""Semconv metric name, used here as a span attribute: end-to-end duration (s, float)."""
GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
"""vLLM: scheduled - queued (s, float)."""
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
"""vLLM: first token - arrival (s, float)."""
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
"""vLLM: finish - arrival (s, float)."""
GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
"""vLLM: first token - scheduled (s, float)."""
GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
"""vLLM: last token - first token (s, float)."""
ERROR_TYPE = "error.type"
"""Semconv: the kind of error of a failed request."""

TT_RUN_ID = "tokentrace.run_id"
"""Resource attribute: the store run the spans came from."""
TT_TENANT = "tokentrace.tenant"
TT_SLO_CLASS = "tokentrace.slo_class"
TT_SESSION = "tokentrace.session"
"""The session (conversation, agent loop) a request is a turn of."""
TT_SESSION_TURN = "tokentrace.session.turn"
"""0-based turn of the request in its session (int)."""
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
"""Semconv: the conversation (session) a generative AI request belongs to."""
TT_STATUS = "tokentrace.request_status"
"""Request status label (``ok``, ``error``, ``aborted``, ``timeout``, ``rejected``)."""
TT_STAGE = "tokentrace.stage"
"""Stage label of a stage span, e.g. ``prefill.compute``."""
TT_TOKEN_INDEX = "tokentrace.token_index"
"""Output token the interval belongs to; -1 = request-level."""
TT_ENGINE_STEP = "tokentrace.engine_step"
TT_INSTANCE_ID = "tokentrace.instance_id"
TT_BYTES = "tokentrace.bytes"
"""Bytes moved during the interval (bytes)."""
TT_KV_TIER = "tokentrace.kv_tier"
TT_BATCH_SIZE = "tokentrace.batch_size"
"""Sequences in the engine step of the interval (count)."""

# --------------------------------------------------------------------------- resources (instances)

SERVICE_INSTANCE_ID = "service.instance.id"
"""Resource attribute (semconv): one instance of a service (a replica)."""
HOST_NAME = "host.name"
"""Resource attribute (semconv): the host."""
PROCESS_PID = "process.pid"
"""Resource attribute (semconv): the operating-system process id."""
VLLM_PROCESS_ID = "vllm.process_id"
"""Resource attribute vLLM sets on its tracer's resource: the process id."""
TT_INSTANCE_NAME = "tokentrace.instance_name"
"""Resource attribute: the instance's name in the store (``decode-1``)."""
TT_INSTANCE_ROLE = "tokentrace.instance_role"
"""Resource attribute: the instance's role label (``gateway``, ``prefill``, ``decode``, ...)."""

# --------------------------------------------------------------------------- more request attributes

GEN_AI_USAGE_CACHE_READ_DOT_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
"""Semconv (current name; vLLM's llm_request since vllm-project/vllm#54476): prompt tokens from a cache (count)."""
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
"""Semconv: finish reason per choice (string array)."""
GEN_AI_RESPONSE_FINISH_REASON = "gen_ai.response.finish_reason"
"""vLLM: ``json.dumps`` of the finish reasons list, e.g. ``'["stop"]'``."""
GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
"""vLLM: last token - scheduled (s, float)."""
TT_FIRST_CONTENT_UNIX_NS = "tokentrace.first_content_unix_ns"
"""Our request attribute: first chunk with visible text (Unix ns)."""
TT_ENGINE_CONFIG_KEYS: dict[str, str] = {
    "tokentrace.engine.max_num_seqs": "max_num_seqs",
    "tokentrace.engine.max_num_batched_tokens": "max_num_batched_tokens",
    "tokentrace.engine.block_size": "block_size",
    "tokentrace.engine.num_device_blocks": "num_device_blocks",
    "tokentrace.engine.scheduling_policy": "scheduling_policy",
}
"""Resource attributes of a serving engine's configuration (counts; the policy a name), e.g. set with
``OTEL_RESOURCE_ATTRIBUTES=tokentrace.engine.max_num_seqs=64,...``, and the ``engine_configs`` field each
fills. An engine whose resource has ``tokentrace.engine.max_num_seqs`` gets one ``engine_configs`` row."""

TT_INSTANCE_SPAN = "tokentrace.instance"
"""A zero-length span per instance, sent first by a lossless export (``token_events=True``): its
resource describes an instance that may own no stage span (a client), so ingest knows it."""
TT_REQUEST_EVENT = "tokentrace.request"
"""Span event on an exported request span: one ``requests`` row of one instance (its times as
``tokentrace.*_unix_ns`` attributes), so that ingest writes every instance's row back."""
TT_ARRIVAL_UNIX_NS = "tokentrace.arrival_unix_ns"
TT_FIRST_TOKEN_UNIX_NS = "tokentrace.first_token_unix_ns"
TT_FINISH_UNIX_NS = "tokentrace.finish_unix_ns"
TT_TOKEN_TIME = "tokentrace.token_time"
"""Token event attribute: which ``tokens`` column the event's time is (``emit``, ``sent``, ``recv``)."""

# Token-level arrays proposed in open-telemetry/semantic-conventions-genai#75 (as vLLM#32573 sends
# them: one value per output token; arrays, or their JSON text).
GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME = "gen_ai.latency.per_token_generation_time"
"""Per output token: when it was generated, s since the request's arrival."""
GEN_AI_LATENCY_PER_TOKEN_SCHEDULED_TIME = "gen_ai.latency.per_token_scheduled_time"
"""Per output token: when the step that generated it was scheduled, s since arrival."""
GEN_AI_ITERATION_PER_TOKEN_BATCH_SIZE = "gen_ai.iteration.per_token_batch_size"
"""Per output token: sequences in its engine step (count)."""
GEN_AI_ITERATION_PER_TOKEN_CACHED_TOKENS = "gen_ai.iteration.per_token_cached_tokens"
"""Prompt tokens served from the prefix cache (count)."""

# --------------------------------------------------------------------------- span names

VLLM_LIFECYCLE_SPANS = {
    "vllm_queue": "schedule.queue",
    "vllm_async_kv_transfer": "transfer.kv",
    "vllm_prefill": "prefill.compute",
    "vllm_decode": "decode.compute",
    "vllm_preempted": "schedule.preempted",
    "vllm.request.queue": "schedule.queue",
    "vllm.request.wait_remote_kv": "transfer.kv",
    "vllm.request.prefill": "prefill.compute",
    "vllm.request.decode": "decode.compute",
}
"""vLLM request-lifecycle spans (vllm-project/vllm#44402; the names of vLLM's tracing design
doc) -> stage label."""
VLLM_STEP_SPANS = frozenset({"vllm_step_execution", "vllm.engine.step"})
"""Per-iteration spans: batch work already inside the prefill/decode phases; counted, not stored."""

SGLANG_RID = "rid"
"""SGLang: the request id on its per-request root span (``<role> Req <rid[:8]>``)."""
SGLANG_STAGES = {
    "tokenize": "gateway.tokenize",
    "dispatch": "gateway.route",
    "dc_dispatch": "gateway.route",
    "request_process": "gateway.route",
    "prefill_waiting": "schedule.queue",
    "prefill_forward": "prefill.compute",
    "chunked_prefill": "prefill.compute",
    "decode_loop": "decode.compute",
    "decode_forward": "decode.compute",
    "prefill_prepare": "schedule.queue",
    "prefill_bootstrap": "schedule.queue",
    "prefill_transfer_kv_cache": "transfer.kv",
    "decode_prepare": "schedule.queue",
    "decode_bootstrap": "schedule.queue",
    "decode_transferred": "transfer.kv",
    "decode_waiting": "schedule.queue",
    "fake_output": "decode.compute",
}
"""SGLang's request stages (``RequestStage`` in ``sglang/srt/managers/schedule_batch.py``; the
names of its ``trace_slice`` spans) -> stage label."""
