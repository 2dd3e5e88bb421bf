"""The hot path: what a traced server calls for every event.

* :class:`Recorder` (``protocol.py``): the surface adapters record into;
* :class:`BufferedRecorder` (``buffered.py``): the implementation, appending
  integers to preallocated column buffers (``buffers.py``, strings interned by
  ``interning.py``, open requests kept by ``request_rows.py``) that a background
  thread (``flusher.py``) hands to a :class:`Sink` (``sink.py``; a
  :class:`JournalSink` also keeps a crash journal of the rows not yet written);
  ``lifecycle.py`` flushes at exit and after ``fork``;
* :class:`ForwardingRecorder` (``forwarding.py``): the base of recorder wrappers (sampling,
  clock skew, live metrics): forwards every call, a wrapper overrides what it changes;
* ``untraced.py``: the recorder that records nothing, what ``instrument()`` falls
  back to when its store cannot be opened.

Part of the core: imports only ``tokentrace.schema`` and ``tokentrace.clock``.
"""

from __future__ import annotations

from tokentrace.recorder.buffered import BufferedRecorder
from tokentrace.recorder.forwarding import ForwardingRecorder
from tokentrace.recorder.protocol import Recorder
from tokentrace.recorder.sink import CounterSink, InMemorySink, JournalSink, Sink

__all__ = ["Recorder", "BufferedRecorder", "ForwardingRecorder", "Sink", "CounterSink", "JournalSink", "InMemorySink"]
