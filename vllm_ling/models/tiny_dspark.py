"""A tiny DSpark drafter for a tiny Ling-3.0 target (``vllm-ling make-tiny DIR --dspark DRAFT_DIR``).

The real drafter's format (docs/dspark.md, :mod:`vllm_ling.models.dspark_format`) at a tiny size:
Qwen3-shaped layers with MHA wider than the hidden size (as the real 32 x 128 over 2560), the
Markov and confidence heads, ``block_size`` 8, auxiliary features from three target layers, and
the target's embedding and LM head stored as BF16 copies (the real checkpoint stores them; vllm-ling
never loads them). With ``agreeing`` the weights are those of
:func:`vllm_ling.models.agreeing_checkpoint.agreeing_dspark_overrides`: every draft is the agreeing
target's greedy token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from vllm_ling.models.dspark_format import SHARED_WITH_TARGET, drafter_config, dspark_specs, read_fields

TARGET_EMBEDDING, TARGET_HEAD = "model.word_embeddings.weight", "lm_head.weight"
# Geometry of the tiny drafter: 2 layers of 8 x 64 heads over the tiny target's 256 hidden;
# features after target layers 1, 3 and 4 (vLLM captures the input of layers 2, 4 and 5);
# the mask token is the tiny tokenizer's <pad> (id 0).
TINY_DRAFTER = {"num_layers": 2, "num_heads": 8, "head_dim": 64, "target_layer_ids": [1, 3, 4],
                "markov_rank": 64, "mask_token_id": 0, "block_size": 8}


def tiny_drafter_config(target_cfg: dict[str, Any]) -> dict[str, Any]:
    return drafter_config(target_cfg, **TINY_DRAFTER)


def _target_vocabulary(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head as its shards store them (BF16)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for shard in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in (TARGET_EMBEDDING, TARGET_HEAD):
                if name in f.keys():
                    found[name] = f.get_tensor(name)
    missing = [n for n in (TARGET_EMBEDDING, TARGET_HEAD) if n not in found]
    if missing:
        raise ValueError(f"{target_dir}: the target checkpoint has no {missing}")
    return found[TARGET_EMBEDDING], found[TARGET_HEAD]


def make_tiny_dspark(out_dir: str | os.PathLike, target_dir: str | os.PathLike, seed: int = 0,
                     agreeing: bool = False) -> Path:
    """Write the tiny drafter for the tiny target in ``target_dir``; return ``out_dir``."""
    from safetensors.torch import save_file

    from vllm_ling.models.tiny_checkpoint import chmod_like_umask

    target = Path(target_dir)
    target_cfg = json.loads((target / "config.json").read_text())
    cfg = tiny_drafter_config(target_cfg)
    out = Path(out_dir)
    fields = read_fields(cfg, str(out / "config.json"))
    specs = dspark_specs(fields)
    embeddings, head = _target_vocabulary(target)
    overrides: dict[str, torch.Tensor] = {}
    if agreeing:
        from vllm_ling.models.agreeing_checkpoint import agreeing_dspark_overrides

        overrides = agreeing_dspark_overrides(specs, embeddings, head, fields.markov_rank, seed)
    gen = torch.Generator().manual_seed(seed + 1000003)
    std = float(target_cfg.get("initializer_range", 0.02))
    tensors: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name in SHARED_WITH_TARGET:
            real = embeddings if spec.name == SHARED_WITH_TARGET[0] else head
        elif len(spec.shape) == 1 and spec.name.endswith("norm.weight"):
            real = torch.ones(spec.shape)
        elif spec.name.startswith("markov_head.markov_w1"):  # an embedding table: unit-scale rows
            real = torch.randn(spec.shape, generator=gen)
        else:
            real = torch.randn(spec.shape, generator=gen) * std
        tensors[spec.name] = overrides.get(spec.name, real).to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    chmod_like_umask(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
