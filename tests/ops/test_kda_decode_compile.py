"""The one-launch KDA decode kernel (vllm_ling.ops.kda_decode_kernel) compiles with Triton's own
compiler and ptxas down to a cubin, on a machine without a GPU, for the DGX Spark (sm_121, the main
target, where nothing runs it before a user does): every launch configuration
:func:`~vllm_ling.ops.kda_decode.launch_config` picks at Ling's shape, plain decode and verify windows,
launched as a programmatic dependent (as everywhere from sm_90). The H100's compile of every served and
benchmarked configuration runs in the GPU tests (tests/ops/test_kda_decode.py, the lease's cuts phase);
all of them compiled here for both targets once (765 s: too long for the suite). The interpreted tests
check what it computes; an error only the compiler raises (a construct the interpreter runs as Python)
fails here."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from benchmarks.kda_decode import HEAD_DIM, NUM_SPEC, WIDTH  # noqa: E402
from vllm_ling.ops.kda_decode import _next_pow2, launch_config  # noqa: E402

SPARK = 121
# the launcher's argument types as the served layer passes them (benchmarks/kda_decode.py's layer_calls)
POINTERS = {"x": "*bf16", "f": "*bf16", "b": "*bf16", "conv_w": "*fp32", "conv_state": "*bf16", "A_log": "*fp32",
            "dt_bias": "*fp32", "state": "*fp32", "slots": "*i32", "cu_seqlens": "*i32", "accepted": "*i32",
            "o": "*bf16", "readers": "*i32"}
FLOATS = {"scale", "lower_bound", "eps"}


def _served_configs() -> set[tuple[int, int, int, bool, bool]]:
    """(block_v, warps, split, prefetch, spec): what serves at every batch."""
    return {(*launch_config(seqs, spec, HEAD_DIM), spec) for seqs in range(1, 257) for spec in (False, True)}


def _compile(block_v: int, warps: int, split: int, prefetch: bool, spec: bool, pdl: bool, capability: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_ling.ops.kda_decode_kernel import kda_decode_kernel

    max_t = _next_pow2(NUM_SPEC + 1) if spec else 1
    constexprs = dict(D=HEAD_DIM, W=WIDTH, MAX_T=max_t, WIN=_next_pow2(WIDTH - 1 + max_t),
                      LP=_next_pow2(WIDTH - 2 + max_t), BV=block_v, SPLIT=split, SPEC=spec, SAFE_GATE=True,
                      HAS_BIAS=True, THRESHOLD=20.0, USE_PDL=pdl, PREFETCH=prefetch)
    signature = {name: POINTERS.get(name, "fp32" if name in FLOATS else "i32")
                 for name in kda_decode_kernel.arg_names if name not in constexprs}
    signature.update({name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(kda_decode_kernel, signature, constexprs),
                          target=GPUTarget("cuda", capability, 32), options={"num_warps": warps})


def test_every_served_configuration_compiles_for_the_spark():
    failed = {}
    for config in sorted(_served_configs()):
        try:
            compiled = _compile(*config, pdl=True, capability=SPARK)
            if not compiled.asm.get("cubin"):
                failed[config] = "no cubin"
        except Exception as exc:  # noqa: BLE001 - the compiler's message is the failure
            failed[config] = f"{type(exc).__name__}: {str(exc)[:400]}"
    assert not failed, f"KDA decode kernel does not compile for sm_{SPARK}: {failed}"


def test_the_compile_check_catches_a_configuration_the_kernel_cannot_take():
    """A block of value channels that does not tile a program's share (3 programs of a 128-channel head)
    must fail to compile, or the test above proves nothing."""
    with pytest.raises(Exception):  # noqa: B017 - whichever error Triton raises for it
        _compile(48, 4, 1, True, False, pdl=True, capability=SPARK)
