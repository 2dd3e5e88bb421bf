"""The demo's terminal report at 80 columns: every table fits, and no word or number is split."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pandas as pd
from rich.console import Console

from tokentrace.app.demo.report import print_report, section_table
from tokentrace.app.report import make_report
from tokentrace.app.report.sections import _flagged_pairs

FIXTURE = Path(__file__).resolve().parents[3] / "data" / "real_run"


def test_the_report_fits_80_columns_and_splits_no_word() -> None:
    out = io.StringIO()
    print_report(make_report(FIXTURE, "mooncake-disagg"), Console(file=out, width=80, force_terminal=False))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    words = set(re.findall(r"\S+", text))
    for expected in ("requests", "schedule.queue", "prefill.compute", "30,000", "interactive", "1,065.5"):
        assert expected in words, expected  # whole, never folded over two lines


def test_a_narrow_table_wraps_headers_between_words() -> None:
    frame = pd.DataFrame({"tenant": ["initech"], "request_share": [0.5], "token_share": [0.25],
                          "compute_share": [0.125], "num_requests": [12345678]})
    out = io.StringIO()
    Console(file=out, width=56, force_terminal=False).print(section_table(frame, width=56))
    cells = set(re.findall(r"\S+", out.getvalue()))
    assert {"initech", "12,345,678", "share", "request", "compute", "token"} <= cells
    assert max(len(line) for line in out.getvalue().splitlines()) <= 56


def test_flagged_noisy_neighbours_are_named() -> None:
    nn = pd.DataFrame({"aggressor": ["acme", "globex"], "victim": ["globex", "initech"], "effect_ms": [12.34, 1.0],
                       "flagged": [True, False]})
    assert _flagged_pairs(nn) == " (acme slows globex: +12.3 ms TTFT)"
    assert _flagged_pairs(nn.assign(flagged=False)) == ""


def test_the_dashboard_request_log_stays_out_of_the_terminal() -> None:
    import logging

    from tokentrace.app.demo import quiet_request_log

    werkzeug = logging.getLogger("werkzeug")
    before = werkzeug.level
    try:
        werkzeug.setLevel(logging.INFO)
        quiet_request_log()
        assert not werkzeug.isEnabledFor(logging.INFO)  # a "POST /_dash-update-component" line is INFO
        assert werkzeug.isEnabledFor(logging.WARNING)
    finally:
        werkzeug.setLevel(before)
