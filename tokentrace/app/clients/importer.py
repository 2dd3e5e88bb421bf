"""Record a parsed client export as run ``R``'s client lane (one instance of role ``client``).

Times go onto the run's reference clock first: wall-clock tools through the run's wall-clock
anchor (:meth:`tokentrace.clock.RunClocks.reference_anchor`), monotonic ones unchanged (same
host). Each record is then matched to a server request (:mod:`.matching`) and written under
that request's key, so its ``request_id`` joins the server's rows; an unmatched record keeps
the id its tool sent (or ``<tool>-<n>``) and joins nothing. The rows are those
``tokentrace bench`` writes for its own requests (``tokentrace.app.bench.runner.record_outcome``):
arrival = send, one ``tokens`` row per reported chunk with ``recv_ns``, first token = chunk 0.
The counts of records matched by id, by time and not at all go into the run manifest
(``client_records``, ``client_matched_by_id``, ``client_matched_by_time``, ``client_unmatched``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow.compute as pc

from tokentrace.app.clients.aiperf import read_aiperf
from tokentrace.app.clients.guidellm import read_guidellm
from tokentrace.app.clients.matching import Match, MatchKind, match_records
from tokentrace.app.clients.records import ClientExport, ClientRecord, TimeBase
from tokentrace.app.clients.vllm_bench import read_vllm_bench
from tokentrace.clock import Anchor, RunClocks
from tokentrace.recorder import BufferedRecorder, CounterSink
from tokentrace.schema import INSTANCES, REQUESTS, Role, col
from tokentrace.store import StoreError, open_run
from tokentrace.store.writer import StoreWriter

__all__ = ["FORMATS", "ImportSummary", "read_client_file", "import_client_file"]

FORMATS: dict[str, Callable[[Path], ClientExport]] = {
    "aiperf": read_aiperf,
    "guidellm": read_guidellm,
    "vllm-bench": read_vllm_bench,
}
"""``--format`` name -> parser."""


@dataclass(frozen=True, slots=True)
class ImportSummary:
    """What :func:`import_client_file` recorded."""

    tool: str
    version: str
    run_id: str
    instance_name: str
    num_records: int
    num_by_id: int
    num_by_time: int
    num_unmatched: int
    num_chunks: int
    notes: tuple[str, ...]


def read_client_file(path: str | Path, fmt: str) -> ClientExport:
    """Parse ``path`` as ``fmt``; ``ValueError`` (one sentence) for an unknown format or a bad file."""
    parse = FORMATS.get(fmt.strip().lower())
    if parse is None:
        raise ValueError(f"unknown client format {fmt!r}; formats: {', '.join(FORMATS)}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    return parse(path)


def _server_requests(run, clocks: RunClocks) -> dict[str, int]:
    """Server request key -> earliest arrival on the reference clock (client instances left out)."""
    inst = run.table(INSTANCES.name)
    clients = {i for i, r in zip(inst.column(col.INSTANCE_ID).to_pylist(), inst.column(col.ROLE).to_pylist())
               if r == Role.CLIENT}
    req = run.table(REQUESTS.name, columns=[col.REQUEST_KEY, col.INSTANCE_ID, col.ARRIVAL_NS])
    req = req.filter(pc.is_valid(req.column(col.ARRIVAL_NS)))
    out: dict[str, int] = {}
    for key, iid, t in zip(*(req.column(c).to_pylist() for c in (col.REQUEST_KEY, col.INSTANCE_ID, col.ARRIVAL_NS))):
        if iid in clients or not key:
            continue
        t = clocks.to_reference_ns(iid, t)
        out[key] = min(out.get(key, t), t)
    return out


def _to_reference(export: ClientExport, clocks: RunClocks) -> Callable[[int], int]:
    if export.time_base is TimeBase.MONOTONIC:
        return lambda t: t
    anchor = clocks.reference_anchor()
    if anchor is None:
        raise ValueError("the run's instances carry no wall-clock anchor, so wall-clock client times cannot be "
                         "placed on its clock")
    return anchor.to_mono_ns


def _server_tenants(run) -> dict[str, str]:
    """Server request key -> its tenant: a request's id is drawn from both, so the client's rows take
    the server's tenant to join its rows."""
    req = run.table(REQUESTS.name, columns=[col.REQUEST_KEY, col.TENANT])
    out: dict[str, str] = {}
    for key, tenant in zip(req.column(col.REQUEST_KEY).to_pylist(), req.column(col.TENANT).to_pylist()):
        if key and tenant:
            out.setdefault(key, tenant)
    return out


