"""Launch the router GEMV (``router_gemv.cu``; the why is in its header).

``router_logits(x, weight)`` = ``x.float() @ weight.T`` for BF16 ``x`` [T, H] (T <= ``MAX_ROWS``,
rows 16-byte aligned) and an fp32 ``weight`` [E, H] (H a multiple of 128, at most
``_MAX_HIDDEN``: the row lives in a warp's registers). One warp per expert row, ``warps`` rows per
CTA. Compiled by NVRTC through :mod:`vllm_ling.ops.cuda_jit` (humming's JIT cache); runs on
sm_80+, with programmatic dependent launch from sm_90. CUDA-graph capturable (no host sync, one
allocation: the output). No vLLM import.
"""

from __future__ import annotations

import ctypes
import functools
from importlib import resources

import torch

KERNEL_NAME = "ling_router_gemv"
MAX_ROWS = 16  # above, the per-token passes cost more than cuBLAS (benchmarks/results/router_h200.md)
_MAX_HIDDEN = 4096  # 32 float4 registers of weights per lane
_WARPS = 4           # expert rows per CTA
_ARG_TYPES = (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3


def shape_problems(num_experts: int, hidden_size: int) -> list[str]:
    """Why the kernel cannot hold an [E, H] gate (empty when it can)."""
    out = []
    if hidden_size % 128:
        out.append(f"hidden size {hidden_size} is not a multiple of 128")
    if hidden_size > _MAX_HIDDEN:
        out.append(f"hidden size {hidden_size} exceeds {_MAX_HIDDEN} (a gate row must fit a warp's registers)")
    if num_experts < 1:
        out.append("no experts")
    return out


@functools.lru_cache(maxsize=None)
def kernel_unavailable_reason() -> str | None:
    """Why the kernel cannot be compiled or launched in this process (None when it can)."""
    try:
        import cuda.bindings.driver  # noqa: F401 - the launcher's driver bindings
        import humming.jit.runtime  # noqa: F401 - the NVRTC runtime and cache it compiles through
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"{type(exc).__name__}: {exc}"
    return None


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the kernel cannot run on ``device`` (None when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"sm_{major}{minor}: needs sm_80+"
    return kernel_unavailable_reason()


@functools.cache
def _kernel_text() -> str:
    return resources.files(__package__).joinpath("router_gemv.cu").read_bytes().decode()


def default_tokens_per_pass(rows: int) -> int:
    """One token per pass for a single row, else two (the sweep in router_h200.md)."""
    return 1 if rows == 1 else 2


def source(hidden_size: int, warps: int, tokens_per_pass: int) -> str:
    """The CUDA text handed to NVRTC: the shape as ``#define`` lines, then the kernel."""
    defines = dict(H_=hidden_size, WARPS=warps, TB=tokens_per_pass)
    return "".join(f"#define {name} {value}\n" for name, value in defines.items()) + _kernel_text()


_COMPILED: dict[tuple, object] = {}


def _compiled(hidden_size: int, warps: int, tokens_per_pass: int, device: torch.device):
    key = (hidden_size, warps, tokens_per_pass, device)
    kernel = _COMPILED.get(key)
    if kernel is None:
        from vllm_ling.ops.cuda_jit import compiled_kernel

        kernel = _COMPILED[key] = compiled_kernel(KERNEL_NAME, source(hidden_size, warps, tokens_per_pass), device)
    return kernel


def router_logits(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
                  warps: int = _WARPS, tokens_per_pass: int | None = None, pdl: bool = True) -> torch.Tensor:
    """fp32 [T, E] logits of BF16 ``x`` [T, H] against the fp32 gate ``weight`` [E, H]."""
    from vllm_ling.ops.cuda_jit import launch

    (e, h), t = weight.shape, x.shape[0]
    problems = shape_problems(e, h)
    if x.dtype != torch.bfloat16 or weight.dtype != torch.float32:
        problems.append(f"needs BF16 activations and an fp32 weight, got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or x.shape[1] != h:
        problems.append(f"activations {tuple(x.shape)} do not match the weight {tuple(weight.shape)}")
    if not 1 <= t <= MAX_ROWS:
        problems.append(f"{t} rows is outside 1..{MAX_ROWS}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or not weight.is_contiguous() \
            or weight.data_ptr() % 16:
        problems.append("x rows and the weight must be contiguous and 16-byte aligned")
    if problems:
        raise ValueError(f"router GEMV cannot run {t} x {tuple(weight.shape)}: {'; '.join(problems)}")
    if out is None:
        out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    kernel = _compiled(h, warps, tokens_per_pass or default_tokens_per_pass(t), x.device)
    pdl = pdl and torch.cuda.get_device_capability(x.device)[0] >= 9
    launch(kernel, (-(-e // warps), 1), 32 * warps, (weight.data_ptr(), x.data_ptr(), out.data_ptr(), e, t, x.stride(0)),
           _ARG_TYPES, torch.cuda.current_stream(x.device).cuda_stream, pdl=pdl)
    return out
