"""The option table is the one declaration: the README, the serve flags and the known-variable
check all follow it, and values are parsed (and refused) by it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_ling import options as o

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_switch_table_is_the_declared_table():
    text = README.read_text()
    found = re.search(r"<!-- options-table:begin -->\n(.*?)\n<!-- options-table:end -->", text, re.S)
    assert found, "README.md lost its options-table markers"
    assert found.group(1).strip() == o.markdown_table(), (
        "README switch table differs from vllm_ling/options.py: regenerate it with "
        "python -c 'from vllm_ling.options import markdown_table; print(markdown_table())'")


def test_every_variable_read_in_the_package_is_declared():
    """A VLLM_LING_* literal anywhere in the package must be a declared option."""
    package = Path(o.__file__).parent
    names = set()
    for path in package.rglob("*.py"):
        names |= set(re.findall(r"\bVLLM_LING_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert names - o.known_env_vars() == set()


def test_serve_flags_come_from_the_table():
    from vllm_ling.cli.serve import build_serve_parser

    flags = {a for action in build_serve_parser()._actions for a in action.option_strings}
    assert {opt.flag for opt in o.serve_options()} <= flags


@pytest.mark.parametrize("name,raw,message", [
    ("VLLM_LING_MOE_BACKEND", "marlin", "VLLM_LING_MOE_BACKEND='marlin': expected one of humming, vllm"),
    ("VLLM_LING_FP8_HEAD", "maybe", "VLLM_LING_FP8_HEAD='maybe' is not a boolean"),
    ("VLLM_LING_NUM_SPEC_TOKENS", "0", "VLLM_LING_NUM_SPEC_TOKENS=0 must be >= 1"),
    ("VLLM_LING_ACCEPT_BREAK_EVEN", "nan", "VLLM_LING_ACCEPT_BREAK_EVEN='nan' is not a finite number"),
    ("VLLM_LING_WARMUP_TOKEN_COUNTS", "1,x", "VLLM_LING_WARMUP_TOKEN_COUNTS='1,x': expected comma-separated integers"),
])
def test_bad_values_are_refused_naming_the_variable(name, raw, message):
    with pytest.raises(o.LingOptionError) as err:
        o.read(name, {name: raw})
    assert str(err.value).startswith(message)


def test_values_parse_to_types_and_enums():
    env = {"VLLM_LING_MOE_DECODE": "COPY", "VLLM_LING_FP8_HEAD": "off",
           "VLLM_LING_WARMUP_ROW_COUNTS": "8, 1,8", "VLLM_LING_ACCEPT_BREAK_EVEN": "3"}
    assert o.read("VLLM_LING_MOE_DECODE", env) is o.MoeDecode.COPY
    assert o.read("VLLM_LING_FP8_HEAD", env) is False
    assert o.read("VLLM_LING_WARMUP_ROW_COUNTS", env) == (1, 8)
    assert o.read("VLLM_LING_ACCEPT_BREAK_EVEN", env) == 3.0
    assert o.LingOptions.from_env({}) == o.LingOptions()
    assert f"{o.MoeDecode.COPY}" == "copy" and o.MoeDecode.COPY == "copy"


def test_closest_known_name_for_a_typo():
    assert o.closest_known("VLLM_LING_FP8HEAD") == "VLLM_LING_FP8_HEAD"
    assert o.closest_known("VLLM_LING_TOTALLY_ELSE_ENTIRELY") is None


def test_warmup_flags_come_from_the_table():
    """`vllm-ling warmup` takes exactly the options marked ``warmup_flag`` (the kernel switches,
    the shapes and the cache), each as a flag."""
    from vllm_ling.cli.warmup import build_warmup_parser

    assert {opt.name for opt in o.warmup_options()} == {
        "VLLM_LING_MOE_BACKEND", "VLLM_LING_MOE_W4A8", "VLLM_LING_MOE_DECODE", "VLLM_LING_MOE_DECODE_MAX_TOKENS",
        "VLLM_LING_FP8_HEAD", "VLLM_LING_DENSE_FP8", "VLLM_LING_ROUTER_GEMV", "VLLM_LING_ROUTER_TOPK",
        "VLLM_LING_BF16_GEMV", "VLLM_LING_RESIDUAL_NORM",
        "VLLM_LING_KDA_MERGED_IN_PROJ", "VLLM_LING_TENSOR_PARALLEL_SIZE", "VLLM_LING_WARMUP_TOKEN_COUNTS",
        "VLLM_LING_WARMUP_ROW_COUNTS", "VLLM_LING_HUMMING_CACHE"}
    dests = {action.dest for action in build_warmup_parser()._actions}
    assert {opt.short for opt in o.warmup_options()} <= dests


def test_the_dense_fp8_option_states_the_decode_kernels_row_limit():
    """The help text is formatted from the constant the kernel checks, so the two cannot drift."""
    from vllm_ling.ops.dense_fp8 import decode_kernel

    assert f"at most {decode_kernel.MAX_ROWS} tokens" in o.option("VLLM_LING_DENSE_FP8").help


@pytest.mark.parametrize("name,kernel_limit", [("VLLM_LING_BF16_GEMV", "BF16_MAX_ROWS"),
                                               ("VLLM_LING_ROUTER_GEMV", "MAX_ROWS")])
def test_the_small_gemv_options_state_the_kernels_row_limits(name, kernel_limit):
    from vllm_ling.ops.small_gemv import kernel

    assert f"at most {getattr(kernel, kernel_limit)} tokens" in o.option(name).help


def test_opt_out_settings_come_from_the_table():
    assert o.opt_out_setting("VLLM_LING_DENSE_FP8") == "VLLM_LING_DENSE_FP8=vllm"
    assert o.opt_out_setting("VLLM_LING_FP8_HEAD") == "VLLM_LING_FP8_HEAD=0"
    with pytest.raises(ValueError, match="VLLM_LING_PORT has no opt-out"):
        o.opt_out_setting("VLLM_LING_PORT")


def test_no_opt_out_setting_is_retyped_in_the_package():
    """An opt-out (``VLLM_LING_X=<its opt_out value>``) in a string the code builds comes from
    :func:`opt_out_setting`; docstrings and comments may name it."""
    import ast

    settings = {opt.opt_out_setting for opt in o.OPTIONS if opt.opt_out is not None}
    package = Path(o.__file__).parent
    bad = []
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                bad += [f"{path.relative_to(package)}:{node.lineno} {s}" for s in settings
                        if re.search(re.escape(s) + r"(?![\w])", node.value)]
    assert bad == [], "use vllm_ling.options.opt_out_setting: " + "; ".join(bad)


def test_options_are_parsed_once_per_process(monkeypatch):
    monkeypatch.delenv("VLLM_LING_FP8_HEAD", raising=False)
    first = o.LingOptions.current()
    assert o.LingOptions.current() is first  # one parse, every caller the same value
    monkeypatch.setenv("VLLM_LING_FP8_HEAD", "0")
    assert o.LingOptions.current().fp8_head is False  # parsed again only when the environment changed


def test_the_break_even_default_is_the_point_the_cost_model_is_scaled_to():
    from vllm_ling.runtime import spec_policy

    default = o.option("VLLM_LING_ACCEPT_BREAK_EVEN").default
    assert spec_policy.CostModel(spec_policy.load_config(), 3).break_even(1) == pytest.approx(default)


def test_the_moe_decode_token_limit_fits_the_decode_kernels_grid():
    from vllm_ling.ops.moe.decode.shapes import MAX_GRID_ROWS

    top_k = 8  # Ling-3.0-flash's num_experts_per_tok
    assert o.MOE_DECODE_MAX_TOKENS_LIMIT * top_k <= MAX_GRID_ROWS


def test_a_renamed_variable_is_still_read_for_one_release_with_a_warning():
    new, old = "VLLM_LING_KDA_MERGED_IN_PROJ", "VLLM_LING_KDA_MERGED_PROJ"
    assert o.RENAMED == {old: new}
    assert o.read(new, {old: "0"}) is False  # the old name still opts out
    assert o.read(new, {old: "0", new: "1"}) is True  # the new name wins
    assert o.LingOptions.from_env({old: "0"}).kda_merged_in_proj is False
    assert o.unknown_variables({old: "0"}) == [
        f"{old} is renamed {new}: it is still read until the next release; set {new} instead"]
