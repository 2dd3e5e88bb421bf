"""The OpenAI-compatible HTTP gateway: a Starlette app in front of a :class:`Backend`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or
false), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Build it with
:func:`create_app` and serve it with uvicorn (bind 127.0.0.1)::

    app = create_app(LocalBackend(EngineConfig()), config=GatewayConfig())
    uvicorn.run(app, host="127.0.0.1", port=8000)

A generation request goes: headers received (request id, tenant from the API key) ->
body read under a size limit and validated -> SLO class resolved -> prompt tokenized ->
handed to the backend -> tokens streamed back (:mod:`.gateway_sse`). Every refusal is a
4xx/5xx with OpenAI's error body. Hook points: :mod:`.gateway_hooks`; metrics:
:mod:`.gateway_metrics`; injected delays (tokenize, route, detokenize, stream_send):
:mod:`.delays`. Everything runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reference_server.engine import DEFAULT_SLO_CLASSES, SLOClass
from reference_server.model import SamplingParams, apply_chat_template
from reference_server.serving.backend import Backend, GenerateRequest
from reference_server.serving.delays import DelayConfig
from reference_server.serving.gateway_hooks import (
    GatewayHooks,
    GatewayRequestFinished,
    RequestParsed,
    RequestReceived,
    Tokenized,
)
from reference_server.serving.gateway_intake import RequestContext, read_json_body, request_id_for
from reference_server.serving.gateway_metrics import GatewayMetrics
from reference_server.serving.gateway_openai import (
    CHAT,
    TEXT_COMPLETION,
    CompletionRequest,
    OpenAIError,
    parse_chat_request,
    parse_completion_request,
)
from reference_server.serving.gateway_sse import GenerationResponse
from reference_server.serving.gateway_tenants import TenantAuth
from reference_server.serving.worker_hooks import RouteDecision, WorkerObserver

__all__ = ["Gateway", "GatewayConfig", "RouteListener", "create_app"]

_INLINE_TOKENIZE_CHARS = 32_768  # longer prompts are tokenized on a worker thread


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The gateway's options. ``auth`` with no keys (the default) serves everyone as tenant
    "default". ``slo_classes`` must be the classes the backend's engines know (the
    ``EngineConfig.slo_classes``); the gateway resolves a request's class and its TTFT
    deadline from them."""

    auth: TenantAuth = field(default_factory=TenantAuth)
    slo_classes: tuple[SLOClass, ...] = DEFAULT_SLO_CLASSES
    max_body_bytes: int = 1 << 20  # 1 MiB
    delays: DelayConfig = field(default_factory=DelayConfig)
    default_temperature: float = 1.0  # OpenAI's default when a request gives none
    default_completion_max_tokens: int = 16  # /v1/completions default, as OpenAI's
    served_model_names: tuple[str, ...] = ()  # accepted model names besides backend.model_name

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"GatewayConfig.max_body_bytes must be >= 1, got {self.max_body_bytes!r}")
        if not self.slo_classes:
            raise ValueError("GatewayConfig.slo_classes must not be empty")
        if self.default_completion_max_tokens < 1:
            raise ValueError("GatewayConfig.default_completion_max_tokens must be >= 1")
        names = {c.name for c in self.slo_classes}
        defaults = {self.auth.default_slo_class, *self.auth.default_slo_classes.values()}
        unknown = sorted(defaults - names)
        if unknown:
            raise ValueError(f"default SLO class(es) {', '.join(unknown)} not among slo_classes "
                             f"{', '.join(sorted(names))}")


class RouteListener(WorkerObserver):
    """Remembers the backend's first route decision for requests the gateway is routing,
    so the ``on_routed`` hook can end when the backend handed the request over. Safe to
    call from any thread (single dict operations)."""

    def __init__(self) -> None:
        self._decisions: dict[str, tuple[int, str] | None] = {}

    def expect(self, request_id: str) -> None:
        self._decisions[request_id] = None

    def forget(self, request_id: str) -> None:
        self._decisions.pop(request_id, None)

    def decision(self, request_id: str) -> tuple[int, str] | None:
        """``(end_ns, instance)`` of the first decision, if one came."""
        return self._decisions.get(request_id)

    def on_route(self, event: RouteDecision) -> None:
        if event.attempt == 0 and self._decisions.get(event.request_id, 0) is None:
            self._decisions[event.request_id] = (event.end_ns, event.instance)


