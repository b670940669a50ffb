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

from benchmarks.kda_decode_ptx import compile_kernel, served_configurations  # noqa: E402

SPARK = 121


def _served_configs() -> set[tuple[int, int, int, bool, bool]]:
    """(block_v, warps, split, prefetch, spec): what serves at every batch, each on both steps."""
    return {(*config, spec) for config in served_configurations() for spec in (False, True)}


@pytest.mark.parametrize("norm", [True, False], ids=["with the output norm", "without (opted out)"])
def test_every_served_configuration_compiles_for_the_spark(norm):
    """Served with the layer's output norm inside (the default); opted out (no norm) the same program less its
    epilogue: one configuration of each step (the full set doubles the test's minutes)."""
    failed = {}
    configs = sorted(_served_configs())
    if not norm:
        configs = [next(c for c in configs if c[-1] is spec) for spec in (False, True)]
    for config in configs:
        try:
            compiled = compile_kernel(*config, pdl=True, capability=SPARK, norm=norm)
            if not compiled.asm.get("cubin"):
                failed[config] = "no cubin"
        except Exception as exc:  # noqa: BLE001 - the compiler's message is the failure
            failed[config] = f"{type(exc).__name__}: {str(exc)[:400]}"
    assert not failed, f"KDA decode kernel does not compile for sm_{SPARK}: {failed}"


def test_dspark_windows_compile_on_the_streamed_path_for_the_spark():
    """DSpark's 9-token verify windows take the streamed path (a loop of the window's length, which the
    interpreter runs as Python): every configuration its launch table rows hand out compiles to a cubin."""
    from benchmarks.kda_decode_ptx import DSPARK_WINDOW, HEAD_DIM
    from vllm_ling.ops.kda_decode import launch_config, streams

    assert streams(True, DSPARK_WINDOW)
    failed = {}
    for config in sorted({launch_config(n, True, HEAD_DIM, stream=True) for n in range(1, 257)}):
        try:
            compiled = compile_kernel(*config, True, pdl=True, capability=SPARK, window=DSPARK_WINDOW)
            if not compiled.asm.get("cubin"):
                failed[config] = "no cubin"
        except Exception as exc:  # noqa: BLE001 - the compiler's message is the failure
            failed[config] = f"{type(exc).__name__}: {str(exc)[:400]}"
    assert not failed, f"streamed KDA decode does not compile for sm_{SPARK}: {failed}"


def test_the_compile_check_catches_a_configuration_the_kernel_cannot_take():
    """A block of value channels that does not tile a program's share (3 programs of a 128-channel head)
    must fail to compile, or the test above proves nothing."""
    with pytest.raises(Exception):  # noqa: B017 - whichever error Triton raises for it
        compile_kernel(48, 4, 1, True, False, pdl=True, capability=SPARK)


def test_ptxas_reports_the_served_programs_registers_spills_and_barriers():
    """benchmarks/kda_decode_ptx.py's report (the table beside the GPU benchmark) reads ptxas's own lines
    (a register count within a thread's 255, spill bytes, the PTX's barriers)."""
    from benchmarks.kda_decode_ptx import ptx_report

    block_v, warps, split, prefetch, spec = min(_served_configs())
    report = ptx_report(compile_kernel(block_v, warps, split, prefetch, spec, pdl=True, capability=SPARK), "sm_121a")
    assert 32 <= report["registers"] <= 255 and report["spill_stores"] >= 0 and report["bar_sync"] >= 0, report
