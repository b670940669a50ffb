"""``vllm-ling warmup``: compile, ahead of serving, the kernels the server will run.

It reads the model's ``config.json`` for the shapes and **the same options the server reads**
(:class:`vllm_ling.options.LingOptions`: MoE backend, W4A8, decode mode and threshold, FP8
head, dense FP8, router GEMV, router top-k, BF16 small GEMV), so it compiles exactly the kernel set the server will use and
nothing else: a kernel group the server will not run is skipped with the reason. It is meant as an init container /
one-shot compose service that shares the humming JIT cache volume
(``VLLM_LING_HUMMING_CACHE``) with the server. Imports torch and the kernels lazily.

Each group runs its kernels once and checks their outputs (the router, BF16 and dense FP8 groups
against float64 references, the router top-k against the plain-PyTorch routing); a group that fails stops the warm-up with one error line naming the
group and exit code ``EXIT_KERNEL_FAILED`` (5), so an init container keeps the server from starting
on a kernel that computes wrong numbers on this GPU. Bad input exits ``EXIT_USAGE`` (2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from vllm_ling.cli.serve import (DEFAULT_MODEL, EXIT_USAGE, LaunchError, check_model_dir, read_model_config,
                                 read_option, resolve_device, resolve_model)
from vllm_ling.models.dense_linears import distinct_decode_shapes
from vllm_ling.ops.moe.humming import HummingUnavailable
from vllm_ling.ops.moe.selection import MoePath, MoeSelection, MoeShape, select_moe
from vllm_ling.options import LingOptionError, LingOptions, ResidualNorm, opt_out_setting, warmup_options
from vllm_ling.selection import Platform, Selection

VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it
EXIT_KERNEL_FAILED = 5  # a kernel group failed to build or run, or computed wrong numbers


@dataclass(frozen=True)
class KernelShapes:
    hidden_size: int
    intermediate_size: int  # per tensor-parallel rank
    num_experts: int
    top_k: int
    vocab_rows: int  # LM-head rows per tensor-parallel rank
    bf16_linear_rows: int  # rows of the unquantized BF16 linears (b_proj, MLA g_proj: heads) per rank
    # Distinct routed-expert SwiGLU clamp limits (None = no clamp); humming generates the
    # activation kernel per limit.
    swiglu_limits: tuple[float | None, ...] = (None,)
    n_group: int = 1  # the router's expert groups and how many it keeps
    topk_group: int = 1


def kernel_shapes(config: dict, tensor_parallel_size: int, config_path: Path) -> KernelShapes:
    missing = [k for k in ("hidden_size", "moe_intermediate_size", "num_experts",
                           "num_experts_per_tok", "vocab_size") if k not in config]
    if missing:
        raise LaunchError(f"{config_path} lacks {', '.join(missing)}: not a Ling MoE config")
    tp = tensor_parallel_size
    if tp < 1 or config["moe_intermediate_size"] % tp:
        raise LaunchError(f"--tensor-parallel-size {tp} does not divide moe_intermediate_size "
                          f"{config['moe_intermediate_size']}")
    padded_vocab = -(-config["vocab_size"] // VOCAB_PADDING) * VOCAB_PADDING
    # 0 or null means no clamp; None is always included (the NEXTN layer lies past the list).
    limits = {float(v) for v in config.get("expert_swiglu_limit_list") or [] if v}
    return KernelShapes(
        hidden_size=config["hidden_size"],
        intermediate_size=config["moe_intermediate_size"] // tp,
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        n_group=config.get("n_group") or 1,
        topk_group=config.get("topk_group") or 1,
        vocab_rows=-(-padded_vocab // tp),
        bf16_linear_rows=max(1, config.get("num_attention_heads", tp) // tp),
        swiglu_limits=(None, *sorted(limits)),
    )


def build_warmup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-ling warmup",
        description="Compile the kernels the server will run for a model's shapes into the JIT "
                    "cache (run once per cache volume before serving). Reads the same "
                    "VLLM_LING_* switches as the server.")
    parser.add_argument("model", nargs="?", default=None,
                        help=f"checkpoint directory (env VLLM_LING_MODEL, default {DEFAULT_MODEL})")
    # flag > environment > default, like `vllm-ling serve`
    for opt in warmup_options():
        flag = {"VLLM_LING_WARMUP_TOKEN_COUNTS": "--token-counts",
                "VLLM_LING_WARMUP_ROW_COUNTS": "--row-counts"}.get(opt.name, opt.flag)
        parser.add_argument(flag, dest=opt.short, default=None, metavar="VALUE",
                            help=f"{opt.help} (env {opt.name}, default {opt.shown_default()})")
    parser.add_argument("--device", default=None,
                        help="auto, cuda or cpu (env VLLM_LING_DEVICE, default auto)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA, report that there is nothing to compile and exit 0 "
                             "(for CPU-only demos); otherwise that is an error (exit 2)")
    return parser


@dataclass(frozen=True)
class WarmupPlan:
    """What warmup will compile: the server's kernel choices for this model and these options."""

    model_dir: Path
    tensor_parallel_size: int
    shapes: KernelShapes
    options: LingOptions
    token_counts: tuple[int, ...]
    row_counts: tuple[int, ...]
    humming_cache: str | None
    dense_shapes: tuple[tuple[int, int], ...] = ()  # block-FP8 dense linears per rank (N, K)

    @property
    def moe_selection(self) -> MoeSelection:
        """The server's MoE selection for these shapes on a GPU (humming's availability is what
        building the kernels proves, so it is assumed here)."""
        return select_moe(self.options, Platform.CUDA, MoeShape(self.shapes.hidden_size, self.shapes.intermediate_size),
                          "the routed experts", humming_status=_checked_by_building)

    @property
    def moe(self) -> bool:
        return self.moe_selection.choice is MoePath.HUMMING

    @property
    def head(self) -> bool:
        return self.options.fp8_head

    def dense_selections(self) -> list[tuple[tuple[int, int], Selection]]:
        """The server's selection for each block-FP8 dense shape (CUDA; the W8A16 kernel's
        availability is what building it proves)."""
        from vllm_ling.ops.dense_fp8.selection import DenseShape, select_dense_fp8
        from vllm_ling.ops.fp8 import QUANT_BLOCK

        return [((n, k), select_dense_fp8(self.options, Platform.CUDA, DenseShape((n,), k), [QUANT_BLOCK, QUANT_BLOCK],
                                          f"dense {n} x {k}", unavailable_reason=lambda: None))
                for n, k in self.dense_shapes]

    @property
    def dense_w8a16_shapes(self) -> list[tuple[int, int]]:
        from vllm_ling.ops.dense_fp8.selection import DenseFp8Kernel

        return [shape for shape, sel in self.dense_selections() if sel.choice is DenseFp8Kernel.W8A16]

    @property
    def dense(self) -> bool:
        return bool(self.dense_w8a16_shapes)

    def router_selection(self) -> Selection:
        """The server's selection for Ling's gates (fp32, unquantized, bias-free, fp32 logits; the
        kernel's availability is what building it proves)."""
        import torch

        from vllm_ling.ops.small_gemv.selection import GateFacts, select_router_gemv

        facts = GateFacts("the MoE router gates", self.shapes.num_experts, self.shapes.hidden_size, torch.float32,
                          has_bias=False, unquantized=True, out_dtype=torch.float32)
        return select_router_gemv(self.options, Platform.CUDA, facts, unavailable_reason=lambda: None)

    @property
    def router(self) -> bool:
        from vllm_ling.ops.small_gemv.selection import GemvPath

        return self.router_selection().choice is GemvPath.LING

    def router_topk_selection(self) -> Selection:
        """The server's selection for Ling's routers (sigmoid scores with an expert bias, vLLM's
        GroupedTopKRouter; the kernel's availability is what building it proves)."""
        from vllm_ling.ops.router_topk.selection import RouterFacts, select_router_topk

        s = self.shapes
        facts = RouterFacts("the MoE routers", "GroupedTopKRouter", ling_model=True, scoring_func="sigmoid",
                            has_bias=True, num_experts=s.num_experts, n_group=s.n_group, topk_group=s.topk_group,
                            top_k=s.top_k)
        return select_router_topk(self.options, Platform.CUDA, facts, unavailable_reason=lambda: None)

    @property
    def router_topk(self) -> bool:
        from vllm_ling.options import RouterTopk

        return self.router_topk_selection().choice is RouterTopk.LING

    @property
    def residual_norm(self) -> bool:
        """The server puts vllm-ling's residual norm first on CUDA (the config hook's decision for a default
        priority) and the kernel takes the model's rows."""
        import torch

        from vllm_ling.ops.residual_norm.kernel import shape_problems

        return (self.options.residual_norm is ResidualNorm.LING
                and not shape_problems(self.shapes.hidden_size, torch.bfloat16, torch.bfloat16))

    def bf16_selection(self) -> Selection:
        from vllm_ling.ops.small_gemv.selection import select_bf16_gemv

        return select_bf16_gemv(self.options, Platform.CUDA, "the BF16 linears", unavailable_reason=lambda: None)

    @property
    def bf16_linears(self) -> bool:
        """The server selects vllm-ling's small GEMV for the unquantized BF16 linears (CUDA) and it holds
        their weights (a weight it cannot hold keeps vLLM's GEMM: layers.small_bf16_cuda.kernel_problems)."""
        from vllm_ling.ops.small_gemv.selection import GemvPath

        return self.bf16_selection().choice is GemvPath.LING and not self.bf16_problems

    @property
    def bf16_problems(self) -> list[str]:
        import torch

        from vllm_ling.ops.small_gemv import shape_problems

        return shape_problems(self.shapes.bf16_linear_rows, self.shapes.hidden_size, torch.bfloat16)

    def describe(self) -> str:
        s = self.shapes
        sel = self.moe_selection
        decode = f"decode {sel.decode}" + (f" (<= {sel.decode_max_tokens} tokens)" if sel.decode_max_tokens else "")
        moe = (f"MoE {'W4A8' if sel.w4a8 else 'W4A16'}, {decode}" if self.moe
               else f"MoE skipped ({sel.reason}: vLLM's backend serves)")
        head = "FP8 LM head" if self.head else f"LM head skipped ({opt_out_setting('VLLM_LING_FP8_HEAD')}: BF16 head)"
        dense = (f"dense FP8 W8A16 on {len(self.dense_w8a16_shapes)} weight shapes" if self.dense else
                 "dense FP8 skipped (" + (f"{self.dense_selections()[0][1].reason}: vLLM's kernel serves"
                                          if self.dense_shapes else "no block-FP8 dense linears") + ")")
        router = (f"router GEMV {s.num_experts} x {s.hidden_size}" if self.router else
                  f"router GEMV skipped ({self.router_selection().reason}: vLLM's GateLinear serves)")
        topk = (f"router top-k {s.num_experts} experts, {s.n_group} groups keep {s.topk_group}" if self.router_topk
                else f"router top-k skipped ({self.router_topk_selection().reason}: vLLM's grouped_topk serves)")
        bf16_sel = self.bf16_selection()
        bf16 = (f"BF16 linears small GEMV {s.bf16_linear_rows} x {s.hidden_size}" if self.bf16_linears else
                "BF16 linears skipped (" + (f"{bf16_sel.reason}: vLLM's GEMM serves" if self.bf16_problems == []
                                            else "; ".join(self.bf16_problems)) + ")")
        norm = (f"residual norm {s.hidden_size}" if self.residual_norm else
                f"residual norm skipped ({opt_out_setting('VLLM_LING_RESIDUAL_NORM')}: vLLM's norm serves)"
                if self.options.residual_norm is not ResidualNorm.LING else
                f"residual norm skipped (hidden size {s.hidden_size}: vLLM's norm serves)")
        return (f"{self.model_dir} (tensor parallel {self.tensor_parallel_size}): hidden "
                f"{s.hidden_size}, expert intermediate {s.intermediate_size}, {s.num_experts} "
                f"experts, top-{s.top_k}, SwiGLU limits {list(s.swiglu_limits)}; {moe}; {head} "
                f"{s.vocab_rows} x {s.hidden_size}; {dense}; {router}; {topk}; {bf16}; {norm}")


