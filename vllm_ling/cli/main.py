"""The ``vllm-ling`` console script: one dispatcher, each subcommand in its own module.

Subcommands are imported lazily so ``vllm-ling plan`` or ``vllm-ling bench`` start
without importing vLLM or torch.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help). Each function takes argv (list[str]) and
# returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "make-tiny": ("vllm_ling.cli.make_tiny", "main",
                  "write a deterministic tiny random-weight Ling-3.0 checkpoint in the real -fp4 format"),
    "inspect": ("vllm_ling.cli.inspect", "main",
                "print a checkpoint's format summary and bytes read per decode token"),
    "serve": ("vllm_ling.cli.serve", "serve_main",
              "run `vllm serve` with vllm-ling's defaults (every default overridable)"),
    "warmup": ("vllm_ling.cli.warmup", "warmup_main",
               "compile the kernels the server will run (MoE, head, dense FP8, router, BF16 GEMV) into the JIT cache"),
    "plan": ("vllm_ling.cli.plan", "main",
             "predict bytes per decode token, floor TPOT and MTP speedup for a device"),
    "demo": ("vllm_ling.cli.demo", "main",
             "serve the tiny checkpoint on localhost, send requests, show what is verified"),
    "bench": ("vllm_ling.bench", "main",
              "benchmark/evaluate an OpenAI-compatible server (synthetic, gsm8k, replay, compare, ablation)"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: vllm-ling <command> [options]", "", "commands:"]
    lines += [f"  {n.ljust(width)}  {h}" for n, (_, _, h) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"vllm-ling: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
