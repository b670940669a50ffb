"""The Selection record and its rule: backend choices travel as enums, never as compared words."""

from __future__ import annotations

import ast
import enum
import types
from pathlib import Path

import pytest

from vllm_ling.selection import Feature, Selection, record, recorded

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_ling"
# words that name a backend or kernel choice (the selectors' enum values)
BACKEND_WORDS = {"humming", "vllm", "reference", "vllm_amx", "dequantized", "w8a16", "ling", "scaled_mm",
                 "default_mtp", "off_no_nextn", "off_pipeline"}
# the same words naming something else: the `vllm` program, distribution and process command line
OTHER_MEANINGS = {("cli/serve.py", "vllm"), ("patches/p2_vllm_cpu_cli.py", "vllm"), ("runtime/report.py", "vllm")}


class _Choice(enum.Enum):
    A = "a"


def test_record_and_read_back_per_feature():
    module = types.SimpleNamespace()
    assert recorded(module, Feature.MOE) is None
    moe = record(module, Selection(Feature.MOE, _Choice.A, "why"))
    record(module, Selection(Feature.HEAD_KERNEL, _Choice.A, "other"))
    assert recorded(module, Feature.MOE) is moe and recorded(module, Feature.HEAD_KERNEL).reason == "other"


def test_a_word_is_no_choice():
    with pytest.raises(TypeError, match="needs a Feature and an enum choice"):
        Selection(Feature.MOE, "humming", "a typo would pass silently")
    with pytest.raises(TypeError):
        Selection("moe", _Choice.A, "feature as a word")


def _compared_words(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                consts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                found += [(node.lineno, c.value) for c in consts
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return found


def test_no_backend_name_is_compared_as_a_string_outside_parsing():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        if rel == "options.py":  # parsing: the words become enums here
            continue
        bad += [f"{rel}:{line} compares {word!r}" for line, word in _compared_words(path)
                if word in BACKEND_WORDS and (rel, word) not in OTHER_MEANINGS]
    assert bad == [], "compare the enum member (is) instead: " + "; ".join(bad)
