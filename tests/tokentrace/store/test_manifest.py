"""The run manifest: run-level file, per-writer fragments, merging; several processes at once."""

from __future__ import annotations

import errno
import json
import os
import platform

import pyarrow as pa
import pytest

import tokentrace
from tokentrace.schema import SCHEMA_VERSION, SPANS, Role, col
from tokentrace.store import CorruptFileWarning, StoreWriter, open_run
from tokentrace.store.layout import create_once
from tokentrace.store.manifest import read_manifest


def test_run_manifest_is_written_at_creation_with_versions_and_config(tmp_path):
    w = StoreWriter(tmp_path, run_id="m", config={"model": "tiny", "batch": 4})
    data = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert data["run"] == "m" and data["format"] == "tokentrace-run"
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["tokentrace_version"] == tokentrace.__version__
    assert data["python"] == platform.python_version()
    assert data["config"] == {"model": "tiny", "batch": 4}
    assert data["created"].endswith("Z")
    assert (tmp_path / "m" / "manifest.d" / f"{w.instance_id}.json").is_file()


def test_the_first_writer_creates_the_run_manifest_and_later_ones_keep_it(tmp_path):
    StoreWriter(tmp_path, run_id="m", config={"who": "first"})
    StoreWriter(tmp_path, run_id="m", config={"who": "second"})
    assert open_run(tmp_path).manifest["config"] == {"who": "first"}


def test_create_once_creates_exactly_once_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "f.json"
    assert create_once(target, b"one") is True
    assert create_once(target, b"two") is False
    assert target.read_bytes() == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_create_once_without_hard_links_falls_back_to_exclusive_create(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    target = tmp_path / "f.json"
    assert create_once(target, b"one") is True
    assert create_once(target, b"two") is False
    assert target.read_bytes() == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_counters_are_cumulative_per_writer_and_summed_over_writers(tmp_path):
    a = StoreWriter(tmp_path, run_id="c")
    b = StoreWriter(tmp_path, run_id="c")
    a.update_counters({"dropped": 1, "sink_errors": 1})
    a.update_counters({"dropped": 5})  # totals replace, never add
    b.update_counters({"dropped": 2, "sampled_out": 7})
    assert open_run(tmp_path).counters() == {"dropped": 7, "sampled_out": 7, "sink_errors": 1}


def test_instances_are_the_union_over_writers(tmp_path):
    a = StoreWriter(tmp_path, run_id="i")
    b = StoreWriter(tmp_path, run_id="i")
    a.register_instance(11, Role.GATEWAY, "gw")
    b.register_instance(12, "decode", "decode-0")
    b.register_instance(13, int(Role.PREFILL), "prefill-0")
    got = [(i["instance"], i["role"], i["name"], i["writer"]) for i in open_run(tmp_path).instances()]
    assert got == [
        (11, "gateway", "gw", a.instance_id),
        (12, "decode", "decode-0", b.instance_id),
        (13, "prefill", "prefill-0", b.instance_id),
    ]
    assert open_run(tmp_path).instances()[0]["pid"] == os.getpid()


def test_instance_ids_seen_in_rows_are_listed_even_if_never_reported(tmp_path):
    w = StoreWriter(tmp_path, run_id="seen")
    data = {n: [1, 1, 1] for n in SPANS.names}
    data[col.INSTANCE_ID] = [5, 6, 5]
    w.write(SPANS, pa.RecordBatch.from_pydict(data))
    w.register_instance(6, Role.DECODE, "decode-6")
    got = [(i["instance"], i["role"], i["name"]) for i in open_run(tmp_path).instances()]
    assert got == [(5, None, None), (6, "decode", "decode-6")]


@pytest.mark.parametrize(
    "counters, instance",
    [({"dropped": 1.5}, None), ({"dropped": True}, None), (None, (-1, "decode")), (None, (1, "janitor"))],
)
def test_bad_counters_and_instances_are_value_errors(tmp_path, counters, instance):
    w = StoreWriter(tmp_path, run_id="v")
    with pytest.raises(ValueError):
        if counters is not None:
            w.update_counters(counters)
        else:
            w.register_instance(instance[0], instance[1], "x")


def test_an_unreadable_fragment_is_skipped_with_a_warning(tmp_path):
    w = StoreWriter(tmp_path, run_id="f")
    w.update_counters({"dropped": 3})
    bad = tmp_path / "f" / "manifest.d" / "123.json"
    bad.write_text("{not json")
    with pytest.warns(CorruptFileWarning, match="123.json"):
        merged = read_manifest(tmp_path / "f")
    assert merged["counters"]["dropped"] == 3
    assert [frag["writer"] for frag in merged["writers"]] == [w.instance_id]


def test_close_marks_the_fragment_closed_with_what_was_written(tmp_path):
    w = StoreWriter(tmp_path, run_id="done")
    rows = {n: [1, 2, 3] for n in SPANS.names}
    w.write(SPANS, pa.RecordBatch.from_pydict(rows))
    w.write(SPANS, pa.RecordBatch.from_pydict(rows))
    (open_frag,) = open_run(tmp_path).manifest["writers"]
    assert open_frag["closed"] is False
    w.close()
    (frag,) = open_run(tmp_path).manifest["writers"]
    assert frag["closed"] is True and frag["writer"] == w.instance_id
    assert frag["parts_written"] == {SPANS.name: 2} and frag["rows_written"] == {SPANS.name: 6}


def test_a_later_writers_config_keys_reach_the_merged_manifest(tmp_path):
    from tokentrace.store import StoreWriter, open_run

    first = StoreWriter(tmp_path, run_id="shared", config={"server": "reference", "mode": "disagg"})
    second = StoreWriter(tmp_path, run_id="shared", config={"workload": {"time_scale": 0.5}, "mode": "other"})
    first.close()
    second.close()
    manifest = open_run(tmp_path, run="shared").manifest
    assert manifest["config"] == {"server": "reference", "mode": "disagg", "workload": {"time_scale": 0.5}}
    assert sorted(w["config"].get("mode") for w in manifest["writers"]) == ["disagg", "other"]
