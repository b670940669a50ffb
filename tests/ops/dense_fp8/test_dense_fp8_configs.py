"""Platform-independent parts of the dense FP8 W8A16 path: config selection per architecture,
config validity for every Ling shape, the reference, the launcher's input checks (CPU)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from vllm_ling.models.dense_linears import distinct_decode_shapes
from vllm_ling.ops.dense_fp8 import W8A16Config, reference_linear, select_config, w8a16_linear
from vllm_ling.ops.dense_fp8 import tuned_configs as T
from vllm_ling.ops.fp8 import block_fp8_quantize

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "vllm_ling", "data", "ling3_flash_fp4_config.json")
# with and without the KDA in-projection merge (VLLM_LING_KDA_MERGED_IN_PROJ): the server runs either
SHAPES = sorted({s for merged in (True, False)
                 for s in distinct_decode_shapes(json.load(open(CONFIG)), kda_merged_in_proj=merged)})
ARCHS = [(9, 0), (10, 0), (12, 1), (8, 9)]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_shape_and_row_count_gets_a_runnable_config(arch):
    for n, k in SHAPES:
        for rows in range(1, 33):
            config, source = select_config(n, k, rows, arch, 132 if arch[0] == 9 else 48)
            assert config.problems(n, k) == [], (n, k, rows, config)
            if arch[0] < 9:
                assert not config.pdl and not config.prefetch_l2, "sm_90 levers chosen for an older arch"
            assert source


@pytest.mark.parametrize("rows", [33, 100, 8192])
def test_prefill_sizes_tile_rows(rows):
    for arch in ARCHS:
        config, _ = select_config(12288, 2560, rows, arch, 132)
        assert config.block_m <= 64 and config.problems(12288, 2560) == []


def test_unknown_arch_falls_back_to_the_heuristic_with_one_warning(caplog):
    logging.getLogger("vllm.ling").propagate = True
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        config, source = select_config(2560, 4096, 1, (12, 1), 48)
        select_config(2560, 4096, 4, (12, 1), 48)
    assert "no table for sm_121" in source
    warnings = [r for r in caplog.records if "sm_121" in r.getMessage()]
    assert len(warnings) <= 1  # once per process (an earlier test may have logged it already)
    assert config == T.heuristic_config(2560, 4096, 1, 48, (12, 1))


def test_tuned_entries_are_valid_for_their_shapes():
    for arch, table in T.TUNED.items():
        for (n, k), buckets in table.items():
            assert (n, k) in SHAPES, f"sm_{arch}: tuned shape {n}x{k} is not a Ling decode shape"
            bounds = [b for b, _ in buckets]
            assert bounds == sorted(bounds)
            for _, config in buckets:
                assert config.problems(n, k) == []


def test_split_k_fills_the_sms_at_one_row():
    config = T.heuristic_config(2560, 4096, 1, 132, (9, 0))
    programs = -(-2560 // config.block_n) * config.split_k
    assert programs >= 132 and config.split_k > 1


def test_config_problems_name_the_cause():
    assert any("k_steps" in p for p in W8A16Config(32, 2, 4, 2).problems(256, 384))
    assert any("block_n" in p for p in W8A16Config(48, 1, 4, 2).problems(256, 256))
    assert any("use_dot" in p for p in W8A16Config(64, 1, 4, 2, block_m=8, use_dot=True).problems(256, 256))
    assert any("multiple of 128" in p for p in W8A16Config(64, 1, 4, 2).problems(256, 200))


def test_reference_matches_a_hand_computed_product():
    # one 128x128 block with scale 2**-3, one with 2**2; w codes = +-1, +-0.5
    w = torch.zeros((2, 256))
    w[0, :128], w[0, 128:] = 1.0, -0.5
    w[1, :] = 0.5
    q = w.to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0**-3, 2.0**2]])
    x = torch.ones((1, 256), dtype=torch.bfloat16)
    out = reference_linear(x, q, s)
    assert out.tolist() == [[128 * 2.0**-3 - 64 * 4.0, 64 * 2.0**-3 + 64 * 4.0]]


def test_reference_agrees_with_quantized_weights():
    w = torch.randn(384, 256) * 0.02
    q, s = block_fp8_quantize(w)
    x = torch.randn(3, 256)
    err = (reference_linear(x, q, s) - x @ w.t()).abs().max()
    assert err < 0.0625 * (x.abs() @ w.abs().t()).max()


def test_launcher_rejects_bad_inputs_before_touching_a_gpu():
    q = torch.zeros((256, 256), dtype=torch.float8_e4m3fn)
    s = torch.ones((2, 2))
    with pytest.raises(ValueError, match="BF16"):
        w8a16_linear(torch.zeros((1, 256)), q, s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a16_linear(torch.zeros((1, 256), dtype=torch.bfloat16), q.float(), s)
    with pytest.raises(ValueError, match="scale"):
        w8a16_linear(torch.zeros((1, 256), dtype=torch.bfloat16), q, torch.ones((2, 3)))


@pytest.mark.parametrize("rows", [1, 4, 8, 9, 32])
def test_decode_kernel_config_fits_every_ling_shape(rows):
    from vllm_ling.ops.dense_fp8.tuned_configs import select_decode_config

    for arch in ((9, 0), (12, 1)):
        for n, k in SHAPES:
            config, reason = select_decode_config(n, k, rows, arch, 48 if arch == (12, 1) else 132)
            if config is None:  # only where the table says the Triton kernel measured faster
                assert reason is None and arch in T.TUNED_DECODE, (n, k, rows, arch)
                continue
            assert config.problems(n, k, rows) == [], (n, k, rows, arch)
            assert config.steps(k) * 64 * config.ksplit == k
    assert "activation rows" in select_decode_config(12288, 2560, 33, (12, 1), 48)[1]  # past 32 rows
    assert "multiple of 16" in select_decode_config(100, 256, 1, (12, 1), 48)[1]


def test_decode_kernel_source_carries_the_launch_shape():
    from vllm_ling.ops.dense_fp8.decode_kernel import DecodeConfig, source

    text = source(DecodeConfig(ksplit=5, warps_n=2), 2560, 17)
    assert text.startswith("#define WARPS_N 2\n#define KSPLIT 5\n#define STEPS 8\n#define TG 3\n")
    assert 'extern "C" __global__' in text and "ling_dense_w8a16" in text


def test_decode_config_problems_name_the_cause():
    from vllm_ling.ops.dense_fp8.decode_kernel import DecodeConfig

    assert any("multiple of 16" in p for p in DecodeConfig(ksplit=1).problems(100, 256, 1))
    assert any("64 x ksplit" in p for p in DecodeConfig(ksplit=3).problems(256, 256, 1))
    assert any("steps per warp" in p for p in DecodeConfig(ksplit=1).problems(256, 2048, 1))
    assert any("1024" in p for p in DecodeConfig(ksplit=40, warps_n=1).problems(256, 2560, 1))
    assert any("shared memory" in p for p in DecodeConfig(ksplit=8, warps_n=4).problems(256, 2048, 32))
    assert DecodeConfig(ksplit=8, warps_n=4).problems(256, 2048, 8) == []
    assert any("activation rows" in p for p in DecodeConfig(ksplit=4).problems(256, 2560, 33))
    assert any("warps_n = 1" in p for p in DecodeConfig(ksplit=4, warps_n=2, stream=True).problems(256, 2560, 1))


def test_an_outgrown_split_k_workspace_stays_allocated():
    """A CUDA graph captured on a workspace keeps its address: growing it later must not free it
    (the graph would write into memory the allocator hands out again)."""
    from vllm_ling.ops.dense_fp8 import linear

    device = torch.device("cpu")  # the buffer logic is device-independent
    small = linear._workspace(device, "test-partials", 16, torch.float32)
    assert linear._workspace(device, "test-partials", 8, torch.float32) is small  # big enough: reused
    big = linear._workspace(device, "test-partials", 64, torch.float32)
    assert big is not small and big.numel() >= 64
    assert any(t is small for t in linear._OUTGROWN)
    del linear._WORKSPACES[(device, "test-partials")]
    linear._OUTGROWN[:] = [t for t in linear._OUTGROWN if t is not small]


def test_the_triton_kernel_scale_block_is_the_formats():
    """The Triton kernel spells its scale block as a constexpr literal (its JIT reads no plain
    module globals); it must be the format's one block size."""
    import inspect

    from vllm_ling.ops.dense_fp8 import kernel as K
    from vllm_ling.ops.fp8 import DEFAULT_BLOCK, QUANT_BLOCK

    assert f"QB: tl.constexpr = {QUANT_BLOCK} " in inspect.getsource(K)
    assert DEFAULT_BLOCK == (QUANT_BLOCK, QUANT_BLOCK)