def _checked_by_building(w4a8: bool) -> tuple[bool, str]:
    return True, "checked when warm-up builds the kernels"


def plan_warmup(args: argparse.Namespace, env: Mapping[str, str]) -> WarmupPlan:
    """Resolve the model, shapes and options (flag > environment > default); no side effects."""
    values = dict(env)
    for opt in warmup_options():
        flag_value = getattr(args, opt.short)
        if flag_value is not None:
            values[opt.name] = flag_value
    model, source = resolve_model(args.model, env)
    model_dir = check_model_dir(model, source)
    if model_dir is None:
        raise LaunchError(f"warmup needs a local checkpoint directory; {model!r} (from "
                          f"{source}) is not one")
    try:
        options = LingOptions.from_env(values)
    except LingOptionError as exc:
        raise LaunchError(str(exc)) from None
    tp = read_option(values, "VLLM_LING_TENSOR_PARALLEL_SIZE")
    config = read_model_config(model_dir)
    try:
        dense_shapes = tuple(distinct_decode_shapes(config, tensor_parallel_size=tp,
                                                    kda_merged_in_proj=options.kda_merged_in_proj))
    except (KeyError, ValueError):  # not the -fp4 layout (e.g. a BF16 checkpoint): nothing block-FP8
        dense_shapes = ()
    plan = WarmupPlan(
        model_dir=model_dir, tensor_parallel_size=tp, dense_shapes=dense_shapes,
        shapes=kernel_shapes(config, tp, model_dir / "config.json"),
        options=options,
        token_counts=read_option(values, "VLLM_LING_WARMUP_TOKEN_COUNTS"),
        row_counts=read_option(values, "VLLM_LING_WARMUP_ROW_COUNTS"),
        humming_cache=read_option(values, "VLLM_LING_HUMMING_CACHE"))
    try:
        plan.moe_selection  # an explicit MoE request the shapes cannot serve: a usage error, as on the server
    except HummingUnavailable as exc:
        raise LaunchError(str(exc)) from None
    return plan


