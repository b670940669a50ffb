"""The CUDA W8A16 dense block-FP8 method: its platform-independent rules (CPU)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

pytest.importorskip("vllm")  # the GPU box runs tests/ops only: it has no vLLM

from vllm_ling.layers import dense_fp8_cuda as D  # noqa: E402
from vllm_ling.ops.dense_fp8.selection import DenseFp8Kernel  # noqa: E402
from vllm_ling.options import DenseFp8, LingOptions, LingOptionError  # noqa: E402
from vllm_ling.selection import Feature, recorded  # noqa: E402

BLOCK = types.SimpleNamespace(weight_block_size=[128, 128])


def test_option_parses_and_defaults_to_ling():
    assert LingOptions.from_env({}).dense_fp8 is DenseFp8.LING
    assert LingOptions.from_env({"VLLM_LING_DENSE_FP8": "vllm"}).dense_fp8 is DenseFp8.VLLM
    with pytest.raises(LingOptionError, match="VLLM_LING_DENSE_FP8"):
        LingOptions.from_env({"VLLM_LING_DENSE_FP8": "fast"})


def test_unaligned_shards():
    assert D.unaligned_shards([4096, 4096, 4096], 2560) == []
    assert D.unaligned_shards([4096, 4096, 4096, 32], 2560) == []   # qkvb: only the last shard is partial
    assert D.unaligned_shards([576], 2560) == []                     # kv_a_proj_with_mqa
    assert any("shard 0" in p for p in D.unaligned_shards([100, 28], 2560))
    assert any("K=200" in p for p in D.unaligned_shards([128], 200))


def test_e8m0_scales_become_an_exact_private_fp32_copy():
    exps = torch.tensor([[0, 1, 120], [127, 130, 254]], dtype=torch.uint8)
    got = D.block_scales_fp32(exps.view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, torch.exp2(exps.float() - 127))
    fp32 = torch.ones(2, 3)
    assert D.block_scales_fp32(fp32).data_ptr() != fp32.data_ptr()  # vLLM may transform the original


def _vllm_kernel_only(method) -> bool:
    """vLLM's kernel at every size, the block scales fitted to it (not the W8A16 method)."""
    return type(method) is D.LingBlockFp8LinearMethod


def test_opt_out_warns_and_keeps_vllm(caplog, monkeypatch):
    monkeypatch.setattr(D.Fp8LinearMethod, "__init__", lambda self, qc: None)
    logging.getLogger("vllm.ling").propagate = True
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        assert _vllm_kernel_only(D.choose_dense_fp8_method(BLOCK, _Layer(), "model.layers.0.self_attn.qkv_proj",
                                                           [4096] * 3, 2560, LingOptions(dense_fp8=DenseFp8.VLLM)))
    assert any("explicit choice" in r.getMessage() for r in caplog.records)


def test_requested_but_unavailable_is_an_error_naming_the_opt_out(monkeypatch):
    import vllm_ling.ops.dense_fp8 as ops

    monkeypatch.setattr(ops, "unavailable_reason", lambda device=None: "sm_80 has no e4m3 conversion")
    with pytest.raises(D.DenseFp8Unavailable, match="VLLM_LING_DENSE_FP8=vllm"):
        D.choose_dense_fp8_method(BLOCK, _Layer(), "p", [4096], 2560, LingOptions())
    with pytest.raises(D.DenseFp8Unavailable, match="128x128"):
        D.choose_dense_fp8_method(types.SimpleNamespace(weight_block_size=[64, 64]), _Layer(), "p", [4096], 2560,
                                  LingOptions())


