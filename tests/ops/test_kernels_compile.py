"""Every CUDA kernel vllm-ling compiles at run time compiles for every GPU it targets, checked on a
machine without one.

The server hands its CUDA C++ to NVRTC (through humming's JIT) when a kernel is first needed, on
the GPU that runs it; the kernels are developed and run on an H200 (sm_90), and the DGX Spark
(sm_121) is the main target. Here the exact source text the launchers generate for Ling-3.0-flash
(full config, tensor parallel 1 and 2) is compiled with NVRTC down to a cubin (ptxas included),
with the options humming-kernels 0.1.17's NVRTC compiler passes, for:

- sm_121a (DGX Spark, GB10): every kernel family and launch variant the server picks there,
  the dense Triton kernel included;
- sm_100a (B200) and sm_80 (A100): the kernels that claim those architectures;
- sm_90a (H100 / H200), where the kernels also run in the GPU tests: one source per family.

A kernel that uses an instruction or feature a target lacks fails to compile. The test that
compiles the MoE decode kernels for sm_80 shows the check catches that: they use thread-block
clusters, which need sm_90+, and the MoE layer refuses them below sm_90 before compiling.

The dense decode kernel takes about 1.5 s per compile, so on sm_121a each launch variant the
server picks (persistent or one wave, split K or not) is compiled for one and for four
groups of eight activation rows (1 and 25-32 rows), with its smallest K (compile time grows with
the unrolled steps; the instructions do not); elsewhere one variant (the instructions do not
depend on the defines). The other kernels compile in full.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest
import torch

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")

from vllm_ling.models.dense_linears import distinct_decode_shapes  # noqa: E402
from vllm_ling.ops.dense_fp8 import decode_kernel as dense_decode  # noqa: E402
from vllm_ling.ops.dense_fp8.linear import launch_config  # noqa: E402
from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, clamp_define  # noqa: E402
from vllm_ling.ops.moe.decode.shapes import PackedDecodeConfig, default_humming_decode_configs  # noqa: E402
from vllm_ling.ops.moe.decode.sources import packed_layout_source  # noqa: E402
from vllm_ling.ops.small_gemv.router import MAX_ROWS as ROUTER_MAX_ROWS  # noqa: E402
from vllm_ling.ops.small_gemv import BF16_MAX_ROWS  # noqa: E402
from vllm_ling.ops.small_gemv import kernel as small_gemv  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block_optin: int  # bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    dense: bool = True         # compile every dense decode variant (else one)
    triton: bool = True        # compile the dense Triton kernel's variants (sm_89+)

    @property
    def moe_decode(self) -> bool:  # thread-block clusters: the MoE layer uses the decode kernels from sm_90
        return self.capability >= (9, 0)

    @property
    def arch(self) -> str:  # humming appends "a" from sm_90 on (arch-specific features allowed)
        major, minor = self.capability
        return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


# The H200's kernels run in the GPU tests (tests/ops, gpu marker): here it is the control that a
# source the device compiles compiles here too.
TARGETS = [
    Target("H200", (9, 0), 132, 232448, dense=False, triton=False),
    Target("DGX Spark", (12, 1), 48, 101376),
    Target("B200", (10, 0), 148, 232448, dense=False),
    Target("A100", (8, 0), 108, 166912, dense=False, triton=False),
]
# humming.jit.compiler.NVRTCCompiler.get_flags with disable_fast_math (vllm_ling.ops.cuda_jit's
# kernels), without include directories: the kernels include nothing
NVRTC_OPTIONS = ["-std=c++17", "--dopt=on", "-extra-device-vectorization", "--ptxas-options=-O3",
                 "--ptxas-options=--register-usage-level=10", "--diag-suppress=39,161,174,177,940,1444",
                 "-default-device"]
CONFIG = json.loads(resources.files("vllm_ling").joinpath("data/ling3_flash_fp4_config.json").read_text())
TENSOR_PARALLEL = (1, 2)


def compile_error(source: str, arch: str) -> str | None:
    """NVRTC's log when ``source`` does not compile to a cubin for ``arch`` (None when it does)."""
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        options = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in NVRTC_OPTIONS]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            return None if err == nvrtc.nvrtcResult.NVRTC_SUCCESS and size > 0 else f"no cubin ({err})"
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        return log.decode(errors="replace").strip() or str(err)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_usable() -> str | None:
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - the library is missing: the reason
        return f"{type(exc).__name__}: {exc}"
    return None if err == nvrtc.nvrtcResult.NVRTC_SUCCESS and (major, minor) >= (12, 9) else \
        f"NVRTC {major}.{minor} cannot target sm_121 (needs 12.9+)"


