"""A deterministic random-weight Ling-3.0 checkpoint (``vllm-ling make-tiny DIR``).

It has the real architecture (KDA and MLA layers in the real pattern, dense first
layers, grouped-sigmoid MoE with expert bias, shared expert, per-layer SwiGLU clamps,
one NEXTN layer) in the real ``-fp4`` storage format: FP8 e4m3 dense weights with
128x128 power-of-two (UE8M0) block scales in ``weight_scale_inv``, MXFP4 routed
experts (e2m1 packed two per byte, one E8M0 scale per 32 inputs), BF16 head,
embeddings and norms, fp32 routers and expert bias, the ``quantization_config`` with
``modules_to_not_convert``, and a byte-level BPE tokenizer trained locally.

Weights are drawn like a freshly initialised model (normal, std = initializer_range),
so the quantization scales are the ones real weights of that magnitude get
(E8M0 exponents around 2**-9 for experts, not random exponents).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import torch

from vllm_ling.models.chat_format import MARKERS, ROLE_END, add_markers, chat_template, marker_ids
from vllm_ling.models.checkpoint_format import (
    BF16, FP8_BLOCK, FP32, MXFP4, TensorSpec, checkpoint_specs)
from vllm_ling.models.names import TINY_WEIGHTS_KEY
from vllm_ling.ops.fp8 import block_fp8_quantize
from vllm_ling.ops.mxfp4 import mxfp4_quantize

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TINY_CONFIG = DATA_DIR / "ling3_tiny_fp4_config.json"
PAD_TOKEN, EOS_TOKEN, BOS_TOKEN = "<pad>", "<eos>", "<bos>"
# Common English words next to the pseudo-words, so chat text (scripts, demos) spells as
# whole-word tokens.
ENGLISH_WORDS = (
    "the a an and or but so if then to of in on at for with from by as is are was be it this "
    "that these I you he she we they my your user users asks ask wants want needs need question "
    "answer tool tools call calls calling function result results weather city today tomorrow "
    "forecast temperature rain sunny check look up find search get set time date what which who "
    "where when how why yes no not can will should must let me us our please thanks hello world "
    "model reply first next now here there one two three name value know "
    "Paris London Tokyo Berlin Madrid Rome").split()


def load_tiny_config(path: str | os.PathLike | None = None) -> dict[str, Any]:
    with open(path or TINY_CONFIG) as f:
        return json.load(f)


def all_mla_variant(config: dict[str, Any]) -> dict[str, Any]:
    """Every layer MLA (layer_group_size 1): no KDA layers."""
    cfg = copy.deepcopy(config)
    cfg["layer_group_size"] = 1
    n = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    keep = [m for m in cfg["quantization_config"]["modules_to_not_convert"]
            if not m.endswith("attention.g_proj")]
    # Head-wise MLA gates are tiny (num_heads outputs) and stay BF16 in the real format.
    cfg["quantization_config"]["modules_to_not_convert"] = keep + [
        f"{i}.attention.g_proj" for i in range(n)]
    return cfg


def routable_variant(config: dict[str, Any]) -> dict[str, Any]:
    """64 routed experts in 2 groups of 32 (keep 1, top 2): the smallest tiny Ling whose routing
    vllm-ling's grouped top-k kernel holds (whole warps of experts per group), so every kernel the
    full size serves also serves the tiny model."""
    cfg = copy.deepcopy(config)
    cfg.update(num_experts=64, n_group=2, topk_group=1, num_experts_per_tok=2)
    return cfg


def _init_tensor(spec: TensorSpec, config: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    std = float(config.get("initializer_range", 0.02))
    name = spec.name
    if name.endswith("A_log"):
        # Per-head decay rates exp(A) in [1, 16], the usual Mamba/KDA initialisation.
        return torch.log(torch.empty(spec.shape).uniform_(1.0, 16.0, generator=gen))
    if name.endswith("dt_bias"):
        return torch.empty(spec.shape).uniform_(-1.0, 1.0, generator=gen)
    if "_conv1d" in name:
        return torch.randn(spec.shape, generator=gen) / math.sqrt(spec.shape[-1])
    if name.endswith("expert_bias"):
        return torch.randn(spec.shape, generator=gen) * 1e-2
    if len(spec.shape) == 1 or name.endswith("norm.weight"):
        return torch.ones(spec.shape)
    return torch.randn(spec.shape, generator=gen) * std


def quantize_for_checkpoint(spec: TensorSpec, real: torch.Tensor) -> dict[str, torch.Tensor]:
    """Store a real-valued tensor the way the -fp4 checkpoint stores ``spec``."""
    scale_name = spec.name[: -len(".weight")] + ".weight_scale_inv"
    if spec.kind == BF16:
        return {spec.name: real.to(torch.bfloat16)}
    if spec.kind == FP32:
        return {spec.name: real.float()}
    if spec.kind == FP8_BLOCK:
        q, scale = block_fp8_quantize(real)
        return {spec.name: q, scale_name: scale}
    if spec.kind == MXFP4:
        packed, scale = mxfp4_quantize(real)
        return {spec.name: packed, scale_name: scale.view(torch.float8_e8m0fnu)}
    raise ValueError(f"unknown kind {spec.kind}")


def random_checkpoint_tensors(config: dict[str, Any], seed: int = 0,
                              overrides: dict[str, torch.Tensor] | None = None
                              ) -> dict[str, torch.Tensor]:
    """All checkpoint tensors, drawn in spec order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for spec in checkpoint_specs(config):
        real = _init_tensor(spec, config, gen)
        if overrides and spec.name in overrides:
            real = overrides[spec.name].reshape(spec.shape).float()
        tensors.update(quantize_for_checkpoint(spec, real))
    return tensors


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int) -> None:
    """A byte-level BPE trained on seeded pseudo-words: no hub, no unknown tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "el", "is", "or",
                 "un", "the", "and", "ing", "tion", "er", "es", "ed", "0", "1", "2", "3",
                 "4", "5", "6", "7", "8", "9"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(2000)]
    corpus += [" ".join(rng.choice(ENGLISH_WORDS) for _ in range(12)) for _ in range(600)]
    corpus += [" ".join(w.capitalize() for w in rng.sample(ENGLISH_WORDS, 12)) for _ in range(200)]
    trained_size = vocab_size - len(MARKERS)  # the chat markers take the last ids
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=trained_size, special_tokens=[PAD_TOKEN, EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    missing = trained_size - tok.get_vocab_size()
    if missing > 0:  # pad so every id the model can emit decodes
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    add_markers(tok, vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD_TOKEN, "eos_token": EOS_TOKEN, "bos_token": BOS_TOKEN,
        "add_bos_token": False, "model_max_length": 4096,
        "chat_template": chat_template(),
    }, indent=2))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def chmod_like_umask(path: Path) -> None:
    """safetensors creates files 0600; a container user (uid 10001) could not read them through a
    bind mount. Give them the mode any other written file gets (umask)."""
    os.chmod(path, 0o666 & ~_umask())


def write_checkpoint(out_dir: str | os.PathLike, config: dict[str, Any],
                     tensors: dict[str, torch.Tensor], seed: int = 0, num_shards: int = 2) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(num_shards):
        shard_names = names[s * per_shard:(s + 1) * per_shard]
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard_names}, str(out / fname),
                  metadata={"format": "pt"})
        chmod_like_umask(out / fname)
        for n in shard_names:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        # The end of an assistant turn (<|role_end|>) stops generation too, as in Ling-3.
        {"eos_token_id": [config["eos_token_id"], marker_ids(config["vocab_size"])[ROLE_END]],
         "pad_token_id": config["pad_token_id"]}))
    build_tokenizer(out, config["vocab_size"], seed)
    return out


def make_tiny(out_dir: str | os.PathLike, seed: int = 0, config_path: str | None = None,
              all_mla: bool = False, agreeing: bool = False, script: str | None = None,
              routable: bool = False) -> Path:
    config = load_tiny_config(config_path)
    if all_mla:
        config = all_mla_variant(config)
    if routable:
        config = routable_variant(config)
    overrides = None
    if script is not None:
        overrides = _scripted(Path(out_dir), config, seed, script)
    elif agreeing:
        from vllm_ling.models.agreeing_checkpoint import agreeing_overrides

        overrides = agreeing_overrides(config, seed)
    config[TINY_WEIGHTS_KEY] = "scripted" if script is not None else "agreeing" if agreeing else "random"
    return write_checkpoint(out_dir, config, random_checkpoint_tensors(config, seed, overrides), seed)


SCRIPT_FILE = "vllm_ling_script.json"


def _scripted(out: Path, config: dict[str, Any], seed: int, script: str) -> dict[str, torch.Tensor]:
    """Plan the script's token chain with the checkpoint's own tokenizer (deterministic: built
    in a scratch directory first, so a script that cannot be spelled leaves nothing behind) and
    record it next to the weights."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    from vllm_ling.models.scripted_checkpoint import plan_chain, scripted_overrides

    with tempfile.TemporaryDirectory() as scratch:
        build_tokenizer(Path(scratch), config["vocab_size"], seed)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(scratch) / "tokenizer.json"))
        chain = plan_chain(tokenizer, script, config["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    (out / SCRIPT_FILE).write_text(json.dumps({"script": script, "chain": chain}, indent=1))
    return scripted_overrides(config, chain, seed)