def _record(recorder: BufferedRecorder, rec: ClientRecord, key: str, to_ref: Callable[[int], int],
            content_first: bool, tenant: str = "") -> None:
    rid = recorder.request_begin(key, tenant=tenant, arrival_ns=to_ref(rec.send_ns),
                                 num_prompt_tokens=rec.num_prompt_tokens, session=rec.session,
                                 session_turn=rec.session_turn)
    first = -1
    for index, t in rec.chunks:
        recorder.token(rid, index, recv_ns=to_ref(t))
        if index == 0:
            first = to_ref(t)
    recorder.request_end(rid, finish_ns=to_ref(rec.finish_ns) if rec.finish_ns >= 0 else -1, status=rec.status,
                         first_token_ns=first, num_output_tokens=rec.num_output_tokens,
                         num_cached_tokens=rec.num_cached_tokens, error=rec.error,
                         first_content_ns=first if content_first else -1)


def import_client_file(path: str | Path, fmt: str, *, store: str | Path, run: str) -> ImportSummary:
    """Record ``path`` (a ``fmt`` results file) as the client lane of run ``run`` of ``store``.

    The run must exist (its server rows are what the records are matched to). Raises
    ``ValueError`` (``StoreError`` included) with one sentence for a bad file, an unknown run or
    a run that already has this tool's client lane; ``OSError`` if the store cannot be written.
    """
    export = read_client_file(path, fmt)
    opened = open_run(store, run)
    name = f"{export.tool}-client"
    inst = opened.table(INSTANCES.name)
    if name in inst.column(col.NAME).to_pylist():
        raise StoreError(f"run {opened.run_id} already has a {name} lane; import into another run")
    clocks = RunClocks.from_instances(inst)
    to_ref = _to_reference(export, clocks)
    server = _server_requests(opened, clocks)
    tenants = _server_tenants(opened)
    if not server:
        raise StoreError(f"run {opened.run_id} has no server requests to match the client records to")
    matches: list[Match] = match_records([(r.key, to_ref(r.send_ns)) for r in export.records], server)
    writer = StoreWriter(opened.path.parent, run_id=opened.run_id, config={"source": "ingest-client"})
    recorder = BufferedRecorder(writer, instance_id=writer.instance_id)
    t0 = to_ref(export.records[0].send_ns)
    anchor = clocks.reference_anchor()
    recorder.instance(role=Role.CLIENT, name=name, host="", pid=0,
                      anchor=Anchor(t0, anchor.to_wall_ns(t0)) if anchor is not None else None)
    counts = {kind: 0 for kind in MatchKind}
    try:
        for rec, m in zip(export.records, matches):
            counts[m.kind] += 1
            key = m.server_key or rec.key or f"{export.tool}-{rec.index}"
            _record(recorder, rec, key, to_ref, content_first=export.tool == "aiperf", tenant=tenants.get(key, ""))
        recorder.flush()
        if isinstance(writer, CounterSink):
            writer.update_counters({"client_records": len(export.records),
                                    "client_matched_by_id": counts[MatchKind.ID],
                                    "client_matched_by_time": counts[MatchKind.TIME],
                                    "client_unmatched": counts[MatchKind.NONE]})
    finally:
        recorder.close()
    return ImportSummary(export.tool, export.version, opened.run_id, name, len(export.records),
                         counts[MatchKind.ID], counts[MatchKind.TIME], counts[MatchKind.NONE],
                         sum(len(r.chunks) for r in export.records), export.notes)
