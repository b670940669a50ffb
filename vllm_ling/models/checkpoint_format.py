"""The tensors of a Ling-3.0 ``-fp4`` checkpoint, derived from its config.json.

One description serves three users: ``make-tiny`` (what to write), ``inspect`` (what
each tensor class costs per decode token) and the pre-load checker (what must be in
the shards, with which dtype and shape). Names and shapes follow the HF checkpoint;
vLLM's ``bailing_moe_v3.py`` maps them (``.attention.`` -> ``.self_attn.``, stacked
q/k/v, per-expert tensors into fused experts). No vLLM or torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Storage kinds. "fp8_block" and "mxfp4" each stand for a weight plus its
# ``weight_scale_inv`` companion tensor.
BF16, FP32, FP8_BLOCK, MXFP4 = "bf16", "fp32", "fp8_block", "mxfp4"

MXFP4_GROUP = 32


@dataclass(frozen=True)
class TensorSpec:
    name: str  # checkpoint name of the weight (without the scale suffix)
    shape: tuple[int, ...]  # logical (unpacked) shape
    kind: str  # BF16 | FP32 | FP8_BLOCK | MXFP4
    tensor_class: str  # grouping for inspect: "routed_experts", "head", ...
    layer: int | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stored_tensors(spec: TensorSpec, block: tuple[int, int] = (128, 128)) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of the tensor(s) that store ``spec`` in the shards."""
    if spec.kind == BF16:
        return [(spec.name, spec.shape, "bfloat16")]
    if spec.kind == FP32:
        return [(spec.name, spec.shape, "float32")]
    scale_name = spec.name[: -len(".weight")] + ".weight_scale_inv"
    n, k = spec.shape
    if spec.kind == FP8_BLOCK:
        return [(spec.name, spec.shape, "float8_e4m3fn"),
                (scale_name, (_ceil_div(n, block[0]), _ceil_div(k, block[1])), "float32")]
    if spec.kind == MXFP4:
        return [(spec.name, (n, k // 2), "uint8"),
                (scale_name, (n, k // MXFP4_GROUP), "float8_e8m0fnu")]
    raise ValueError(f"unknown storage kind {spec.kind!r}")


def stored_bytes(spec: TensorSpec, block: tuple[int, int] = (128, 128)) -> int:
    size = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1, "float8_e8m0fnu": 1}
    total = 0
    for _, shape, dtype in stored_tensors(spec, block):
        n = 1
        for d in shape:
            n *= d
        total += n * size[dtype]
    return total


def is_kda_layer(layer: int, config: dict[str, Any]) -> bool:
    """Same rule as vLLM's bailing_moe_v3._is_kda_layer: the last layer of each group and
    any tail layers are MLA, the rest KDA."""
    group = config["layer_group_size"]
    n = config["num_hidden_layers"]
    return not ((layer + 1) % group == 0 or layer >= n // group * group)


def is_not_converted(module: str, modules_to_not_convert: list[str]) -> bool:
    """``modules_to_not_convert`` matched at a dotted-component boundary, as vLLM does for
    Ling (``match_mode="suffix"``): ``b_proj`` matches ``...attention.b_proj`` but not
    ``...q_b_proj``, and ``5.attention.g_proj`` matches layer 5 but not layer 15."""
    return any(module == m or module.endswith("." + m) for m in modules_to_not_convert)


def _is_excluded(module: str, config: dict[str, Any]) -> bool:
    qc = config.get("quantization_config") or {}
    return is_not_converted(module, qc.get("modules_to_not_convert") or [])


def _linear(name: str, shape: tuple[int, int], config: dict[str, Any], tensor_class: str,
            layer: int | None) -> TensorSpec:
    module = name[: -len(".weight")]
    kind = BF16 if _is_excluded(module, config) else FP8_BLOCK
    return TensorSpec(name, shape, kind, tensor_class, layer)


def _attention_specs(i: int, config: dict[str, Any], kda: bool) -> list[TensorSpec]:
    p = f"model.layers.{i}.attention"
    h, hid = config["num_attention_heads"], config["hidden_size"]
    if kda:
        hd, conv = config["head_dim"], config["short_conv_kernel_size"]
        proj = h * hd
        specs = [_linear(f"{p}.{n}.weight", (proj, hid), config, "kda_attention", i)
                 for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")]
        specs += [
            _linear(f"{p}.b_proj.weight", (h, hid), config, "kda_attention", i),
            _linear(f"{p}.o_proj.weight", (hid, proj), config, "kda_attention", i),
            TensorSpec(f"{p}.dt_bias", (proj,), FP32, "kda_attention", i),
            TensorSpec(f"{p}.A_log", (h,), FP32, "kda_attention", i),
            TensorSpec(f"{p}.o_norm.weight", (hd,), BF16, "norms", i),
        ]
        specs += [TensorSpec(f"{p}.{n}_conv1d.weight", (proj, 1, conv), FP32, "kda_attention", i)
                  for n in ("q", "k", "v")]
        return specs
    nope, rope, vd = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_lora = config["kv_lora_rank"]
    if config.get("q_lora_rank"):
        raise ValueError("q_lora_rank is set: the Ling-3.0 -fp4 format has q_lora_rank null")
    specs = [
        _linear(f"{p}.q_proj.weight", (h * (nope + rope), hid), config, "mla_attention", i),
        _linear(f"{p}.kv_a_proj_with_mqa.weight", (kv_lora + rope, hid), config, "mla_attention", i),
        TensorSpec(f"{p}.kv_a_layernorm.weight", (kv_lora,), BF16, "norms", i),
        _linear(f"{p}.kv_b_proj.weight", (h * (nope + vd), kv_lora), config, "mla_attention", i),
        _linear(f"{p}.dense.weight", (hid, h * vd), config, "mla_attention", i),
    ]
    granularity = config.get("gated_attention_proj_granularity_type")
    if granularity in ("head_wise", "element_wise"):
        g_out = h if granularity == "head_wise" else h * vd
        specs.append(_linear(f"{p}.g_proj.weight", (g_out, hid), config, "mla_attention", i))
    return specs


def _mlp_specs(i: int, config: dict[str, Any]) -> list[TensorSpec]:
    p = f"model.layers.{i}.mlp"
    hid = config["hidden_size"]
    if i < config["first_k_dense_replace"]:
        inter = config["intermediate_size"]
        return [_linear(f"{p}.gate_proj.weight", (inter, hid), config, "dense_mlp", i),
                _linear(f"{p}.up_proj.weight", (inter, hid), config, "dense_mlp", i),
                _linear(f"{p}.down_proj.weight", (hid, inter), config, "dense_mlp", i)]
    e, inter = config["num_experts"], config["moe_intermediate_size"]
    shared = config["moe_shared_expert_intermediate_size"] * config.get("num_shared_experts", 1)
    specs = [TensorSpec(f"{p}.gate.weight", (e, hid), FP32, "router", i),
             TensorSpec(f"{p}.gate.expert_bias", (e,), FP32, "router", i)]
    for j in range(e):
        q = f"{p}.experts.{j}"
        specs += [TensorSpec(f"{q}.gate_proj.weight", (inter, hid), MXFP4, "routed_experts", i, j),
                  TensorSpec(f"{q}.up_proj.weight", (inter, hid), MXFP4, "routed_experts", i, j),
                  TensorSpec(f"{q}.down_proj.weight", (hid, inter), MXFP4, "routed_experts", i, j)]
    specs += [_linear(f"{p}.shared_experts.gate_proj.weight", (shared, hid), config, "shared_expert", i),
              _linear(f"{p}.shared_experts.up_proj.weight", (shared, hid), config, "shared_expert", i),
              _linear(f"{p}.shared_experts.down_proj.weight", (hid, shared), config, "shared_expert", i)]
    return specs


def checkpoint_specs(config: dict[str, Any], include_mtp: bool = True) -> list[TensorSpec]:
    """Every tensor of the checkpoint, target layers then NEXTN layers."""
    hid, vocab = config["hidden_size"], config["vocab_size"]
    n = config["num_hidden_layers"]
    specs = [TensorSpec("model.word_embeddings.weight", (vocab, hid), BF16, "embeddings")]
    for i in range(n):
        specs += [TensorSpec(f"model.layers.{i}.input_layernorm.weight", (hid,), BF16, "norms", i),
                  TensorSpec(f"model.layers.{i}.post_attention_layernorm.weight", (hid,), BF16, "norms", i)]
        specs += _attention_specs(i, config, is_kda_layer(i, config))
        specs += _mlp_specs(i, config)
    specs.append(TensorSpec("model.norm.weight", (hid,), BF16, "norms"))
    specs.append(TensorSpec("lm_head.weight", (vocab, hid), BF16, "head"))
    if include_mtp:
        for i in range(n, n + config.get("num_nextn_predict_layers", 0)):
            p = f"model.layers.{i}"
            specs += [TensorSpec(f"{p}.{norm}.weight", (hid,), BF16, "mtp_norms", i)
                      for norm in ("enorm", "hnorm", "input_layernorm",
                                   "post_attention_layernorm", "final_layernorm")]
            specs.append(_linear(f"{p}.eh_proj.weight", (hid, 2 * hid), config, "mtp_other", i))
            specs += [TensorSpec(s.name, s.shape, s.kind, "mtp_" + s.tensor_class, i, s.expert)
                      for s in _attention_specs(i, config, kda=False) + _mlp_specs(i, config)]
    return specs
