"""tokentrace's application layer: what drives and renders on top of the core and the analyzers.

``cli`` (the ``tokentrace`` command), ``report``, ``export`` (Perfetto and OTLP), ``bench`` (the
load generator), ``demo``, ``clients`` (other clients' results as a client lane) and ``analysis``
(the ``Run`` that ``tokentrace.open`` returns). Nothing under ``tokentrace/`` outside this folder
imports it, except the facade's lazy ``open`` (docs/architecture.md).
"""
