"""``tokentrace demo``: the reference server, disaggregated and traced, replaying a real trace.

Exit status: 0 when the demo ran (Ctrl-C while the dashboard is served included),
2 on bad options, a missing trace or a dashboard port in use (checked first), 1 when
the server did not start, 130 when interrupted before the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tokentrace.app.cli import EXIT_USAGE, check_path

__all__ = ["register", "demo_command"]
EXIT_SERVER = 1
EXIT_INTERRUPTED = 130


def demo_command(
    store: Annotated[Path, typer.Option(help="Store folder the demo writes its run into.")] = Path("demo-store"),
    requests: Annotated[int, typer.Option(min=1, help="Requests of the trace to replay (its first N).")] = 80,
    no_dashboard: Annotated[bool, typer.Option("--no-dashboard", help="Print the report and exit.")] = False,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Dashboard port on 127.0.0.1.")] = 8050,
    model: Annotated[Optional[str], typer.Option(
        help="Reference model: a preset (tiny, small: random weights) or the bundled trained model (trained). "
             "Default: trained.")] = None,
    speculative: Annotated[bool, typer.Option(
        "--speculative", help="Speculative decoding on the decode worker: the bundled draft model proposes "
                              "tokens for the trained model, which verifies them.")] = False,
    time_scale: Annotated[float, typer.Option(help="Multiply the trace's arrival times (<1 = faster).")] = 1.0,
    length_scale: Annotated[float, typer.Option(help="Multiply prompt lengths.")] = 1 / 64,
    output_scale: Annotated[float, typer.Option(help="Multiply output lengths (the trace's; 1/16: ~22 tokens "
                                                     "per request).")] = 1 / 16,
    block_size: Annotated[int, typer.Option(min=1, help="Server KV block size in tokens.")] = 8,
    trace: Annotated[Optional[Path], typer.Option(help="Mooncake JSONL trace (default: its first 80 requests, shipped "
                                                            "with tokentrace; more need the whole file).")] = None,
    run: Annotated[Optional[str], typer.Option(help="Run id to write (default: a new time-stamped id).")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (default: the server's choice).")] = None,
    sessions: Annotated[Optional[str], typer.Option(
        help="Multi-turn sessions instead of the trace: agent (short tool-call turns on a long context) or chat.")]
    = None,
    num_sessions: Annotated[int, typer.Option(min=1, help="Sessions to run with --sessions.")] = 12,
    kv_retention: Annotated[str, typer.Option(
        help="The server's KV retention between a session's turns: lru, keep, offload or drop.")] = "lru",
) -> None:
    """Replay a real trace through the traced reference server, print where the time went, serve the dashboard.

    The reference server runs disaggregated under `tokentrace run`; a Mooncake slice drives it.
    Three tenants share it."""
    from tokentrace.app.demo import SPECULATIVE_SOURCE, DemoOptions, run_demo
    from tokentrace.app.demo.server import ServerStartError
    from tokentrace.store import StoreError

    check_path(store, "store")
    check_path(trace, "trace")
    opts = DemoOptions(store=store, num_requests=requests, model=model, time_scale=time_scale,
                       length_scale=length_scale, output_scale=output_scale, block_size=block_size, trace=trace,
                       run=run, dashboard=not no_dashboard, port=port, device=device,
                       speculative=SPECULATIVE_SOURCE if speculative else None, sessions=sessions,
                       num_sessions=num_sessions, kv_retention=kv_retention)
    try:
        run_demo(opts)
    except ServerStartError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(EXIT_SERVER) from None
    except (ValueError, StoreError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