_NVRTC_PROBLEM = _nvrtc_usable()
pytestmark = pytest.mark.skipif(_NVRTC_PROBLEM is not None, reason=f"NVRTC unusable: {_NVRTC_PROBLEM}")


def dense_decode_sources(target: Target) -> dict[str, str]:
    """Per launch variant the server picks on ``target`` (any Ling shape, 1 and 25-32 rows), the
    source with the fewest unrolled K steps."""
    best: dict[tuple, tuple[int, str]] = {}
    for tp in TENSOR_PARALLEL:
        for n, k in distinct_decode_shapes(CONFIG, include_mtp=True, tensor_parallel_size=tp):
            for rows in range(1, dense_decode.MAX_ROWS + 1):
                config = launch_config(n, k, rows, target.capability, target.sm_count)
                if not isinstance(config, dense_decode.DecodeConfig):
                    continue  # the Triton kernel: compiled by Triton on the GPU
                groups = dense_decode.row_groups(rows)
                if groups not in (1, dense_decode.row_groups(dense_decode.MAX_ROWS)):
                    continue
                variant = ("stream" if config.stream else "wave", config.ksplit > 1, groups)
                steps = config.steps(k)
                if variant not in best or steps < best[variant][0]:
                    best[variant] = (steps, dense_decode.source(config, k, rows))
    return {f"{v[0]} ksplit>1={v[1]} row_groups={v[2]}": src for v, (_, src) in sorted(best.items())}


def small_gemv_sources() -> dict[str, str]:
    """The router gate's (fp32 weight and logits) and the BF16 linears' kernels, each launch shape the
    server picks for them (CTA width, tokens per pass)."""
    out = {}
    for use, n, weight_dtype, out_dtype, max_rows in (
            ("router", CONFIG["num_experts"], torch.float32, torch.float32, ROUTER_MAX_ROWS),
            ("bf16 linear", CONFIG["num_attention_heads"], torch.bfloat16, torch.bfloat16, BF16_MAX_ROWS)):
        for warps, tokens_per_pass in sorted({small_gemv.default_launch(r, n) for r in range(1, max_rows + 1)}):
            out[f"{use} warps={warps} tokens/pass={tokens_per_pass}"] = small_gemv.source(
                CONFIG["hidden_size"], weight_dtype, out_dtype, warps, tokens_per_pass)
    return out


def moe_decode_sources(target: Target) -> dict[str, str]:
    """Both decode layouts' kernels at each tensor-parallel size, for the routed experts' clamp."""
    hidden, top_k = CONFIG["hidden_size"], CONFIG["num_experts_per_tok"]
    clamp = clamp_define(ROUTED_EXPERT_CLAMP)
    out = {}
    for tp in TENSOR_PARALLEL:
        inter = CONFIG["moe_intermediate_size"] // tp
        for key, config in default_humming_decode_configs(hidden, inter).items():
            assert not config.problems(hidden, inter, top_k, target.smem_per_block_optin), (target.name, key)
            for shape in (config.gate_up, config.down):
                out[f"tp{tp} {shape.kernel_name}"] = shape.source(hidden, inter, top_k, clamp)
        out[f"tp{tp} packed layout"] = packed_layout_source(hidden, inter, top_k, PackedDecodeConfig(), clamp)
    return out


def router_topk_sources() -> dict[str, str]:
    """Ling's router (its experts, groups, kept groups and picks), and one narrower configuration, in each
    kernel variant."""
    from vllm_ling.ops.router_topk import kernel as router_topk

    ling = (CONFIG["num_experts"], CONFIG["n_group"], CONFIG["topk_group"], CONFIG["num_experts_per_tok"])
    return {f"{variant} experts/groups/kept/picks={cfg}": router_topk.source(*cfg, renormalize=True, variant=variant)
            for cfg in (ling, (64, 2, 1, 4)) for variant in router_topk.VARIANTS}


def residual_norm_sources() -> dict[str, str]:
    """Ling's hidden size, and widths of one, two and four 16-byte chunks per thread."""
    from vllm_ling.ops.residual_norm import kernel as residual_norm

    return {f"hidden={h} addends={n}": residual_norm.source(h, n) for h in (CONFIG["hidden_size"], 256, 12288, 32768)
            for n in (1, 2)}


