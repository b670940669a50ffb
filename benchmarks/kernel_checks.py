"""Time the known-answer kernel checks (vllm_ling.ops.known_answer) on this machine.

Prints one row per check: kernel, verdict, max relative error, tolerance, and seconds for
the first run in this process (includes humming's JIT compile unless its cache is warm and
problem construction) and the best of three later runs (what a startup with a warm JIT cache
pays). On a CPU it times the plain-PyTorch paths; on CUDA every head kernel and humming MoE
in each decode mode.

    python -m benchmarks.kernel_checks
"""

from __future__ import annotations

import time

import torch

from vllm_ling.ops import known_answer as ka
from vllm_ling.ops import moe


def _timed(fn):
    t0 = time.perf_counter()
    result = fn()
    first = time.perf_counter() - t0
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t0)
    return result, first, min(warm)


def main() -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    rows = []
    for kernel in (("humming", "triton", "scaled_mm", "torch") if cuda else ("torch",)):
        try:
            rows.append((f"fp8_head {kernel}",) + _timed(lambda k=kernel: ka.check_fp8_head_kernel(k, dev)))
        except ValueError as exc:
            print(f"fp8_head {kernel}: not runnable here ({exc})")
    if cuda and moe.humming_status()[0]:
        for decode in ("auto", "copy", "off"):
            build = lambda t, k, d=decode: moe.HummingMxfp4Experts(**t, top_k=k, decode=d)  # noqa: E731
            rows.append((f"moe humming decode={decode}",)
                        + _timed(lambda b=build, d=decode: ka.check_mxfp4_experts(b, d, dev)))
    else:
        build = lambda t, k: lambda x, w, ids, limit: moe.experts_reference(  # noqa: E731
            x, t["w13_weight"], t["w2_weight"], w, ids, limit,
            w13_scale=t["w13_weight_scale"], w2_scale=t["w2_weight_scale"])
        rows.append(("moe reference (tiny-model sizes)",)
                    + _timed(lambda: ka.check_mxfp4_experts(build, "reference", dev, hidden=64,
                                                            intermediate=64, token_counts=(4,))))
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"known-answer kernel checks on {name}, torch {torch.__version__}")
    print(f"{'check':34} {'ok':3} {'cases':>5} {'max rel err':>11} {'tolerance':>9} {'first s':>8} {'warm s':>7}")
    for label, r, first, warm in rows:
        print(f"{label:34} {'yes' if r.passed else 'NO':3} {r.cases:5d} {r.max_error:11.3g} "
              f"{r.tolerance:9.3g} {first:8.3f} {warm:7.3f}")
        if not r.passed:
            print("   ", r.message())


if __name__ == "__main__":
    main()
