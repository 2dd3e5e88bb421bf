"""URL handling: parsing a view's query, building links and new query strings."""

from __future__ import annotations

import pytest

from dashboard.components.controls import new_search
from dashboard.components.shell import ViewQuery, href, parse_query
from tokentrace.store import StoreError


def test_parse_query_keeps_known_keys_and_checks_values():
    q = parse_query({"run": "r1", "by": "tenant", "page": "3", "utm": "x"})
    assert q == ViewQuery(run="r1", by="tenant", page=3)
    with pytest.raises(StoreError, match="is not one of"):
        parse_query({"by": "colour"})
    with pytest.raises(StoreError, match="not a page number"):
        parse_query({"page": "-1"})
    with pytest.raises(StoreError, match="too long"):
        parse_query({"run": "x" * 1000})


def test_href_carries_ids_and_filters_only():
    q = ViewQuery(run="r1", tenant="acme", request="42")
    assert href("/explorer", q) == "/explorer?run=r1&tenant=acme&request=42"
    assert href("/", q, tenant="", request="") == "/?run=r1"


@pytest.mark.parametrize(("search", "changes", "expected"), [
    ("", {"run": "b"}, "?run=b"),
    ("?run=a&request=7&page=2", {"run": "b"}, "?run=b"),  # another run: its request and page are gone
    ("?run=a&request=7", {"run": "a"}, "?run=a&request=7"),  # unchanged: kept
    ("?run=a&tenant=x&page=3", {"tenant": None}, "?run=a"),
    ("?run=a&sort=-e2e_ms&page=3", {"sort": "ttft_ms", "page": 0}, "?run=a&sort=ttft_ms"),
])
def test_new_search_applies_changes_and_resets_dependants(search, changes, expected):
    assert new_search(search, changes) == expected
