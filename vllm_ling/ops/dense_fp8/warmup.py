"""Compile, ahead of serving, every dense FP8 decode kernel the server will launch for a set of
weight shapes (``vllm-ling warmup``). No vLLM import.

For each [N, K] shape and each row count 1..``max_rows``, the launch configuration the server
resolves (:func:`~vllm_ling.ops.dense_fp8.linear.launch_config`) is collected; every distinct
compiled kernel (a CUDA decode config and its row-group count, or a Triton config) runs once on
random block-FP8 weights and its outputs are compared with the float64 reference at the kernels'
tested tolerance (:func:`~vllm_ling.ops.dense_fp8.reference.output_errors`): a kernel that compiles
for this GPU but computes wrong numbers fails the warm-up, naming shape, rows and kernel. The CUDA
kernels land in humming's JIT cache, which the server shares.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_ling.ops.dense_fp8 import decode_kernel as D
from vllm_ling.ops.dense_fp8.linear import device_facts, kernel_name, launch_config, w8a16_linear
from vllm_ling.ops.dense_fp8.reference import output_errors
from vllm_ling.ops.dense_fp8.selection import OPTION
from vllm_ling.ops.fp8 import block_fp8_quantize
from vllm_ling.options import opt_out_setting


def _kernel_key(config, rows: int) -> tuple:
    """What one compiled kernel is: a decode config compiles once per row-group count."""
    return (config, D.row_groups(rows)) if isinstance(config, D.DecodeConfig) else (config,)


def check_outputs(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """Raise naming ``what`` when ``out`` is not ``x @ (weight * scale).T`` within the tolerance."""
    err, tol = output_errors(out, x, weight, scale)
    bad = ~(err <= tol)
    if bad.any():
        worst = float(err.nan_to_num(float("inf")).max())
        raise RuntimeError(f"dense FP8 warmup: wrong outputs for {what}: {int(bad.sum())} of {bad.numel()} outside "
                           f"2^-8 |ref| + 2^-14 |x|.|w| of the float64 reference (largest error {worst:.3g}); "
                           f"do not serve with this kernel ({opt_out_setting(OPTION)} runs vLLM's)")


def warmup_kernels(shapes: list[tuple[int, int]], max_rows: int = D.MAX_ROWS,
                   device: torch.device | str | None = None) -> dict[str, Any]:
    """Run each distinct kernel the server will launch for ``shapes`` at 1..``max_rows`` rows."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise RuntimeError(f"dense FP8 warmup needs a CUDA device, got {device}")
    started = time.perf_counter()
    capability, sm_count = device_facts(device)
    gen = torch.Generator(device=device).manual_seed(0)
    kernels: dict[str, int] = {}
    for n, k in shapes:
        todo: dict[tuple, int] = {}
        for rows in range(1, max_rows + 1):
            todo.setdefault(_kernel_key(launch_config(n, k, rows, capability, sm_count), rows), rows)
        if not todo:
            continue
        weight, scale = block_fp8_quantize(torch.randn((n, k), device=device, generator=gen) * 0.02)
        for key, rows in todo.items():
            x = torch.randn((rows, k), device=device, generator=gen).to(torch.bfloat16)
            out = w8a16_linear(x, weight, scale)
            label = kernel_name(key[0])
            check_outputs(out, x, weight, scale, f"{n}x{k} at {rows} rows ({label}: {key[0]})")
            kernels[label] = kernels.get(label, 0) + 1
        del weight, scale
    torch.cuda.synchronize(device)
    return {"kernel": ", ".join(f"{v} x {name}" for name, v in sorted(kernels.items())) or "none",
            "shapes": len(shapes), "build_seconds": round(time.perf_counter() - started, 1)}
