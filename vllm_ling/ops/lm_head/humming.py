"""The ``"humming"`` kernel: humming-kernels' W8A16 dense GEMM (FP8 e4m3 weight, per-channel
bf16 scale, BF16 activations), prepared as vLLM 0.32 prepares humming FP8 linears, with a
tuned config for small row counts (``HUMMING_TUNING_BY_ARCH``). humming is imported only when
this kernel is prepared."""

from __future__ import annotations

import functools
import json
import time

import torch

from vllm_ling.ops.lm_head.state import Fp8HeadState


@functools.lru_cache(maxsize=1)
def import_humming():
    """Point humming's JIT cache at ours (``vllm_ling.ops.humming_cache``: env
    VLLM_LING_HUMMING_CACHE, default ~/.cache/vllm-ling/humming), then import it."""
    from vllm_ling.ops.humming_cache import configure_humming_cache

    configure_humming_cache()
    import humming  # noqa: F401
    import humming.ops
    import humming.schema
    import humming.transform

    return humming


# gemm_type "dense" and fp32 accumulation, as vLLM 0.32's get_humming_linear_compute_config.
HUMMING_COMPUTE_CONFIG = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "dense"})

# Hand-tuned humming config for small row counts, per arch: rows 1..max_rows use `config`,
# larger row counts keep humming's own per-M heuristic table. H200 (sm_90), 157,184 x 2,560:
# the best of the sweep of benchmarks/lm_head.py --sweep (MMA 16x64x256, warps 16x32x64,
# 3 stages, 3 CTAs/SM, no Stream-K), faster than humming's own heuristic (WGMMA,
# warp-specialised, TMA, Stream-K); the sweep's numbers are in benchmarks/results/lm_head_h200.md.
# Likely why (not profiled): several small CTAs per SM keep more weight bytes in flight than one
# warp-specialised CTA per SM, and for 1..16 rows Stream-K fix-ups cost more than they balance.
HUMMING_TUNING_BY_ARCH: dict[tuple[int, int], dict] = {
    (9, 0): {
        "max_rows": 16,
        "config": {"mma_type": "mma", "block_shape": [16, 64, 256], "warp_shape": [16, 32, 64],
                   "num_stages": 3, "num_ctas_per_sm": 3, "use_stream_k": False, "use_tma": False,
                   "use_warp_spec": False},
    },
}


def humming_tuning_table(layer_config, device: torch.device, small: dict | None) -> list | None:
    """humming's per-M tuning list ``[[lo, hi, config], ...]`` (rows in (lo, hi]) with rows
    1..small["max_rows"] replaced by small["config"]; None (= humming decides) without one."""
    if not small:
        return None
    import_humming()
    import humming.tune

    table = humming.tune.get_heuristics_config(layer_config, gemm_type="dense", device=device)
    max_rows = int(small["max_rows"])
    out = [[0, max_rows, dict(small["config"])]]
    for lo, hi, config in table:
        if 0 < hi <= max_rows:
            continue
        out.append([max(lo, max_rows), hi, config])
    return out


def prepare_humming(weight_fp8: torch.Tensor, scale: torch.Tensor, common: dict,
                     tuning: str = "table") -> Fp8HeadState:
    humming = import_humming()
    vocab, hidden = weight_fp8.shape
    if hidden % 4:
        raise ValueError(f"humming needs the hidden size divisible by 4, got {hidden}")
    weight_schema = humming.schema.HummingWeightSchema(b_dtype="float8e4m3", weight_scale_group_size=0)
    tensors = {
        "weight": weight_fp8.contiguous().view(torch.int32),  # [V, H/4]: humming's packed layout
        # Exact: our scales are bf16-representable by construction.
        "weight_scale": scale.to(torch.bfloat16).reshape(vocab, 1).contiguous(),
    }
    # Same padding as vLLM's humming linears (N to 256, K to 128).
    config, out = humming.transform.prepare_and_transform_humming_tensors(
        tensors=tensors,
        shape_n=vocab,
        shape_k=hidden,
        weight_schema=weight_schema,
        input_schema=humming.schema.HummingInputSchema(),
        pad_n_to_multiple=256,
        pad_k_to_multiple=128,
        has_bias=False,
        torch_dtype=torch.bfloat16,
        device=weight_fp8.device,
    )
    del tensors
    props = torch.cuda.get_device_properties(weight_fp8.device)
    small = HUMMING_TUNING_BY_ARCH.get((props.major, props.minor)) if tuning == "table" else None
    tuning_list = humming_tuning_table(config, weight_fp8.device, small)
    extra = {
        "layer_config": config.to_str(),  # serialised once; humming_forward would redo it per call
        "layer_config_obj": config,
        "tuning_config": json.dumps(tuning_list) if tuning_list else None,
        "tuning": "table" if tuning_list else "heuristic",
        # Stream-K locks: vLLM sizes them 8 per SM; 16 leaves room for 2 CTAs per SM.
        "locks": torch.zeros(props.multi_processor_count * 16, dtype=torch.int32, device=weight_fp8.device),
    }
    state = Fp8HeadState(weight=out["weight"], scale=out["weight_scale"], extra=extra, **common)
    # humming compiles its whole per-row-count kernel table on the first call: do it now, under
    # the cross-process compile lock, so the first decode step does not pay for it.
    from vllm_ling.ops.humming_cache import compile_lock

    started = time.perf_counter()
    with compile_lock():
        humming_logits(torch.zeros((1, hidden), dtype=torch.bfloat16, device=weight_fp8.device), state, None)
    torch.cuda.synchronize(weight_fp8.device)
    state.extra["compile_seconds"] = round(time.perf_counter() - started, 2)
    return state


def humming_logits(x: torch.Tensor, state: Fp8HeadState, out: torch.Tensor | None) -> torch.Tensor:
    humming = import_humming()
    x = x.to(torch.bfloat16).contiguous()
    direct_out = out if (out is not None and out.dtype == torch.bfloat16) else None
    logits = humming.ops.humming_gemm(
        layer_config=state.extra["layer_config"],
        compute_config=HUMMING_COMPUTE_CONFIG,
        tuning_config=state.extra["tuning_config"],
        inputs=x,
        weight=state.weight,
        weight_scale=state.scale,
        outputs=direct_out,
        locks=state.extra["locks"],
    )
    if state.out_dtype != torch.bfloat16:
        logits = logits.to(state.out_dtype)
    if out is not None and logits is not out:
        out.copy_(logits)
        logits = out
    return logits
