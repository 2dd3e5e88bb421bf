"""The manual API and the tokentrace facade: no-op until bound, forwarding after."""

from __future__ import annotations

import pytest

import tokentrace
from tokentrace import api
from tokentrace.recorder import BufferedRecorder, Recorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import (
    CACHE_EVENTS,
    INSTANCES,
    REQUESTS,
    SPANS,
    STEPS,
    TOKENS,
    CacheEventKind,
    RequestStatus,
    Role,
    Stage,
    Tier,
    col,
    request_id_of,
)


@pytest.fixture(autouse=True)
def unbound():
    api.unbind()
    yield
    api.unbind()


@pytest.fixture
def bound():
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=8, flush_interval_s=60)
    api.bind(rec)
    yield rec, sink
    rec.close()


def _record_one_of_each() -> None:
    rid = api.request_begin("r", arrival_ns=1)
    api.span(rid, Stage.STREAM_SEND, 1, 2)
    api.token_emitted(rid, 0, 5)
    api.token_sent(rid, 0, 6)
    with api.stage(rid, Stage.DETOKENIZE, 0):
        pass
    api.step(1, 2, 3, 4, 5, 6, 7, 8, 9)
    api.cache_event(CacheEventKind.HIT, Tier.DEVICE, 1, 2, 2, rid)
    api.request_end(rid, finish_ns=9)


def test_unbound_api_is_a_silent_no_op():
    assert api.current() is None
    _record_one_of_each()  # must not raise
    assert api.request_begin("r") == -1
    with api.stage(1, Stage.DETOKENIZE) as s:
        assert s is not None
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=1)
    api.bind(rec)  # binding later does not resurrect earlier calls
    rec.close()
    for t in (REQUESTS, SPANS, TOKENS, STEPS, CACHE_EVENTS):
        assert sink.num_rows(t.name) == 0


def test_bound_api_forwards_every_call(bound):
    rec, sink = bound
    assert api.current() is rec
    _record_one_of_each()
    rec.flush()
    rid = request_id_of("r")
    for t in (REQUESTS, STEPS, CACHE_EVENTS):
        assert sink.num_rows(t.name) == 1, t.name
    tokens = sink.table(TOKENS.name).to_pylist()
    assert [(r[col.EMIT_NS], r[col.SENT_NS]) for r in tokens] == [(5, None), (None, 6)]
    spans = {r[col.STAGE]: r for r in sink.table(SPANS.name).to_pylist()}
    assert spans[int(Stage.STREAM_SEND)][col.START_NS] == 1
    timed = spans[int(Stage.DETOKENIZE)]
    assert timed[col.REQUEST_ID] == rid and timed[col.TOKEN_INDEX] == 0
    assert 0 < timed[col.START_NS] <= timed[col.END_NS]


def test_defaults_read_the_clock(bound):
    rec, sink = bound
    before = tokentrace.now_ns()
    rid = api.request_begin("q")
    api.token_sent(rid, 0)
    api.request_end(rid, status=RequestStatus.TIMEOUT)
    after = tokentrace.now_ns()
    rec.flush()
    (req,) = sink.table(REQUESTS.name).to_pylist()
    assert before <= req[col.ARRIVAL_NS] <= req[col.FINISH_NS] <= after
    assert req[col.STATUS] == int(RequestStatus.TIMEOUT)
    (tok,) = sink.table(TOKENS.name).to_pylist()
    assert before <= tok[col.SENT_NS] <= after


def test_stage_records_even_when_the_block_raises(bound):
    rec, sink = bound
    with pytest.raises(KeyError):
        with api.stage(3, Stage.GATEWAY_TOKENIZE):
            raise KeyError("boom")
    rec.flush()
    assert sink.table(SPANS.name).column(col.STAGE).to_pylist() == [int(Stage.GATEWAY_TOKENIZE)]


def test_functions_imported_before_bind_record_after_it():
    from tokentrace.api import span as early_span

    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=1)
    api.bind(rec)
    early_span(1, Stage.STREAM_SEND, 1, 2)
    api.unbind()
    early_span(1, Stage.STREAM_SEND, 3, 4)
    rec.close()
    assert sink.table(SPANS.name).column(col.START_NS).to_pylist() == [1]


def test_bind_rejects_non_recorders():
    with pytest.raises(TypeError, match="Recorder"):
        api.bind(InMemorySink())  # type: ignore[arg-type]


