"""Scoring a response against the user's own expected answer (GSM8K is one case of it).

A replay line's ``expected`` is one of:

==========================================  ===============================================
``"Paris"``  or  ``{"string": "Paris"}``    the answer text equals it after normalisation
                                            (Unicode NFKC, case-folded, whitespace collapsed,
                                            surrounding quotes/punctuation and a final period
                                            dropped)
``42``  or  ``{"number": "3/4"}``           the answer's number equals it: the number after a
                                            ``####`` marker if there is one, else the last
                                            number in the text; fractions (``3/4``), thousands
                                            separators (``1,234``), ``$`` and ``%`` are read;
                                            exact rational comparison unless ``"tolerance"``
                                            (absolute) is given
``{"regex": "...", "flags": "i"}``          ``re.search`` finds the pattern in the answer
``{"tool_call": {"name": ..., "arguments":  a returned tool call has this name and (when
{...}}}``                                   given) exactly these JSON arguments;
``{"tool_calls": [{...}, ...]}``            every listed call is among the returned ones
==========================================  ===============================================

The number reader here is the one GSM8K scoring uses (``gsm8k.extract_strict/flexible``).
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

# A number inside text: optional sign (a "-" is a sign only when it does not follow a
# digit, letter or bracket: "5-3" is not -3), optional "$", then a fraction "3/4", a
# thousands-grouped "1,234,567.5" (groups of exactly three digits, so "1,2,3" is three
# numbers), a plain "1234.5" / ".5", optionally with an exponent; never starting or ending
# inside another number ("3/4/2026" is a date, not a fraction).
_NUM_BODY = r"(?:\d+/\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)"
NUMBER = re.compile(r"(?:(?<![\w)\]])[-\u2212])?\$?\s?(?<![\d/.])" + _NUM_BODY + r"(?![\d/])")
_GSM8K_MARKER = re.compile(r"####\s*((?:[-\u2212]\s?)?\$?\s?[-\u2212]?" + _NUM_BODY + ")")


def parse_number(text: str | None) -> Fraction | None:
    """The exact value of one number written as text, or None.

    Reads ``18``, ``-5``, ``18.00``, ``.5``, ``1,234.5``, ``$1,234``, ``3/4``, ``-3/4``,
    ``50%`` (as 50), ``1e3``, a trailing period, a Unicode minus. Commas must group thousands.
    """
    if text is None:
        return None
    s = unicodedata.normalize("NFKC", text).strip().replace("\u2212", "-")
    s = s.replace("$", "").replace(" ", "").rstrip(".").removesuffix("%")
    while s.startswith("--"):
        s = s[1:]
    if "," in s:
        if not re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
            return None
        s = s.replace(",", "")
    if not s or not re.fullmatch(r"-?(?:\d+/\d+|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)", s):
        return None
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def canonical_number(value: Fraction) -> str:
    """One spelling per value: ``18``, ``0.75``, ``-2.5``; ``1/3`` when no finite decimal exists."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d != 1:
        return f"{value.numerator}/{value.denominator}"
    digits = 0
    scaled = value
    while scaled.denominator != 1:
        scaled *= 10
        digits += 1
    sign = "-" if scaled < 0 else ""
    text = str(abs(scaled.numerator)).rjust(digits + 1, "0")
    return f"{sign}{text[:-digits]}.{text[-digits:]}"


def normalize_number(text: str | None) -> str | None:
    """Canonical spelling of a written number (``3/4`` and ``0.75`` give the same), or None."""
    value = parse_number(text)
    return None if value is None else canonical_number(value)


def numbers_in(text: str) -> list[Fraction]:
    """Every number in the text, in order (unparseable matches skipped)."""
    out = []
    for m in NUMBER.finditer(text):
        value = parse_number(m.group(0))
        if value is not None:
            out.append(value)
    return out


def marked_number(text: str) -> Fraction | None:
    """The number after the first ``####`` marker (GSM8K's answer format), or None."""
    m = _GSM8K_MARKER.search(text)
    return parse_number(m.group(1)) if m else None


def last_number(text: str) -> Fraction | None:
    found = numbers_in(text)
    return found[-1] if found else None


def answer_number(text: str) -> Fraction | None:
    """The answer's number: after a ``####`` marker when present, else the last number."""
    marked = marked_number(text)
    return marked if marked is not None else last_number(text)