def test_unaligned_linear_keeps_vllm(monkeypatch):
    import vllm_ling.ops.dense_fp8 as ops

    monkeypatch.setattr(ops, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(D.Fp8LinearMethod, "__init__", lambda self, qc: None)
    layer = _Layer()
    assert _vllm_kernel_only(D.choose_dense_fp8_method(BLOCK, layer, "p", [100, 28], 2560, LingOptions()))
    selection = recorded(layer, Feature.DENSE_FP8)  # the layer records why it keeps vLLM's kernel
    assert selection.choice is DenseFp8Kernel.VLLM and "shard 0 has 100 rows" in selection.reason


class _Layer(types.SimpleNamespace):
    """A stand-in layer the op's registry can hold (weakly)."""


def test_kernel_choice_happens_inside_one_traceable_op(monkeypatch):
    # vLLM compiles the model with fullgraph=True and symbolic batch sizes: apply() must trace
    # to one opaque op, and the op (not the trace) picks the kernel by row count
    w = torch.randn(8, 16)
    layer = _Layer(output_size_per_partition=8, ling_w8a16=(w, None), ling_dense_fp8_method=None,
                   ling_dense_fp8_key="test.linear#1", ling_w8a16_max_rows=D.DECODE_MAX_ROWS)
    monkeypatch.setitem(D._LAYERS, "test.linear#1", layer)
    monkeypatch.setattr(D.Fp8LinearMethod, "apply", lambda self, lyr, x, bias=None: (x.float() @ w.t()).to(x.dtype))
    monkeypatch.setattr(D.LingW8A16Fp8LinearMethod, "apply_w8a16",
                        staticmethod(lambda lyr, x: (x.float() @ w.t()).to(torch.bfloat16) + 1000))
    method = object.__new__(D.LingW8A16Fp8LinearMethod)
    method.prefix = "test.linear"
    compiled = torch.compile(lambda x: method.apply(layer, x), fullgraph=True, dynamic=True, backend="eager")
    small = torch.randn(4, 16).to(torch.bfloat16)
    large = torch.randn(D.DECODE_MAX_ROWS + 1, 16).to(torch.bfloat16)
    assert (compiled(small).float() > 900).all()                   # decode size: the W8A16 path
    assert torch.allclose(compiled(large).float(), large.float() @ w.t(), atol=0.1)  # vLLM's kernel
    layer.ling_w8a16_max_rows = 3                                    # a shape vLLM's kernel wins above 3 rows
    assert torch.allclose(compiled(small).float(), small.float() @ w.t(), atol=0.1)
    assert (compiled(small[:3]).float() > 900).all()
    layer.ling_w8a16_max_rows = D.DECODE_MAX_ROWS
    layer.ling_w8a16 = None                                          # weight replaced: vLLM's kernel
    assert torch.allclose(compiled(small).float(), small.float() @ w.t(), atol=0.1)


def test_a_strided_prefill_input_reaches_vllms_kernel_contiguous(monkeypatch):
    """MLA's kv_b_proj runs over a slice of the cached context's latents (row stride 576 for 512
    columns): handed on as it is, vLLM quantizes it with its Triton fallback, JIT-compiled inside a
    served prompt. The op copies it once, values unchanged."""
    w = torch.randn(8, 16)
    layer = _Layer(output_size_per_partition=8, ling_w8a16=(w, None), ling_dense_fp8_method=None,
                   ling_dense_fp8_key="test.strided#1", ling_w8a16_max_rows=2)
    monkeypatch.setitem(D._LAYERS, "test.strided#1", layer)
    seen = []

    def vllm_apply(self, lyr, x, bias=None):
        seen.append(x.is_contiguous())
        return (x.float() @ w.t()).to(x.dtype)

    monkeypatch.setattr(D.Fp8LinearMethod, "apply", vllm_apply)
    wide = torch.randn(5, 20).to(torch.bfloat16)
    latents = wide[:, :16]  # 5 rows > 2: vLLM's kernel
    assert not latents.is_contiguous()
    out = D.dense_fp8_linear_op(latents, "test.strided#1")
    assert seen == [True] and torch.allclose(out.float(), latents.float() @ w.t(), atol=0.1)


def _loaded_layer():
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(256, 256).to(torch.float8_e4m3fn), requires_grad=False)
    exps = torch.tensor([[120, 121], [122, 127]], dtype=torch.uint8)
    layer.weight_scale_inv = torch.nn.Parameter(exps.view(torch.float8_e8m0fnu), requires_grad=False)
    return layer


