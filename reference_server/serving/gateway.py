"""The OpenAI-compatible HTTP gateway: a Starlette app in front of a :class:`Backend`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or
false), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Build it with
:func:`create_app` and serve it with uvicorn (bind 127.0.0.1)::

    app = create_app(LocalBackend(EngineConfig()), config=GatewayConfig())
    uvicorn.run(app, host="127.0.0.1", port=8000)

A generation request goes: headers received (request id, tenant from the API key) ->
body read under a size and a time limit and validated -> SLO class resolved -> prompt
tokenized -> handed to the backend -> tokens streamed back (:mod:`.gateway_sse`). Every
refusal is a 4xx/5xx with OpenAI's error body. Hook points: :mod:`.gateway_hooks`; metrics:
:mod:`.gateway_metrics`; injected delays (tokenize, route, detokenize, stream_send):
:mod:`.delays`. Everything runs on the event-loop thread.

Tenants are kept apart. With API keys configured, ``/metrics`` and ``/health`` answer in
full to an admin key only; a tenant's key sees its own series and the overall status; no
key gets 401. A client's ``X-Request-Id`` names a request among its tenant's requests
only: reusing one that is still in flight for the same tenant gets 409, and one in flight
for another tenant changes nothing in the answer (the backend serves it under a private
id, and observers do not see it, so neither tenant's trace is mixed with the other's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
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
from reference_server.serving.gateway_intake import (
    InFlightIds,
    RequestContext,
    read_json_body,
    request_id_for,
    session_of,
)
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
from reference_server.serving.http_framing import FramingGuard
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
    body_timeout_s: float = 30.0  # a body must arrive within this long of its headers, else 408
    delays: DelayConfig = field(default_factory=DelayConfig)
    default_temperature: float = 1.0  # OpenAI's default when a request gives none
    default_completion_max_tokens: int = 16  # /v1/completions default, as OpenAI's
    served_model_names: tuple[str, ...] = ()  # accepted model names besides backend.model_name

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"GatewayConfig.max_body_bytes must be >= 1, got {self.max_body_bytes!r}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"GatewayConfig.body_timeout_s must be > 0, got {self.body_timeout_s!r}")
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
        self._untraced = _Untraced(self)
        self._ids = InFlightIds()

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
        """200 when every role present has a live instance, else 503; per-instance status
        (only the status for a tenant's key when tenants are configured; 401 without a key)."""
        scope = self._reader_scope(request)
        if isinstance(scope, Response):
            return scope
        stats = self.backend.stats()
        roles = sorted({inst.role for inst in stats.instances})
        missing = [role for role in roles if not any(i.alive for i in stats.instances if i.role == role)]
        healthy = bool(roles) and not missing
        body: dict[str, Any] = {"status": "ok" if healthy else "unavailable"}
        if scope is _ADMIN:
            body["missing_roles"] = missing
            body["instances"] = [{"name": i.name, "role": i.role, "alive": i.alive, "num_waiting": i.num_waiting,
                                  "num_running": i.num_running} for i in stats.instances]
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        """Every series for an admin key (or without tenants); a tenant's own series for its key."""
        scope = self._reader_scope(request)
        if isinstance(scope, Response):
            return scope
        text = self.metrics.render() if scope is _ADMIN else self.metrics.render_tenant(scope)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    def _reader_scope(self, request: Request) -> Any:
        """``_ADMIN``, the tenant whose key the request carries, or a 401 response."""
        authorization = request.headers.get("authorization")
        auth = self.config.auth
        if auth.is_admin(authorization):
            return _ADMIN
        tenant = auth.tenant_for(authorization)
        if tenant is not None:
            return tenant
        err = OpenAIError(401, f"{request.url.path} needs an API key: an admin key for everything, a tenant's key "
                          f"for its own view. Pass it as 'Authorization: Bearer <key>'.", code="invalid_api_key")
        return _error_response(err, {"www-authenticate": "Bearer"})

    async def completions(self, request: Request) -> Any:
        return await self._generation(request, TEXT_COMPLETION)

    async def chat_completions(self, request: Request) -> Any:
        return await self._generation(request, CHAT)

    # ------------------------------------------------------------------ generation intake

    async def _generation(self, request: Request, operation: str) -> Any:
        ctx = self._received(request)
        handed_over = False
        try:
            if ctx.tenant is None:
                raise OpenAIError(401, "Incorrect API key provided. Pass a known key as 'Authorization: Bearer "
                                  "<key>'.", code="invalid_api_key")
            if ctx.duplicate_of is not None:
                raise OpenAIError(409, f"X-Request-Id {ctx.duplicate_of!r} is already in use by another of your "
                                  f"requests in flight; use a new id per request", param=None,
                                  code="duplicate_request_id")
            body = await read_json_body(request, max_bytes=self.config.max_body_bytes,
                                        timeout_s=self.config.body_timeout_s)
            parsed = parse_chat_request(body) if operation == CHAT else parse_completion_request(body)
            self._accept(ctx, parsed, request.headers.get("x-slo-class"))
            prompt_ids = await self._tokenize(ctx, parsed)
            sampling = self._sampling(parsed, len(prompt_ids))
            slo = self._slo[ctx.slo_class]
            req = GenerateRequest(ctx.backend_id, prompt_ids, sampling, ctx.tenant, ctx.slo_class, ctx.arrival_ns,
                                  ctx.arrival_ns + int(slo.ttft_ms * 1e6), ctx.traceparent,
                                  session_of(request.headers.get("x-session-id"), parsed.user))
            response = GenerationResponse(self if ctx.traced else self._untraced, ctx, req)
            handed_over = True
            return _Releasing(response, lambda: self._ids.release(ctx))
        except OpenAIError as err:
            return self._reject(ctx, err)
        finally:
            if not handed_over:
                self._ids.release(ctx)

    def _received(self, request: Request) -> RequestContext:
        arrival_ns = time.monotonic_ns()  # gateway monotonic clock, ns
        headers = request.headers
        client_id = headers.get("x-request-id")
        tenant = self.config.auth.tenant_for(headers.get("authorization"))
        ctx = RequestContext(request_id_for(client_id), request.url.path, arrival_ns, tenant=tenant,
                             traceparent=headers.get("traceparent"))
        self._ids.claim(ctx)
        if ctx.traced and self.hooks.observers:
            self.hooks.emit("on_request_received", RequestReceived(
                ctx.request_id, arrival_ns, ctx.endpoint, ctx.tenant, headers.get("x-slo-class"), client_id,
                ctx.traceparent, headers.get("x-session-id"), headers.get("x-session-turn")))
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
        if ctx.traced and self.hooks.observers:
            self.hooks.emit("on_request_parsed", RequestParsed(
                ctx.request_id, time.monotonic_ns(), ctx.operation, ctx.model, ctx.tenant, ctx.slo_class,
                ctx.stream, parsed.max_tokens or 0, parsed.user or ""))

    async def _tokenize(self, ctx: RequestContext, parsed: CompletionRequest) -> tuple[int, ...]:
        """Prompt (or chat template) -> token ids, checked against the context window."""
        start_ns = time.monotonic_ns()
        await self.config.delays.delay("tokenize")
        tokenizer = self.backend.tokenizer
        text = apply_chat_template([dict(m) for m in parsed.messages]) if parsed.messages is not None else parsed.prompt
        param = "messages" if parsed.messages is not None else "prompt"
        if isinstance(text, str):
            try:
                if len(text) > _INLINE_TOKENIZE_CHARS:  # keep the event loop free for other streams
                    ids = tuple(await asyncio.to_thread(tokenizer.encode, text))
                else:
                    ids = tuple(tokenizer.encode(text))
            except ValueError as exc:  # text the tokenizer cannot take (e.g. a lone surrogate)
                raise OpenAIError(400, f"the {param} cannot be tokenized: {exc}", param=param) from None
        else:
            ids = tuple(parsed.prompt or ())
            bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise OpenAIError(400, f"prompt token id {bad[0]} is outside the vocabulary "
                                  f"[0, {tokenizer.vocab_size})", param="prompt")
        end_ns = time.monotonic_ns()
        ctx.num_prompt_tokens = len(ids)
        if ctx.traced and self.hooks.observers:
            self.hooks.emit("on_tokenized", Tokenized(ctx.request_id, start_ns, end_ns, len(ids)))
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
        if ctx.traced and self.hooks.observers:
            self.hooks.emit("on_request_finished", GatewayRequestFinished(
                ctx.request_id, time.monotonic_ns(), err.status, "rejected", ctx.num_prompt_tokens, 0, err.message))
        headers = {"x-request-id": ctx.request_id}
        if err.status == 401:
            headers["www-authenticate"] = "Bearer"
        if err.status == 408:
            headers["connection"] = "close"  # the rest of the body may still be on its way
        return _error_response(err, headers)


_ADMIN: Any = object()  # the scope of a reader that may see everything (admin key, or no tenants configured)


class _Untraced:
    """What a response needs of the gateway, with no observers: serves a request whose id is
    another tenant's without it reaching anyone's trace (``GatewayParts`` of ``gateway_sse``)."""

    def __init__(self, gateway: Gateway) -> None:
        self.config = gateway.config
        self.backend = gateway.backend
        self.metrics = gateway.metrics
        self.route_listener = RouteListener()  # never told of a decision: no on_routed is emitted anyway
        self.hooks = GatewayHooks(())


class _Releasing:
    """An ASGI response that runs ``release`` once the wrapped one is done (however it ends)."""

    def __init__(self, response: Any, release: Any) -> None:
        self.response = response
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self._release()


def _error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error body as JSON; non-ASCII escaped, so any echoed input serializes."""
    return Response(json.dumps(err.body()).encode(), status_code=err.status, headers=headers,
                    media_type="application/json")


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
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(FramingGuard)])
    app.state.gateway = gateway
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path 404, wrong method 405) in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    err = OpenAIError(status, f"{detail}: {request.method} {request.url.path}", param=None)
    return _error_response(err, getattr(exc, "headers", None))