def normalize_text(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed, surrounding quotes/punctuation and final period dropped."""
    s = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return s.strip(" \"'`*_.,;:!?()[]{}")


class ExpectedError(ValueError):
    """An ``expected`` value that is not one of the documented forms."""


@dataclass(frozen=True)
class ToolCallSpec:
    name: str
    arguments: dict[str, Any] | None  # None: any arguments


@dataclass(frozen=True)
class Expected:
    kind: str  # "string" | "number" | "regex" | "tool_call"
    text: str | None = None
    number: Fraction | None = None
    tolerance: float = 0.0
    pattern: re.Pattern | None = None
    tool_calls: tuple[ToolCallSpec, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        if self.kind == "string":
            return repr(self.text)
        if self.kind == "number":
            tol = f" +- {self.tolerance:g}" if self.tolerance else ""
            return canonical_number(self.number) + tol
        if self.kind == "regex":
            return f"/{self.pattern.pattern}/"
        return ", ".join(f"{c.name}({'' if c.arguments is None else json.dumps(c.arguments, sort_keys=True)})"
                         for c in self.tool_calls)


_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def _tool_spec(raw: Any) -> ToolCallSpec:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise ExpectedError(f"a tool call needs a non-empty 'name', got {raw!r}")
    args = raw.get("arguments")
    if isinstance(args, str):  # the OpenAI wire form: arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise ExpectedError(f"tool call {raw['name']!r}: 'arguments' is not JSON ({exc})") from exc
    if args is not None and not isinstance(args, dict):
        raise ExpectedError(f"tool call {raw['name']!r}: 'arguments' must be an object, got {args!r}")
    return ToolCallSpec(raw["name"], args)


def parse_expected(raw: Any) -> Expected:
    """The ``expected`` field of a replay line; raises ExpectedError naming what is wrong."""
    if isinstance(raw, bool) or raw is None:
        raise ExpectedError(f"expected must be a string, a number or an object, got {raw!r}")
    if isinstance(raw, str):
        return Expected("string", text=raw)
    if isinstance(raw, (int, float)):
        if not math.isfinite(raw):
            raise ExpectedError(f"expected number must be finite, got {raw!r}")
        return Expected("number", number=Fraction(str(raw)))
    if not isinstance(raw, dict):
        raise ExpectedError(f"expected must be a string, a number or an object, got {type(raw).__name__}")
    kinds = [k for k in ("string", "number", "regex", "tool_call", "tool_calls") if k in raw]
    if len(kinds) != 1:
        raise ExpectedError("an expected object needs exactly one of 'string', 'number', 'regex', "
                            f"'tool_call', 'tool_calls'; got keys {sorted(raw)}")
    kind = kinds[0]
    value = raw[kind]
    if kind == "string":
        if not isinstance(value, str):
            raise ExpectedError(f"expected.string must be a string, got {value!r}")
        return Expected("string", text=value)
    if kind == "number":
        number = (Fraction(str(value)) if isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value) else parse_number(value) if isinstance(value, str) else None)
        if number is None:
            raise ExpectedError(f"expected.number {value!r} is not a number (e.g. 42, \"3/4\", \"1,234.5\")")
        tol = raw.get("tolerance", 0.0)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise ExpectedError(f"expected.tolerance must be a number >= 0, got {tol!r}")
        return Expected("number", number=number, tolerance=float(tol))
    if kind == "regex":
        flags = 0
        for ch in raw.get("flags", ""):
            if ch not in _FLAGS:
                raise ExpectedError(f"expected.flags: unknown flag {ch!r} (use i, m, s, x)")
            flags |= _FLAGS[ch]
        try:
            return Expected("regex", pattern=re.compile(value, flags))
        except (re.error, TypeError) as exc:
            raise ExpectedError(f"expected.regex {value!r} does not compile: {exc}") from exc
    calls = [value] if kind == "tool_call" else value
    if not isinstance(calls, list) or not calls:
        raise ExpectedError("expected.tool_calls must be a non-empty list of {name, arguments}")
    return Expected("tool_call", tool_calls=tuple(_tool_spec(c) for c in calls))


def parse_tool_arguments(arguments: Any) -> tuple[Any, str | None]:
    """(parsed arguments, error): the wire form is a JSON string."""
    if isinstance(arguments, dict):
        return arguments, None
    if not isinstance(arguments, str):
        return None, f"arguments of type {type(arguments).__name__}"
    try:
        return json.loads(arguments or "{}"), None
    except json.JSONDecodeError as exc:
        return None, f"arguments are not JSON: {exc}"


def _call_matches(spec: ToolCallSpec, call: dict[str, Any]) -> bool:
    if call.get("name") != spec.name:
        return False
    if spec.arguments is None:
        return True
    parsed, error = parse_tool_arguments(call.get("arguments"))
    return error is None and parsed == spec.arguments


def score(expected: Expected, content: str | None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``{"correct": bool, "extracted": str | None}`` for one response.

    ``content`` is the answer text (not the reasoning); ``tool_calls`` are the returned calls
    as ``{"name", "arguments"}`` (arguments a JSON string or an object).
    """
    content = content or ""
    if expected.kind == "string":
        got = normalize_text(content)
        return {"correct": got == normalize_text(expected.text), "extracted": got}
    if expected.kind == "number":
        got = answer_number(content)
        if got is None:
            return {"correct": False, "extracted": None}
        ok = got == expected.number if not expected.tolerance else (
            abs(float(got - expected.number)) <= expected.tolerance)
        return {"correct": ok, "extracted": canonical_number(got)}
    if expected.kind == "regex":
        m = expected.pattern.search(content)
        return {"correct": m is not None, "extracted": m.group(0) if m else None}
    calls = tool_calls or []
    ok = all(any(_call_matches(spec, c) for c in calls) for spec in expected.tool_calls)
    return {"correct": ok, "extracted": ", ".join(
        f"{c.get('name')}({c.get('arguments') if isinstance(c.get('arguments'), str) else json.dumps(c.get('arguments'))})"
        for c in calls) or None}
