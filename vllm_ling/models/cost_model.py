"""The byte cost model of a Ling-3.0 decode step (behind ``vllm-ling plan`` and the MTP policy).

At batch size 1 decode is memory-bandwidth bound, so the time per output token cannot be
lower than (bytes read per token) / (device bandwidth). This module counts those bytes per
component from a Ling-3.0 ``config.json``, deriving every shape the way vLLM 0.32's
``model_executor/models/bailing_moe_v3.py`` (and ``bailing_moe_v3_mtp.py``) builds the
layers, and turns them into a floor TPOT for a device and a model of MTP speculative decoding.

Imports neither vLLM nor torch: it must run on a laptop before any GPU is bought.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_ling.models import checkpoint_format
from vllm_ling.models.names import TARGET_ARCH

DEVICE_BANDWIDTH_GBS: dict[str, tuple[float, str]] = {
    "spark": (273.0, "NVIDIA DGX Spark (GB10, LPDDR5x)"),
    "h100": (3350.0, "NVIDIA H100 SXM (HBM3)"),
    "h200": (4800.0, "NVIDIA H200 (HBM3e)"),
    "b200": (8000.0, "NVIDIA B200 (HBM3e)"),
}

# NVIDIA's published DGX Spark study of Ling-3.0-flash (October 2026; batch 1, 32K in / 2K out, greedy).
# Used only to print "model vs measurement" next to the prediction, never to fit anything.
STUDY_SPARK = {
    "context": 32768,
    "baseline_tpot_ms": 27.71,  # FlashInfer MXFP4 MoE, CUTLASS dense, fp32 LM head
    "humming_tpot_ms": 25.35,  # + Humming MXFP4 MoE
    "fp8_head_tpot_ms": 22.76,  # + FP8 LM head
    "mtp_tpot_ms": 9.72,  # + NEXTN MTP, 3 draft tokens, 4 verify tokens
    "mtp_accept_length": 3.90,
    "gsm8k_accept_length": 2.68,
}

FP8_BLOCK = 128  # 128x128 weight blocks, one fp32 scale each (vLLM's Fp8LinearMethod)
MXFP4_GROUP = 32  # one E8M0 byte per 32 e2m1 values
HEAD_BYTES_PER_PARAM = {"bf16": 2.0, "fp8": 1.0, "fp32": 4.0}
BF16 = 2
FP32 = 4

MB = 1e6
GB = 1e9


class PlanError(ValueError):
    """Bad planner input (missing file, config that is not Ling-3.0, bad flag)."""


@dataclass
class Component:
    name: str
    batch1_bytes: float
    verify_bytes: float
    note: str = ""


@dataclass
class LayerCounts:
    num_layers: int
    kda_layers: list[int]
    mla_layers: list[int]
    dense_layers: list[int]
    moe_layers: list[int]


@dataclass
class Plan:
    config_path: str
    counts: LayerCounts
    context: int
    verify_tokens: int
    components: list[Component] = field(default_factory=list)
    head_bytes: dict[str, float] = field(default_factory=dict)
    draft_step_bytes_without_head: float = 0.0
    distinct_experts_verify: float = 0.0


def is_kda_layer(layer_idx: int, layer_group_size: int, num_hidden_layers: int) -> bool:
    return checkpoint_format.is_kda_layer(
        layer_idx, {"layer_group_size": layer_group_size, "num_hidden_layers": num_hidden_layers})


_is_not_converted = checkpoint_format.is_not_converted


def fp8_block_linear_bytes(in_features: int, out_shards: list[int]) -> float:
    """FP8 e4m3 weight (1 byte/param) plus one fp32 scale per 128x128 block of each shard."""
    weight = in_features * sum(out_shards)
    scales = sum(math.ceil(o / FP8_BLOCK) for o in out_shards) * math.ceil(in_features / FP8_BLOCK)
    return weight + scales * FP32


def mxfp4_expert_bytes(hidden: int, intermediate: int) -> float:
    """One routed expert: gate, up ([I, H]) and down ([H, I]) at 0.5 byte/param + 1 byte/32."""
    params = 3 * hidden * intermediate
    return params * 0.5 + params / MXFP4_GROUP


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts touched by `tokens` tokens under uniform independent routing: E(1-(1-k/E)^t)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _get(cfg: dict, key: str, path: str) -> Any:
    if key not in cfg:
        raise PlanError(f"{path}: config has no {key!r}; is this a Ling-3.0 (bailing_hybrid) config?")
    return cfg[key]


def layer_counts(cfg: dict, path: str = "config") -> LayerCounts:
    n = int(_get(cfg, "num_hidden_layers", path))
    group = int(_get(cfg, "layer_group_size", path))
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    kda = [i for i in range(n) if is_kda_layer(i, group, n)]
    mla = [i for i in range(n) if not is_kda_layer(i, group, n)]
    has_moe = cfg.get("num_experts") is not None
    dense = [i for i in range(n) if not has_moe or i < first_dense]
    moe = [i for i in range(n) if has_moe and i >= first_dense]
    return LayerCounts(n, kda, mla, dense, moe)


def _mla_weight_bytes(cfg: dict, prefix: str, skip: list[str]) -> float:
    """MLA projections as read at decode.

    vLLM dequantizes kv_b_proj at load into W_UK / W_UV in the activation dtype (BF16) and
    the decode path multiplies by those (``mla_attention.py``: ``split_kv_b_proj``), so
    kv_b is counted in BF16, not FP8.
    """
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    nope = cfg.get("qk_nope_head_dim", 128)
    rope = cfg.get("qk_rope_head_dim", 64)
    v_dim = cfg.get("v_head_dim", 128)
    kv_lora = cfg.get("kv_lora_rank", 512)
    q_lora = cfg.get("q_lora_rank")

    def linear(name: str, in_f: int, shards: list[int]) -> float:
        if _is_not_converted(f"{prefix}.{name}", skip):
            return in_f * sum(shards) * BF16
        return fp8_block_linear_bytes(in_f, shards)

    total = 0.0
    if q_lora is None:
        total += linear("q_proj", h, [heads * (nope + rope)])
        total += linear("kv_a_proj_with_mqa", h, [kv_lora + rope])
    else:
        total += linear("fused_qkv_a_proj", h, [q_lora, kv_lora + rope])
        total += linear("q_b_proj", q_lora, [heads * (nope + rope)]) + q_lora * BF16
    total += kv_lora * heads * (nope + v_dim) * BF16  # W_UK and W_UV
    gran = cfg.get("gated_attention_proj_granularity_type")
    g_out = heads if gran == "head_wise" else heads * v_dim if gran == "element_wise" else 0
    if g_out:
        total += linear("g_proj", h, [g_out])
    total += linear("dense", heads * v_dim, [h])
    total += kv_lora * BF16  # kv_a_layernorm
    return total


def _kda_weight_bytes(cfg: dict, prefix: str, skip: list[str]) -> tuple[float, float]:
    """KDA projections (q/k/v/b/f/g/o) and the fp32 parameters (conv weights, dt_bias, A_log)."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg["head_dim"]
    proj = heads * head_dim
    conv = cfg.get("short_conv_kernel_size", 4)

    def linear(name: str, in_f: int, shards: list[int]) -> float:
        if _is_not_converted(f"{prefix}.{name}", skip):
            return in_f * sum(shards) * BF16
        return fp8_block_linear_bytes(in_f, shards)

    if _is_not_converted(f"{prefix}.b_proj", skip):  # vLLM keeps b_proj separate then
        projections = linear("qkv_proj", h, [proj] * 3) + h * heads * BF16
    else:
        projections = linear("qkvb_proj", h, [proj, proj, proj, heads])
    projections += linear("f_proj", h, [proj])
    projections += linear("g_proj", h, [proj])
    projections += linear("o_proj", proj, [h])
    fp32_params = (3 * proj * conv + proj + heads) * FP32  # q/k/v conv1d, dt_bias, A_log
    return projections, fp32_params


