"""Warm-up of the MoE kernels (``vllm-ling warmup``): compile into the shared JIT cache every
humming kernel (and decode kernel) the MoE layer needs, on random MXFP4 weights."""

from __future__ import annotations

import time

import torch

from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, SwigluClamp
from vllm_ling.ops.moe.humming import (DECODE_AUTO, DEFAULT_DECODE_MAX_TOKENS, HummingMxfp4Experts,
                                       HummingUnavailable, humming_status)


def random_mxfp4_experts(num_experts: int, hidden_size: int, intermediate_size: int,
                         device: torch.device | str = "cuda", seed: int = 0,
                         scale_exponents: tuple[int, int] = (118, 122)) -> dict[str, torch.Tensor]:
    """Random MXFP4 expert tensors in vLLM's layout (uint8 codes and E8M0 scales).

    Scales 2**(e-127) with e in ``scale_exponents`` keep activations O(1) at Ling sizes.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    E, H, I = num_experts, hidden_size, intermediate_size

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)

    def scales(*shape):
        lo, hi = scale_exponents
        return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, device=device, generator=g)

    return {"w13_weight": codes(E, 2 * I, H // 2), "w13_weight_scale": scales(E, 2 * I, H // 32),
            "w2_weight": codes(E, H, I // 2), "w2_weight_scale": scales(E, H, I // 32)}


def warmup_kernels(hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                   token_counts=(1, 2, 4, 8, 16), w4a8: bool = False,
                   swiglu_limits=(None,), clamp: SwigluClamp = ROUTED_EXPERT_CLAMP,
                   decode: str = DECODE_AUTO, decode_max_tokens: int = DEFAULT_DECODE_MAX_TOKENS,
                   device: int | torch.device | None = None) -> dict:
    """Compile (into the shared JIT cache) every humming kernel the MoE layer needs for
    these batch sizes and clamp limits, by running the layer once on random weights.

    Returns counts and timings: ``kernels_before`` / ``kernels_after`` (cubins in the
    cache), ``new_kernels``, ``seconds`` (total), ``build_seconds`` (weight transform),
    ``per_call_seconds`` {"tokens=T,limit=L": s}, ``cache_dir``.
    """
    from vllm_ling.ops.humming_cache import configure_humming_cache, count_cached_kernels

    ok, reason = humming_status(w4a8=w4a8)
    if not ok:
        raise HummingUnavailable(reason)
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    kernels_dir = configure_humming_cache()
    before = count_cached_kernels(kernels_dir)
    t0 = time.perf_counter()
    tensors = random_mxfp4_experts(num_experts, hidden_size, intermediate_size, dev)
    # built as the server builds it (same decode switches), so the same kernels compile
    experts = HummingMxfp4Experts(**tensors, w4a8=w4a8, clamp=clamp, top_k=top_k, decode=decode,
                                  decode_max_tokens=decode_max_tokens)
    del tensors
    build_s = time.perf_counter() - t0
    per_call = {}
    g = torch.Generator(device=dev).manual_seed(1)
    for limit in swiglu_limits:
        for t in token_counts:
            x = torch.randn(t, hidden_size, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.stack([torch.randperm(num_experts, device=dev, generator=g)[:top_k]
                               for _ in range(t)]).to(torch.int32)
            w = torch.full((t, top_k), 1.0 / top_k, device=dev)
            t1 = time.perf_counter()
            experts(x, w, ids, limit)
            torch.cuda.synchronize(dev)
            per_call[f"tokens={t},limit={limit}"] = time.perf_counter() - t1
    after = count_cached_kernels(kernels_dir)
    return {"cache_dir": str(kernels_dir), "kernels_before": before, "kernels_after": after,
            "new_kernels": after - before, "seconds": time.perf_counter() - t0,
            "build_seconds": build_s, "per_call_seconds": per_call, "w4a8": w4a8}
