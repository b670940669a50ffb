"""The CUDA small-GEMV method for the checkpoint's unquantized BF16 linears: its
platform-independent rules (CPU)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

pytest.importorskip("vllm")  # the GPU box runs tests/ops only: it has no vLLM

from vllm_ling.layers import small_bf16_cuda as S  # noqa: E402
from vllm_ling.options import LingOptionError, LingOptions, Bf16Gemv  # noqa: E402


def test_option_parses_and_defaults_to_ling():
    assert LingOptions.from_env({}).bf16_gemv is Bf16Gemv.LING
    assert LingOptions.from_env({"VLLM_LING_BF16_GEMV": "vllm"}).bf16_gemv is Bf16Gemv.VLLM
    with pytest.raises(LingOptionError, match="VLLM_LING_BF16_GEMV"):
        LingOptions.from_env({"VLLM_LING_BF16_GEMV": "fast"})


def test_opt_out_warns_and_keeps_vllm(caplog):
    logging.getLogger("vllm.ling").propagate = True
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        assert S.choose_small_bf16_method(types.SimpleNamespace(), "model.layers.0.self_attn.b_proj",
                                          LingOptions(bf16_gemv=Bf16Gemv.VLLM)) is None
    assert any("explicit choice" in r.getMessage() and "VLLM_LING_BF16_GEMV=vllm" in r.getMessage()
               for r in caplog.records)


def test_requested_but_unavailable_is_an_error_naming_the_opt_out(monkeypatch):
    import vllm_ling.ops.small_gemv as ops

    monkeypatch.setattr(ops, "unavailable_reason", lambda device=None: "sm_75: needs sm_80+")
    with pytest.raises(S.Bf16GemvUnavailable, match="VLLM_LING_BF16_GEMV=vllm"):
        S.choose_small_bf16_method(types.SimpleNamespace(), "p", LingOptions())
    monkeypatch.setattr(ops, "unavailable_reason", lambda device=None: None)
    layer = types.SimpleNamespace()
    assert isinstance(S.choose_small_bf16_method(layer, "p", LingOptions()), S.LingSmallBf16LinearMethod)
    from vllm_ling.ops.small_gemv.selection import GemvPath
    from vllm_ling.selection import Feature, recorded

    assert recorded(layer, Feature.BF16_GEMV).choice is GemvPath.LING  # recorded on the layer it was chosen for


@pytest.mark.parametrize("weight,words", [
    (torch.zeros(32, 2560, dtype=torch.bfloat16), None),                    # b_proj / MLA g_proj
    (torch.zeros(16, 2560, dtype=torch.bfloat16), None),                    # the same at TP=2
    (torch.zeros(32, 2560, dtype=torch.float16), "not BF16"),               # --dtype float16
    (torch.zeros(1024, 2560, dtype=torch.bfloat16), "exceed"),              # a wide weight: cuBLAS
    (torch.zeros(32, 2500, dtype=torch.bfloat16), "multiple of 256"),
    (torch.zeros(2560, 32, dtype=torch.bfloat16).t(), "contiguous"),
])
def test_kernel_problems(weight, words):
    problems = S.kernel_problems(weight)
    assert (problems == []) if words is None else any(words in p for p in problems), problems


def _method(monkeypatch):
    monkeypatch.setattr(S.UnquantizedLinearMethod, "process_weights_after_loading", lambda self, layer: None)
    return S.LingSmallBf16LinearMethod("test.b_proj")


def test_post_load_serves_a_fitting_weight_and_reports_one_that_does_not(monkeypatch, caplog):
    method = _method(monkeypatch)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(32, 2560).to(torch.bfloat16), requires_grad=False)
    method.process_weights_after_loading(layer)
    assert layer.ling_small_gemv.data_ptr() == layer.weight.data_ptr() and layer.ling_small_gemv_reason is None
    assert S._LAYERS[layer.ling_small_gemv_key] is layer

    logging.getLogger("vllm.ling").propagate = True
    wide = torch.nn.Module()
    wide.weight = torch.nn.Parameter(torch.randn(600, 2560).to(torch.bfloat16), requires_grad=False)
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        method.process_weights_after_loading(wide)
    assert wide.ling_small_gemv is None and "exceed" in wide.ling_small_gemv_reason
    assert any("keeps vLLM's GEMM" in r.getMessage() for r in caplog.records)


def test_kernel_choice_happens_inside_one_traceable_op(monkeypatch):
    # vLLM compiles the model with fullgraph=True and symbolic batch sizes: apply() must trace
    # to one opaque op, and the op (not the trace) picks the kernel by row count
    w = torch.randn(32, 256).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    method = _method(monkeypatch)
    layer.quant_method = method
    method.process_weights_after_loading(layer)
    calls = []

    def fake_small_gemv(lyr, x):  # the kernel needs CUDA; record the call, compute independently
        calls.append(x.shape[0])
        return (x.float() @ lyr.ling_small_gemv.float().t()).to(torch.bfloat16)

    monkeypatch.setattr(S.LingSmallBf16LinearMethod, "apply_small_gemv", staticmethod(fake_small_gemv))
    # vLLM's GEMM on CPU needs its own post-load packing (skipped here): F.linear stands in
    monkeypatch.setattr(S.UnquantizedLinearMethod, "apply",
                        lambda self, lyr, x, bias=None: torch.nn.functional.linear(x, lyr.weight))
    compiled = torch.compile(lambda x: method.apply(layer, x), fullgraph=True, dynamic=True, backend="eager")
    small = torch.randn(S.SMALL_BF16_MAX_ROWS, 256).to(torch.bfloat16)
    large = torch.randn(S.SMALL_BF16_MAX_ROWS + 1, 256).to(torch.bfloat16)
    for x in (small, large):
        assert torch.allclose(compiled(x).float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)
    assert calls == [S.SMALL_BF16_MAX_ROWS]  # only the decode-sized batch took the small GEMV
    layer.ling_small_gemv = None           # a weight the kernel cannot hold: vLLM's GEMM
    compiled(small)
    assert calls == [S.SMALL_BF16_MAX_ROWS]
    fake = S._small_bf16_linear_fake(torch.empty(3, 5, 256), layer.ling_small_gemv_key)
    assert fake.shape == (3, 5, 32)


def test_rows_reach_the_kernel_16_byte_aligned(monkeypatch):
    import vllm_ling.ops.small_gemv as ops

    seen = []

    def kernel(x, w, out_dtype):  # the real kernel refuses misaligned rows; record what it would get
        seen.append(x.data_ptr() % 16)
        return (x.float() @ w.float().t()).to(out_dtype)

    monkeypatch.setattr(ops, "small_gemv", kernel)
    w = torch.randn(32, 256).to(torch.bfloat16)
    layer = types.SimpleNamespace(ling_small_gemv=w)
    flat = torch.randn(2 * 256 + 1).to(torch.bfloat16)
    x = flat[1:].view(2, 256)  # contiguous, but 2 bytes past an aligned address
    assert x.is_contiguous() and x.data_ptr() % 16
    out = S.LingSmallBf16LinearMethod.apply_small_gemv(layer, x)
    assert seen == [0] and torch.allclose(out.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


def test_op_names_are_the_layer_prefix_so_a_cached_compiled_graph_finds_its_layers(monkeypatch):
    # vLLM 0.32 on torch >= 2.10 saves the compiled model (VLLM_USE_AOT_COMPILE) with the op's
    # layer-name argument baked in and loads it on the next start: the name must come out the
    # same in a fresh process (the prefix), never from the object's address
    method = _method(monkeypatch)
    layers = [torch.nn.Module(), torch.nn.Module()]
    for layer in layers:
        layer.weight = torch.nn.Parameter(torch.randn(32, 2560).to(torch.bfloat16), requires_grad=False)
        method.process_weights_after_loading(layer)
    assert [layer.ling_small_gemv_key for layer in layers] == ["test.b_proj", "test.b_proj#2"]
    assert S._LAYERS["test.b_proj"] is layers[0]


def test_an_empty_batch_gets_an_empty_output(monkeypatch):
    # the kernel takes 1..MAX_ROWS rows (it raises on 0, as the router GEMV would; the router and
    # dense W8A16 ops hand 0 rows to vLLM's path / return at once): the op must answer any count
    method = _method(monkeypatch)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(32, 256).to(torch.bfloat16), requires_grad=False)
    layer.quant_method = method
    method.process_weights_after_loading(layer)
    monkeypatch.setattr(S.UnquantizedLinearMethod, "apply",
                        lambda self, lyr, x, bias=None: torch.nn.functional.linear(x, lyr.weight))
    out = method.apply(layer, torch.empty(0, 256, dtype=torch.bfloat16))
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