def _moe_bytes(cfg: dict, prefix: str, skip: list[str], experts_touched: float) -> tuple[float, float, float]:
    """(routed experts, shared expert, router) bytes of one MoE layer."""
    h = cfg["hidden_size"]
    e = cfg["num_experts"]
    routed = experts_touched * mxfp4_expert_bytes(h, cfg["moe_intermediate_size"])
    shared_i = cfg.get("moe_shared_expert_intermediate_size", cfg["moe_intermediate_size"]) * cfg.get(
        "num_shared_experts", 0
    )
    if shared_i:
        # vLLM pads the shared intermediate to whole 128 blocks (a no-op for Ling's 768).
        padded = math.ceil(shared_i / FP8_BLOCK) * FP8_BLOCK
        if _is_not_converted(f"{prefix}.shared_experts.gate_up_proj", skip):
            shared = 3 * h * shared_i * BF16
        else:
            shared = fp8_block_linear_bytes(h, [padded, padded]) + fp8_block_linear_bytes(padded, [h])
    else:
        shared = 0.0
    router = (h * e + e) * FP32  # GateLinear fp32 weight + expert bias
    return routed, shared, router


def load_config(checkpoint: str | None, config: str | None) -> tuple[dict, str]:
    if checkpoint and config:
        raise PlanError("give either a checkpoint directory or --config, not both")
    if checkpoint:
        path = Path(checkpoint)
        if not path.is_dir():
            raise PlanError(f"checkpoint directory {checkpoint!r} does not exist")
        path = path / "config.json"
        if not path.is_file():
            raise PlanError(f"{path}: no config.json in the checkpoint directory")
    elif config:
        path = Path(config)
        if not path.is_file():
            raise PlanError(f"--config {config!r}: file not found")
    else:
        ref = resources.files("vllm_ling") / "data" / "ling3_flash_fp4_config.json"
        return json.loads(ref.read_text()), "packaged ling3_flash_fp4_config.json"
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: not valid JSON ({exc})") from exc
    return cfg, str(path)


