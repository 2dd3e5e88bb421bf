"""The serving configuration of each traced engine lands in ``engine_configs`` (one row per instance)."""

from __future__ import annotations

from types import SimpleNamespace

from instrument.adapters import ReferenceEngineAdapter
from instrument.reference_cluster import WorkerTracer
from reference_server.engine.config import EngineConfig
from reference_server.engine.engine import Engine
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import ENGINE_CONFIGS, Role, col


def test_an_instrumented_engine_writes_its_configuration_once():
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=11, flush_interval_s=60)
    config = EngineConfig(model="tiny", block_size=4, num_device_blocks=40, num_host_blocks=8,
                          max_num_seqs=3, max_num_batched_tokens=24, scheduling_policy="slo",
                          preemption_mode="swap", enable_chunked_prefill=False)
    ReferenceEngineAdapter().attach(Engine(config), rec, Role.COLOCATED)
    rec.close()
    rows = sink.table(ENGINE_CONFIGS.name).to_pylist()
    assert rows == [{
        col.INSTANCE_ID: 11, col.ROLE: int(Role.COLOCATED), col.MAX_NUM_SEQS: 3, col.MAX_NUM_BATCHED_TOKENS: 24,
        col.KV_BLOCK_SIZE: 4, col.NUM_BLOCKS_TOTAL_DEVICE: 40, col.NUM_BLOCKS_TOTAL_HOST: 8,
        col.NUM_BLOCKS_TOTAL_DISK: 0, col.SCHEDULING_POLICY: "slo", col.PREEMPTION_MODE: "swap",
        col.CHUNKED_PREFILL: 0, col.PREFIX_CACHING: 1, col.SPECULATIVE_SOURCE: "", col.NUM_SPECULATIVE_TOKENS: 0,
    }]


def test_a_worker_tracer_records_its_role_and_speculative_settings():
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=5, flush_interval_s=60)
    engine = Engine(EngineConfig(model="tiny", num_device_blocks=32, speculative="ngram", num_speculative_tokens=3))
    worker = SimpleNamespace(role="decode", engine=engine, add_observer=lambda obs: None)
    WorkerTracer(rec, worker).attach()
    rec.close()
    (row,) = sink.table(ENGINE_CONFIGS.name).to_pylist()
    assert row[col.ROLE] == int(Role.DECODE)
    assert (row[col.SPECULATIVE_SOURCE], row[col.NUM_SPECULATIVE_TOKENS]) == ("ngram", 3)
    assert row[col.NUM_BLOCKS_TOTAL_DEVICE] == 32


def test_an_engine_without_a_configuration_writes_no_row():
    from instrument.engine_config import record_engine_config

    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=1, flush_interval_s=60)
    assert record_engine_config(rec, SimpleNamespace(), role=Role.COLOCATED) is False
    rec.close()
    assert sink.table(ENGINE_CONFIGS.name).num_rows == 0


def test_an_otlp_resource_with_engine_settings_gives_each_replica_its_configuration(tmp_path):
    """Resource attributes ``tokentrace.engine.*`` (e.g. from OTEL_RESOURCE_ATTRIBUTES on a vLLM process): one
    ``engine_configs`` row per replica however many spans it sends; a value that is no count is left out."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import tokentrace
    from instrument import semconv as sc
    from instrument.otlp_decode import PROTOBUF
    from instrument.otlp_server import store_ingestor
    from tokentrace.store import StoreWriter

    t0 = tokentrace.clock.take_anchor().wall_ns
    ingestor = store_ingestor(StoreWriter(tmp_path, run_id="otlp"))
    for replica, seqs, blocks in (("a", 8, 1024), ("b", 16, "many")):
        exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({
            sc.SERVICE_NAME: "vllm", sc.SERVICE_INSTANCE_ID: replica, sc.TT_INSTANCE_ROLE: "decode",
            "tokentrace.engine.max_num_seqs": seqs, "tokentrace.engine.max_num_batched_tokens": 2048,
            "tokentrace.engine.block_size": 16, "tokentrace.engine.num_device_blocks": blocks,
            "tokentrace.engine.scheduling_policy": "fcfs"}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("vllm.tracing")
        for k in range(3):
            span = tracer.start_span(sc.LLM_REQUEST_SPAN, start_time=t0 + k * 1_000_000, attributes={
                sc.GEN_AI_REQUEST_ID: f"{replica}-{k}", sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.05,
                sc.GEN_AI_LATENCY_E2E: 0.2, sc.GEN_AI_USAGE_PROMPT_TOKENS: 10, sc.GEN_AI_USAGE_COMPLETION_TOKENS: 4})
            span.end(end_time=t0 + k * 1_000_000 + 200_000_000)
        provider.shutdown()
        ingestor.ingest(encode_spans(list(exporter.get_finished_spans())).SerializeToString(), PROTOBUF)
    ingestor.close()
    rows = sorted(tokentrace.open(tmp_path, run="otlp").table(ENGINE_CONFIGS.name).to_pylist(),
                  key=lambda r: r[col.MAX_NUM_SEQS])
    assert [(r[col.MAX_NUM_SEQS], r[col.MAX_NUM_BATCHED_TOKENS], r[col.NUM_BLOCKS_TOTAL_DEVICE], r[col.ROLE])
            for r in rows] == [(8, 2048, 1024, int(Role.DECODE)), (16, 2048, None, int(Role.DECODE))]
    assert len({r[col.INSTANCE_ID] for r in rows}) == 2
