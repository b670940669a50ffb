"""The generic scorer: every kind of `expected`, the number reader GSM8K shares, bad inputs."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from vllm_ling.bench import gsm8k
from vllm_ling.bench.scoring import (
    ExpectedError,
    canonical_number,
    normalize_number,
    numbers_in,
    parse_expected,
    parse_number,
    score,
)


@pytest.mark.parametrize("text,value", [
    ("18", Fraction(18)), ("-5", Fraction(-5)), ("18.00", Fraction(18)), (".5", Fraction(1, 2)),
    ("1,234", Fraction(1234)), ("1,234,567.25", Fraction(123456725, 100)), ("$1,234", Fraction(1234)),
    ("3/4", Fraction(3, 4)), ("-3/4", Fraction(-3, 4)), ("50%", Fraction(50)), ("1e3", Fraction(1000)),
    ("12.", Fraction(12)), ("\u22127", Fraction(-7)), ("- $ 5", Fraction(-5)),
    ("1,23", None), ("12,3456", None), ("3/0", None), ("abc", None), ("", None), ("-", None), (None, None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("value,text", [
    (Fraction(18), "18"), (Fraction(3, 4), "0.75"), (Fraction(-5, 2), "-2.5"), (Fraction(1, 3), "1/3"),
    (Fraction(1, 80), "0.0125"), (Fraction(-1, 8), "-0.125"),
])
def test_canonical_number_round_trips(value, text):
    assert canonical_number(value) == text
    assert parse_number(text) == value  # the canonical spelling reads back as the same value


def test_fraction_and_decimal_spellings_agree():
    assert normalize_number("3/4") == normalize_number("0.75") == normalize_number("0.750")
    assert normalize_number("1,000") == normalize_number("1000.0") == "1000"


@pytest.mark.parametrize("text,found", [
    ("The answer is 1,234.", ["1234"]),
    ("1,2,3", ["1", "2", "3"]),  # a list, not thousands
    ("She had 3/4 of the pie", ["0.75"]),
    ("on 3/4/2026 at 7", ["7"]),  # a date is no fraction
    ("5-3=2", ["5", "3", "2"]),  # minus between numbers is no sign
    ("version 1.2.3", ["1.2"]),
    ("costs $1,234.50 now", ["1234.5"]),
])
def test_numbers_in_text(text, found):
    assert [canonical_number(v) for v in numbers_in(text)] == found


@pytest.mark.parametrize("completion,strict,flexible", [
    ("so #### 3/4", "0.75", "0.75"),
    ("#### 1,000 dollars", "1000", "1000"),
    ("The list is 1,2,3 so #### 6", "6", "6"),
    ("half of it, 1/2 #### 0.5", "0.5", "0.5"),
])
def test_gsm8k_extraction_reads_fractions_and_thousands(completion, strict, flexible):
    assert gsm8k.extract_strict(completion) == strict
    assert gsm8k.extract_flexible(completion) == flexible
    gold = gsm8k.gold_answer(f"... #### {strict}")
    assert gsm8k.score(completion, gold)["correct_strict"]


def _ok(expected, content="", calls=None) -> bool:
    return score(parse_expected(expected), content, calls)["correct"]


@pytest.mark.parametrize("expected,content,correct", [
    ("Paris", "Paris", True),
    ("Paris", "  paris. ", True),  # case, surrounding space and final period
    ("Paris", "\"PARIS\"", True),  # quotes
    ("the capital is Paris", "The   capital\nis Paris!", True),  # whitespace collapsed
    ("Paris", "Paris, France", False),  # exact match, not containment
    ({"string": "ﬁne"}, "fine", True),  # NFKC: the ligature is "fi"
    ("Paris", "", False),
])
def test_string_expected(expected, content, correct):
    assert _ok(expected, content) is correct


@pytest.mark.parametrize("expected,content,correct", [
    (42, "The answer is 42.", True),
    (42, "42 apples, then 43", False),  # the last number counts
    (42, "#### 42 (and later 43)", True),  # the marker wins over the last number
    (0.75, "It is 3/4", True),
    ({"number": "3/4"}, "0.75", True),
    (1234, "1,234 people", True),
    ({"number": 3.14159, "tolerance": 0.001}, "about 3.1412", True),
    ({"number": 3.14159, "tolerance": 0.0001}, "about 3.1412", False),
    (7, "seven", False),
    (-5, "it fell to -5 degrees", True),
])
def test_number_expected(expected, content, correct):
    assert _ok(expected, content) is correct


@pytest.mark.parametrize("expected,content,correct", [
    ({"regex": r"\bParis\b"}, "I think Paris.", True),
    ({"regex": r"^paris$", "flags": "i"}, "PARIS", True),
    ({"regex": r"^paris$"}, "PARIS", False),
    ({"regex": r"\d{3}-\d{4}"}, "call 555-1234", True),
])
def test_regex_expected(expected, content, correct):
    assert _ok(expected, content) is correct


WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}


@pytest.mark.parametrize("expected,calls,correct", [
    ({"tool_call": WEATHER}, [{"name": "get_weather", "arguments": json.dumps({"unit": "c", "city": "Paris"})}], True),
    ({"tool_call": WEATHER}, [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}], True),
    ({"tool_call": WEATHER}, [{"name": "get_weather", "arguments": json.dumps({"city": "Berlin", "unit": "c"})}], False),
    ({"tool_call": WEATHER}, [{"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}], False),
    ({"tool_call": WEATHER}, [{"name": "get_time", "arguments": json.dumps({"city": "Paris", "unit": "c"})}], False),
    ({"tool_call": WEATHER}, [{"name": "get_weather", "arguments": "{not json"}], False),
    ({"tool_call": WEATHER}, [], False),
    ({"tool_call": {"name": "get_weather"}}, [{"name": "get_weather", "arguments": "{\"x\": 1}"}], True),  # name only
    ({"tool_call": {"name": "f", "arguments": "{\"a\": 1}"}}, [{"name": "f", "arguments": "{\"a\": 1}"}], True),
    ({"tool_calls": [{"name": "a"}, {"name": "b"}]}, [{"name": "b", "arguments": "{}"}, {"name": "a", "arguments": "{}"}], True),
    ({"tool_calls": [{"name": "a"}, {"name": "b"}]}, [{"name": "a", "arguments": "{}"}], False),
])
def test_tool_call_expected(expected, calls, correct):
    assert _ok(expected, "", calls) is correct


def test_tool_call_expected_ignores_content():
    assert not _ok({"tool_call": {"name": "f"}}, "f()", [])


@pytest.mark.parametrize("raw,message", [
    (None, "must be a string, a number or an object"),
    (True, "must be a string, a number or an object"),
    ([1, 2], "got list"),
    ({}, "exactly one of"),
    ({"string": "a", "regex": "b"}, "exactly one of"),
    ({"number": "twelve"}, "is not a number"),
    ({"number": 1, "tolerance": -1}, "tolerance must be a number >= 0"),
    ({"regex": "("}, "does not compile"),
    ({"regex": "a", "flags": "q"}, "unknown flag"),
    ({"tool_call": {"arguments": {}}}, "non-empty 'name'"),
    ({"tool_call": {"name": "f", "arguments": "[1"}}, "not JSON"),
    ({"tool_call": {"name": "f", "arguments": [1]}}, "must be an object"),
    ({"tool_calls": []}, "non-empty list"),
    (float("nan"), "finite"),
])
def test_bad_expected_is_named(raw, message):
    with pytest.raises(ExpectedError, match=message):
        parse_expected(raw)
