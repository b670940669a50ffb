"""bailing_hybrid loads without trust-remote-code and keeps the checkpoint's head_dim."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

DATA = Path(__file__).resolve().parents[2] / "vllm_ling" / "data"


def _config_dir(tmp_path: Path, name: str, mutate=None) -> Path:
    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((DATA / name).read_text())
    if mutate:
        mutate(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name,head_dim,hidden,heads", [
    ("ling3_tiny_fp4_config.json", 64, 256, 16),
    ("ling3_flash_fp4_config.json", 128, 2560, 32),
])
def test_config_parses_without_remote_code(tmp_path, name, head_dim, hidden, heads):
    import vllm_ling
    from vllm.transformers_utils.config import get_config

    vllm_ling.register()
    cfg = get_config(str(_config_dir(tmp_path, name)), trust_remote_code=False)
    assert type(cfg).__name__ == "LingHybridConfig"
    # head_dim is read from the checkpoint, not derived as hidden/heads (which differs here).
    assert cfg.head_dim == head_dim != hidden // heads
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.expert_swiglu_limit_list == json.loads((DATA / name).read_text())["expert_swiglu_limit_list"]
    mla = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert mla == [i for i in range(cfg.num_hidden_layers) if (i + 1) % 6 == 0]


def test_wrong_architecture_names_config_json(tmp_path):
    """The check names the file; the config still parses (vLLM retries a parse that raises,
    so vLLM runs the check after it: tests/patches/test_p9_architecture_check.py)."""
    import vllm_ling
    from vllm.transformers_utils.config import get_config

    from vllm_ling.models.configuration import check_architectures

    vllm_ling.register()
    d = _config_dir(tmp_path, "ling3_tiny_fp4_config.json",
                    lambda c: c.update(architectures=["BailingMoeV3ForCausalLMX"]))
    cfg = get_config(str(d), trust_remote_code=False)
    with pytest.raises(ValueError, match=re.escape(f"{d}/config.json: architectures "
                                                   "['BailingMoeV3ForCausalLMX'] is not a Ling-3.0 architecture")):
        check_architectures(cfg.architectures, f"{d}/config.json")
    for ling in (["BailingMoeV3ForCausalLM"], ["BailingMoeV3MTPModel"], []):  # [] = vLLM's sub-config views
        check_architectures(ling)


def test_invalid_swiglu_limit_list_is_reported(tmp_path):
    from vllm_ling.models.configuration import LingHybridConfig

    cfg = json.loads((DATA / "ling3_tiny_fp4_config.json").read_text())
    cfg["expert_swiglu_limit_list"] = [0, 4]
    with pytest.raises(ValueError, match="expert_swiglu_limit_list has 2 entries for num_hidden_layers=6"):
        LingHybridConfig(**cfg).validate_ling_fields()


def test_the_config_hook_validates_ling_fields_before_load(tmp_path):
    """P4 runs while vLLM builds its config (before any weight loads): a broken clamp list is
    refused there, naming the checkpoint's config.json."""
    import types

    from vllm_ling.models.configuration import LingHybridConfig
    from vllm_ling.patches.config_hooks import LingConfigHook

    cfg = json.loads((DATA / "ling3_tiny_fp4_config.json").read_text())
    cfg["share_expert_swiglu_limit_list"] = [7.0]
    model_config = types.SimpleNamespace(hf_config=LingHybridConfig(**cfg), model=str(tmp_path))
    with pytest.raises(ValueError, match=f"{tmp_path}/config.json: invalid Ling-3.0 config: "
                                         "share_expert_swiglu_limit_list has 1 entries"):
        LingConfigHook.verify_and_update_config(types.SimpleNamespace(model_config=model_config))