def family_sources(target: Target, family: str) -> dict[str, str]:
    if family == "dense decode":
        dense = dense_decode_sources(target)
        # one variant where the instruction set is all that is checked: it is the same for every define
        return dense if target.dense else dict(list(dense.items())[:1])
    if family == "small GEMV":
        return small_gemv_sources()
    if family == "router top-k":
        return router_topk_sources()
    if family == "residual norm":
        return residual_norm_sources()
    return moe_decode_sources(target)


CASES = [(t, f) for t in TARGETS for f in ("dense decode", "small GEMV", "router top-k", "residual norm", "MoE decode")
         if f != "MoE decode" or t.moe_decode]


@pytest.mark.parametrize("target,family", CASES, ids=[f"{t.arch}-{f.replace(' ', '_')}" for t, f in CASES])
def test_kernel_family_compiles(target, family):
    sources = family_sources(target, family)
    assert sources, f"no {family} kernel selected for {target.name}"
    failed = {name: err for name, src in sources.items() if (err := compile_error(src, target.arch))}
    assert not failed, f"{family} kernels do not compile for {target.name} ({target.arch}): " + "; ".join(
        f"{name}: {err[:600]}" for name, err in failed.items())


def test_a_feature_the_target_lacks_fails_to_compile():
    """The MoE decode kernels use thread-block clusters (sm_90+): for sm_80 NVRTC must refuse them,
    or the checks above prove nothing."""
    sources = moe_decode_sources(TARGETS[0])
    err = compile_error(sources["tp1 ling_moe_hs_gate_up"], "sm_80")
    assert err is not None and "sm_90" in err, err


# ---- the dense Triton W8A16 kernel (Triton's own compiler and ptxas, same Triton as the server) ----

def dense_triton_variants(target: Target) -> dict[str, tuple[dict, dict]]:
    """Per Triton launch variant (tensor cores or not, split K or not, L2 prefetch, PDL, FP16
    dot) the server can run on ``target``: where the table or row limit picks Triton, and the
    fallback where the decode kernel cannot run; each variant once, at its smallest K."""
    from vllm_ling.ops.dense_fp8.linear import triton_compile_args, triton_config

    best: dict[tuple, tuple[int, dict, dict]] = {}
    for tp in TENSOR_PARALLEL:
        for n, k in distinct_decode_shapes(CONFIG, include_mtp=True, tensor_parallel_size=tp):
            for rows in range(1, dense_decode.MAX_ROWS + 1):
                for config in (launch_config(n, k, rows, target.capability, target.sm_count),
                               triton_config(n, k, rows, target.capability, target.sm_count)):
                    if isinstance(config, dense_decode.DecodeConfig):
                        continue
                    variant = (config.use_dot, config.split_k > 1, config.prefetch_l2, config.pdl, config.dot_f16)
                    if variant not in best or k < best[variant][0]:
                        best[variant] = (k, *triton_compile_args(config, k))
    return {"dot={} split_k={} prefetch={} pdl={} f16={}".format(*v): (c, o) for v, (_, c, o) in sorted(best.items())}


def triton_compile_error(constexprs: dict, options: dict, target: Target) -> str | None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_ling.ops.dense_fp8 import kernel as dense_triton

    parts = "*fp32" if constexprs["SPLIT_K"] > 1 else "*bf16"  # unused split-K buffers are the output
    tickets = "*i32" if constexprs["SPLIT_K"] > 1 else "*bf16"
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "ws_ptr": parts,
                 "cnt_ptr": tickets, **{name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_wn", "stride_sn")},
                 **{name: "constexpr" for name in constexprs}}
    try:
        compiled = triton.compile(ASTSource(dense_triton._w8a16_block_fp8_kernel, signature, constexprs),
                                  target=GPUTarget("cuda", target.capability[0] * 10 + target.capability[1], 32),
                                  options=options)
    except Exception as exc:  # noqa: BLE001 - the compiler's message is the failure
        return f"{type(exc).__name__}: {exc}"
    return None if compiled.asm.get("cubin") else "no cubin"


TRITON_TARGETS = [t for t in TARGETS if t.triton]


@pytest.mark.parametrize("target", TRITON_TARGETS, ids=[t.arch for t in TRITON_TARGETS])
def test_dense_triton_kernel_compiles(target):
    pytest.importorskip("triton")
    variants = dense_triton_variants(target)
    assert variants, f"no Triton variant for {target.name}"
    failed = {name: err for name, (c, o) in variants.items() if (err := triton_compile_error(c, o, target))}
    assert not failed, f"dense Triton kernel does not compile for {target.name}: " + "; ".join(
        f"{name}: {err[:600]}" for name, err in failed.items())
