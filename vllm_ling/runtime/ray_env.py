"""The one way vllm-ling's settings reach Ray workers: the launching process's values.

vLLM's Ray executor (``RayExecutorV2``, vLLM 0.32's default) hands its own environment to
each worker only after the worker has started and imported vLLM (``initialize_worker``), and
with ``setdefault``: a value the worker node already has wins. So a switch given to the
launcher can silently lose to a stale one on another node, and anything read while the
plugin loads in the worker misses it. What is in ``ParallelConfig.ray_runtime_env`` instead
reaches every worker process when Ray starts it (vLLM passes it to ``ray.init`` and to each
worker actor), overriding the node's environment.

Every option the table declares with ``Scope.PLUGIN`` (read inside vLLM's processes; the
test-only diagnostics too) goes there with the launcher's value, or ``""`` (= its default) when the launcher has none, so
every rank runs one configuration. ``Scope.NODE`` options describe the host (a cache
directory, the CPU stand-in for Ray's device) and stay each node's own.
"""

from __future__ import annotations

import os
from typing import Mapping

from vllm_ling.options import OPTIONS, Scope
from vllm_ling.processes import SERVER_MARKER_ENV


def propagated_names() -> tuple[str, ...]:
    return tuple(n for o in OPTIONS if o.scope in (Scope.PLUGIN, Scope.TEST) for n in (o.name, o.former_name) if n)


def worker_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variable -> the launcher's value ("" when unset: the worker then uses the default); and the
    server's marker, so its Ray workers are known as its processes (vllm_ling.processes)."""
    env = os.environ if env is None else env
    values = {name: env.get(name, "") for name in propagated_names()}
    if env.get(SERVER_MARKER_ENV):
        values[SERVER_MARKER_ENV] = env[SERVER_MARKER_ENV]
    return values


def attach_to(parallel_config, env: Mapping[str, str] | None = None) -> bool:
    """Put :func:`worker_env` into ``parallel_config.ray_runtime_env`` when the Ray backend
    serves; returns whether it did. The user's own runtime env is kept (ours wins on our names)."""
    if parallel_config.distributed_executor_backend != "ray":
        return False
    from ray.runtime_env import RuntimeEnv

    base = dict(parallel_config.ray_runtime_env or {})
    env_vars = dict(base.get("env_vars") or {})
    env_vars.update(worker_env(env))
    base["env_vars"] = env_vars
    parallel_config.ray_runtime_env = RuntimeEnv(**base)
    return True
