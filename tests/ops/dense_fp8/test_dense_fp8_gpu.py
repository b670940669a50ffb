"""The W8A16 block-FP8 kernels against the float64 plain-PyTorch reference (GPU only).

Every dense block-FP8 linear shape of Ling-3.0-flash (vLLM's merges, target + NEXTN layer) at
1..32 rows with the kernel and config selected (the CUDA decode kernel up to 32 rows), plus
explicit configs covering each path of both kernels (CUDA: split-K 1..20 warps, 1-3 tiles per
CTA with a partial last CTA, 1-4 row groups, PDL on and off; Triton: fp32 FMAs on 1/2/4 rows,
tensor cores, split-K 1..8, PDL and L2 prefetch on and off); all 256 e4m3 codes (+-0,
subnormals, NaN); extreme block scales and activations; CUDA-graph capture.

Tolerance per output, with ``S = |x| @ |w * scale|.T`` (float64): ``2**-8 |ref| + 2**-14 S``:
half a BF16 step of the output (the kernel rounds once, from fp32) plus fp32 summation of up
to 6,144 exact products (each term ``w * x * scale`` is exact in fp32 for power-of-two scales;
worst-case reordering error of the fp32 sums is far below 2**-14 S at these K). Outputs are
poisoned with NaN before each call, so an unwritten element fails.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from vllm_ling.models.dense_linears import distinct_decode_shapes
from vllm_ling.ops.dense_fp8 import W8A16Config, unavailable_reason, w8a16_linear
from vllm_ling.ops.dense_fp8.decode_kernel import DecodeConfig
from vllm_ling.ops.dense_fp8.linear import decode_kernel_unavailable_reason, launch_config
from vllm_ling.ops.dense_fp8.tuned_configs import select_decode_config
from vllm_ling.ops.dense_fp8.reference import magnitude_bound, reference_linear
from vllm_ling.ops.fp8 import block_fp8_quantize

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or unavailable_reason() is not None:
    pytest.skip(f"needs a CUDA GPU the kernel runs on ({unavailable_reason()})", allow_module_level=True)

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "vllm_ling", "data", "ling3_flash_fp4_config.json")
# with and without the KDA in-projection merge (VLLM_LING_KDA_MERGED_IN_PROJ): the server runs either
SHAPES = sorted({s for merged in (True, False)
                 for s in distinct_decode_shapes(json.load(open(CONFIG)), kda_merged_in_proj=merged)},
                key=lambda s: (-s[0] * s[1], s))
ROWS = (1, 2, 3, 4, 8, 16, 17, 32)
DEV = torch.device("cuda")


def _weights(n, k, gen, std=0.02):
    return block_fp8_quantize(torch.randn((n, k), device=DEV, generator=gen) * std)


def _check(x, q, s, config=None, out=None):
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=torch.bfloat16, device=DEV) if out is None else out
    got = w8a16_linear(x, q, s, out=out, config=config).double()
    ref = reference_linear(x, q, s, dtype=torch.float64)
    tol = 2.0**-8 * ref.abs() + 2.0**-14 * magnitude_bound(x, q, s)
    bad = ~((got - ref).abs() <= tol)  # NaN fails
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs off; worst {(got - ref).abs().max().item():.3g}"
                           f" config {config}")
    return got


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_ling_shape_with_selected_config(shape):
    gen = torch.Generator(device=DEV).manual_seed(shape[0] * 7 + shape[1])
    q, s = _weights(*shape, gen)
    for rows in ROWS:
        x = torch.randn((rows, shape[1]), device=DEV, generator=gen).to(torch.bfloat16)
        _check(x, q, s)


def test_decode_kernel_serves_every_ling_shape_up_to_32_rows():
    # not a silent Triton fallback: humming's JIT is on this box, every Ling shape fits; the
    # Triton kernel serves only where the tuned table says it measured faster
    assert decode_kernel_unavailable_reason() is None
    from vllm_ling.ops.dense_fp8.linear import describe_kernels, layer_launch_configs

    # what each layer records and the report names: the kernel per decode row count
    assert describe_kernels(layer_launch_configs(4096, 2560, 32, torch.device(DEV))).startswith("CUDA W8A16 decode at 1-")
    cap = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in SHAPES:
        for rows in ROWS:
            tuned_triton = select_decode_config(n, k, rows, cap, sms) == (None, None)
            kind = W8A16Config if tuned_triton else DecodeConfig
            assert isinstance(launch_config(n, k, rows, cap, sms), kind), (n, k, rows)
        assert isinstance(launch_config(n, k, 33, cap, sms), W8A16Config)


DECODE_CONFIGS = [
    DecodeConfig(ksplit=1),                      # no shared-memory reduction, 16+ steps per warp
    DecodeConfig(ksplit=2, warps_n=3),           # 3 tiles per CTA: 35 tiles leave a partial last CTA
    DecodeConfig(ksplit=4, warps_n=2, pdl=False),
    DecodeConfig(ksplit=8, min_blocks=2),
    DecodeConfig(ksplit=16),
    DecodeConfig(ksplit=4, stream=True, ctas_per_sm=1),
    DecodeConfig(ksplit=8, stream=True, ctas_per_sm=3, min_blocks=2, pdl=False),
]


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=lambda c: f"ks{c.ksplit}wn{c.warps_n}"
                         f"mb{c.min_blocks}{'P' if c.pdl else ''}")
def test_decode_kernel_configs(config):
    gen = torch.Generator(device=DEV).manual_seed(12)
    # 560 rows = 35 tiles of 16 and a partial last 128-row scale block; K = 1024 and 2048
    for n, k in ((560, 2048), (2560, 1024)):
        q, s = _weights(n, k, gen)
        for rows in (1, 3, 9, 32):
            if config.problems(n, k, rows):
                continue
            x = torch.randn((rows, k), device=DEV, generator=gen).to(torch.bfloat16)
            _check(x, q, s, config)


def test_streaming_kernel_walks_several_tiles_per_cta():
    # 8192 rows = 512 tiles over 132..264 CTAs: two to four tiles per CTA, odd and even counts
    gen = torch.Generator(device=DEV).manual_seed(13)
    q, s = _weights(8192, 1024, gen)
    for ctas in (1, 2):
        for rows in (1, 9, 32):
            x = torch.randn((rows, 1024), device=DEV, generator=gen).to(torch.bfloat16)
            _check(x, q, s, DecodeConfig(ksplit=4, stream=True, ctas_per_sm=ctas))


@pytest.mark.parametrize("x_scale", [2.0**-60, 2.0**-20, 2.0**20, 2.0**60])
def test_decode_kernel_activation_range(x_scale):
    # activations scaled by 2**64 inside the kernel: exact for |x| < 2**64, products stay normal
    gen = torch.Generator(device=DEV).manual_seed(9)
    q, s = _weights(2560, 4096, gen)
    for rows in (1, 4):
        x = (torch.randn((rows, 4096), device=DEV, generator=gen) * x_scale).to(torch.bfloat16)
        x[0, :7] = 0.0
        _check(x, q, s, DecodeConfig(ksplit=8))


PATH_CONFIGS = [
    W8A16Config(block_n=32, k_steps=1, num_warps=4, num_stages=2),
    W8A16Config(block_n=8, k_steps=2, num_warps=2, num_stages=2, split_k=4),
    W8A16Config(block_n=64, k_steps=1, num_warps=4, num_stages=2, split_k=2, pdl=False),
    W8A16Config(block_n=16, k_steps=1, num_warps=4, num_stages=2, block_m=2, prefetch_l2=False),
    W8A16Config(block_n=16, k_steps=1, num_warps=4, num_stages=2, block_m=4, split_k=2),
    W8A16Config(block_n=32, k_steps=8, num_warps=8, num_stages=2, block_m=4, pdl=False, prefetch_l2=False),
    W8A16Config(block_n=64, k_steps=1, num_warps=4, num_stages=3, block_m=16, use_dot=True),
    W8A16Config(block_n=64, k_steps=1, num_warps=4, num_stages=4, block_m=32, use_dot=True, split_k=4),
    W8A16Config(block_n=128, k_steps=2, num_warps=8, num_stages=3, block_m=16, use_dot=True, split_k=2),
    W8A16Config(block_n=16, k_steps=1, num_warps=4, num_stages=3, block_m=16, use_dot=True, split_k=8,
                pdl=False, prefetch_l2=False),
    W8A16Config(block_n=64, k_steps=1, num_warps=4, num_stages=3, block_m=16, use_dot=True, split_k=2,
                dot_f16=True, prefetch_l2=False),
    W8A16Config(block_n=128, k_steps=2, num_warps=8, num_stages=3, block_m=32, use_dot=True, dot_f16=True),
]


@pytest.mark.parametrize("config", PATH_CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}sk{c.split_k}"
                         f"{'f16' if c.dot_f16 else 'dot' if c.use_dot else 'fma'}{'P' if c.pdl else ''}"
                         f"{'L' if c.prefetch_l2 else ''}")
def test_kernel_paths(config):
    gen = torch.Generator(device=DEV).manual_seed(11)
    # 576 rows: a partial last 128-row scale block (kv_a_proj_with_mqa); K = 2048 splits 8 ways
    for n, k in ((576, 2048), (2560, 1024)):
        q, s = _weights(n, k, gen)
        for rows in (1, 3, config.block_m, 2 * config.block_m + 1):
            x = torch.randn((rows, k), device=DEV, generator=gen).to(torch.bfloat16)
            _check(x, q, s, config)


def test_all_e4m3_codes_including_zero_subnormal_and_nan():
    gen = torch.Generator(device=DEV).manual_seed(3)
    n, k = 256, 1024
    codes = (torch.arange(n, device=DEV)[:, None] * 5 + torch.arange(k, device=DEV)[None, :]) % 256
    nan_codes = (codes == 0x7F) | (codes == 0xFF)
    finite = torch.where(nan_codes, torch.zeros_like(codes), codes).to(torch.uint8).view(torch.float8_e4m3fn)
    assert set(codes.unique().tolist()) == set(range(256))
    s = torch.exp2(torch.randint(-12, 4, (2, 8), device=DEV, generator=gen).float())
    for config in (None, DecodeConfig(ksplit=8, warps_n=2), PATH_CONFIGS[1], PATH_CONFIGS[6]):
        for rows in (1, 4, 32):
            x = torch.randn((rows, k), device=DEV, generator=gen).to(torch.bfloat16)
            _check(x, finite, s, config)
    # NaN codes (0x7F, 0xFF): the Triton kernel makes exactly their rows' outputs NaN; the CUDA
    # decode kernel reads them as +-480 (the layer refuses checkpoints holding them)
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    x = torch.randn((2, k), device=DEV, generator=gen).to(torch.bfloat16)
    got = w8a16_linear(x, q, s, config=PATH_CONFIGS[0])
    assert torch.equal(torch.isnan(got[0]), nan_codes.any(dim=1))
    got = w8a16_linear(x, q, s, config=DecodeConfig(ksplit=4)).double()
    w480 = finite.double().where(~nan_codes, torch.where(codes == 0x7F, 480.0, -480.0).double())
    w480 = w480 * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    ref, mag = x.double() @ w480.t(), x.double().abs() @ w480.abs().t()
    assert ((got - ref).abs() <= 2.0**-8 * ref.abs() + 2.0**-14 * mag).all(), "NaN codes are not read as +-480"


def test_subnormal_only_weights():
    # codes 0x01..0x07 (and their negatives) are e4m3 subnormals: 2**-9 .. 7 * 2**-9
    gen = torch.Generator(device=DEV).manual_seed(4)
    n, k = 256, 512
    mags = torch.randint(1, 8, (n, k), device=DEV, generator=gen)
    sign = torch.randint(0, 2, (n, k), device=DEV, generator=gen) * 0x80
    q = (mags + sign).to(torch.uint8).view(torch.float8_e4m3fn)
    s = torch.ones((2, 4), device=DEV)
    x = torch.randn((1, k), device=DEV, generator=gen).to(torch.bfloat16)
    _check(x, q, s)
    _check(x, q, s, PATH_CONFIGS[0])


@pytest.mark.parametrize("lo,hi", [(-60, -40), (40, 60), (-60, 60)])
def test_extreme_block_scales(lo, hi):
    gen = torch.Generator(device=DEV).manual_seed(5 + hi)
    n, k = 512, 2048
    q, _ = _weights(n, k, gen, std=1.0)
    s = torch.exp2(torch.randint(lo, hi + 1, (n // 128, k // 128), device=DEV, generator=gen).float())
    for config in (None, DecodeConfig(ksplit=2), PATH_CONFIGS[1], PATH_CONFIGS[7]):
        for rows in (1, 4, 32):
            x = torch.randn((rows, k), device=DEV, generator=gen).to(torch.bfloat16)
            _check(x, q, s, config)


@pytest.mark.parametrize("x_scale", [2.0**-40, 1.0, 2.0**40])
def test_fp16_tensor_core_path_rescales_activations(x_scale):
    # x far outside fp16's range either way: the per-row power-of-two pre-scale keeps it exact
    gen = torch.Generator(device=DEV).manual_seed(8)
    q, s = _weights(2560, 4096, gen)
    for config in PATH_CONFIGS[-2:]:
        for rows in (1, 4, 33):
            x = (torch.randn((rows, 4096), device=DEV, generator=gen) * x_scale).to(torch.bfloat16)
            x[0, :7] = 0.0  # zeros and one all-zero row when rows > 1
            if rows > 1:
                x[1] = 0.0
            _check(x, q, s, config)


def test_non_power_of_two_scales():
    # checkpoints without scale_fmt ue8m0 carry any fp32 scale: products are then rounded
    # once in fp32, still far inside the tolerance
    gen = torch.Generator(device=DEV).manual_seed(6)
    q, s = block_fp8_quantize(torch.randn((1536, 2560), device=DEV, generator=gen) * 0.02, ue8m0=False)
    for rows in (1, 4, 16):
        _check(torch.randn((rows, 2560), device=DEV, generator=gen).to(torch.bfloat16), q, s)


def test_cuda_graph_capture_and_replay():
    gen = torch.Generator(device=DEV).manual_seed(7)
    # the decode kernel (selected, and without PDL) between Triton ones: PDL edges both ways
    layers = [(_weights(12288, 2560, gen), None), (_weights(2560, 4096, gen), PATH_CONFIGS[1]),
              (_weights(1536, 2560, gen), PATH_CONFIGS[7]), (_weights(2560, 768, gen), None),
              (_weights(576, 2560, gen), DecodeConfig(ksplit=5, pdl=False)),
              (_weights(4096, 2560, gen), DecodeConfig(ksplit=8, stream=True, ctas_per_sm=1))]
    for rows in (1, 4):
        xs = [torch.randn((rows, w[0].shape[1]), device=DEV, generator=gen).to(torch.bfloat16) for w, _ in layers]
        outs = [torch.empty((rows, w[0].shape[0]), dtype=torch.bfloat16, device=DEV) for w, _ in layers]

        def step():
            for (w, c), x, o in zip(layers, xs, outs):
                w8a16_linear(x, *w, out=o, config=c)

        step()  # grows the split-K workspace before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(2):
            for x in xs:
                x.copy_(torch.randn(x.shape, device=DEV, generator=gen).to(torch.bfloat16))
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            first = [o.clone() for o in outs]
            for ((w, c), x, o) in zip(layers, xs, outs):
                eager = _check(x, *w, config=c)
                assert torch.equal(o.double(), eager), "graph replay differs from the eager call"
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(first, outs)), "replays are not bitwise repeatable"


def test_rejects_bad_inputs_before_launch():
    q = torch.zeros((256, 384), dtype=torch.float8_e4m3fn, device=DEV)
    s = torch.ones((2, 3), device=DEV)
    x = torch.zeros((1, 384), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="k_steps"):
        w8a16_linear(x, q, s, config=dataclasses.replace(PATH_CONFIGS[0], k_steps=2))
    with pytest.raises(ValueError, match="scale"):
        w8a16_linear(x, q, torch.ones((2, 2), device=DEV))
    with pytest.raises(ValueError, match="multiple of 64 x ksplit"):
        w8a16_linear(x, q, s, config=DecodeConfig(ksplit=4))
    with pytest.raises(ValueError, match="activation rows"):
        w8a16_linear(torch.zeros((33, 384), dtype=torch.bfloat16, device=DEV), q, s, config=DecodeConfig(ksplit=2))


def test_warmup_compiles_every_kernel_the_server_launches():
    from vllm_ling.ops.dense_fp8 import decode_kernel as D
    from vllm_ling.ops.dense_fp8.warmup import warmup_kernels

    shapes = [(576, 2560), (2560, 768), (12288, 2560)]
    result = warmup_kernels(shapes)
    assert "CUDA W8A16 decode" in result["kernel"] and result["shapes"] == 3
    cap = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    compiled = set(D._COMPILED)
    for n, k in shapes:
        for rows in range(1, 33):
            config = launch_config(n, k, rows, cap, sms)
            if isinstance(config, DecodeConfig):  # the server's launch would find it compiled
                key = (config.warps_n, config.ksplit, config.min_blocks, config.steps(k), -(-rows // 8),
                       config.stream, torch.device("cuda", 0))
                assert key in compiled or (*key[:-1], torch.device("cuda")) in compiled, (n, k, rows, config)