def _method():
    method = object.__new__(D.LingW8A16Fp8LinearMethod)
    method.prefix = "test.proc"
    return method


def test_post_load_keeps_the_loaded_weight_and_fp32_scales(monkeypatch):
    from vllm.model_executor import utils as vllm_utils

    monkeypatch.setattr(vllm_utils, "is_weights_pre_processed", lambda: False)
    layer = _loaded_layer()
    weight = layer.weight.data

    def vllm_processing(self, lyr):  # vLLM converts the scales for its kernel, keeps the weight
        lyr.weight_scale_inv = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    monkeypatch.setattr(D.Fp8LinearMethod, "process_weights_after_loading", vllm_processing)
    method = _method()
    method.process_weights_after_loading(layer)
    kept, scale = layer.ling_w8a16
    scratch = _loaded_layer()  # a known-answer check's scratch layer through a copy of the method
    method.process_weights_after_loading(scratch)
    assert D._LAYERS[layer.ling_dense_fp8_key] is layer and D._LAYERS[scratch.ling_dense_fp8_key] is scratch
    assert kept.data_ptr() == weight.data_ptr()
    assert torch.equal(scale, torch.tensor([[2.0**-7, 2.0**-6], [2.0**-5, 1.0]]))

    def vllm_repack(self, lyr):  # e.g. a Marlin repack: a new weight tensor
        lyr.weight = torch.nn.Parameter(lyr.weight.data.clone(), requires_grad=False)

    monkeypatch.setattr(D.Fp8LinearMethod, "process_weights_after_loading", vllm_repack)
    layer = _loaded_layer()
    _method().process_weights_after_loading(layer)
    assert layer.ling_w8a16 is None and "replaced the weight" in layer.ling_w8a16_reason

    monkeypatch.setattr(vllm_utils, "is_weights_pre_processed", lambda: True)
    layer = _loaded_layer()
    _method().process_weights_after_loading(layer)
    assert layer.ling_w8a16 is None and "pre-processed" in layer.ling_w8a16_reason


def test_checkpoint_with_e4m3_nan_codes_is_refused_naming_the_layer(monkeypatch):
    from vllm.model_executor import utils as vllm_utils

    monkeypatch.setattr(vllm_utils, "is_weights_pre_processed", lambda: False)
    monkeypatch.setattr(D.Fp8LinearMethod, "process_weights_after_loading", lambda self, lyr: None)
    layer = _loaded_layer()
    _method().process_weights_after_loading(layer)  # randn codes: no NaN, accepted
    assert layer.ling_w8a16 is not None
    for code in (0x7F, 0xFF):
        layer = _loaded_layer()
        layer.weight.data.view(torch.uint8)[3, 5] = code
        with pytest.raises(ValueError, match=r"test\.proc\.weight holds 1 e4m3 NaN codes"):
            _method().process_weights_after_loading(layer)


