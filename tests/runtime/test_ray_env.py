"""The propagation rule: every setting vLLM's processes read reaches the Ray workers with the
launching process's value, by one mechanism (``ParallelConfig.ray_runtime_env``), declared by
the option table's scope. The two-node test (tests/deploy/test_ray_two_nodes.py) shows it on
a real cluster; these tests keep the rule when a variable is added."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from vllm_ling import options as o
from vllm_ling.runtime import ray_env

PACKAGE = Path(o.__file__).parent
# Code that runs inside vLLM's processes (engine core, workers, API server).
IN_VLLM_PROCESSES = ["models", "layers", "ops", "runtime", "patches", "plugin.py", "__init__.py"]


def names_read_in_vllm_processes() -> set[str]:
    names: set[str] = set()
    for part in IN_VLLM_PROCESSES:
        root = PACKAGE / part
        for path in [root] if root.is_file() else root.rglob("*.py"):
            names |= set(re.findall(r"\bVLLM_LING_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names


def test_every_variable_read_in_vllm_processes_is_propagated_or_node_local():
    """A new VLLM_LING_* read in vLLM's processes must be declared plugin (propagated) or node
    (each host's own, on purpose); launcher-only variables never reach a worker."""
    scopes = {opt.name: opt.scope for opt in o.OPTIONS}
    read = names_read_in_vllm_processes() & set(scopes)
    launcher_only = {n for n in read if scopes[n] is o.Scope.LAUNCHER}
    # launcher/local_server.py, smoke.py and memory_guard.py run in the launcher, not in vLLM's processes
    assert launcher_only <= {"VLLM_LING_SMOKE", "VLLM_LING_SMOKE_MIN_ACCEPT", "VLLM_LING_MODEL",
                             "VLLM_LING_PORT", "VLLM_LING_DEVICE", "VLLM_LING_MEMORY_AVAILABLE_GB"}, launcher_only
    propagated = set(ray_env.propagated_names())
    for name in read - launcher_only:
        assert name in propagated or scopes[name] is o.Scope.NODE, name
    # a renamed variable's former name travels too while it is still read
    assert {n for opt in o.OPTIONS if opt.scope in (o.Scope.PLUGIN, o.Scope.TEST)
            for n in (opt.name, opt.former_name) if n} == propagated


def test_worker_env_is_the_launchers_value_or_empty_for_the_default():
    env = {"VLLM_LING_FP8_HEAD": "0", "VLLM_LING_NUM_SPEC_TOKENS": "2",
           "VLLM_LING_HUMMING_CACHE": "/launcher/cache", "VLLM_LING_PORT": "9000"}
    got = ray_env.worker_env(env)
    assert got["VLLM_LING_FP8_HEAD"] == "0" and got["VLLM_LING_NUM_SPEC_TOKENS"] == "2"
    assert got["VLLM_LING_MOE_W4A8"] == ""  # unset here: "" overrides a node's stale value
    assert o.read("VLLM_LING_MOE_W4A8", got) is False  # and reads as the default
    assert "VLLM_LING_HUMMING_CACHE" not in got and "VLLM_LING_PORT" not in got


def test_attach_keeps_the_users_runtime_env_and_wins_on_our_names():
    config = SimpleNamespace(distributed_executor_backend="ray", ray_runtime_env={
        "env_vars": {"MY_VAR": "1", "VLLM_LING_FP8_HEAD": "1"}, "working_dir": "/srv"})
    assert ray_env.attach_to(config, {"VLLM_LING_FP8_HEAD": "0"})
    runtime_env = config.ray_runtime_env
    assert runtime_env["env_vars"]["MY_VAR"] == "1" and runtime_env["working_dir"] == "/srv"
    assert runtime_env["env_vars"]["VLLM_LING_FP8_HEAD"] == "0"
    mp = SimpleNamespace(distributed_executor_backend="mp", ray_runtime_env=None)
    assert not ray_env.attach_to(mp, {}) and mp.ray_runtime_env is None
