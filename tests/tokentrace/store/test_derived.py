"""A run's derived tables (tokentrace.store.derived): written whole, read back only for the part files and the
format they were written for, invisible to the run's table listing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from tokentrace.schema import REQUESTS, col
from tokentrace.store import StoreWriter, open_run
from tokentrace.store.derived import DERIVED_DIR, parts_fingerprint, read_derived, remove_derived, write_derived

FORMAT = "1/test"


def _requests(ids: list[int]) -> pa.Table:
    """Rows of ``requests`` with ids and arrivals, every other column null."""
    given = {col.REQUEST_ID: ids, col.ARRIVAL_NS: [10 * i for i in ids]}
    return pa.table({c.name: pa.array(given.get(c.name, [None] * len(ids)), c.type) for c in REQUESTS.columns})


def _run(tmp_path, rows: int = 3):
    with StoreWriter(tmp_path, run_id="r") as w:
        w.write(REQUESTS, _requests(list(range(rows))))
    return tmp_path / "r"


def _facts(n: int) -> pa.Table:
    return pa.table({col.REQUEST_ID: pa.array(range(n), pa.int64()), "latency_ns": pa.array([7] * n, pa.int64())})


def test_round_trip_with_extra_metadata(tmp_path):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    path = write_derived(run, "token_times", _facts(4), fingerprint=fp, format_key=FORMAT, extra={"one_row": "1"})
    assert path == run / DERIVED_DIR / "token_times.parquet"
    found = read_derived(run, fp, FORMAT)
    assert list(found) == ["token_times"]
    assert found["token_times"].extra == {"one_row": "1"}
    snapshot = found["token_times"].path  # this reader's own link to the file: in place whatever writers do
    assert snapshot.parent == path.parent and snapshot.read_bytes() == path.read_bytes()
    del found
    assert not snapshot.exists()  # dropped with its DerivedFile


def test_streamed_batches_are_written_whole(tmp_path):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    reader = pa.RecordBatchReader.from_batches(_facts(1).schema, _facts(5).to_batches(max_chunksize=2))
    write_derived(run, "token_steps", reader, fingerprint=fp, format_key=FORMAT)
    import pyarrow.parquet as pq

    assert pq.read_table(run / DERIVED_DIR / "token_steps.parquet").num_rows == 5
    assert not [p for p in (run / DERIVED_DIR).iterdir() if p.name.startswith(".")]  # no temporary file left


@pytest.mark.parametrize("change", ["new part", "rewritten part", "removed part"])
def test_facts_go_stale_when_the_parts_change(tmp_path, change):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    write_derived(run, "request_facts", _facts(3), fingerprint=fp, format_key=FORMAT)
    part = next((run / "requests").rglob("part-*.parquet"))
    if change == "new part":
        with StoreWriter(tmp_path, run_id="r") as w:
            w.write(REQUESTS, _requests([99]))
    elif change == "rewritten part":
        st = part.stat()
        os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    else:
        part.unlink()
    new_fp = parts_fingerprint(run)
    assert new_fp != fp
    assert read_derived(run, new_fp, FORMAT) == {}
    assert list(read_derived(run, fp, FORMAT)) == ["request_facts"]  # still there, for the old parts only


def test_other_format_and_foreign_files_are_ignored(tmp_path):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    write_derived(run, "token_times", _facts(2), fingerprint=fp, format_key=FORMAT)
    (run / DERIVED_DIR / "broken.parquet").write_bytes(b"PAR1 truncated")
    (run / DERIVED_DIR / "notes.txt").write_text("not a derived table")
    assert read_derived(run, fp, "2/test") == {}
    assert list(read_derived(run, fp, FORMAT)) == ["token_times"]


def test_the_folder_is_not_a_table_of_the_run(tmp_path):
    run = _run(tmp_path)
    write_derived(run, "token_times", _facts(2), fingerprint=parts_fingerprint(run), format_key=FORMAT)
    opened = open_run(tmp_path, "r")
    assert opened.tables() == ["requests"]
    assert opened.table("requests").num_rows == 3


def test_bad_names_and_removal(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(ValueError, match="identifier"):
        write_derived(run, "../escape", _facts(1), fingerprint="x", format_key=FORMAT)
    write_derived(run, "a", _facts(1), fingerprint="x", format_key=FORMAT)
    write_derived(run, "b", _facts(1), fingerprint="x", format_key=FORMAT)
    assert remove_derived(run) == 2
    assert not (run / DERIVED_DIR).exists()
    assert remove_derived(run) == 0


def test_removal_waiting_for_the_lock_while_another_removes_the_folder(tmp_path):
    import fcntl
    import shutil
    import threading

    run = _run(tmp_path)
    write_derived(run, "a", _facts(1), fingerprint="x", format_key=FORMAT)
    fd = os.open(run / "_derived.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process's derive(force=True), holding the lock
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(_removed_or_error(run)))
    waiter.start()
    waiter.join(0.5)  # past the folder check, waiting for the lock
    shutil.rmtree(run / DERIVED_DIR)  # the other process removed the facts
    os.close(fd)
    waiter.join(30)
    assert result == [0]


def _removed_or_error(run):
    try:
        return remove_derived(run)
    except OSError as err:
        return err


# ---------------------------------------------------------------------------------- faults, real processes

REPO = Path(__file__).resolve().parents[3]
REAL_RUN = REPO / "tests" / "data" / "real_run"
DERIVE = ("import sys; from analyzers.derivation import derive; from tokentrace.store import open_run\n"
          "for _ in range(int(sys.argv[3])): derive(open_run(sys.argv[1], sys.argv[2]), force=True)")


def _real_store(tmp_path: Path) -> tuple[Path, Path]:
    store = tmp_path / "store"
    shutil.copytree(REAL_RUN, store)
    (run,) = [p for p in store.iterdir() if p.is_dir()]
    return store, run


def _python(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def _report(store: Path, run: Path) -> subprocess.Popen:
    return _python("-c", "from tokentrace.app.cli import main; main()", "report", str(store), "--run", run.name,
                   "--format", "json")


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


def test_facts_corrupted_in_the_middle_are_not_used(tmp_path):
    store, run = _real_store(tmp_path)
    assert _finish(_python("-c", DERIVE, str(store), run.name, "1"))[0] == 0
    facts = run / DERIVED_DIR / "request_facts.parquet"
    clean = _finish(_report(store, run))
    assert clean[0] == 0, clean[2]
    data = bytearray(facts.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 200] = bytes((b + 1) % 256 for b in data[middle:middle + 200])  # footer intact
    st = facts.stat()
    facts.write_bytes(bytes(data))
    os.utime(facts, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "request_facts" not in read_derived(run, parts_fingerprint(run), _format_key())
    rc, out, err = _finish(_report(store, run))
    assert rc == 0, err
    assert "Traceback" not in err
    assert _rounded(json.loads(out)) == _rounded(json.loads(clean[1]))  # the same answers, from the parts


def _rounded(x):
    """Floats to 9 significant digits: sums taken in another order differ in the last bits."""
    if isinstance(x, float):
        return float(f"{x:.9g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _format_key() -> str:
    from analyzers.facts import format_key

    return format_key()


def test_two_processes_deriving_at_once_and_a_report_reading_meanwhile(tmp_path):
    store, run = _real_store(tmp_path)
    writers = [_python("-c", DERIVE, str(store), run.name, "6") for _ in range(2)]
    reports = []
    while any(w.poll() is None for w in writers):  # reports keep starting while the facts are rewritten
        reports.append(_finish(_report(store, run)))
    for w in writers:
        rc, _, err = _finish(w)
        assert rc == 0, err  # neither deleted the other's files
    assert reports and all(rc == 0 for rc, _, _ in reports), [err for rc, _, err in reports if rc]
    found = read_derived(run, parts_fingerprint(run), _format_key())
    assert "request_facts" in found  # every fact written whole and verified
    del found  # and with it this process's snapshots
    assert not [p for p in (run / DERIVED_DIR).iterdir()
                if p.name.startswith(".") or ".snap-" in p.name]  # no temporary file or snapshot


def test_a_part_rewritten_to_the_same_size_with_its_mtime_restored_is_noticed(tmp_path):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    part = next((run / "requests").rglob("part-*.parquet"))
    st = part.stat()
    data = part.read_bytes()
    time.sleep(0.01)
    part.write_bytes(data)  # same bytes, same size
    os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert part.stat().st_size == st.st_size and part.stat().st_mtime_ns == st.st_mtime_ns
    assert parts_fingerprint(run) != fp


def test_unverified_reading_leaves_the_digest_to_the_reader(tmp_path):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    for name in ("token_times", "request_facts"):
        write_derived(run, name, _facts(400), fingerprint=fp, format_key=FORMAT)
    target = run / DERIVED_DIR / "request_facts.parquet"
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes((b + 1) % 256 for b in data[middle:middle + 16])  # footer intact
    target.write_bytes(bytes(data))
    assert list(read_derived(run, fp, FORMAT)) == ["token_times"]  # verified now: the corrupted file left out
    found = read_derived(run, fp, FORMAT, verify=False)  # footers only: both listed, each checked when opened
    assert sorted(found) == ["request_facts", "token_times"]
    assert found["token_times"].is_intact()
    assert not found["request_facts"].is_intact()
