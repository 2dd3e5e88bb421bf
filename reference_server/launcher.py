"""One command for the whole stack: workers, then the gateway on uvicorn.

``python -m reference_server --mode colocated --instances 2`` (engine workers as
separate processes), ``--mode disagg --prefill 1 --decode 2`` (prefill and decode
workers, KV moved between them over sockets) or ``--mode local`` (one engine inside the
gateway process). The gateway binds ``--host``/``--port`` (127.0.0.1:8000 by default;
port 0 picks a free one) and prints ``READY http://HOST:PORT`` once it listens (health:
``GET /health``). Ctrl-C or SIGTERM stops the gateway, which stops every worker process
it started; workers also exit on their own if the launcher dies (their control
connection closes).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from typing import Any

from reference_server.engine import EngineConfig, TenantConfig
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
    p.add_argument("--model", default="tiny", help="model preset (tiny, small)")
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
    p.add_argument("--seed", type=int, default=0, help="random weights seed")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--kv-chunk-blocks", type=int, default=16, help="KV blocks per transfer frame")
    p.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds without a pong = dead worker")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def build_engine_config(args: argparse.Namespace, tenants: list[TenantConfig] | None = None) -> EngineConfig:
    """The engine config every instance uses. ``ValueError`` on bad values."""
    tenant_list = list(tenants or [])
    if not any(t.name == "default" for t in tenant_list):
        tenant_list.append(TenantConfig("default"))
    return EngineConfig(
        model=args.model, checkpoint=args.checkpoint, seed=args.seed, device=args.device,
        block_size=args.block_size, num_device_blocks=args.num_device_blocks, num_host_blocks=args.num_host_blocks,
        num_disk_blocks=args.num_disk_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, scheduling_policy=args.scheduling_policy,
        preemption_mode=args.preemption_mode, tenants=tuple(tenant_list))


def build_backend(args: argparse.Namespace, config: EngineConfig, delays: DelayConfig) -> Any:
    """A LocalBackend (``--mode local``) or a ClusterBackend (not started)."""
    if args.mode == "local":
        from reference_server.serving.backend import LocalBackend
        return LocalBackend(config, delays=delays)
    from reference_server.serving.cluster import ClusterBackend
    return ClusterBackend(
        config, mode=args.mode, num_instances=args.instances, num_prefill=args.prefill, num_decode=args.decode,
        router=args.router, delays=delays, kv_chunk_blocks=args.kv_chunk_blocks, host=args.host,
        heartbeat_timeout_s=args.heartbeat_timeout)


def _build_app(args: argparse.Namespace) -> Any:
    from reference_server.serving.gateway import GatewayConfig, create_app
    from reference_server.serving.gateway_tenants import TenantAuth, load_tenants
    tenants: list[TenantConfig] = []
    auth = TenantAuth()
    if args.tenants:
        tenants, keys, defaults = load_tenants(args.tenants)
        auth = TenantAuth(keys=keys, default_slo_classes=defaults)
    delays = DelayConfig.parse(args.delay)
    config = build_engine_config(args, tenants)
    from reference_server.serving.router import Router
    Router(args.router)  # validate the policy name before starting anything
    backend = build_backend(args, config, delays)
    gateway_config = GatewayConfig(auth=auth, slo_classes=config.slo_classes, max_body_bytes=args.max_body_bytes,
                                   delays=delays, served_model_names=tuple(args.served_model_name))
    return create_app(backend, config=gateway_config)


async def _serve(app: Any, args: argparse.Namespace) -> None:
    import uvicorn
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, lifespan="on",
                                           timeout_graceful_shutdown=5))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"READY http://{host}:{port}", flush=True)
    await task


def main(argv: list[str] | None = None) -> int:
    """Run the stack until interrupted; returns the exit status (2 on bad options)."""
    args = parse_args(argv)
    try:
        app = _build_app(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(app, args))
    return 0