def test_facade_reexports_the_api_and_enums():
    assert tokentrace.__version__ == "0.1.0"
    assert tokentrace.span is api.span and tokentrace.stage is api.stage
    assert tokentrace.Stage is Stage and tokentrace.Recorder is Recorder
    assert tokentrace.InMemorySink is InMemorySink
    for name in tokentrace.__all__:
        assert hasattr(tokentrace, name), name


def test_instrument_with_a_sink_binds_and_writes_the_instance_row():
    sink = InMemorySink()
    with tokentrace.instrument(sink=sink, role="prefill", name="p-1", instance_id=77,
                               flush_interval_s=5) as handle:
        assert api.current() is handle.recorder
        assert handle.instance_id == 77 and handle.run_id is None
        tokentrace.span(1, Stage.PREFILL_COMPUTE, 10, 20)
    assert api.current() is None and handle.recorder.closed and sink.closed
    (inst,) = sink.table(INSTANCES.name).to_pylist()
    assert inst[col.ROLE] == int(Role.PREFILL) and inst[col.NAME] == "p-1"
    assert sink.table(SPANS.name).column(col.INSTANCE_ID).to_pylist() == [77]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(), ValueError, "exactly one"),
        (dict(sink=InMemorySink(), store="x"), ValueError, "exactly one"),
        (dict(sink=InMemorySink(), run="r1"), ValueError, "store"),
        (dict(sink=InMemorySink(), role="chef"), ValueError, "valid roles"),
        (dict(sink=InMemorySink(), colour="red"), TypeError, "colour"),
        (dict(store="x", instance_id=3), ValueError, "store writer assigns"),
    ],
)
def test_instrument_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        tokentrace.instrument(**kwargs)
    assert api.current() is None


def test_instrument_names_the_supported_targets():
    with pytest.raises(TypeError, match="supported targets"):
        tokentrace.instrument(object(), sink=InMemorySink())


def test_instrument_into_a_store_then_open_and_list_runs(tmp_path):
    pytest.importorskip("tokentrace.store")
    handle = tokentrace.instrument(store=tmp_path, run="run-1", role=Role.DECODE)
    assert handle.run_id == "run-1"
    rid = tokentrace.request_begin("s", arrival_ns=1)
    tokentrace.span(rid, Stage.DECODE_COMPUTE, 2, 3)
    tokentrace.request_end(rid, finish_ns=4)
    handle.close()
    handle.close()  # idempotent
    assert [info.run_id for info in tokentrace.runs(tmp_path)] == ["run-1"]
    run = tokentrace.open(tmp_path)
    assert run.run_id == "run-1"


def test_instrument_attaches_to_the_reference_engine_and_detaches_on_close():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from reference_server.engine.config import EngineConfig
    from reference_server.engine.engine import Engine
    from reference_server.model import SamplingParams

    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=32))
    sink = InMemorySink()
    with tokentrace.instrument(engine, sink=sink, name="engine-0") as handle:
        assert handle.adapter is not None
        engine.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert handle.adapter not in engine._observers
    engine.generate(["after close"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert sink.num_rows(REQUESTS.name) == 1
    assert sink.num_rows(TOKENS.name) == 3
    assert sink.num_rows(SPANS.name) > 0
    assert handle.counters["dropped_invalid"] == 0


def test_instrument_with_a_store_it_cannot_open_warns_once_and_leaves_the_server_untraced(tmp_path, caplog):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from reference_server.engine.config import EngineConfig
    from reference_server.engine.engine import Engine
    from reference_server.model import SamplingParams

    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=32))
    observers = list(engine._observers)
    with caplog.at_level("WARNING", logger="tokentrace"):
        handle = tokentrace.instrument(engine, store=a_file / "store", name="engine-0")
    assert handle.untraced_reason == f"cannot open the store at {a_file / 'store'}: Not a directory"
    assert [r.getMessage() for r in caplog.records] == [
        f"tokentrace: {handle.untraced_reason}; the program runs on without tracing"]
    assert list(engine._observers) == observers and handle.adapter is None  # nothing attached to the server
    assert tokentrace.api.current() is None  # the manual API stays a no-op
    assert len(engine.generate(["still served"], SamplingParams(max_tokens=2, ignore_eos=True))) == 1
    handle.close()
