"""One command for the whole stack: workers, then the gateway on uvicorn.

``python -m reference_server --mode colocated --instances 2`` (engine workers as
separate processes), ``--mode disagg --prefill 1 --decode 2`` (prefill and decode
workers, KV moved between them over sockets) or ``--mode local`` (one engine inside the
gateway process). The gateway binds ``--host``/``--port`` (127.0.0.1:8000 by default;
port 0 picks a free one) and prints ``READY http://HOST:PORT`` once it listens (health:
``GET /health``). Ctrl-C or SIGTERM stops the gateway, which stops every worker process
it started, and exits 0; workers also exit on their own if the launcher dies (their control
connection closes). A Ctrl-C reaches every process of the terminal's process group, and a
supervisor (``tokentrace run``) may forward it once more: a second SIGINT within
:data:`SAME_INTERRUPT_S` of the first counts as the same one, so shutdown stays graceful (a
supervisor scheduled late on a busy host forwards it a second or more after the process group
got it; a later one forces the exit). A port that cannot be
bound, like any bad option, is one line on stderr and exit status 2, before any worker
starts.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import time
from typing import Any

from reference_server.engine import EngineConfig, TenantConfig
from reference_server.engine.speculative import check_speculative_options
from reference_server.serving.delays import DelayConfig

__all__ = ["build_backend", "build_engine_config", "main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m reference_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("local", "colocated", "disagg"), default="colocated")
    p.add_argument("--instances", type=int, default=2, help="colocated workers (--mode colocated)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (--mode disagg)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (--mode disagg)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = a free port")
    p.add_argument("--model", default="tiny",
                   help="model preset (tiny, small: random weights) or bundled trained model (trained, trained-draft)")
    p.add_argument("--checkpoint", default=None, help="local Hugging Face-format folder (overrides --model)")
    p.add_argument("--served-model-name", action="append", default=[], help="extra accepted model name")
    p.add_argument("--tenants", default=None, help="tenants file (TOML or JSON); turns API-key auth on")
    p.add_argument("--router", default="prefix_aware", help="prefix | load | round_robin (or *_aware)")
    p.add_argument("--delay", default="", help="delay injection spec, e.g. decode_step=2ms,tokenize=1ms~3ms")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-device-blocks", type=int, default=256)
    p.add_argument("--num-host-blocks", type=int, default=0)
    p.add_argument("--num-disk-blocks", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--scheduling-policy", default="fcfs", help="fcfs | slo | fair")
    p.add_argument("--preemption-mode", default="recompute", help="recompute | swap")
    p.add_argument("--kv-retention", default="lru",
                   help="a finished session turn's KV: lru | keep | offload | drop (sessions: X-Session-Id or user)")
    p.add_argument("--kv-retention-ttl", type=float, default=None, help="seconds a 'keep' pin lasts (default: "
                   "until the session's next turn)")
    p.add_argument("--kv-retention-max-blocks", type=int, default=None,
                   help="device blocks 'keep' pins at most (default: half the device tier)")
    p.add_argument("--seed", type=int, default=0, help="random weights seed")
    p.add_argument("--speculative", default=None, choices=("model", "ngram", "early_exit"),
                   help="speculative decoding: draft model, n-gram prompt lookup or early exit (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="proposals per request per step (k)")
    p.add_argument("--speculative-budget", type=int, default=16,
                   help="proposals per step over the batch: k shrinks as the batch grows, 0 = off")
    p.add_argument("--speculative-draft-model", default="trained-draft",
                   help="draft model for --speculative model: bundled name, preset or checkpoint folder")
    p.add_argument("--speculative-exit-layer", type=int, default=2, help="layers of the early-exit draft")
    p.add_argument("--speculative-ngram-min", type=int, default=2, help="shortest suffix n-gram looked up (1-3)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--kv-chunk-blocks", type=int, default=16, help="KV blocks per transfer frame")
    p.add_argument("--heartbeat-timeout", type=float, default=2.0,
                   help="seconds of a worker's silence (no frame) while the gateway runs = dead worker (then restarted)")
    p.add_argument("--restart-workers", action=argparse.BooleanOptionalAction, default=True,
                   help="start a dead worker again (backoff 1 s doubling to 30 s); off: the service stays degraded")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def build_engine_config(args: argparse.Namespace, tenants: list[TenantConfig] | None = None) -> EngineConfig:
    """The engine config every instance uses. ``ValueError`` on bad values."""
    tenant_list = list(tenants or [])
    if not any(t.name == "default" for t in tenant_list):
        tenant_list.append(TenantConfig("default"))
    config = EngineConfig(
        model=args.model, checkpoint=args.checkpoint, seed=args.seed, device=args.device,
        block_size=args.block_size, num_device_blocks=args.num_device_blocks, num_host_blocks=args.num_host_blocks,
        num_disk_blocks=args.num_disk_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, scheduling_policy=args.scheduling_policy,
        preemption_mode=args.preemption_mode, tenants=tuple(tenant_list), kv_retention=args.kv_retention,
        kv_retention_ttl_s=args.kv_retention_ttl, kv_retention_max_blocks=args.kv_retention_max_blocks,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens, speculative_budget=args.speculative_budget,
        speculative_draft_model=args.speculative_draft_model, speculative_exit_layer=args.speculative_exit_layer,
        speculative_ngram_min=args.speculative_ngram_min)
    check_speculative_options(config)
    return config


def build_backend(args: argparse.Namespace, config: EngineConfig, delays: DelayConfig) -> Any:
    """A LocalBackend (``--mode local``) or a ClusterBackend (not started)."""
    if args.mode == "local":
        from reference_server.serving.backend import LocalBackend
        return LocalBackend(config, delays=delays)
    from reference_server.serving.cluster import ClusterBackend
    return ClusterBackend(
        config, mode=args.mode, num_instances=args.instances, num_prefill=args.prefill, num_decode=args.decode,
        router=args.router, delays=delays, kv_chunk_blocks=args.kv_chunk_blocks, host=args.host,
        heartbeat_timeout_s=args.heartbeat_timeout, restart_dead_workers=args.restart_workers)


def _build_app(args: argparse.Namespace) -> Any:
    from reference_server.serving.gateway import GatewayConfig, create_app
    from reference_server.serving.gateway_tenants import TenantAuth, load_tenants
    tenants: list[TenantConfig] = []
    auth = TenantAuth()
    if args.tenants:
        tenants, _, _ = load_tenants(args.tenants)
        auth = TenantAuth.from_file(args.tenants)
    delays = DelayConfig.parse(args.delay)
    config = build_engine_config(args, tenants)
    from reference_server.serving.router import Router
    Router(args.router)  # validate the policy name before starting anything
    backend = build_backend(args, config, delays)
    gateway_config = GatewayConfig(auth=auth, slo_classes=config.slo_classes, max_body_bytes=args.max_body_bytes,
                                   delays=delays, served_model_names=tuple(args.served_model_name))
    return create_app(backend, config=gateway_config)


def _bind(host: str, port: int) -> socket.socket:
    """The gateway's listening socket; ``ValueError`` (one sentence) when it cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family = infos[0][0] if infos else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are TCP,
        # and accepted connections inherit the listener's protocol. With Nagle on, a response's small writes
        # on a kept-alive connection wait for the client's delayed ACK: ~40 ms on a token stream.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    return sock


