"""Subcommands of the ``tokentrace`` CLI, one module each.

Every module here defines ``register(app: typer.Typer) -> None`` that adds its
command(s) to the root app; :func:`tokentrace.app.cli.main` calls each at start-up.
Modules keep their heavy imports (the reference server, analyzers, dashboard)
inside the command functions, so ``tokentrace --help`` stays fast and the core
does not depend on the outer packages at import time.
"""
