"""What-if: a discrete-event simulator of the run's own engines, fitted to its steps and spans.

``fit_whatif(src)`` fits and validates against the run itself; ``.predict(settings)`` and ``.sweep(...)``
replay the run's requests through a changed configuration. See docs/whatif.md.
"""

from __future__ import annotations

from analyzers.whatif.predict import (
    SETTINGS,
    SLO_METRIC,
    Prediction,
    SweepResult,
    WhatIf,
    check_settings,
    fit_whatif,
    parse_setting,
    parse_sweep,
)

__all__ = ["SETTINGS", "SLO_METRIC", "Prediction", "SweepResult", "WhatIf", "check_settings", "fit_whatif",
           "parse_setting", "parse_sweep"]