def build_plan(cfg: dict, *, context: int, verify_tokens: int, config_path: str = "config") -> Plan:
    """Bytes per decode step for batch 1 and for a verify window of `verify_tokens` tokens."""
    if context < 0:
        raise PlanError(f"--context must be >= 0, got {context}")
    if verify_tokens < 1:
        raise PlanError(f"--verify-tokens must be >= 1, got {verify_tokens}")
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch != TARGET_ARCH:
        raise PlanError(f"{config_path}: architecture {arch!r} is not {TARGET_ARCH}")
    counts = layer_counts(cfg, config_path)
    skip = list((cfg.get("quantization_config") or {}).get("modules_to_not_convert", []))
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg["head_dim"]
    k = verify_tokens
    n_exp = cfg.get("num_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    distinct = expected_distinct_experts(n_exp, top_k, k) if n_exp else 0.0

    comp: dict[str, list[float]] = {}

    def add(name: str, b1: float, bk: float | None = None) -> None:
        acc = comp.setdefault(name, [0.0, 0.0])
        acc[0] += b1
        acc[1] += b1 if bk is None else bk

    for i in counts.moe_layers:
        prefix = f"model.layers.{i}.mlp"
        routed1, shared, router = _moe_bytes(cfg, prefix, skip, top_k)
        routedk, _, _ = _moe_bytes(cfg, prefix, skip, distinct)
        add("routed experts MXFP4", routed1, routedk)
        add("shared expert FP8", shared)
        add("routers fp32 + expert bias", router)
    for i in counts.dense_layers:
        inter = cfg["intermediate_size"]
        if _is_not_converted(f"model.layers.{i}.mlp.gate_up_proj", skip):
            add("dense MLP FP8", 3 * h * inter * BF16)
        else:
            add("dense MLP FP8", fp8_block_linear_bytes(h, [inter, inter]) + fp8_block_linear_bytes(inter, [h]))
    for i in counts.kda_layers:
        proj_bytes, fp32_bytes = _kda_weight_bytes(cfg, f"model.layers.{i}.attention", skip)
        add("KDA projections FP8 (+BF16 b_proj)", proj_bytes)
        add("KDA conv/gate params fp32", fp32_bytes)
    for i in counts.mla_layers:
        add("MLA projections FP8 (+BF16 W_UK/W_UV)", _mla_weight_bytes(cfg, f"model.layers.{i}.attention", skip))
    norms = counts.num_layers * 2 * h * BF16 + h * BF16 + len(counts.kda_layers) * head_dim * BF16
    add("norms BF16", norms)

    # Inference state. KDA recurrent state dtype: MambaStateDtypeCalculator.kda_state_dtype
    # gives fp32 for the default mamba_ssm_cache_dtype "auto"; conv state is in the model dtype.
    # A verify window reads the state once but stores one state per window position so the
    # rejected suffix can be rolled back.
    rec_state = heads * head_dim * head_dim * FP32
    conv_state = 3 * heads * head_dim * (cfg.get("short_conv_kernel_size", 4) - 1) * BF16
    n_kda = len(counts.kda_layers)
    add("KDA recurrent state fp32 (read)", n_kda * rec_state)
    add("KDA recurrent state fp32 (write)", n_kda * rec_state, n_kda * rec_state * k)
    add("KDA conv state BF16 (read+write)", n_kda * conv_state * 2, n_kda * conv_state * (1 + k))
    kv_per_token = (cfg.get("kv_lora_rank", 512) + cfg.get("qk_rope_head_dim", 64)) * BF16
    add(f"MLA KV cache BF16 @ {context} tokens", len(counts.mla_layers) * kv_per_token * context)

    plan = Plan(config_path, counts, context, k, distinct_experts_verify=distinct)
    plan.components = [Component(n, v[0], v[1]) for n, v in comp.items()]
    vocab = cfg["vocab_size"]
    plan.head_bytes = {
        "bf16": vocab * h * BF16,
        "fp8": vocab * h * 1 + vocab * BF16,  # per-output-channel BF16 scale
        "fp32": vocab * h * FP32,
    }

    # One NEXTN draft step: eh_proj, one MLA layer (with its KV cache), one MoE layer, norms;
    # the head is added per configuration (the draft shares the target's head module).
    draft = 0.0
    if cfg.get("num_nextn_predict_layers", 0):
        mtp = counts.num_layers
        prefix = f"model.layers.{mtp}"
        draft += fp8_block_linear_bytes(2 * h, [h])
        draft += _mla_weight_bytes(cfg, f"{prefix}.attention", skip)
        draft += kv_per_token * context
        routed1, shared, router = _moe_bytes(cfg, f"{prefix}.mlp", skip, top_k)
        draft += routed1 + shared + router + 5 * h * BF16
    plan.draft_step_bytes_without_head = draft
    return plan


def totals(plan: Plan, head: str) -> tuple[float, float]:
    b1 = sum(c.batch1_bytes for c in plan.components) + plan.head_bytes[head]
    bk = sum(c.verify_bytes for c in plan.components) + plan.head_bytes[head]
    return b1, bk


def mtp_model(plan: Plan, head: str, draft_tokens: int) -> dict[str, float]:
    """Costs of one speculative cycle in units of one plain decode step (bytes-proportional).

    Model: a cycle is `draft_tokens` sequential draft steps (NEXTN layer + head, batch 1) and one
    verify step over draft_tokens+1 positions; it emits `accept_length` tokens on average, so
        speedup = accept_length / (verify_cost_ratio + draft_cost_ratio)
    and MTP pays off only when accept_length > verify_cost_ratio + draft_cost_ratio.
    Time is taken as proportional to bytes, i.e. every step reaches the same fraction of
    bandwidth; small steps (drafts) are in reality less efficient, so this flatters MTP.
    """
    b1, bk = totals(plan, head)
    verify_ratio = bk / b1
    draft_ratio = draft_tokens * (plan.draft_step_bytes_without_head + plan.head_bytes[head]) / b1
    return {
        "verify_cost_ratio": verify_ratio,
        "draft_cost_ratio": draft_ratio,
        "break_even_accept_length": verify_ratio + draft_ratio,
    }


def mtp_speedup(accept_length: float, verify_cost_ratio: float, draft_cost_ratio: float) -> float:
    return accept_length / (verify_cost_ratio + draft_cost_ratio)


def plan_to_dict(plan: Plan, bandwidth_gbs: float, device: str, draft_tokens: int,
                 verify_ratio_override: float | None) -> dict[str, Any]:
    heads_out = {}
    for head in ("fp32", "bf16", "fp8"):
        b1, bk = totals(plan, head)
        mtp = mtp_model(plan, head, draft_tokens)
        if verify_ratio_override is not None:
            mtp["verify_cost_ratio_given"] = verify_ratio_override
            mtp["break_even_accept_length_given"] = verify_ratio_override + mtp["draft_cost_ratio"]
        heads_out[head] = {
            "bytes_per_token_batch1": b1,
            "bytes_per_verify_step": bk,
            "floor_tpot_ms": b1 / (bandwidth_gbs * GB) * 1e3,
            "ceiling_tokens_per_s": bandwidth_gbs * GB / b1,
            "head_bytes": plan.head_bytes[head],
            "mtp": mtp,
        }
    c = plan.counts
    return {
        "config": plan.config_path,
        "device": device,
        "bandwidth_gbs": bandwidth_gbs,
        "context_tokens": plan.context,
        "verify_tokens": plan.verify_tokens,
        "draft_tokens": draft_tokens,
        "layers": {"total": c.num_layers, "kda": len(c.kda_layers), "mla": len(c.mla_layers),
                   "dense_mlp": len(c.dense_layers), "moe": len(c.moe_layers)},
        "distinct_experts_per_layer_verify": plan.distinct_experts_verify,
        "components": [{"name": x.name, "batch1_bytes": x.batch1_bytes, "verify_bytes": x.verify_bytes}
                       for x in plan.components],
        "mtp_draft_step_bytes_without_head": plan.draft_step_bytes_without_head,
        "heads": heads_out,
    }


# ---- DSpark: a separate block drafter (docs/dspark.md) ----------------------------------------

def dspark_draft_components(fields, context: int, draft_tokens: int) -> list[Component]:
    """Bytes one DSpark draft cycle reads at batch 1, head excluded (the drafter shares the target's).

    vLLM 0.32's D-Spark runtime (``qwen3_dflash.py``, ``dspark/speculator.py``): the context K/V of
    the newly verified tokens through ``fc`` and a fused copy of every layer's K/V projection
    (``_build_fused_kv_buffers``), one forward of the ``draft_tokens`` query block through all BF16
    layers, attention over the draft's own KV cache at ``context`` tokens (MHA: every head's K and V),
    then the Markov head step by step, each reading all of ``markov_w2`` (it does not stay in cache:
    vocabulary x rank BF16 is 80 MB at full size). ``fields``: :class:`dspark_format.DSparkFields`."""
    from vllm_ling.models.dspark_format import dspark_specs

    specs = dspark_specs(fields)

    def weights(tensor_class: str) -> float:
        return sum(s.numel for s in specs if s.tensor_class == tensor_class) * BF16

    kv_width = fields.num_kv_heads * fields.head_dim
    kv_per_token = fields.num_layers * 2 * kv_width * BF16
    markov_w2 = fields.vocab_size * fields.markov_rank * BF16
    parts = [
        ("draft layers BF16 (attention + MLP)", weights("dspark_attention") + weights("dspark_mlp")),
        ("draft fused context K/V projection copy", fields.num_layers * 2 * kv_width * fields.hidden_size * BF16),
        ("draft fc + norms + confidence", weights("dspark_fc") + weights("dspark_norms")
         + weights("dspark_confidence")),
        (f"draft KV cache BF16 @ {context} tokens", kv_per_token * context),
        (f"Markov head: markov_w2 x {draft_tokens} steps", markov_w2 * draft_tokens),
    ]
    return [Component(name, b, b) for name, b in parts]


def dspark_model(verify_plan: Plan, head: str, fields, draft_tokens: int) -> dict[str, float]:
    """One DSpark cycle in plain decode steps: a verify over ``draft_tokens + 1`` positions
    (``verify_plan`` built with that window) and one draft cycle (its components plus the shared
    head read once for the whole block); speedup and break-even as for MTP (:func:`mtp_model`)."""
    b1, bk = totals(verify_plan, head)
    draft = sum(c.batch1_bytes for c in dspark_draft_components(fields, verify_plan.context, draft_tokens))
    draft += verify_plan.head_bytes[head]
    verify_ratio, draft_ratio = bk / b1, draft / b1
    return {"verify_cost_ratio": verify_ratio, "draft_cost_ratio": draft_ratio,
            "break_even_accept_length": verify_ratio + draft_ratio, "draft_cycle_bytes": draft}
