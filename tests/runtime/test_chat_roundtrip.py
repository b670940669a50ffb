"""The startup chat round-trip check on vLLM's own renderer and parser classes (no server):
the tiny checkpoint's Ling-3 template with the ling3 parsers passes; a wrong or missing parser
fails naming template and parsers, and strict refuses."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def vllm_setup(tiny_checkpoint):
    import vllm_ling
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    vllm_ling.register()
    config = EngineArgs(model=str(tiny_checkpoint), enforce_eager=True, dtype="bfloat16",
                        max_model_len=256).create_engine_config()
    return config, renderer_from_config(config)


def _online(vllm_setup, reasoning, tool, auto=True, template=None, kwargs=None):
    """vLLM's OnlineRenderer exactly as init_app_state builds it from the serve flags."""
    from vllm.renderers.online_renderer import OnlineRenderer

    config, renderer = vllm_setup
    return OnlineRenderer(config.model_config, renderer, request_logger=None, chat_template=template,
                          chat_template_content_format="auto", enable_auto_tools=auto, tool_parser=tool,
                          reasoning_parser=reasoning, default_chat_template_kwargs=kwargs or {})


def _run(vllm_setup, reasoning, tool, auto=True, **kw):
    from vllm_ling.runtime.chat_roundtrip import run_roundtrip

    return run_roundtrip(_online(vllm_setup, reasoning, tool, auto, **kw), reasoning, tool, auto)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_ling3_parsers_parse_back_the_tiny_template(vllm_setup, kwargs):
    result = _run(vllm_setup, "ling3", "ling3", kwargs=kwargs)
    assert result.status == "passed", result.detail
    assert ("reasoning and tool call" in result.detail) == (not kwargs)


def test_wrong_tool_parser_fails_naming_template_and_parsers(vllm_setup):
    result = _run(vllm_setup, "ling3", "hermes")
    assert result.status == "failed"
    assert "--tool-call-parser hermes" in result.detail and "chat template" in result.detail
    assert "0 tool calls parsed" in result.detail
    assert "--tool-call-parser ling3" in result.fix


def test_wrong_template_fails(vllm_setup):
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    result = _run(vllm_setup, "ling3", "ling3", template=chatml)
    assert result.status == "failed" and "(inline text)" in result.detail


def test_tool_parser_without_auto_tool_choice_fails(vllm_setup):
    result = _run(vllm_setup, "ling3", "ling3", auto=False)
    assert result.status == "failed" and "--enable-auto-tool-choice" in result.detail


def test_no_parsers_is_off_by_request(vllm_setup):
    assert _run(vllm_setup, None, None, auto=False).status == "off by request"


def test_strict_refuses_and_warn_records(vllm_setup, tmp_path, monkeypatch):
    import json

    from vllm_ling.runtime.chat_roundtrip import check_at_startup
    from vllm_ling.runtime.verification.policy import LingVerificationError

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"passed": True, "checks": [{"name": "lm_head", "passed": True}]}))
    monkeypatch.setenv("VLLM_LING_REPORT_PATH", str(report))
    state = SimpleNamespace(online_renderer=_online(vllm_setup, "ling3", "hermes"))
    args = Namespace(tool_call_parser="hermes", enable_auto_tool_choice=True,
                     structured_outputs_config=SimpleNamespace(reasoning_parser="ling3"))
    monkeypatch.setenv("VLLM_LING_VERIFY", "strict")
    with pytest.raises(LingVerificationError, match=r"--reasoning-parser ling3 --tool-call-parser hermes do not "
                                                    r"parse what the model's tokenizer chat template renders"):
        check_at_startup(state, args)
    monkeypatch.setenv("VLLM_LING_VERIFY", "warn")
    assert check_at_startup(state, args).status == "failed"
    written = json.loads(report.read_text())
    assert written["passed"] is False and written["chat_roundtrip"]["tool_parser"] == "hermes"
    assert [c["name"] for c in written["checks"]] == ["lm_head", "chat_roundtrip"]
