"""Patch P6: vllm-ling's startup verification runs right after a model runner loads models.

What: wraps ``load_model`` of vLLM 0.32's model runners (V1 ``GPUModelRunner``,
``CPUModelRunner``, V2 ``gpu.model_runner.GPUModelRunner``): once the target and the NEXTN
draft are loaded and vLLM has shared modules between them, the worker verifies them
(``vllm_ling.runtime.verification.verify_once``).
Why: vLLM has no post-load hook for plugins; the model's first forward comes too late on
the CPU runner (no profile forward: the first request would be the first forward), and a
strict refusal must happen before the server reports healthy.
Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

import functools
import importlib

from vllm_ling.log import get_logger
from vllm_ling.refusal import Refusal, record

logger = get_logger("verify")

RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)
_MARK = "_vllm_ling_verify_wrapped"


def runner_classes() -> list[type]:
    """The runner classes this vLLM build can import (a platform may lack one)."""
    classes = []
    for module_name, cls_name in RUNNERS:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a runner this platform's build cannot import
            continue
        if (cls := getattr(module, cls_name, None)) is not None:
            classes.append(cls)
    return classes


def is_wrapped(cls: type) -> bool:
    return getattr(cls.__dict__.get("load_model"), _MARK, False)


def is_applied() -> bool:
    return all(is_wrapped(cls) for cls in runner_classes())


def _wrap(cls: type) -> None:
    original = cls.__dict__["load_model"]

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from vllm_ling.models import loaded
        from vllm_ling.runtime.verification import verify_once

        target = loaded.get("target")
        if target is not None:
            try:
                verify_once(target, self.vllm_config, runner=f"{type(self).__module__}.{type(self).__name__}")
            except Refusal as exc:  # strict: vLLM logs it with its traceback (at DEBUG: refusal._LogFilter)
                record(str(exc))  # the launcher's (vllm-ling serve) / the API server's last line
                logger.error("%s", exc)
                raise
        return result

    setattr(load_model, _MARK, True)
    cls.load_model = load_model


def apply() -> None:
    for cls in runner_classes():
        if not is_wrapped(cls):
            _wrap(cls)
