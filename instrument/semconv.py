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
    "TT_RUN_ID", "TT_TENANT", "TT_SLO_CLASS", "TT_STATUS", "TT_STAGE", "TT_TOKEN_INDEX", "TT_ENGINE_STEP",
    "TT_INSTANCE_ID", "TT_BYTES", "TT_KV_TIER", "TT_BATCH_SIZE", "SERVICE_NAME",
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
