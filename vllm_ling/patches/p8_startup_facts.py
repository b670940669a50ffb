"""Patch P8: each worker records its startup facts after vLLM's warm-up, before ready.

What: wraps ``compile_or_warm_up_model`` of vLLM 0.32's workers (``gpu_worker.Worker``, which
both GPU model runners use, and ``cpu_worker.CPUWorker``): once it returns, the KV cache is
allocated and warm-up / CUDA-graph capture have compiled what they compile, and the worker
records its KV-cache bytes and humming JIT compiles and cache hits
(``vllm_ling.runtime.startup_facts.record_after_warmup``) into the verification report.
Why: those numbers exist only in the worker; vLLM sends the front end block counts, not bytes,
and calls no plugin in the worker after warm-up. The engine core sends READY only after every
worker returned, so the front end's stat logger finds the facts when the engine is ready.
A failure to record is one WARNING; it never stops the server.
Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

import functools
import importlib

GPU_WORKER = ("vllm.v1.worker.gpu_worker", "Worker")
# Imported on the CPU platform only: importing it replaces torch.cuda.Event / Stream and other
# torch functions with CPU stand-ins (vllm.v1.worker.cpu.shm), which would break a CUDA process.
CPU_WORKER = ("vllm.v1.worker.cpu_worker", "CPUWorker")
METHOD = "compile_or_warm_up_model"
_MARK = "_vllm_ling_startup_facts_wrapped"


def worker_classes() -> list[type]:
    """This platform's worker classes that this vLLM build can import."""
    from vllm.platforms import current_platform

    classes = []
    for module_name, cls_name in (GPU_WORKER, CPU_WORKER) if current_platform.is_cpu() else (GPU_WORKER,):
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - a worker this platform's build cannot import
            continue
        if (cls := getattr(module, cls_name, None)) is not None:
            classes.append(cls)
    return classes


def is_wrapped(cls: type) -> bool:
    return getattr(cls.__dict__.get(METHOD), _MARK, False)


def is_applied() -> bool:
    return all(is_wrapped(cls) for cls in worker_classes())


def _wrap(cls: type) -> None:
    original = cls.__dict__[METHOD]

    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            from vllm_ling.runtime.startup_facts import record_after_warmup

            record_after_warmup(self)
        except Exception as exc:  # noqa: BLE001 - facts are not worth a failed start
            from vllm_ling.log import get_logger

            get_logger("startup").warning("vllm-ling could not record the startup facts "
                                      "(KV-cache bytes, humming JIT counts): %s: %s; they are missing from "
                                      "the report and metrics.", type(exc).__name__, exc)
        return result

    setattr(compile_or_warm_up_model, _MARK, True)
    setattr(cls, METHOD, compile_or_warm_up_model)


def apply() -> None:
    for cls in worker_classes():
        if not is_wrapped(cls):
            _wrap(cls)
