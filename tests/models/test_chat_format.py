"""The tiny checkpoints' Ling-3 chat template and marker tokens (no vLLM needed)."""

from __future__ import annotations

import json

import pytest

from vllm_ling.models.chat_format import MARKERS, ROLE_END, SPECIAL_MARKERS, TEXT_MARKERS, marker_ids

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


def test_markers_are_single_tokens_at_the_end_of_the_vocabulary(tok, tiny_checkpoint):
    vocab = json.loads((tiny_checkpoint / "config.json").read_text())["vocab_size"]
    ids = marker_ids(vocab)
    for m in MARKERS:
        assert tok.encode(m, add_special_tokens=False) == [ids[m]], m
    assert sorted(ids.values()) == list(range(vocab - len(MARKERS), vocab))
    # Role markup is hidden from output text like EOS; reasoning/tool markup is not.
    hidden = tok.decode([ids[m] for m in MARKERS], skip_special_tokens=True)
    assert hidden == "".join(TEXT_MARKERS) and not any(m in hidden for m in SPECIAL_MARKERS)
    gen = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert ids[ROLE_END] in gen["eos_token_id"]  # the end of an assistant turn stops generation


def test_template_renders_roles_tools_calls_and_results(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning": "old thoughts", "tool_calls": [CALL]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "22 C"},
                {"role": "user", "content": "Thanks"}]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<role>SYSTEM</role>Be brief.\n# Tools")
    assert json.dumps(TOOLS[0]["function"]) in text  # one declaration per line
    assert "detailed thinking on<|role_end|><role>HUMAN</role>Weather?<|role_end|>" in text
    # A turn before the last user message keeps its tool call, not its reasoning.
    assert ("<role>ASSISTANT</role>\n<think></think><tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
            "</tool_call><|role_end|>") in text
    assert ("<role>OBSERVATION</role>\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C\n"
            "</tool_response><|role_end|><role>HUMAN</role>Thanks<|role_end|>") in text
    assert text.endswith("<role>ASSISTANT</role>\n<think>")
    off = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert "detailed thinking off" in off and off.endswith("<role>ASSISTANT</role>\n<think></think>")


@pytest.mark.parametrize("thinking", [True, False])
def test_a_rendered_turn_starts_with_its_generation_prompt(tok, thinking):
    """What the startup round-trip check relies on: turn = generation prompt + model output."""
    prompt = [{"role": "user", "content": "Weather in Paris?"}]
    turn = {"role": "assistant", "content": "", "reasoning": "Look it up.", "tool_calls": [CALL]}
    head = tok.apply_chat_template(prompt, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=thinking)
    full = tok.apply_chat_template(prompt + [turn], tools=TOOLS, tokenize=False, enable_thinking=thinking)
    assert full.startswith(head)
    out = full[len(head):]
    assert out.endswith("</tool_call><|role_end|>")
    assert ("\nLook it up.\n</think>\n\n<tool_call>" in out) == thinking
