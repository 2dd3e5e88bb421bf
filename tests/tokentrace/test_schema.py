"""The schema contract: tables, stages, versions, and the no-literal rule."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokentrace import schema
from tokentrace.schema import (
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    TABLES,
    Stage,
    col,
    column_names,
    request_id_of,
)

REPO = Path(__file__).resolve().parents[2]

# Packages and folders that must use tokentrace.schema instead of literals.
# reference_server/ is excluded on purpose: it is a stand-in for a third-party
# server and knows nothing of tokentrace's tables.
CHECKED_DIRS = ("tokentrace", "instrument", "analyzers", "dashboard", "benchmarks", "tests")


def test_seventeen_stages_in_pipeline_order_with_dotted_labels():
    assert len(Stage) == 17
    labels = [s.label for s in Stage]
    assert len(set(labels)) == 17
    assert labels[:2] == ["gateway.accept", "gateway.receive"]
    assert labels[-3:] == ["detokenize", "stream.relay", "stream.send"]
    # a speculative step's stages sit between the decode queue and the plain decode step, in pipeline order
    decode = labels.index("decode.queue")
    assert labels[decode:decode + 4] == ["decode.queue", "decode.draft", "decode.verify", "decode.compute"]
    assert (Stage.DECODE_DRAFT, Stage.DECODE_VERIFY) == (15, 16)  # the next free values: files store them
    assert sorted(int(s) for s in Stage) == list(range(17))  # values stay dense
    for s in Stage:
        assert Stage.from_label(s.label) is s


def test_unknown_stage_label_names_the_valid_ones():
    with pytest.raises(ValueError, match="prefill.compute"):
        Stage.from_label("prefill")


def test_every_table_has_documented_columns_with_units():
    assert set(TABLES) == {"requests", "spans", "tokens", "steps", "cache_events", "loop_lags", "spec_steps",
                           "instances", "engine_configs"}
    for t in TABLES.values():
        assert t.doc
        for c in t.columns:
            assert c.doc, f"{t.name}.{c.name} has no description"
            if c.name.endswith("_ns"):
                assert c.unit == "ns" and c.clock, f"{t.name}.{c.name} lacks unit or clock"
                assert c.type == pa.int64()
            if c.name.endswith("_bytes") or c.name == col.NUM_BYTES:
                assert c.unit == "bytes"


def test_spec_steps_columns_codes_and_clock():
    t = schema.SPEC_STEPS
    assert t.names == (col.INSTANCE_ID, col.REQUEST_ID, col.STEP, col.DRAFT_SOURCE, col.NUM_PROPOSED,
                       col.NUM_ACCEPTED, col.FIRST_TOKEN_INDEX, col.DRAFT_START_NS, col.DRAFT_END_NS,
                       col.VERIFY_START_NS, col.VERIFY_END_NS, col.BATCH_SIZE, col.NUM_SPEC_SEQS)
    assert t.column(col.DRAFT_SOURCE).enum is schema.DraftSource
    assert {s.name: int(s) for s in schema.DraftSource} == {"MODEL": 0, "NGRAM": 1, "EARLY_EXIT": 2}
    # the four phase boundaries are points on the engine's clock, so readers align them like every other time
    from tokentrace.clock import time_columns
    assert time_columns(t.name) == [col.DRAFT_START_NS, col.DRAFT_END_NS, col.VERIFY_START_NS, col.VERIFY_END_NS]


def test_schema_metadata_carries_version_and_docs():
    s = schema.SPANS.schema
    assert s.metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert s.field(col.START_NS).metadata[b"unit"] == b"ns"
    assert b"doc" in s.field(col.STAGE).metadata


@pytest.mark.parametrize("name", sorted(TABLES))
def test_parquet_round_trip_keeps_schema_and_values(name):
    t = TABLES[name]
    arrays = []
    for c in t.columns:
        if pa.types.is_string(c.type):
            arrays.append(pa.array(["a", "", "é"], type=c.type))
        else:
            arrays.append(pa.array([0, 7, None if c.nullable else 3], type=c.type))
    table = pa.Table.from_arrays(arrays, schema=t.schema)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    buf.seek(0)
    back = pq.read_table(buf)
    assert back.schema.equals(t.schema, check_metadata=True)
    assert back.equals(table)


def test_request_id_is_stable_and_63_bit():
    a = request_id_of("cmpl-123")
    assert a == request_id_of("cmpl-123")
    assert a != request_id_of("cmpl-124")
    assert 0 <= a < 2**63
    # Fixed value: every process and every version must derive the same id.
    assert request_id_of("") == request_id_of("")
    assert isinstance(request_id_of("x" * 1000), int)


def _string_literals(tree: ast.AST):
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_no_column_name_is_spelled_as_a_literal_outside_schema():
    names = column_names()
    offenders = []
    for folder in CHECKED_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == REPO / "tokentrace" / "schema.py" or ".venv" in path.parts:
                continue
            if path.is_relative_to(REPO / "tests" / "reference_server"):
                continue  # the stand-in third-party server's own tests speak its language
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in _string_literals(tree):
                if node.value in names:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not offenders, "use tokentrace.schema.col instead of literals:\n" + "\n".join(offenders)


def test_the_literal_check_would_catch_an_offender():
    tree = ast.parse(f"x = {col.START_NS!r}\n")
    assert [n.value for n in _string_literals(tree)] == [col.START_NS]
