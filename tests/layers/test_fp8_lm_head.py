"""The FP8 head as a vLLM quant method on the tiny checkpoint's real head."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


def _bf16_head(checkpoint) -> torch.Tensor:
    from safetensors import safe_open

    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            if "lm_head.weight" in f.keys():
                return f.get_tensor("lm_head.weight")
    raise AssertionError("no lm_head.weight")


def test_head_is_quantized_in_place_and_halves_memory(tiny_checkpoint, gloo_world):
    from conftest import build_tiny_models

    from vllm_ling.layers.fp8_lm_head import Fp8LmHeadMethod

    _, target, _ = build_tiny_models(tiny_checkpoint, load=False)
    head = target.lm_head
    param = head.weight
    assert isinstance(head.quant_method, Fp8LmHeadMethod) and param.dtype == torch.bfloat16
    bf16_bytes = param.numel() * param.element_size()
    target.load_weights([("lm_head.weight", _bf16_head(tiny_checkpoint))])
    head.quant_method.process_weights_after_loading(head)
    assert target.lm_head is head and head.weight is param  # same module, same Parameter object
    assert head.weight.dtype == torch.float8_e4m3fn
    fp8_bytes = head.weight.numel() * head.weight.element_size() + head.weight_scale.numel() * 4
    assert fp8_bytes == bf16_bytes // 2 + 4 * head.weight.shape[0]  # V*H bytes + one fp32 scale per row


def test_logits_match_the_fp32_reference(loaded_tiny_models, tiny_checkpoint):
    from vllm_ling.ops.lm_head import reference_logits

    _, target, _ = loaded_tiny_models
    w = _bf16_head(tiny_checkpoint)
    gen = torch.Generator().manual_seed(0)
    # realistic hidden states: the final RMSNorm output (unit RMS) of the tiny model's width
    hidden = torch.randn(64, w.shape[1], generator=gen).to(torch.bfloat16)
    ref = reference_logits(hidden, w)
    got = target.compute_logits(hidden).float()
    assert got.shape == ref.shape  # LogitsProcessor sliced any vocabulary padding
    # e4m3 keeps 3 mantissa bits: per-weight error <= 2**-4 |w| -> logits within a few % of
    # the row's |w|.|x| sum; the BF16 output adds 2**-8 relative.
    bound = (2 ** -4 * (w.float().abs() @ hidden.float().abs().t()).t() + 2 ** -7 * ref.abs()).max()
    assert (got - ref).abs().max() <= bound
    top1 = ref.topk(2, dim=-1)
    margin = top1.values[:, 0] - top1.values[:, 1]
    agree = got.argmax(-1) == ref.argmax(-1)
    # every flip must sit at a small margin (bounded by twice the logit error)
    assert bool((agree | (margin < 2 * (got - ref).abs().max())).all())
    assert agree.float().mean() >= 0.9
    top5_overlap = [len(set(a.tolist()) & set(b.tolist())) / 5
                    for a, b in zip(got.topk(5, -1).indices, ref.topk(5, -1).indices)]
    assert sum(top5_overlap) / len(top5_overlap) >= 0.8


def test_fp32_head_and_fp8_head_are_rejected_before_loading(tiny_checkpoint):
    import vllm_ling
    from vllm.engine.arg_utils import EngineArgs

    vllm_ling.register()
    with pytest.raises(Exception) as err:
        EngineArgs(model=str(tiny_checkpoint), enforce_eager=True,
                   hf_overrides={"head_dtype": "float32"}).create_engine_config()
    msg = str(err.value)
    assert "VLLM_LING_FP8_HEAD=1" in msg and '"head_dtype": "float32"' in msg


def test_draft_lm_head_quantization_is_rejected_before_loading(tiny_checkpoint):
    import vllm_ling
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ling.patches.config_hooks import LingConfigError

    vllm_ling.register()
    with pytest.raises(LingConfigError, match="draft_lm_head_quantization are mutually exclusive"):
        EngineArgs(model=str(tiny_checkpoint), enforce_eager=True, speculative_config={
            "method": "mtp", "num_speculative_tokens": 3, "draft_lm_head_quantization": "fp8"},
        ).create_engine_config()


def test_fp8_head_opt_out_keeps_bf16(tiny_checkpoint, monkeypatch, gloo_world):
    from conftest import build_tiny_models

    from vllm_ling.layers.fp8_lm_head import Fp8LmHeadMethod

    monkeypatch.setenv("VLLM_LING_FP8_HEAD", "0")
    vllm_config, target, _ = build_tiny_models(tiny_checkpoint, load=False,
                                               hf_overrides={"head_dtype": "float32"})
    assert not isinstance(target.lm_head.quant_method, Fp8LmHeadMethod)
    assert vllm_config.model_config.head_dtype == torch.float32
