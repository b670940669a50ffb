"""Config class for Ling-3.0 (`model_type: bailing_hybrid`) without trust-remote-code.

transformers 5.19 does not know ``bailing_hybrid`` and 5.20's class overwrites
``head_dim`` (checked against the published configs). vLLM ships a correct text config for the VL variant; we reuse
it for the text-only model so ``head_dim`` is read from the checkpoint and the
Ling-specific fields (KDA, MLA, MoE clamps, MTP) are validated before weights load.
"""

from __future__ import annotations

from vllm.transformers_utils.configs.bailing_moe_v3_vl import BailingMoeV3TextConfig

from vllm_ling.models.names import LING_ARCHITECTURES, LING_MODEL_TYPE  # noqa: F401 (re-exported)
from vllm_ling.refusal import Refusal


class LingConfigFieldError(Refusal, ValueError):
    """A Ling config.json field vllm-ling cannot serve (the message names the file and field)."""


# Fields the model code reads without a default that matches Ling-3.0; a checkpoint
# missing one would silently build the wrong network.
REQUIRED_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "layer_group_size", "first_k_dense_replace", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "n_group", "topk_group", "kv_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "vocab_size",
)


def check_architectures(architectures: list[str] | None, source: str = "config.json") -> None:
    """Refuse a ``bailing_hybrid`` config that names no Ling-3.0 architecture (ValueError
    naming ``source``). vLLM runs it right after parsing the config, through patch P9
    (vllm_ling/patches/config_hooks.py), before the architecture is resolved; an empty list
    (vLLM's sub-config views) passes."""
    if architectures and not set(architectures) & set(LING_ARCHITECTURES):
        raise LingConfigFieldError(
            f"{source}: architectures {architectures} is not a Ling-3.0 architecture for "
            f"model_type {LING_MODEL_TYPE!r}; expected {LING_ARCHITECTURES[0]!r}. Fix the "
            "\"architectures\" field of the checkpoint's config.json.")


class LingHybridConfig(BailingMoeV3TextConfig):
    """``bailing_hybrid`` as a top-level (text-only) config."""

    model_type = LING_MODEL_TYPE
    base_config_key = ""

    def __init__(self, **kwargs):
        # No refusal here (see check_architectures): vLLM 0.32 retries the whole config parse
        # on any exception, so an error raised while parsing is logged twice, 2 s apart.
        super().__init__(**kwargs)
        # Kept explicitly: the model code reads these with getattr defaults, and the
        # per-layer clamps must be honoured or the output is garbage.
        self.expert_swiglu_limit_list = kwargs.get("expert_swiglu_limit_list")
        self.share_expert_swiglu_limit_list = kwargs.get("share_expert_swiglu_limit_list")

    def validate_ling_fields(self, source: str = "config.json") -> None:
        """Raise a ValueError naming every missing or inconsistent field."""
        problems = [f"missing field {f!r}" for f in REQUIRED_FIELDS
                    if getattr(self, f, None) is None]
        for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            limits = getattr(self, name, None)
            if limits is not None and len(limits) != self.num_hidden_layers:
                problems.append(f"{name} has {len(limits)} entries for "
                                f"num_hidden_layers={self.num_hidden_layers}")
        if (self.num_experts or 0) % max(self.n_group or 1, 1):
            problems.append(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if problems:
            raise LingConfigFieldError(f"{source}: invalid Ling-3.0 config: " + "; ".join(problems))
