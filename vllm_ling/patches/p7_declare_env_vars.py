"""Patch P7: vLLM knows vllm-ling's ``VLLM_LING_*`` variables.

What: adds every name of vllm-ling's option table to ``vllm.envs.environment_variables``; a
``VLLM_LING_*`` variable that is not ours gets one WARNING per server saying it is ignored and
naming the closest declared variable (most likely a typo). vLLM hashes the value of every
variable in that table into its torch.compile cache key (``vllm.envs.compile_factors``), so an
option that changes what the model computes (``Option.compile_factor``) is read through
``os.environ`` as vLLM reads its own, and every other one reads as None there: a new port,
report path or smoke setting must not recompile the model or be written into the cache's key
file (vllm-ling reads its options from the environment itself, never through ``vllm.envs``).
Why: vLLM warns about every ``VLLM_*`` variable it does not know, and refuses them with
``--fail-on-environ-validation``; plugins have no way to declare theirs.
Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

import functools
import os

from vllm_ling.log import get_logger

logger = get_logger("plugin")


def _ours() -> set[str]:
    from vllm_ling.options import known_env_vars

    return set(known_env_vars())


def _not_a_compile_factor() -> None:
    return None


def _getter(name: str):
    """What ``vllm.envs`` (and so vLLM's compile cache key) reads for option ``name``."""
    from vllm_ling.options import BY_NAME, RENAMED

    option = BY_NAME[RENAMED.get(name, name)]  # a former name hashes like the option it names
    return functools.partial(os.environ.get, name) if option.compile_factor else _not_a_compile_factor


def is_applied() -> bool:
    import vllm.envs as envs

    return _ours() <= envs.environment_variables.keys()


def apply() -> None:
    import vllm.envs as envs

    known = _ours()
    for name in sorted(known):
        envs.environment_variables.setdefault(name, _getter(name))
    warn_unknown_ling_variables()


def warn_unknown_ling_variables() -> None:
    """Once per server, not once per process: the first process that registers (or
    ``vllm-ling serve`` before it) warns and marks the environment vLLM's engine core and
    workers inherit."""
    from vllm_ling.options import UNKNOWN_WARNED_MARKER, unknown_variables

    if os.environ.get(UNKNOWN_WARNED_MARKER):
        return
    for message in unknown_variables(os.environ):
        logger.warning("%s", message)
    os.environ[UNKNOWN_WARNED_MARKER] = "1"
