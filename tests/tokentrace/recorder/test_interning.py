"""String tables behind the integer buffers."""

from __future__ import annotations

import numpy as np
import pytest

from tokentrace.recorder.interning import NO_STRING, Labels, SideStrings


def test_labels_intern_once_and_decode():
    labels = Labels()
    a = labels.intern("acme")
    assert labels.intern("acme") == a and labels.intern("") == 0
    b = labels.intern("globex")
    assert labels.decode(np.array([a, b, 0, NO_STRING, 12345])) == ["acme", "globex", "", "", ""]


def test_labels_reject_non_strings():
    with pytest.raises(TypeError):
        Labels().intern(None)  # type: ignore[arg-type]


def test_side_strings_are_removed_when_decoded():
    side = SideStrings()
    i, j = side.put("req-1"), side.put("req-2")
    assert side.put("") == NO_STRING
    assert len(side) == 2
    assert side.decode(np.array([j, NO_STRING, i])) == ["req-2", "", "req-1"]
    assert len(side) == 0
    k = side.put("x")
    side.discard(k)
    assert len(side) == 0
    with pytest.raises(TypeError):
        side.put(3)  # type: ignore[arg-type]
