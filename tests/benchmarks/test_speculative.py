"""The speculative decoding benchmark runs end to end (reduced) and ends with its figure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_benchmark_prints_its_table_and_ratio_last() -> None:
    cmd = [sys.executable, "benchmarks/speculative.py", "--model", "tiny", "--draft-model", "tiny",
           "--sources", "ngram,model", "--batch-sizes", "1,2", "--repeats", "1", "--max-tokens", "8"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("machine: ")
    assert len([ln for ln in lines if re.match(r"\s+(ngram|model)\s+[12]\s", ln)]) == 8  # 2 sources x 2 sizes x 2
    assert re.fullmatch(r"spec_vs_plain_decode_throughput=\d+\.\d\d", lines[-1])


def test_bad_arguments_are_one_clear_error() -> None:
    cmd = [sys.executable, "benchmarks/speculative.py", "--sources", "medusa"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "sources among" in done.stderr and "Traceback" not in done.stderr
