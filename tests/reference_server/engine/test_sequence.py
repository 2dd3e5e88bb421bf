from __future__ import annotations

import pytest

from reference_server.engine.sequence import StopChecker


def stream(checker: StopChecker, deltas: list[str]) -> tuple[list[str], bool]:
    out, hit = [], False
    for d in deltas:
        text, hit = checker.push(d)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(checker.flush())
    return out, hit


@pytest.mark.parametrize("stop,deltas,expected_text,expected_hit", [
    ((), ["ab", "c", "d"], "abcd", False),
    (("STOP",), ["hello S", "TO", "P world"], "hello ", True),
    (("STOP",), ["hello S", "TA", "RT"], "hello START", False),
    (("xy", "b"), ["a", "bxy"], "a", True),
    (("\n\n",), ["line\n", "\nmore"], "line", True),
])
def test_streamed_deltas_add_up_to_the_final_text(stop, deltas, expected_text, expected_hit):
    checker = StopChecker(stop)
    out, hit = stream(checker, deltas)
    assert "".join(out) == expected_text == checker.text
    assert hit == expected_hit


def test_text_that_may_start_a_stop_string_is_held_back():
    checker = StopChecker(("STOP",))
    assert checker.push("abcST") == ("abc", False)  # "ST" may become "STOP"
    assert checker.push("O") == ("", False)
    assert checker.push("x") == ("STOx", False)  # it did not
    assert checker.push("yS") == ("y", False)
    assert checker.flush() == "S"
