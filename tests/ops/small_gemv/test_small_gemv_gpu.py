"""The small GEMV with BF16 weights and BF16 or fp32 outputs against the float64 reference (GPU
only); the fp32-weight mode is tested as the router (tests/ops/small_gemv/test_router_gemv_gpu.py).

Shapes: Ling's BF16 linears (KDA b_proj and MLA g_proj: 32 heads x 2560, per tensor-parallel
rank 32 / tp), a partial last CTA, the largest K a warp holds; 1..16 rows; PDL on and off;
CUDA-graph capture. Tolerance per output: ``2**-8 |ref| + 2**-16 S`` (BF16 output: half a BF16
step, rounded once from fp32; fp32 output: the first term is dropped), ``S = |x| @ |w|.T``:
each fused multiply-add rounds once and a lane chains at most 32 x 8 of them plus a 5-level
butterfly, below 2**-16 S; a lost or mispaired term is off by O(S / K) >= 2**-13 S here.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ling.ops.small_gemv import (MAX_ROWS, kernel_rows, magnitude_bound, reference_gemv, small_gemv,
                                      unavailable_reason)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or unavailable_reason() is not None:
    pytest.skip(f"needs a CUDA GPU the kernel runs on ({unavailable_reason()})", allow_module_level=True)

DEV = torch.device("cuda")


def _check(t, n, k, out_dtype, seed=0, **kw):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn((t, k), device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn((n, k), device=DEV, generator=g) * k**-0.5).to(torch.bfloat16)
    out = torch.full((t, n), float("nan"), dtype=out_dtype, device=DEV)
    got = small_gemv(x, w, out_dtype, out=out, **kw).double()
    ref = reference_gemv(x, w)
    tol = (2.0**-8 * ref.abs() if out_dtype == torch.bfloat16 else 0.0) + 2.0**-16 * magnitude_bound(x, w)
    bad = ~((got - ref).abs() <= tol)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs off; worst {(got - ref).abs().max().item():.3g}"


@pytest.mark.parametrize("n", [32, 16, 8])
@pytest.mark.parametrize("rows", [1, 2, 4, 7, MAX_ROWS])
def test_ling_bf16_linears(n, rows):
    _check(rows, n, 2560, torch.bfloat16, seed=n + rows)


@pytest.mark.parametrize("n,k", [(5, 256), (33, 8192), (130, 1024)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_other_shapes_and_fp32_output(n, k, out_dtype):
    _check(3, n, k, out_dtype, seed=n)


@pytest.mark.parametrize("pdl,warps,tokens_per_pass", [(False, 4, 2), (True, 1, 1), (True, 8, 4)])
def test_launch_shapes(pdl, warps, tokens_per_pass):
    _check(5, 32, 2560, torch.bfloat16, pdl=pdl, warps=warps, tokens_per_pass=tokens_per_pass)


@pytest.mark.parametrize("n,k", [(33, 8192), (32, 2560), (130, 1024)])
def test_staged_rounds(n, k):
    """More rows than one pass: activations staged in shared memory, several rounds where K is
    large (8192: two rows per round), a last CTA with warps past N taking part in the barriers."""
    for tokens_per_pass in (1, 2, 4):
        _check(MAX_ROWS, n, k, torch.bfloat16, seed=k + tokens_per_pass, tokens_per_pass=tokens_per_pass)
    _check(MAX_ROWS, n, k, torch.float32, seed=k)


@pytest.mark.parametrize("rows", [3, 4])
def test_staged_equals_direct_bit_for_bit(rows):
    """The staged path sums in the same order as the direct one (per lane, then the butterfly):
    one pass of all rows (direct) and one or two rows per pass (staged) give identical bits
    (fp32 weights, the router's mode)."""
    g = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn((rows, 2560), device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn((256, 2560), device=DEV, generator=g) * 0.02)
    direct = small_gemv(x, w, torch.float32, tokens_per_pass=4)
    for tokens_per_pass in (1, 2):
        staged = small_gemv(x, w, torch.float32, tokens_per_pass=tokens_per_pass)
        assert torch.equal(staged, direct), f"{tokens_per_pass} rows per pass differs from one pass"


def test_cuda_graph_capture_and_replay():
    x = torch.randn((2, 2560), device=DEV).to(torch.bfloat16)
    w = torch.randn((32, 2560), device=DEV).to(torch.bfloat16)
    out = torch.empty((2, 32), dtype=torch.bfloat16, device=DEV)
    small_gemv(x, w, torch.bfloat16, out=out)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small_gemv(x, w, torch.bfloat16, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from the eager call"


def test_rejects_bad_inputs_before_launch():
    x = torch.zeros((2, 2560), dtype=torch.bfloat16, device=DEV)
    w = torch.zeros((32, 2560), dtype=torch.bfloat16, device=DEV)
    for args, words in [((x, w.half(), torch.bfloat16), "neither fp32 nor BF16"),
                        ((x, w, torch.float16), "output dtype"),
                        ((x, torch.zeros((32, 2500), dtype=torch.bfloat16, device=DEV), torch.bfloat16), "multiple of 256"),
                        ((x, torch.zeros((32, 16384), dtype=torch.bfloat16, device=DEV), torch.bfloat16), "exceeds")]:
        with pytest.raises(ValueError, match=words):
            small_gemv(*args)
    with pytest.raises(ValueError, match="out must be"):
        small_gemv(x, w, torch.bfloat16, out=torch.empty((2, 32), dtype=torch.float32, device=DEV))


def test_kernel_rows_copies_only_what_the_kernel_cannot_read():
    flat = torch.randn(3 * 2560 + 1, device=DEV).to(torch.bfloat16)
    odd = flat[1:].view(3, 2560)                       # contiguous, 2 bytes off the 16-byte grid
    aligned = torch.randn(2, 3, 2560, device=DEV).to(torch.bfloat16)
    assert kernel_rows(aligned).data_ptr() == aligned.data_ptr() and kernel_rows(aligned).shape == (6, 2560)
    rows = kernel_rows(odd)
    assert rows.data_ptr() % 16 == 0 and torch.equal(rows, odd)
    w = torch.randn((32, 2560), device=DEV).to(torch.bfloat16)
    got = small_gemv(rows, w, torch.float32).double()
    assert ((got - reference_gemv(odd, w)).abs() <= 2.0**-16 * magnitude_bound(odd, w)).all()
