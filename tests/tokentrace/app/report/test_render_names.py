"""Column headers a person reads: words and units from result column names."""

from __future__ import annotations

import pytest

from tokentrace.app.report.render_names import column_label, is_percent_column


@pytest.mark.parametrize("column, label, percent", [
    ("p99_ms", "p99 (ms)", False),
    ("served_rps", "served (req/s)", False),
    ("ttft_share", "TTFT share (%)", True),
    ("attainment", "both met (%)", True),
    ("mean_request_fluidity", "mean request fluidity (%)", True),
    ("lookup_hit_rate", "lookup hit rate (%)", True),
    # a percentage word inside a name whose unit suffix says what it is: a rate, not a share
    ("attainment_constrained_rate_rps", "highest rate meeting the SLO share (req/s)", False),
    ("share_window_s", "share window (s)", False),
    ("output_tokens_per_s", "output (tokens/s)", False),
])
def test_headers_carry_the_right_unit(column, label, percent):
    assert column_label(column) == label
    assert is_percent_column(column) is percent