def _load_warmup_functions():
    """The kernel groups' warmup entry points, imported lazily (they import humming)."""
    try:
        from vllm_ling.ops import lm_head, moe
        from vllm_ling.ops.dense_fp8 import warmup as dense_fp8
        from vllm_ling.ops.residual_norm import warmup as residual_norm
        from vllm_ling.ops.router_topk import warmup as router_topk
        from vllm_ling.ops.small_gemv import warmup as small_gemv
        return [("moe", moe.warmup_kernels), ("lm_head", lm_head.warmup_kernels),
                ("dense_fp8", dense_fp8.warmup_kernels), ("router", small_gemv.warmup_router),
                ("router_topk", router_topk.warmup_kernels), ("bf16_linears", small_gemv.warmup_bf16_linears),
                ("residual_norm", residual_norm.warmup_kernels)]
    except (ImportError, AttributeError) as exc:
        raise LaunchError(
            "this vllm-ling has no kernel warmup (vllm_ling.ops.moe.warmup_kernels / "
            f"vllm_ling.ops.lm_head.warmup_kernels): {exc}") from exc


def _describe(result) -> str:
    if result is None:
        return ""
    if isinstance(result, (list, tuple, set)):
        return f"{len(result)} configurations"
    if isinstance(result, dict):
        keys = ("kernel", "reason", "w4a8", "build_seconds", "compile_seconds")
        return ", ".join(f"{k}={result[k]}" for k in keys if result.get(k) is not None)
    return str(result)


