"""Compile and launch this package's CUDA kernels (the MoE and dense FP8 decode kernels): NVRTC
through humming-kernels' JIT runtime (:class:`humming.jit.runtime.KernelRuntime` is subclassed:
humming's cache directory and file locks, no humming code copied), launched with the CUDA
driver's ``cuLaunchKernelEx`` (thread-block clusters, programmatic dependent launch, dynamic
shared memory)."""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources
from typing import Callable, ClassVar

import torch

@functools.lru_cache(maxsize=None)
def jit_unavailable_reason() -> str | None:
    """Why this module cannot compile or launch a kernel in this process (None when it can)."""
    try:
        import cuda.bindings.driver  # noqa: F401 - the launcher's driver bindings
        import humming.jit.runtime  # noqa: F401 - the NVRTC runtime and cache it compiles through
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"{type(exc).__name__}: {exc}"
    return None


def cuda_capability(device: torch.device | str | None) -> tuple[int, int] | str:
    """``device``'s compute capability, or why it is not a usable CUDA device (the string)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    return torch.cuda.get_device_capability(device)


def sm80_unavailable_reason(device: torch.device | str | None) -> str | None:
    """Why a kernel of this package that needs sm_80+ (BF16 conversions and MMAs) cannot compile or run on
    ``device`` (None when it can)."""
    capability = cuda_capability(device)
    if isinstance(capability, str):
        return capability
    if capability[0] < 8:
        return f"sm_{capability[0]}{capability[1]}: needs sm_80+"
    return jit_unavailable_reason()


@functools.cache
def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch takes effect on ``device`` (sm_90+: below it the kernels compile
    their griddepcontrol out and launch without the attribute)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def ptx_loads() -> str:
    """The global-load helpers every kernel of this package shares (``ptx_loads.cuh``): each
    kernel's source puts them after its ``#define`` lines."""
    return resources.files(__package__).joinpath("ptx_loads.cuh").read_bytes().decode()


_KERNEL_BASE: list[type] = []
_KERNEL_CLASSES: dict[str, type] = {}


def compiled_kernel(name: str, source: str, device: torch.device):
    """The ``extern "C"`` kernel ``name`` of ``source``, compiled (cached per source by humming's
    KernelRuntime)."""
    if not _KERNEL_BASE:
        from humming.jit.runtime import KernelRuntime

        @dataclasses.dataclass(kw_only=True)
        class _LingDecodeKernel(KernelRuntime):
            disable_fast_math: ClassVar[bool] = True
            source: str

            def init_kernel(self):
                self.code = self.source
                self.kernel_expr = None
                self.prepare()

        _KERNEL_BASE.append(_LingDecodeKernel)
    if name not in _KERNEL_CLASSES:
        _KERNEL_CLASSES[name] = dataclasses.make_dataclass(
            name, [], bases=(_KERNEL_BASE[0],), kw_only=True, namespace={"name": name})
    with torch.cuda.device(device):
        return _KERNEL_CLASSES[name](source=source)


def define_lines(values: dict[str, object]) -> str:
    """``#define NAME VALUE`` lines: a kernel's configuration ahead of its text."""
    return "".join(f"#define {name} {value}\n" for name, value in values.items())


def cached_kernel(cache: dict[tuple, object], name: str, key: tuple, device: torch.device,
                  source: Callable[..., str], *source_args):
    """The kernel ``name`` for ``key`` from ``cache``, compiled from ``source(*source_args)`` on first use
    (launches look the kernel up by the key alone: no source text is built on the hot path)."""
    kernel = cache.get(key)
    if kernel is None:
        kernel = cache[key] = compiled_kernel(name, source(*source_args), device)
    return kernel


_DYNAMIC_SMEM_SET: dict[int, int] = {}  # CUfunction handle -> dynamic shared memory allowed


def _allow_dynamic_smem(func, nbytes: int) -> None:
    import cuda.bindings.driver as cbd

    key = int(func)
    if _DYNAMIC_SMEM_SET.get(key, 48 * 1024) >= nbytes:
        return
    (err,) = cbd.cuFuncSetAttribute(
        func, cbd.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
    if err != cbd.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot allow {nbytes} bytes of dynamic shared memory: {err}")
    _DYNAMIC_SMEM_SET[key] = nbytes


def launch(kernel, grid: tuple[int, int], threads: int, args, arg_types, stream: int,
            cluster: int = 1, pdl: bool = False, smem: int = 0) -> None:
    import cuda.bindings.driver as cbd

    func = kernel.load_cubin()
    if smem:
        _allow_dynamic_smem(func, smem)
    cfg = cbd.CUlaunchConfig()
    cfg.sharedMemBytes = smem
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid[0], grid[1], 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
    cfg.hStream = stream
    attrs = []
    if cluster > 1:
        attr = cbd.CUlaunchAttribute()
        attr.id = cbd.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        attrs.append(attr)
    if pdl:
        attr = cbd.CUlaunchAttribute()
        attr.id = cbd.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    cfg.attrs, cfg.numAttrs = attrs, len(attrs)
    (err,) = cbd.cuLaunchKernelEx(cfg, func, (args, arg_types), 0)
    if err != cbd.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{kernel.name} launch failed: {err}")