class Gateway:
    """The app's state (``app.state.gateway``): backend, config, hooks and metrics."""

    def __init__(self, backend: Backend, *, config: GatewayConfig, observers: Iterable[Any] = ()) -> None:
        self.backend = backend
        self.config = config
        self.hooks = GatewayHooks(tuple(observers))
        self.metrics = GatewayMetrics(backend.stats)
        self.route_listener = RouteListener()
        self._slo = {c.name: c for c in config.slo_classes}
        self._started_s = int(time.time())  # wall clock, s (the models' "created")

    def add_observer(self, observer: Any) -> None:
        """Attach a :class:`~reference_server.serving.gateway_hooks.GatewayObserver`."""
        self.hooks.add(observer)

    def remove_observer(self, observer: Any) -> None:
        """Detach an observer; ``ValueError`` if it is not attached."""
        self.hooks.remove(observer)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.backend.model_name, *self.config.served_model_names)

    # ------------------------------------------------------------------ plain endpoints

    async def models(self, request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": self._started_s, "owned_by": "reference_server",
                 "max_model_len": self.backend.max_model_len} for name in self.model_names]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        """200 when every role present has a live instance, else 503; per-instance status."""
        stats = self.backend.stats()
        roles = sorted({inst.role for inst in stats.instances})
        missing = [role for role in roles if not any(i.alive for i in stats.instances if i.role == role)]
        healthy = bool(roles) and not missing
        instances = [{"name": i.name, "role": i.role, "alive": i.alive, "num_waiting": i.num_waiting,
                      "num_running": i.num_running} for i in stats.instances]
        body = {"status": "ok" if healthy else "unavailable", "missing_roles": missing, "instances": instances}
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Any:
        return await self._generation(request, TEXT_COMPLETION)

    async def chat_completions(self, request: Request) -> Any:
        return await self._generation(request, CHAT)

    # ------------------------------------------------------------------ generation intake

    async def _generation(self, request: Request, operation: str) -> Any:
        ctx = self._received(request)
        try:
            if ctx.tenant is None:
                raise OpenAIError(401, "Incorrect API key provided. Pass a known key as 'Authorization: Bearer "
                                  "<key>'.", code="invalid_api_key")
            body = await read_json_body(request, max_bytes=self.config.max_body_bytes)
            parsed = parse_chat_request(body) if operation == CHAT else parse_completion_request(body)
            self._accept(ctx, parsed, request.headers.get("x-slo-class"))
            prompt_ids = await self._tokenize(ctx, parsed)
            sampling = self._sampling(parsed, len(prompt_ids))
        except OpenAIError as err:
            return self._reject(ctx, err)
        slo = self._slo[ctx.slo_class]
        req = GenerateRequest(ctx.request_id, prompt_ids, sampling, ctx.tenant, ctx.slo_class, ctx.arrival_ns,
                              ctx.arrival_ns + int(slo.ttft_ms * 1e6), ctx.traceparent)
        return GenerationResponse(self, ctx, req)

    def _received(self, request: Request) -> RequestContext:
        arrival_ns = time.monotonic_ns()  # gateway monotonic clock, ns
        headers = request.headers
        client_id = headers.get("x-request-id")
        ctx = RequestContext(request_id_for(client_id), request.url.path, arrival_ns,
                             tenant=self.config.auth.tenant_for(headers.get("authorization")),
                             traceparent=headers.get("traceparent"))
        if self.hooks.observers:
            self.hooks.emit("on_request_received", RequestReceived(
                ctx.request_id, arrival_ns, ctx.endpoint, ctx.tenant, headers.get("x-slo-class"), client_id,
                ctx.traceparent))
        return ctx

    def _accept(self, ctx: RequestContext, parsed: CompletionRequest, slo_header: str | None) -> None:
        """Check the model and resolve the SLO class; fire ``on_request_parsed``."""
        if parsed.model not in self.model_names:
            raise OpenAIError(404, f"The model `{parsed.model}` does not exist. Available: "
                              f"{', '.join(self.model_names)}", param="model", code="model_not_found")
        assert ctx.tenant is not None  # checked by the caller (401)
        slo_class = slo_header or parsed.slo_class or self.config.auth.slo_class_for(ctx.tenant)
        if slo_class not in self._slo:
            raise OpenAIError(400, f"unknown SLO class {slo_class!r}; known: {', '.join(self._slo)}",
                              param="slo_class", code="invalid_slo_class")
        ctx.operation, ctx.model, ctx.slo_class = parsed.operation, parsed.model, slo_class
        ctx.stream, ctx.include_usage = parsed.stream, parsed.include_usage
        if self.hooks.observers:
            self.hooks.emit("on_request_parsed", RequestParsed(
                ctx.request_id, time.monotonic_ns(), ctx.operation, ctx.model, ctx.tenant, ctx.slo_class,
                ctx.stream, parsed.max_tokens or 0))

    async def _tokenize(self, ctx: RequestContext, parsed: CompletionRequest) -> tuple[int, ...]:
        """Prompt (or chat template) -> token ids, checked against the context window."""
        start_ns = time.monotonic_ns()
        await self.config.delays.delay("tokenize")
        tokenizer = self.backend.tokenizer
        text = apply_chat_template([dict(m) for m in parsed.messages]) if parsed.messages is not None else parsed.prompt
        if isinstance(text, str):
            if len(text) > _INLINE_TOKENIZE_CHARS:  # keep the event loop free for other streams
                ids = tuple(await asyncio.to_thread(tokenizer.encode, text))
            else:
                ids = tuple(tokenizer.encode(text))
        else:
            ids = tuple(parsed.prompt or ())
            bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise OpenAIError(400, f"prompt token id {bad[0]} is outside the vocabulary "
                                  f"[0, {tokenizer.vocab_size})", param="prompt")
        end_ns = time.monotonic_ns()
        ctx.num_prompt_tokens = len(ids)
        if self.hooks.observers:
            self.hooks.emit("on_tokenized", Tokenized(ctx.request_id, start_ns, end_ns, len(ids)))
        param = "messages" if parsed.messages is not None else "prompt"
        if not ids:
            raise OpenAIError(400, "the prompt is empty", param=param)
        limit = self.backend.max_model_len
        if len(ids) >= limit:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                              f"{param} has {len(ids)} tokens and at least one output token is needed.",
                              param=param, code="context_length_exceeded")
        return ids

    def _sampling(self, parsed: CompletionRequest, num_prompt_tokens: int) -> SamplingParams:
        room = self.backend.max_model_len - num_prompt_tokens  # output tokens that still fit, >= 1
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            max_tokens = room if parsed.operation == CHAT else min(room, self.config.default_completion_max_tokens)
        elif max_tokens > room:
            param = "max_completion_tokens" if parsed.operation == CHAT else "max_tokens"
            raise OpenAIError(400, f"This model's maximum context length is {self.backend.max_model_len} tokens. "
                              f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                              f"({num_prompt_tokens} in the prompt, {max_tokens} in the completion).",
                              param=param, code="context_length_exceeded")
        temperature = self.config.default_temperature if parsed.temperature is None else parsed.temperature
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=parsed.top_k,
                                  top_p=parsed.top_p, seed=parsed.seed, stop=parsed.stop,
                                  ignore_eos=parsed.ignore_eos)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=None) from None

    def _reject(self, ctx: RequestContext, err: OpenAIError) -> Response:
        self.metrics.requests.labels(ctx.endpoint, str(err.status), "rejected").inc()
        if self.hooks.observers:
            self.hooks.emit("on_request_finished", GatewayRequestFinished(
                ctx.request_id, time.monotonic_ns(), err.status, "rejected", ctx.num_prompt_tokens, 0, err.message))
        headers = {"x-request-id": ctx.request_id}
        if err.status == 401:
            headers["www-authenticate"] = "Bearer"
        return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(backend: Backend, *, config: GatewayConfig | None = None, observers: Iterable[Any] = (),
               manage_backend: bool = True) -> Starlette:
    """The gateway's Starlette app. With ``manage_backend`` the app's lifespan starts and
    stops ``backend``; otherwise the caller does. ``app.state.gateway`` is the
    :class:`Gateway` (``add_observer`` / ``remove_observer``, ``metrics``, ``hooks``)."""
    gateway = Gateway(backend, config=config or GatewayConfig(), observers=observers)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_backend:
            await backend.start()
        backend.add_observer(gateway.route_listener)
        try:
            yield
        finally:
            backend.remove_observer(gateway.route_listener)
            if manage_backend:
                await backend.stop()

    routes = [
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.gateway = gateway
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path 404, wrong method 405) in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    err = OpenAIError(status, f"{detail}: {request.method} {request.url.path}", param=None)
    return JSONResponse(err.body(), status_code=status, headers=getattr(exc, "headers", None))
