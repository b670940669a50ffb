"""FP8 online-quantized LM head for the Ling target (and the module the MTP draft shares).

The checkpoint's BF16 head loads through vLLM's normal vocab-parallel weight loader
(each tensor-parallel rank gets its vocabulary shard, padding rows zero). After loading,
``process_weights_after_loading`` quantizes it in place, per output row, to FP8 e4m3
(``vllm_ling.ops.lm_head.quantize_fp8_per_channel``): the module object keeps its
identity, ``layer.weight`` becomes the FP8 tensor (half the bytes), ``layer.weight_scale``
holds the per-row scales, and the BF16 storage is freed. ``apply`` computes logits with
the kernel chosen per GPU architecture by measurement (``select_head_kernel``, whose selection is
recorded on the head), or the chunked fp32 reference on CPU; vLLM's LogitsProcessor then gathers,
slices padding and applies soft-capping as for any head. The quant config records on every head
whether it is this FP8 head (``select_fp8_head``); :data:`FP8_HEAD_READER` and
:data:`KERNEL_READER` read both back for the startup verification.
"""

from __future__ import annotations

import logging

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.utils import set_weight_attrs

from vllm_ling.log import get_logger, log_once
from vllm_ling.models.names import MARKOV_PROJECTION_ATTR
from vllm_ling.ops import lm_head as head_ops
from vllm_ling.ops.lm_head.selection import Fp8Head
from vllm_ling.options import HeadKernel, opt_out_setting
from vllm_ling.selection import Feature, Reader, Served, record, recorded

logger = get_logger("lm_head")


class Fp8LmHeadMethod(QuantizeMethodBase):
    """Quant method for ``ParallelLMHead``: BF16 in the checkpoint, FP8 in memory."""

    def __init__(self, kernel: HeadKernel | None = None):
        self.requested_kernel = kernel  # None: the selector's choice for the head's device
        self.state: head_ops.Fp8HeadState | None = None

    @property
    def kernel(self) -> HeadKernel | None:
        """The kernel prepared for the loaded head (what serves)."""
        return self.state.kernel if self.state is not None else None

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        weight = Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                       dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        layer.ling_checkpoint_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        bf16 = layer.weight.data
        q, scale = head_ops.quantize_fp8_per_channel(bf16)
        selection = record(layer, head_ops.select_head_kernel(bf16.device, preferred=self.requested_kernel))
        self.state = head_ops.prepare_fp8_head(q, scale, selection.choice,
                                               out_dtype=getattr(layer, "ling_checkpoint_dtype", bf16.dtype))
        self.state.reason = selection.reason
        stored = self.state.weight
        if stored.dtype != torch.float8_e4m3fn:  # humming repacks the FP8 bytes into int32 words
            stored = stored.view(torch.float8_e4m3fn)
        # Same Parameter object for tooling that holds it; new (FP8) storage; BF16 freed.
        layer.weight.data = stored
        layer.weight_scale = Parameter(self.state.scale, requires_grad=False)
        del bf16, q
        log_once(logger, logging.INFO, f"fp8-head-{self.state.kernel}",
                 "FP8 LM head: %d x %d per-row e4m3, kernel %s (%s)", self.state.vocab_size,
                 self.state.hidden_size, self.state.kernel, self.state.reason)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        assert self.state is not None, "FP8 head used before process_weights_after_loading"
        logits = head_ops.fp8_head_logits(x, self.state)
        if bias is not None:
            logits = logits + bias
        return logits

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the FP8 LM head is not an input embedding (Ling does not tie them)")


def _is_head(module) -> bool:
    """A vLLM LM head (the DSpark drafter's Markov projection is vLLM's head class, but no LM head)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, ParallelLMHead) and not getattr(module, MARKOV_PROJECTION_ATTR, False)


def _weight_text(head) -> str:
    w = head.weight
    return f"{type(head.quant_method).__name__}, {str(w.dtype).replace('torch.', '')}, {w.numel() * w.element_size()} bytes"


def served_precision(head) -> Served:
    """FP8 where the head runs this method on a float8_e4m3fn weight of one byte per logical
    vocabulary row and column (a GPU kernel's repacked layout may pad a little; BF16 would be 2x);
    the checkpoint's head on vLLM's method; None for anything between."""
    w, fp8 = head.weight, isinstance(head.quant_method, Fp8LmHeadMethod)
    rows = getattr(head, "num_embeddings_per_partition", None) or w.shape[0]
    cols = getattr(head, "embedding_dim", None) or w.shape[-1]
    nbytes = w.numel() * w.element_size()
    if fp8 and w.dtype == torch.float8_e4m3fn and rows * cols <= nbytes < 1.1 * rows * cols:
        return Served.of(Fp8Head.FP8, label=_weight_text(head))
    if not fp8 and w.dtype != torch.float8_e4m3fn:
        return Served.of(Fp8Head.VLLM, label=_weight_text(head))
    return Served.of(None, label=_weight_text(head))


def expected_heads(config, stage, draft_here: bool) -> int:
    """The target's head, on the last pipeline stage (the draft shares it)."""
    return 1 if stage.is_last else 0


FP8_HEAD_READER = Reader(
    Feature.FP8_HEAD, "lm_head", "LM heads", _is_head, served_precision,
    f"the ling_fp8 quantization was not selected: do not pass --quantization, or set "
    f"{opt_out_setting('VLLM_LING_FP8_HEAD')}; a head serving other than its selection is a defect: report it",
    expected=expected_heads, optimization="fp8_head", optimizing=frozenset({Fp8Head.FP8}), known_answers="fp8_head")


def served_kernel(head) -> Served:
    """The kernel the FP8 head prepared for its loaded weight (read from its state)."""
    kernel = getattr(head.quant_method, "kernel", None)
    return Served.of(kernel, label=str(kernel) if kernel is not None else f"no kernel ({type(head.quant_method).__name__})")


KERNEL_READER = Reader(
    Feature.HEAD_KERNEL, "lm_head", "FP8 LM head kernels",
    lambda m: _is_head(m) and (isinstance(m.quant_method, Fp8LmHeadMethod) or recorded(m, Feature.HEAD_KERNEL)),
    served_kernel, "force a kernel that runs here with VLLM_LING_LM_HEAD_KERNEL; a head serving another kernel than "
    "its selection is a defect: report it")