def warmup_main(argv: list[str]) -> int:
    args = build_warmup_parser().parse_args(list(argv))
    try:
        plan = plan_warmup(args, os.environ)
        device = resolve_device(args.device or read_option(os.environ, "VLLM_LING_DEVICE") or "auto")
    except LaunchError as exc:
        print(f"vllm-ling warmup: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"vllm-ling warmup: {plan.describe()}")
    print(f"vllm-ling warmup: MoE token counts {list(plan.token_counts)}; LM-head row counts "
          f"{list(plan.row_counts)}")
    if plan.humming_cache:
        os.environ["VLLM_LING_HUMMING_CACHE"] = plan.humming_cache

    if device != "cuda":
        reason = ("no CUDA device: humming compiles its kernels with NVRTC for the GPU it runs "
                  "on, and the CPU build uses the plain-PyTorch reference, so there is nothing "
                  "to compile")
        if args.allow_cpu:
            print(f"vllm-ling warmup: {reason}.")
            return 0
        print(f"vllm-ling warmup: error: {reason}; run it on the GPU machine (or pass "
              "--allow-cpu to accept a no-op).", file=sys.stderr)
        return EXIT_USAGE

    try:
        wanted = {"moe": plan.moe, "lm_head": plan.head, "dense_fp8": plan.dense, "router": plan.router,
                  "router_topk": plan.router_topk, "bf16_linears": plan.bf16_linears,
                  "residual_norm": plan.residual_norm}
        groups = [(name, warm) for name, warm in _load_warmup_functions() if wanted[name]]
    except LaunchError as exc:
        print(f"vllm-ling warmup: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    from vllm_ling.ops.humming_cache import compile_lock, configure_humming_cache, count_cached_kernels

    kernels_dir = configure_humming_cache()
    print(f"vllm-ling warmup: humming cache {kernels_dir} ({count_cached_kernels(kernels_dir)} "
          "kernels before)")
    shapes = plan.shapes
    rows = []
    with compile_lock():
        for name, warm in groups:
            before = count_cached_kernels(kernels_dir)
            start = time.perf_counter()
            try:
                result = _run_group(name, warm, plan, shapes)
            except RuntimeError as exc:
                print(f"vllm-ling warmup: error: kernel group {name}: {exc}", file=sys.stderr)
                return EXIT_KERNEL_FAILED
            seconds = time.perf_counter() - start
            rows.append((name, seconds, count_cached_kernels(kernels_dir) - before, _describe(result)))
    print(f"{'kernel group':<14}{'seconds':>10}{'new kernels':>14}  detail")
    for name, seconds, new, detail in rows:
        print(f"{name:<14}{seconds:>10.1f}{new:>14d}  {detail}")
    print(f"vllm-ling warmup: done; {count_cached_kernels(kernels_dir)} kernels in {kernels_dir}")
    return 0


def _run_group(name: str, warm, plan, shapes):
    """One kernel group's warm-up call with the arguments that group takes."""
    if name == "moe":
        return warm(shapes.hidden_size, shapes.intermediate_size, shapes.num_experts, shapes.top_k,
                    token_counts=list(plan.token_counts), swiglu_limits=shapes.swiglu_limits,
                    **plan.moe_selection.kernel_kwargs())
    if name == "dense_fp8":
        return warm(plan.dense_w8a16_shapes)
    if name == "router":
        return warm(shapes.hidden_size, shapes.num_experts)
    if name == "router_topk":  # Ling's routers renormalise (vLLM's BailingMoeV3MoE); the scale is an argument
        return warm(shapes.num_experts, shapes.n_group, shapes.topk_group, shapes.top_k)
    if name == "bf16_linears":
        return warm(shapes.bf16_linear_rows, shapes.hidden_size)
    if name == "residual_norm":
        return warm(shapes.hidden_size)
    return warm(shapes.vocab_rows, shapes.hidden_size, row_counts=list(plan.row_counts))
