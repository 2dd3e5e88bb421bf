"""The hot path: what a traced server calls for every event.

* :class:`Recorder` (``protocol.py``): the surface adapters record into;
* :class:`BufferedRecorder` (``buffered.py``): the implementation, appending
  integers to preallocated column buffers (``buffers.py``, strings interned by
  ``interning.py``, open requests kept by ``request_rows.py``) that a background
  thread (``flusher.py``) hands to a :class:`Sink` (``sink.py``); ``lifecycle.py``
  flushes at exit and after ``fork``.

Part of the core: imports only ``tokentrace.schema`` and ``tokentrace.clock``.
"""

from __future__ import annotations

from tokentrace.recorder.buffered import BufferedRecorder
from tokentrace.recorder.protocol import Recorder
from tokentrace.recorder.sink import CounterSink, InMemorySink, Sink

__all__ = ["Recorder", "BufferedRecorder", "Sink", "CounterSink", "InMemorySink"]