def test_each_layer_records_and_serves_its_decode_kernel_per_row_count(monkeypatch):
    """After loading, a layer resolves one launch config per decode row count (on CUDA: the decode
    kernel or, where the tuned table or the JIT says so, Triton), records the kernels for decode and
    prefill sizes, and its op hands the W8A16 launcher exactly the config of the row count; the
    known-answer label names the recorded decode kernels. (The configs stand in for a GPU's.)"""
    from vllm.model_executor import utils as vllm_utils

    import vllm_ling.ops.dense_fp8 as ops
    from vllm_ling.layers.dense_fp8_path import served
    from vllm_ling.layers.known_answer import dense_kernel_label
    from vllm_ling.ops.dense_fp8.decode_kernel import DecodeConfig
    from vllm_ling.ops.dense_fp8.tuned_configs import W8A16Config

    cuda, triton = DecodeConfig(ksplit=4), W8A16Config(block_n=16, k_steps=1, num_warps=4, num_stages=3)
    plan = (3, (cuda, cuda, triton))  # as an sm_90 table: the decode kernel at 1-2 rows, Triton at 3
    monkeypatch.setattr(vllm_utils, "is_weights_pre_processed", lambda: False)
    monkeypatch.setattr(D.Fp8LinearMethod, "process_weights_after_loading", lambda self, lyr: None)
    monkeypatch.setattr(D, "decode_plan", lambda weight: plan)
    method, layer = _method(), _loaded_layer()
    method.fp8_linear = CutlassLikeKernel()
    method.process_weights_after_loading(layer)
    selection = recorded(layer, Feature.DENSE_FP8)
    assert (selection.choice, selection.max_rows, selection.prefill) == (DenseFp8Kernel.W8A16, 3, "CutlassLikeKernel")
    assert selection.decode == "CUDA W8A16 decode at 1-2 rows, Triton W8A16 (fp32 FMA) at 3 rows"
    layer.quant_method = method
    assert served(layer).key == selection.served_as()  # read back from what the op dispatches by
    assert dense_kernel_label(method, layer).endswith("; decode: " + selection.decode)
    seen = []
    monkeypatch.setattr(ops, "w8a16_linear", lambda x, w, s, config=None: seen.append(config) or x.new_zeros(
        x.shape[0], w.shape[0]))
    for rows in (1, 3):
        D.LingW8A16Fp8LinearMethod.apply_w8a16(layer, torch.zeros(rows, 256, dtype=torch.bfloat16))
    assert seen == [cuda, triton]  # what it recorded is what it launches


def test_w8a16_row_limit_per_shape_and_architecture():
    from vllm_ling.ops.dense_fp8.tuned_configs import W8A16_MAX_ROWS, w8a16_max_rows

    # the two widest weights hand 9+ rows to vLLM's W8A8 kernel on sm_90 (measured faster there)
    assert w8a16_max_rows(12288, 2560, (9, 0)) == 8 and w8a16_max_rows(20480, 2560, (9, 0)) == 8
    assert w8a16_max_rows(4096, 2560, (9, 0)) == D.DECODE_MAX_ROWS
    assert w8a16_max_rows(12288, 2560, (12, 1)) == D.DECODE_MAX_ROWS  # untuned arch: no measurement, W8A16
    assert all(0 < r <= D.DECODE_MAX_ROWS for table in W8A16_MAX_ROWS.values() for r in table.values())


def test_op_names_are_the_layer_prefix_so_a_cached_compiled_graph_finds_its_layers(monkeypatch):
    # vLLM 0.32 on torch >= 2.10 saves the compiled model (VLLM_USE_AOT_COMPILE) with the op's
    # layer-name argument baked in and loads it on the next start: the name must come out the
    # same in a fresh process (the prefix), never from the object's address
    from vllm.model_executor import utils as vllm_utils

    monkeypatch.setattr(vllm_utils, "is_weights_pre_processed", lambda: False)
    monkeypatch.setattr(D.Fp8LinearMethod, "process_weights_after_loading", lambda self, lyr: None)
    method = _method()
    served = _loaded_layer()
    method.process_weights_after_loading(served)
    assert served.ling_dense_fp8_key == "test.proc"
    scratch = _loaded_layer()  # a known-answer check's scratch layer, processed later, same prefix
    method.process_weights_after_loading(scratch)
    method.process_weights_after_loading(served)  # processed again (a weight reload): same name
    assert served.ling_dense_fp8_key == "test.proc" and scratch.ling_dense_fp8_key == "test.proc#2"
    assert D._LAYERS["test.proc"] is served and D._LAYERS["test.proc#2"] is scratch


