"""Registration through vLLM's real plugin loader, in fresh processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from vllm_ling.ops.humming_cache import HUMMING_ENV_NO_BACKGROUND_BUILD

pytest.importorskip("vllm")

PROBE = r"""
import json, logging, sys
started = []  # every process this one starts, from its first line
sys.addaudithook(lambda event, args: started.append(" ".join(map(str, args[1]))) if event == "subprocess.Popen" else None)
import vllm.plugins as plugins
records = []
class H(logging.Handler):
    def emit(self, r):
        records.append(r.getMessage())
logging.getLogger("vllm.ling").addHandler(H())
logging.getLogger("vllm").setLevel(logging.INFO)  # as vLLM's logging config does in its processes
plugins.load_general_plugins()
plugins.plugins_loaded = False          # vLLM may load plugins again in the same process
plugins.load_general_plugins()
import vllm_ling
vllm_ling.register()                    # and a direct call must be a no-op too
import humming.ops.utils, humming.utils.nvrtc  # what starts humming's background builds
from vllm import ModelRegistry
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.transformers_utils.config import _CONFIG_REGISTRY
from vllm.model_executor.custom_op import op_registry_oot
out = {
  "target": ModelRegistry._try_load_model_cls("BailingMoeV3ForCausalLM").__module__,
  "draft": ModelRegistry._try_load_model_cls("BailingMoeV3MTPModel").__module__,
  "quant": get_quantization_config("ling_fp8").__name__,
  "config": _CONFIG_REGISTRY["bailing_hybrid"].__name__,
  "kda_oot": op_registry_oot.get("BailingMoeV3KimiDeltaAttention").__module__,
  "gate_oot": repr(op_registry_oot.get("GateLinear")),
  "registered_lines": [m for m in records if m.startswith("vllm-ling registered")],
  "humming_builds": [c for c in started if "humming" in c],
}
print("RESULT" + json.dumps(out))
"""


def test_plugin_loader_registers_once_in_a_fresh_process():
    # the switch the plugin sets, as a process that ran register() (pytest's own) would pass it on
    env = {k: v for k, v in os.environ.items() if k != HUMMING_ENV_NO_BACKGROUND_BUILD}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    assert out["target"] == "vllm_ling.models.ling3"
    assert out["draft"] == "vllm_ling.models.ling3_mtp"
    assert out["quant"] == "LingFp8Config"
    assert out["config"] == "LingHybridConfig"
    assert out["kda_oot"] == "vllm_ling.layers.kda_cpu"  # this suite runs on the CPU platform
    # the gate is installed on every platform (each records its selection; on CPU GateLinear's path)
    assert out["gate_oot"] == "<class 'vllm_ling.layers.router_gate_cuda.LingGateLinear'>"
    assert len(out["registered_lines"]) == 1, out["registered_lines"]
    assert "BailingMoeV3ForCausalLM -> vllm_ling.models.ling3:LingForCausalLM" in out["registered_lines"][0]
    # every register-stage patch of the registry, in its order (P3: this suite runs on the CPU)
    assert ("patches P1 bailing-hybrid-config, P3 cpu-mla-hybrid-block-size, P4 model-config-hook-api, "
            "P5 model-default-speculative-config, P6 worker-post-load-hook, "
            "P7 plugin-environment-variables, P8 worker-post-warmup-hook, "
            "P9 config-parse-no-retry-on-rejection") in out["registered_lines"][0]
    # without CUDA, humming's import-time background builds (one Python process each) are off
    assert out["humming_builds"] == [], out["humming_builds"]


def test_other_vllm_version_logs_one_warning(monkeypatch, caplog):
    from vllm_ling import versions

    monkeypatch.setattr(versions, "vllm_version", lambda: "0.99.0")
    monkeypatch.setattr(versions, "_warned_versions", set())
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        assert versions.check_vllm_version() is False
        assert versions.check_vllm_version() is False
    warnings = [r for r in caplog.records if "tested with vLLM 0.32.0" in r.getMessage()]
    assert len(warnings) == 1 and "0.99.0" in warnings[0].getMessage()


def test_installed_vllm_is_the_tested_release():
    from vllm_ling.versions import TESTED_VLLM_VERSION, vllm_version_is

    assert vllm_version_is(TESTED_VLLM_VERSION)
