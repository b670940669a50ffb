"""``make-tiny --script``: the chain planner and the head it builds (plain PyTorch, no vLLM)."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_ling.models.chat_format import ROLE_END, marker_ids
from vllm_ling.models.scripted_checkpoint import (EXAMPLE_SCRIPT, ScriptError, greedy_walk, plan_chain,
                                                  scripted_overrides)


@pytest.fixture(scope="module")
def tok_and_config(tiny_checkpoint):
    from transformers import AutoTokenizer

    return (AutoTokenizer.from_pretrained(str(tiny_checkpoint)),
            json.loads((tiny_checkpoint / "config.json").read_text()))


def test_chain_spells_the_script_with_distinct_tokens(tok_and_config):
    tok, config = tok_and_config
    ids = marker_ids(config["vocab_size"])
    chain = plan_chain(tok, EXAMPLE_SCRIPT, config["vocab_size"])
    assert chain[0] == ids["<think>"] and chain[-1] == ids[ROLE_END]
    assert len(set(chain)) == len(chain)
    assert tok.decode(chain[1:-1]) == EXAMPLE_SCRIPT
    assert ids["<tool_call>"] in chain and ids["</think>"] in chain  # markers as their own tokens


def test_impossible_scripts_are_refused_with_the_reason(tok_and_config):
    tok, config = tok_and_config
    two_args = ("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>"
                "<arg_key>b</arg_key><arg_value>2</arg_value></tool_call>")
    with pytest.raises(ScriptError, match=r"distinct tokens.*'<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>'"):
        plan_chain(tok, two_args, config["vocab_size"])
    with pytest.raises(ScriptError, match="<role>"):
        plan_chain(tok, "hi <role>", config["vocab_size"])


def test_head_makes_every_chain_token_predict_the_next(tok_and_config):
    """Independent of the construction: logits = head . rmsnorm(E[v]) in BF16, as the target's
    last layer sees them (blocks write nothing), argmax over the vocabulary."""
    tok, config = tok_and_config
    chain = plan_chain(tok, EXAMPLE_SCRIPT, config["vocab_size"])
    t = scripted_overrides(config, chain, seed=0)
    emb = t["model.word_embeddings.weight"].bfloat16().float()
    head = t["lm_head.weight"].bfloat16().float()
    x = emb[chain[:-1]]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    logits = h @ head.T
    assert logits.argmax(-1).tolist() == chain[1:]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 0.5 * top2[:, 0].min()  # margin far beyond FP8 rounding
    assert greedy_walk(config, chain, chain[0], 200) == chain[1:]


def test_cli_refuses_an_unspellable_script_and_leaves_nothing(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-m", "vllm_ling.cli", "make-tiny", str(out), "--script",
                        "<arg_key>a</arg_key><arg_key>b</arg_key>"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--script" in r.stderr and "distinct tokens" in r.stderr
    assert not out.exists()


def test_cli_refuses_agreeing_and_script_together(tmp_path, capsys):
    """Two ways of choosing the weights: asking for both is an error, not one silently winning."""
    import pytest

    from vllm_ling.cli.make_tiny import main

    out = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exit_info:
        main([str(out), "--agreeing", "--script", "hello"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert not out.exists()
