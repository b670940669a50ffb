"""Triton MXFP4 decode kernels run by Triton's CPU interpreter (no GPU needed).

Small shapes (8 experts, hidden 256, intermediate 128) so the interpreter finishes in
seconds; a fresh subprocess because TRITON_INTERPRET must be set before the kernels are
decorated (module import). Checks the modes the interpreter can execute: ``words_fma``,
``dot_scaled`` and ``dequant_fma`` (Triton 3.9's interpreter computes BF16 ``tl.dot`` wrongly, so
``dequant_dot`` is checked on the GPU only, in test_moe_decode_triton_gpu.py), with a
power-of-two and a padded (3) top-k, with and without the SwiGLU clamp.

Tolerance: relative Frobenius error < 2e-2 against the float32 reference on the same
MXFP4 weights. Sources: BF16 act and BF16 output; the interpreter converts fp32 -> BF16 by
truncation (not round-to-nearest), about twice the GPU's error, observed up to 7e-3 here.
A wrong expert, row, nibble order, scale or clamp is an O(1) error.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import torch
    from vllm_ling.ops import moe
    from vllm_ling.ops.moe_decode_triton import TritonMxfp4DecodeExperts, triton_decode_available

    ok, reason = triton_decode_available("cpu")
    assert ok, reason
    E, H, I = 8, 256, 128
    w = moe.random_mxfp4_experts(E, H, I, device="cpu", seed=0)
    worst = 0.0
    for mode in ("words_fma", "dot_scaled", "dequant_fma"):
        ex = TritonMxfp4DecodeExperts(**w, mode=mode, block_i=16, block_h=4,
                                      block_k_gate_up=128, block_k_down=64)
        for T, K, ids in ((1, 4, [[0, 7, 7, 3]]), (2, 3, [[7, 0, 5], [5, 5, 5]])):
            g = torch.Generator().manual_seed(T)
            x = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16)
            ids = torch.tensor(ids, dtype=torch.int32)
            tw = torch.rand(T, K, generator=g) + 0.1
            for limit in (None, 1.0):
                out = ex(x, tw, ids, limit)
                ref = moe.experts_reference(x, w["w13_weight"], w["w2_weight"], tw, ids, limit,
                                            w13_scale=w["w13_weight_scale"],
                                            w2_scale=w["w2_weight_scale"])
                if limit is not None:
                    free = moe.experts_reference(x, w["w13_weight"], w["w2_weight"], tw, ids, None,
                                                 w13_scale=w["w13_weight_scale"],
                                                 w2_scale=w["w2_weight_scale"])
                    assert (ref - free).norm() / ref.norm() > 0.1, "clamp does not bite"
                assert out.shape == (T, H) and out.dtype == torch.bfloat16
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                assert rel < 2e-2, f"{mode} T={T} top_k={K} limit={limit}: rel err {rel:.2e}"
                worst = max(worst, rel)
    print(f"OK worst rel err {worst:.2e}")
""")


def test_kernels_match_reference_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "OK worst rel err" in proc.stdout
