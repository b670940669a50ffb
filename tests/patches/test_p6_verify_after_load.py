"""P6: vLLM's model runners verify the loaded models only through the patch."""

from __future__ import annotations

import inspect

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")

VERIFY = "vllm_ling.runtime.verification.verify_once"


class LoadedTarget:
    """Stands for the Ling target a runner's load_model builds (weak-referenceable)."""


@pytest.fixture
def upstream_runners(monkeypatch):
    """vLLM's runner classes with their own load_model (restored after the test)."""
    from vllm_ling.patches import p6_verify_after_load as p6

    classes = p6.runner_classes()
    for cls in classes:
        original = cls.__dict__["load_model"]
        monkeypatch.setattr(cls, "load_model", getattr(original, "__wrapped__", original))
    return classes


def test_runners_load_model_is_our_wrapper_around_vllms(upstream_runners):
    from vllm_ling.patches import p6_verify_after_load as p6
    from vllm_ling.patches.registry import apply_all, by_id, source_sha256

    assert not p6.is_applied()
    assert apply_all("register", ids=("P6",)) == ["P6 worker-post-load-hook"]
    assert p6.is_applied()
    wrapped = {f"{cls.__module__}:{cls.__qualname__}.load_model": cls.__dict__["load_model"]
               for cls in upstream_runners}
    # the CPU runner is always importable; every wrapper wraps exactly vLLM's recorded method
    assert "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model" in wrapped
    import hashlib

    for symbol, wrapper in wrapped.items():
        source = inspect.getsource(wrapper.__wrapped__)
        assert source_sha256(symbol) == by_id("P6").upstream_sha256[symbol]
        assert hashlib.sha256(source.encode()).hexdigest() == source_sha256(symbol), symbol
    apply_all("register", ids=("P6",))
    assert not any(getattr(cls.load_model.__wrapped__, p6._MARK, False)
                   for cls in upstream_runners)  # wrapped once


def test_verification_runs_after_load_only_with_p6(monkeypatch):
    from vllm_ling.models import loaded
    from vllm_ling.patches import p6_verify_after_load as p6

    calls = []
    target = LoadedTarget()

    class Runner:
        vllm_config = "the runner's vllm_config"

        def load_model(self):
            loaded.remember("target", target)
            self.done_loading = True

    def verify_once(model, vllm_config, runner):
        calls.append((model, vllm_config, runner, runner_instance.done_loading))

    monkeypatch.setattr(VERIFY, verify_once)
    monkeypatch.setattr(loaded, "_models", {})
    runner_instance = Runner()
    runner_instance.load_model()
    assert calls == []  # vLLM's load_model alone: nothing verifies the models before serving

    p6._wrap(Runner)
    runner_instance = Runner()
    runner_instance.load_model()
    assert calls == [(target, "the runner's vllm_config", f"{__name__}.Runner", True)]


def test_p6_refuses_changed_upstream_runners(upstream_runners, monkeypatch):
    from vllm_ling.patches import p6_verify_after_load as p6

    assert_refuses_changed_source(monkeypatch, "P6", lambda: not any(p6.is_wrapped(c) for c in upstream_runners))
