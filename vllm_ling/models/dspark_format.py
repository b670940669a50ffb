"""The Ling-3.0 DSpark drafter (``LingDSparkModel``): its config fields and tensors, read from its
config.json, and what it must agree on with the target.

One description serves ``make-tiny --dspark`` (what to write), the pre-load checks (what the
config and the shards must hold, :func:`check_dspark_checkpoint`), the drafter class (which
fields it relies on) and ``vllm-ling plan`` (bytes per draft step). Field names and tensor
names are the ones the public loaders read (docs/dspark.md, section 1): vLLM 0.32's
``qwen3_dflash.py`` / ``qwen3_dspark.py``, SGLang's ``models/dspark.py`` and DeepSpec's
``modeling/dspark``. No vLLM or torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ling.models.checkpoint_format import BF16, TensorSpec
from vllm_ling.models.names import DSPARK_ARCH, DSPARK_MODEL_TYPE
from vllm_ling.refusal import Refusal

# The drafter's frozen copies of the target's input embedding and LM head (DeepSpec copies and
# freezes them before training). vllm-ling never loads them: the drafter uses the target's modules.
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")
# vLLM 0.32's Qwen3 DSpark implements only this Markov head (markov_w1 / markov_w2); SGLang also
# has "gated" and "rnn" heads, which vLLM would load into the wrong computation.
MARKOV_HEAD_TYPE = "vanilla"


class DSparkFormatError(Refusal, ValueError):
    """The DSpark drafter does not match the format its config declares, or not the target."""


@dataclass(frozen=True)
class DSparkFields:
    """What a Ling-3.0 DSpark drafter's config.json says, in the names vllm-ling uses."""

    source: str  # the config.json it was read from (for messages)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]  # HF output_hidden_states numbering: the stream after layer i
    mask_token_id: int
    markov_rank: int
    markov_head_type: str
    confidence_head: bool
    confidence_with_markov: bool
    sample_from_anchor: bool

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """vLLM's capture points for the target: the *input* of layer i + 1 (vLLM's
        ``get_eagle3_aux_layers_from_config`` adds the same 1)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def fc_inputs(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


def _nested(cfg: dict[str, Any], key: str) -> Any:
    """A field at the top level or in ``dflash_config`` (both spellings exist in the wild)."""
    if cfg.get(key) is not None:
        return cfg[key]
    return (cfg.get("dflash_config") or {}).get(key)


def read_fields(cfg: dict[str, Any], source: str) -> DSparkFields:
    """The drafter's fields; DSparkFormatError naming the field and ``source`` when one is missing
    or malformed."""
    def need(key: str, value: Any = None) -> Any:
        value = cfg.get(key) if value is None else value
        if value is None:
            raise DSparkFormatError(
                f"{source}: the DSpark drafter config has no {key!r} (vLLM, SGLang and DeepSpec read "
                f"it). Pass the {DSPARK_ARCH} checkpoint made for this Ling-3.0 target.")
        return value

    def integer(key: str, value: Any = None, minimum: int = 0) -> int:
        v = need(key, value)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise DSparkFormatError(f"{source}: {key}={v!r} must be an integer >= {minimum}. "
                                    f"Fix {key} in the drafter's config.json.")
        return v

    archs = cfg.get("architectures") or []
    if DSPARK_ARCH not in archs:
        raise DSparkFormatError(
            f"{source}: architectures {archs} does not name {DSPARK_ARCH!r}: this is not a Ling-3.0 DSpark "
            "drafter. Pass the drafter made for Ling-3.0 (inclusionAI/Ling-3.0-flash-dspark).")
    if cfg.get("model_type") != DSPARK_MODEL_TYPE:
        raise DSparkFormatError(
            f"{source}: model_type {cfg.get('model_type')!r}; vllm-ling reads {DSPARK_ARCH} drafters exported with "
            f"model_type {DSPARK_MODEL_TYPE!r} (Qwen3-shaped). Report the checkpoint if it is the official one.")
    block = cfg.get("block_size", cfg.get("dspark_block_size"))
    layer_ids = need("target_layer_ids", _nested(cfg, "target_layer_ids"))
    if not isinstance(layer_ids, list) or not layer_ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
        raise DSparkFormatError(f"{source}: target_layer_ids={layer_ids!r} must be a non-empty list of "
                                "integers. Fix it in the drafter's config.json.")
    if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])):
        raise DSparkFormatError(f"{source}: target_layer_ids={layer_ids} must be strictly increasing. "
                                "Fix it in the drafter's config.json.")
    head_type = str(cfg.get("markov_head_type", MARKOV_HEAD_TYPE))
    if head_type != MARKOV_HEAD_TYPE:
        raise DSparkFormatError(
            f"{source}: markov_head_type={head_type!r}; vLLM 0.32 runs only the {MARKOV_HEAD_TYPE!r} Markov head. "
            "Use a drafter with a vanilla Markov head.")
    hidden, heads = integer("hidden_size", minimum=1), integer("num_attention_heads", minimum=1)
    confidence = bool(cfg.get("enable_confidence_head", False))
    with_markov = bool(cfg.get("confidence_head_with_markov", False))
    if with_markov and not confidence:
        raise DSparkFormatError(f"{source}: confidence_head_with_markov is set without enable_confidence_head. "
                                "Fix the drafter's config.json.")
    return DSparkFields(
        source=source,
        num_layers=integer("num_hidden_layers", minimum=1),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=integer("num_key_value_heads", cfg.get("num_key_value_heads", heads), minimum=1),
        head_dim=integer("head_dim", cfg.get("head_dim", hidden // heads), minimum=1),
        intermediate_size=integer("intermediate_size", minimum=1),
        vocab_size=integer("vocab_size", minimum=1),
        block_size=integer("block_size", block, minimum=1),
        target_layer_ids=tuple(layer_ids),
        mask_token_id=integer("mask_token_id", _nested(cfg, "mask_token_id")),
        markov_rank=integer("markov_rank", minimum=1),
        markov_head_type=head_type,
        confidence_head=confidence,
        confidence_with_markov=with_markov,
        sample_from_anchor=bool(cfg.get("sample_from_anchor", True)),
    )


def check_against_target(fields: DSparkFields, target_cfg: dict[str, Any], target_source: str) -> None:
    """Refuse a drafter that cannot serve this target (DSparkFormatError naming both files)."""
    n = int(target_cfg["num_hidden_layers"])
    what = f"{fields.source} (drafter) and {target_source} (target)"
    for key, mine in (("hidden_size", fields.hidden_size), ("vocab_size", fields.vocab_size)):
        theirs = int(target_cfg[key])
        if mine != theirs:
            raise DSparkFormatError(
                f"{what}: {key} {mine} != {theirs}: the drafter shares the target's embedding and LM head, so "
                "both must agree. Pass the DSpark drafter made for this target.")
    # vLLM captures the stream at the input of layer i + 1, so the last layer's output (i = n - 1)
    # and the embedding (i = -1) have no capture point (vLLM's get_eagle3_aux_layers_from_config).
    bad = [i for i in fields.target_layer_ids if not 0 <= i <= n - 2]
    if bad:
        raise DSparkFormatError(
            f"{what}: target_layer_ids {bad} are outside 0..{n - 2} for a target of {n} layers: vLLM captures "
            "the input of layer id + 1. Pass the DSpark drafter made for this target.")
    if not 0 <= fields.mask_token_id < fields.vocab_size:
        raise DSparkFormatError(f"{fields.source}: mask_token_id {fields.mask_token_id} is outside the vocabulary "
                                f"0..{fields.vocab_size - 1}. Fix mask_token_id in the drafter's config.json.")


def dspark_specs(fields: DSparkFields) -> list[TensorSpec]:
    """Every tensor of the drafter checkpoint (all BF16; no ``model.`` prefix), vocabulary copies last."""
    h, q = fields.hidden_size, fields.num_heads * fields.head_dim
    kv, inter = fields.num_kv_heads * fields.head_dim, fields.intermediate_size
    specs: list[TensorSpec] = []
    for i in range(fields.num_layers):
        p = f"layers.{i}"
        specs += [TensorSpec(f"{p}.self_attn.q_proj.weight", (q, h), BF16, "dspark_attention", i),
                  TensorSpec(f"{p}.self_attn.k_proj.weight", (kv, h), BF16, "dspark_attention", i),
                  TensorSpec(f"{p}.self_attn.v_proj.weight", (kv, h), BF16, "dspark_attention", i),
                  TensorSpec(f"{p}.self_attn.o_proj.weight", (h, q), BF16, "dspark_attention", i),
                  TensorSpec(f"{p}.self_attn.q_norm.weight", (fields.head_dim,), BF16, "dspark_norms", i),
                  TensorSpec(f"{p}.self_attn.k_norm.weight", (fields.head_dim,), BF16, "dspark_norms", i),
                  TensorSpec(f"{p}.mlp.gate_proj.weight", (inter, h), BF16, "dspark_mlp", i),
                  TensorSpec(f"{p}.mlp.up_proj.weight", (inter, h), BF16, "dspark_mlp", i),
                  TensorSpec(f"{p}.mlp.down_proj.weight", (h, inter), BF16, "dspark_mlp", i),
                  TensorSpec(f"{p}.input_layernorm.weight", (h,), BF16, "dspark_norms", i),
                  TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), BF16, "dspark_norms", i)]
    specs += [TensorSpec("fc.weight", (h, fields.fc_inputs), BF16, "dspark_fc"),
              TensorSpec("hidden_norm.weight", (h,), BF16, "dspark_norms"),
              TensorSpec("norm.weight", (h,), BF16, "dspark_norms"),
              TensorSpec("markov_head.markov_w1.weight", (fields.vocab_size, fields.markov_rank), BF16,
                         "dspark_markov"),
              TensorSpec("markov_head.markov_w2.weight", (fields.vocab_size, fields.markov_rank), BF16,
                         "dspark_markov")]
    if fields.confidence_head:
        width = h + (fields.markov_rank if fields.confidence_with_markov else 0)
        specs += [TensorSpec("confidence_head.proj.weight", (1, width), BF16, "dspark_confidence"),
                  TensorSpec("confidence_head.proj.bias", (1,), BF16, "dspark_confidence")]
    specs += [TensorSpec(name, (fields.vocab_size, h), BF16, "dspark_shared_vocab") for name in SHARED_WITH_TARGET]
    return specs


def param_count(fields: DSparkFields, shared: bool = False) -> int:
    """Parameters in the checkpoint (``shared``: only those vllm-ling keeps, without the two
    vocabulary copies it takes from the target)."""
    return sum(s.numel for s in dspark_specs(fields) if not (shared and s.name in SHARED_WITH_TARGET))


def check_dspark_checkpoint(model_dir: str | Path, fields: DSparkFields) -> list[str]:
    """Raise DSparkFormatError naming each missing or malformed tensor (safetensors headers only);
    return the names of tensors that are not part of the format (ignored)."""
    from vllm_ling.models.checkpoint_check import CheckpointFormatError, compare_with_specs

    try:
        return compare_with_specs(Path(model_dir), dspark_specs(fields), what="DSpark drafter")
    except CheckpointFormatError as exc:
        raise DSparkFormatError(str(exc)) from None


def drafter_config(target_cfg: dict[str, Any], *, num_layers: int, num_heads: int, head_dim: int,
                   target_layer_ids: list[int], markov_rank: int, mask_token_id: int,
                   block_size: int = 8, intermediate_size: int | None = None,
                   rope_theta: float = 1_000_000.0) -> dict[str, Any]:
    """A drafter config.json for ``target_cfg`` in the format of section 1 of docs/dspark.md (what
    ``make-tiny --dspark`` writes; the full-size one is ``data/ling3_flash_dspark_config.json``)."""
    return {
        "architectures": [DSPARK_ARCH],
        "model_type": DSPARK_MODEL_TYPE,
        "dtype": "bfloat16",
        "hidden_size": target_cfg["hidden_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size or target_cfg["intermediate_size"],
        "hidden_act": "silu",
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "vocab_size": target_cfg["vocab_size"],
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rope_theta": rope_theta,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "num_target_layers": target_cfg["num_hidden_layers"],
        "block_size": block_size,
        "target_layer_ids": list(target_layer_ids),
        "mask_token_id": mask_token_id,
        "markov_rank": markov_rank,
        "markov_head_type": MARKOV_HEAD_TYPE,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "pad_token_id": target_cfg.get("pad_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
    }
