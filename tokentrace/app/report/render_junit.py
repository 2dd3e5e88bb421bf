"""The budgets as JUnit XML: one test case per budget, a failure carrying actual against limit.

CI systems (GitHub Actions test reporters, GitLab, Jenkins) read this format::

    <testsuites name="tokentrace" tests="2" failures="1">
      <testsuite name="tokentrace.budgets" tests="2" failures="1" errors="0" skipped="0">
        <properties><property name="run_id" value="..."/></properties>
        <testcase classname="tokentrace.budgets" name="ttft.p99 &lt;= 800ms" time="0"/>
        <testcase classname="tokentrace.budgets" name="itl.p99 &lt;= 50ms" time="0">
          <failure type="BudgetViolation" message="itl.p99 = 61.0 ms violates limit &lt;= 50.0 ms">...</failure>
        </testcase>
      </testsuite>
    </testsuites>

A run without budgets gives a suite with no test cases.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from tokentrace.app.report.budget import format_value
from tokentrace.app.report.model import Report

__all__ = ["SUITE", "render_junit"]

SUITE = "tokentrace.budgets"


def render_junit(report: Report) -> str:
    """JUnit XML (UTF-8 declaration, ends with a newline) with one ``testcase`` per budget."""
    failures = sum(1 for r in report.budgets if not r.passed)
    counts = {"tests": str(len(report.budgets)), "failures": str(failures)}
    root = ET.Element("testsuites", {"name": "tokentrace", **counts})
    suite = ET.SubElement(root, "testsuite", {"name": SUITE, **counts, "errors": "0", "skipped": "0",
                                              "timestamp": report.run.created or ""})
    props = ET.SubElement(suite, "properties")
    facts = {"run_id": report.run.run_id, "store": report.run.path}
    if report.baseline is not None:
        facts["baseline_run_id"] = report.baseline.run_id
    for name, value in facts.items():
        ET.SubElement(props, "property", {"name": name, "value": value})
    for r in report.budgets:
        case = ET.SubElement(suite, "testcase", {"classname": SUITE, "name": r.budget.text, "time": "0"})
        if r.passed:
            ET.SubElement(case, "system-out").text = r.message
            continue
        failure = ET.SubElement(case, "failure", {"type": "BudgetViolation", "message": r.message})
        failure.text = (f"metric: {r.budget.metric}\nmeasured: {format_value(r.actual, r.budget.kind)}\n"
                        f"limit: {r.budget.op} {format_value(r.budget.limit, r.budget.kind)}\n"
                        f"run: {report.run.run_id}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
