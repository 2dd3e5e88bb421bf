"""Recorders at process boundaries: flush at interpreter exit, fresh state after fork."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import INSTANCES, SPANS, Role, Stage, col

REPO = Path(__file__).resolve().parents[3]


class FileSink:
    """Appends every batch as one JSON line; ``fork_child`` writes to ``<path>.child``."""

    def __init__(self, path, instance_id=None):
        self.path = str(path)
        self.instance_id = instance_id

    def write(self, table, batch):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps([table.name, batch.to_pylist()]) + "\n")

    def close(self):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(["closed", []]) + "\n")

    def fork_child(self):
        return FileSink(self.path + ".child", instance_id=(self.instance_id or 0) + 1)


def read_sink(path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        name, rows = json.loads(line)
        out.setdefault(name, []).extend(rows)
    return out


def test_events_are_flushed_at_interpreter_exit_without_close(tmp_path):
    out = tmp_path / "events.jsonl"
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        from tokentrace.recorder import BufferedRecorder
        from tokentrace.schema import Stage
        """
    ) + textwrap.dedent(inspect.getsource(FileSink)) + textwrap.dedent(
        f"""
        rec = BufferedRecorder(FileSink({str(out)!r}), instance_id=5, flush_interval_s=3600)
        for i in range(1000):
            rec.span(1, Stage.STREAM_SEND, i, i + 1)
        # no close(): the atexit hook must flush and close the sink
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    got = read_sink(out)
    assert [r[col.START_NS] for r in got[SPANS.name]] == list(range(1000))
    assert "closed" in got


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_records_into_its_own_sink_and_not_the_parents_events(tmp_path):
    parent_path = tmp_path / "parent.jsonl"
    rec = BufferedRecorder(FileSink(parent_path, instance_id=10), instance_id=10, flush_interval_s=3600)
    rec.instance(role=Role.DECODE, name="worker")
    rec.span(1, Stage.DECODE_COMPUTE, 1, 2)  # still buffered at the fork
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            rec.span(2, Stage.DECODE_COMPUTE, 3, 4)
            rec.close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    rec.span(1, Stage.DECODE_COMPUTE, 5, 6)
    rec.close()

    parent = read_sink(parent_path)
    child = read_sink(str(parent_path) + ".child")
    assert [(r[col.REQUEST_ID], r[col.START_NS]) for r in parent[SPANS.name]] == [(1, 1), (1, 5)]
    assert [(r[col.REQUEST_ID], r[col.START_NS], r[col.INSTANCE_ID]) for r in child[SPANS.name]] == [(2, 3, 11)]
    assert [r[col.PID] for r in parent[INSTANCES.name]] == [os.getpid()]
    (child_instance,) = child[INSTANCES.name]
    assert child_instance[col.PID] == pid and child_instance[col.INSTANCE_ID] == 11
    assert child_instance[col.NAME] == "worker" and child_instance[col.ROLE] == int(Role.DECODE)
    assert "closed" in parent and "closed" in child
