"""P8: vLLM's workers record the startup facts after warm-up only through the patch."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging

import pytest
import torch

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")


@pytest.fixture
def upstream_workers(monkeypatch):
    """vLLM's worker classes with their own compile_or_warm_up_model (restored after the test)."""
    from vllm_ling.patches import p8_startup_facts as p8

    classes = p8.worker_classes()
    for cls in classes:
        original = cls.__dict__[p8.METHOD]
        monkeypatch.setattr(cls, p8.METHOD, getattr(original, "__wrapped__", original))
    return classes


def test_workers_warm_up_is_our_wrapper_around_vllms(upstream_workers):
    from vllm_ling.patches import p8_startup_facts as p8
    from vllm_ling.patches.registry import apply_all, by_id, source_sha256

    assert not p8.is_applied()
    assert apply_all("register", ids=("P8",)) == ["P8 worker-post-warmup-hook"]
    assert p8.is_applied()
    wrapped = {f"{cls.__module__}:{cls.__qualname__}.{p8.METHOD}": cls.__dict__[p8.METHOD]
               for cls in upstream_workers}
    assert set(wrapped) == set(by_id("P8").upstream_sha256)  # both on the CPU platform
    for symbol, wrapper in wrapped.items():
        source = inspect.getsource(wrapper.__wrapped__)
        assert hashlib.sha256(source.encode()).hexdigest() == source_sha256(symbol), symbol
    apply_all("register", ids=("P8",))
    assert not any(getattr(cls.compile_or_warm_up_model.__wrapped__, p8._MARK, False)
                   for cls in upstream_workers)  # wrapped once


def test_a_cuda_process_never_imports_the_cpu_worker(monkeypatch):
    """Importing vllm.v1.worker.cpu_worker swaps torch.cuda.Event / Stream for CPU stand-ins."""
    from vllm.platforms import current_platform

    from vllm_ling.patches import p8_startup_facts as p8

    imported = []
    real_import = p8.importlib.import_module
    monkeypatch.setattr(p8.importlib, "import_module", lambda name: imported.append(name) or real_import(name))
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert [c.__qualname__ for c in p8.worker_classes()] == ["Worker"]
    assert imported == ["vllm.v1.worker.gpu_worker"]


class Runner:
    """Stands for a model runner after initialize_kv_cache: per-layer views of shared raw tensors."""

    def __init__(self):
        raw_a = torch.zeros(4096, dtype=torch.int8)
        raw_b = torch.zeros(1000, dtype=torch.int8)
        # two layers share raw_a (hybrid groups), one uses raw_b; views of other dtypes/shapes
        self.kv_caches = [raw_a.view(torch.bfloat16).view(2, 1024), raw_a[:2048].view(torch.float32),
                          raw_b.view(10, 100)]


def test_startup_facts_are_merged_into_the_report_only_with_p8(monkeypatch, tmp_path):
    from vllm_ling.patches import p8_startup_facts as p8
    from vllm_ling.runtime.report import write_report

    path = tmp_path / "report.json"
    write_report({"passed": True, "memory": {"weights_bytes": 7}}, str(path))
    monkeypatch.setenv("VLLM_LING_REPORT_PATH", str(path))

    class Worker:
        def __init__(self):
            self.model_runner = Runner()

        def compile_or_warm_up_model(self):
            return "vLLM's compilation times"

    assert Worker().compile_or_warm_up_model() == "vLLM's compilation times"
    assert "startup" not in json.loads(path.read_text())  # vLLM alone records nothing

    p8._wrap(Worker)
    assert Worker().compile_or_warm_up_model() == "vLLM's compilation times"
    report = json.loads(path.read_text())
    assert report["memory"] == {"weights_bytes": 7, "kv_cache_bytes": 4096 + 1000}  # each raw tensor once
    assert report["startup"]["humming_jit_applicable"] is False  # the CPU platform
    assert report["startup"]["humming_jit_compiled_kernels"] == 0 and "CPU" in report["startup"]["humming_jit_detail"]


def test_a_failure_to_record_is_one_warning_not_a_failed_start(caplog):
    from vllm_ling.patches import p8_startup_facts as p8

    class Worker:  # no model_runner: recording fails
        def compile_or_warm_up_model(self):
            return 1

    p8._wrap(Worker)
    with caplog.at_level(logging.WARNING):
        assert Worker().compile_or_warm_up_model() == 1
    assert [r for r in caplog.records if "could not record the startup facts" in r.getMessage()]


def test_p8_refuses_changed_upstream_workers(upstream_workers, monkeypatch):
    from vllm_ling.patches import p8_startup_facts as p8

    assert_refuses_changed_source(monkeypatch, "P8", lambda: not any(p8.is_wrapped(c) for c in upstream_workers))
