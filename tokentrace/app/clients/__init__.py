"""Client-side results of other load generators as a run's client lane.

``tokentrace ingest-client --format aiperf|guidellm|vllm-bench FILE --store S --run R``
reads the per-request records a benchmark client wrote (:mod:`.aiperf`, :mod:`.guidellm`,
:mod:`.vllm_bench`: one parser each, checked against the tool's own writer), matches
each record to the server's request in run ``R`` (:mod:`.matching`: by the request id
the tool sent, else by send time and order) and records them as an instance of role
``client`` (:mod:`.importer`), exactly as ``tokentrace bench`` records its own: the
request row (arrival = send time) and one ``tokens`` row per received chunk
(``recv_ns``). Agreement, the waterfall's client lane and the report then read them.
"""

from __future__ import annotations

from tokentrace.app.clients.importer import FORMATS, ImportSummary, import_client_file, read_client_file
from tokentrace.app.clients.records import ClientExport, ClientRecord, TimeBase

__all__ = ["FORMATS", "ClientExport", "ClientRecord", "ImportSummary", "TimeBase", "import_client_file",
           "read_client_file"]
