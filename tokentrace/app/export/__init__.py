"""``tokentrace export``: a run in formats other tools open (Perfetto / Chrome trace-event JSON).

Modules import the analyzers lazily, inside functions, so the core package does
not depend on :mod:`analyzers` at import time.
"""

from __future__ import annotations

from tokentrace.app.export.perfetto import perfetto_trace, trace_events, write_perfetto

__all__ = ["EXPORT_FORMATS", "perfetto_trace", "trace_events", "write_perfetto"]

EXPORT_FORMATS: tuple[str, ...] = ("perfetto", "otlp")
"""Formats ``tokentrace export --format`` accepts."""
