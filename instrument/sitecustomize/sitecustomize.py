"""Loaded by Python at start-up when ``tokentrace run`` put this folder on ``PYTHONPATH``.

With ``TOKENTRACE_STORE`` unset this costs one environment lookup and does
nothing else. With it set, ``instrument.autoinstrument.install()`` hooks the
reference server's imports (see that module). Whatever happens, the program
starts: a failure is logged once as a warning. Afterwards the next
``sitecustomize`` on ``sys.path`` (if any, e.g. a distribution's) is run too,
since this one shadows it.
"""

from __future__ import annotations

import os
import sys


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows, as ``opentelemetry-instrument`` does."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("TOKENTRACE_STORE"):
    try:
        from instrument.autoinstrument import install

        install()
    except Exception as _exc:  # never break the traced program
        import logging

        logging.getLogger("tokentrace").warning(
            "tokentrace: could not set up tracing (%s: %s); the program runs on without it",
            type(_exc).__name__, _exc)
    try:
        _chain_next_sitecustomize()
    except Exception:
        pass