def test_known_answer_check_through_a_scratch_layer_runs_both_kernels(monkeypatch):
    # the startup check builds a bare scratch layer (no quant_method) through a copy of the served
    # method; its GEMM-sized case (256 rows) is vLLM's kernel's, through that copy. vLLM's block-FP8
    # kernels need a GPU: plain-PyTorch stand-ins with vLLM's parameter layout
    from vllm.model_executor import utils as vllm_utils

    import vllm_ling.ops.dense_fp8 as ops
    from vllm_ling.layers.known_answer import check_dense_fp8_method
    from vllm_ling.ops.fp8 import block_fp8_dequantize

    def create_weights(self, layer, k_part, sizes, k, n, dtype, **extra):
        layer.weight = torch.nn.Parameter(torch.empty(sum(sizes), k_part, dtype=torch.float8_e4m3fn),
                                          requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(torch.empty(sum(sizes) // 128, k_part // 128),
                                                    requires_grad=False)
        layer.output_size_per_partition = sum(sizes)

    def vllm_apply(self, lyr, x, bias=None):
        assert isinstance(self, D.Fp8LinearMethod)
        w = block_fp8_dequantize(lyr.weight.data, lyr.weight_scale_inv.data, (128, 128), dtype=torch.float32)
        return (x.float() @ w.t()).to(x.dtype)

    monkeypatch.setattr(vllm_utils, "is_weights_pre_processed", lambda: False)
    monkeypatch.setattr(D.Fp8LinearMethod, "create_weights", create_weights)
    monkeypatch.setattr(D.Fp8LinearMethod, "process_weights_after_loading", lambda self, lyr: None)
    monkeypatch.setattr(D.Fp8LinearMethod, "apply", vllm_apply)
    monkeypatch.setattr(ops, "w8a16_linear", ops.reference_linear)
    method = _method()
    method.weight_block_size = [128, 128]
    result = check_dense_fp8_method(method)
    assert result.passed and result.cases == 2, result.message()


class CutlassLikeKernel:
    """vLLM 0.32's CUTLASS/Triton block-FP8 kernels: they keep the scales vLLM loaded and read
    them as float32 (an E8M0 tensor makes ``dispatch_scaled_mm`` raise: vllm#47818)."""

    def apply_weights(self, layer, x, bias=None):
        from vllm_ling.ops.fp8 import block_fp8_dequantize

        scale = layer.weight_scale_inv.data
        if scale.dtype != torch.float32:
            raise RuntimeError(f"dispatch_scaled_mm: scale_b must be float32, got {scale.dtype}")
        w = block_fp8_dequantize(layer.weight.data, scale, (128, 128), dtype=torch.float32)
        return (x.float() @ w.t()).to(x.dtype)


def _e8m0_create_weights(self, layer, k_part, sizes, k, n, dtype, **extra):
    """Fp8LinearMethod.create_weights for a ``scale_fmt: ue8m0`` checkpoint (vLLM's parameter
    layout, E8M0 block scales), with the CUTLASS-like kernel selected."""
    layer.weight = torch.nn.Parameter(torch.empty(sum(sizes), k_part, dtype=torch.float8_e4m3fn),
                                      requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(
        torch.empty(sum(sizes) // 128, k_part // 128, dtype=torch.float8_e8m0fnu), requires_grad=False)
    layer.output_size_per_partition = sum(sizes)
    self.fp8_linear = CutlassLikeKernel()


def _e8m0_vllm(monkeypatch):
    from vllm.model_executor import utils as vllm_utils

    monkeypatch.setattr(vllm_utils, "is_weights_pre_processed", lambda: False)
    monkeypatch.setattr(D.Fp8LinearMethod, "create_weights", _e8m0_create_weights)
    monkeypatch.setattr(D.Fp8LinearMethod, "process_weights_after_loading", lambda self, lyr: None)
    monkeypatch.setattr(D.Fp8LinearMethod, "apply", lambda self, lyr, x, bias=None: self.fp8_linear.apply_weights(lyr, x))


def _bare(cls):
    method = object.__new__(cls)
    method.prefix, method.weight_block_size, method.use_marlin, method.block_scales = "test.e8m0", [128, 128], False, None
    return method


def test_e8m0_checkpoint_computes_right_on_a_kernel_that_reads_fp32_scales(monkeypatch):
    # the GPU profile-run crash (issue 32): vLLM's own method hands the E8M0 scales to the kernel;
    # ours upcasts them once, and the known answer (one-hot GEMM-sized rows through vLLM's kernel,
    # one decode row through the W8A16 kernel) passes; on the plain method the same check fails
    import vllm_ling.ops.dense_fp8 as ops
    from vllm_ling.layers.known_answer import check_dense_fp8_method

    _e8m0_vllm(monkeypatch)
    monkeypatch.setattr(ops, "w8a16_linear", ops.reference_linear)
    for cls in (D.LingBlockFp8LinearMethod, D.LingW8A16Fp8LinearMethod):
        result = check_dense_fp8_method(_bare(cls))
        assert result.passed and result.cases == 2, result.message()
        assert "(block scales float32 (upcast from E8M0))" in result.kernel, result.kernel
    plain = object.__new__(D.Fp8LinearMethod)
    plain.weight_block_size, plain.use_marlin = [128, 128], False
    result = check_dense_fp8_method(plain)
    assert not result.passed and "dispatch_scaled_mm" in result.message()


def test_scales_are_fitted_only_when_vllm_left_them_in_e8m0(monkeypatch):
    _e8m0_vllm(monkeypatch)
    layer = torch.nn.Module()
    method = _bare(D.LingBlockFp8LinearMethod)
    method.create_weights(layer, 256, [256], 256, 256, torch.bfloat16)
    exps = torch.tensor([[120, 127], [130, 1]], dtype=torch.uint8)
    layer.weight_scale_inv.data.copy_(exps.view(torch.float8_e8m0fnu))
    method.process_weights_after_loading(layer)
    assert layer.weight_scale_inv.dtype == torch.float32
    assert torch.equal(layer.weight_scale_inv.data, torch.exp2(exps.double() - 127).float())  # exact
    assert layer.ling_block_scales == method.block_scales == D.E8M0_UPCAST
    # a kernel whose processing converted them (DeepGEMM, B12x, CPU: float32) is left alone
    converted = torch.nn.Module()
    converted.weight = torch.nn.Parameter(torch.zeros(256, 256, dtype=torch.float8_e4m3fn), requires_grad=False)
    converted.weight_scale_inv = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    kept = converted.weight_scale_inv
    assert D.fit_block_scales(converted, "DeepGemmFp8BlockScaledMMKernel") == "float32"
    assert converted.weight_scale_inv is kept
    marlin = _bare(D.LingBlockFp8LinearMethod)  # Marlin repacks the scales in its own layout
    marlin.use_marlin = True
    layer2 = torch.nn.Module()
    marlin.create_weights(layer2, 256, [256], 256, 256, torch.bfloat16)
    marlin.process_weights_after_loading(layer2)
    assert layer2.weight_scale_inv.dtype == torch.float8_e8m0fnu and marlin.block_scales is None


def test_the_scratch_check_is_served_by_the_served_layers_kernel(monkeypatch):
    # vLLM selects the kernel per weight shape: a scratch layer of another shape could get another
    # kernel; the check rebuilds the served one, and fails (named) where vLLM cannot build it
    import vllm.model_executor.kernels.linear as kernels

    from vllm_ling.layers.known_answer import KernelMismatch, _serve_with_the_same_kernel

    class Served:
        pass

    class Other:
        pass

    calls = []

    def init_kernel(**kw):
        calls.append(kw["force_kernel"])
        return kw["force_kernel"]() if kw["force_kernel"] is Served and not refuse else Other()

    monkeypatch.setattr(kernels, "init_fp8_linear_kernel", init_kernel)
    served, scratch = _bare(D.LingBlockFp8LinearMethod), _bare(D.LingBlockFp8LinearMethod)
    served.fp8_linear = Served()
    scratch.activation_quant_key = scratch.weight_quant_key = None
    scratch.input_dtype = scratch.out_dtype = torch.bfloat16
    layer = types.SimpleNamespace(weight=torch.empty(256, 256))
    refuse = False
    scratch.fp8_linear = Other()
    _serve_with_the_same_kernel(scratch, served, layer)
    assert type(scratch.fp8_linear) is Served and calls == [Served]
    _serve_with_the_same_kernel(scratch, served, layer)  # already the same: nothing rebuilt
    assert calls == [Served]
    refuse = True
    scratch.fp8_linear = Other()
    with pytest.raises(KernelMismatch, match="cannot build Served"):
        _serve_with_the_same_kernel(scratch, served, layer)