SAME_INTERRUPT_S = 3.0
"""A second SIGINT this soon after the first is the same interrupt (see the module doc)."""


def _make_server(app: Any, log_level: str) -> Any:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn, with the same Ctrl-C delivered twice (process group + supervisor) kept graceful."""

        _first_exit_s = 0.0

        def handle_exit(self, sig: int, frame: Any) -> None:
            now = time.monotonic()
            if sig == signal.SIGINT and self.should_exit and now - self._first_exit_s < SAME_INTERRUPT_S:
                return  # the same interrupt again: a third, later one still forces the exit
            if not self.should_exit:
                self._first_exit_s = now
            super().handle_exit(sig, frame)

    return _Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))


async def _serve(app: Any, sock: socket.socket, log_level: str) -> None:
    server = _make_server(app, log_level)
    # uvicorn re-raises the signal that stopped it once it is done; this handler takes that
    # re-raise (instead of asyncio's, which would end in a KeyboardInterrupt traceback).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: setattr(server, "should_exit", True))
    host, port = sock.getsockname()[:2]
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"READY http://{host}:{port}", flush=True)
    await task


def main(argv: list[str] | None = None) -> int:
    """Run the stack until interrupted; returns the exit status (2 on bad options or a port
    that cannot be bound, 0 after a Ctrl-C or SIGTERM)."""
    args = parse_args(argv)
    try:
        sock = _bind(args.host, args.port)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        app = _build_app(args)
    except ValueError as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(app, sock, args.log_level))
    except KeyboardInterrupt:  # an interrupt before the server took over its signals
        return 130
    finally:
        sock.close()
    return 0
