"""What ptxas makes of the one-launch KDA decode kernel, per launch configuration, on a machine without a
GPU: registers per thread, spill bytes and block-wide barriers (``bar.sync``) in the PTX, for plain
decode and 4-token verify windows, compiled by Triton (its own compiler and bundled ptxas) for sm_90a
(H100 / H200) and sm_121a (DGX Spark).

    python -m benchmarks.kda_decode_ptx --out benchmarks/results/kda_decode_ptx.md

The kernel is latency-bound (a few microseconds a layer for 4 MB of state): its time goes to dependent
memory round trips and synchronisation, not bandwidth. Spills add local-memory round trips; each
``bar.sync`` is a block-wide wait (a layout conversion or a sum across warps through shared memory).
vLLM's recurrence kernel runs one warp per 32 x 128 state tile, so its sums stay inside the warp. These
counts explain the GPU benchmark's columns (``benchmarks/kda_decode.py``); they do not replace them.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.kda_decode import CONFIGS, DSPARK_WINDOW, HEAD_DIM, NUM_SPEC, WIDTH, config_name
from benchmarks.output import write_outputs
from vllm_ling.ops.kda_decode import _next_pow2, launch_config, streams

TARGETS = {"sm_90a": 90, "sm_121a": 121}
# the launcher's argument types as the served layer passes them (benchmarks/kda_decode.py's layer_calls)
POINTERS = {"x": "*bf16", "f": "*bf16", "b": "*bf16", "conv_w": "*fp32", "conv_state": "*bf16", "A_log": "*fp32",
            "dt_bias": "*fp32", "state": "*fp32", "slots": "*i32", "cu_seqlens": "*i32", "accepted": "*i32",
            "o": "*bf16", "readers": "*i32", "gate": "*bf16", "norm_w": "*bf16"}
FLOATS = {"scale", "lower_bound", "eps", "norm_eps"}


def compile_kernel(block_v: int, warps: int, split: int, prefetch: bool, spec: bool, pdl: bool, capability: int,
                   window: int = NUM_SPEC + 1, norm: bool = True):
    """Triton's compile of the kernel at Ling's shape for ``capability`` (90, 121, ...), down to a cubin;
    verify windows of ``window`` tokens take the path the launcher gives them (tile or streamed); ``norm``:
    with the layer's gated output norm (served by default; off: ``VLLM_LING_KDA_OUTPUT_NORM=0``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_ling.ops.kda_decode_kernel import kda_decode_kernel

    max_t = _next_pow2(window) if spec else 1
    stream = streams(spec, window)
    constexprs = dict(D=HEAD_DIM, W=WIDTH, MAX_T=max_t, LP=_next_pow2(WIDTH - 2 + max_t), BV=block_v, SPLIT=split,
                      SPEC=spec, SAFE_GATE=True, HAS_BIAS=True, THRESHOLD=20.0, USE_PDL=pdl,
                      PREFETCH=prefetch, STREAM=stream, NORM=norm)
    signature = {name: POINTERS.get(name, "fp32" if name in FLOATS else "i32")
                 for name in kda_decode_kernel.arg_names if name not in constexprs}
    signature.update({name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(kda_decode_kernel, signature, constexprs),
                          target=GPUTarget("cuda", capability, 32), options={"num_warps": warps})


def _ptxas() -> str:
    """Triton's bundled ptxas that takes the PTX version its compiler emits (the Blackwell build where
    there is one: it reads the newer PTX for every architecture)."""
    from triton import knobs

    for tool in (getattr(knobs.nvidia, "ptxas_blackwell", None), knobs.nvidia.ptxas):
        if tool is not None and tool.path and Path(tool.path).exists():
            return tool.path
    raise RuntimeError("Triton's bundled ptxas was not found")


def ptx_report(compiled, arch: str) -> dict[str, int]:
    """registers, spill stores and loads (bytes), and ``bar.sync`` count of a compiled kernel's PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([_ptxas(), "-v", f"-arch={arch}", str(ptx), "-o", str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True, check=True)
    text = run.stderr + run.stdout
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas said nothing about registers and spills: {text[-500:]}")
    return {"registers": int(registers.group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2)), "bar_sync": compiled.asm["ptx"].count("bar.sync")}


def served_configurations() -> set[tuple[int, int, int, bool]]:
    """What the launch table hands out at Ling's head size, plain decodes and verify windows, at any batch."""
    return {launch_config(seqs, spec, HEAD_DIM) for seqs in range(1, 257) for spec in (False, True)}


def configurations(served: set[tuple[int, int, int, bool]]) -> list[tuple[int, int, int, bool]]:
    """The served configurations, then the rest the GPU benchmark times, once each."""
    return sorted(served | set(CONFIGS), key=lambda c: (c not in served, c))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: " + ", ".join(TARGETS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    served = served_configurations()
    lines = ["# The KDA decode kernel through ptxas, per launch configuration", "",
             f"`python -m benchmarks.kda_decode_ptx` (no GPU): Ling's shape ({HEAD_DIM}-channel heads, conv width "
             f"{WIDTH}), programmatic dependent launch on, the gated output norm inside the launch (served by "
             f"default); plain decode, {NUM_SPEC + 1}-token verify windows (the "
             f"tile path) and {DSPARK_WINDOW}-token ones (DSpark's, the streamed path). "
             "Registers per thread, spilled bytes stored / loaded, block-wide barriers in the PTX. *served*: a "
             "configuration the launch table hands out.", "",
             "| target | configuration | served | plain: registers | plain: spills | plain: bar.sync "
             "| window: registers | window: spills | window: bar.sync "
             "| streamed: registers | streamed: spills | streamed: bar.sync |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arch in args.targets.split(","):
        for config in configurations(served):
            cells = []
            for spec, window in ((False, 1), (True, NUM_SPEC + 1), (True, DSPARK_WINDOW)):
                report = ptx_report(compile_kernel(*config, spec=spec, pdl=True, capability=TARGETS[arch],
                                                   window=window), arch)
                cells += [str(report["registers"]), f"{report['spill_stores']} / {report['spill_loads']}",
                          str(report["bar_sync"])]
            lines.append(f"| {arch} | {config_name(config)} | {'yes' if config in served else ''} | " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    write_outputs("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
