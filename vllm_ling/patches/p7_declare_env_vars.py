"""Patch P7: vLLM knows vllm-ling's ``VLLM_LING_*`` variables.

What: adds every name of vllm-ling's option table to ``vllm.envs.environment_variables``
(read through ``os.environ``, as vLLM reads its own); a ``VLLM_LING_*`` variable that is
not ours gets one WARNING saying it is ignored (most likely a typo).
Why: vLLM warns about every ``VLLM_*`` variable it does not know, and refuses them with
``--fail-on-environ-validation``; plugins have no way to declare theirs.
Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

import functools
import logging
import os

from vllm_ling.log import get_logger, log_once

logger = get_logger("plugin")


def _ours() -> set[str]:
    from vllm_ling.options import known_env_vars

    return set(known_env_vars())


def is_applied() -> bool:
    import vllm.envs as envs

    return _ours() <= envs.environment_variables.keys()


def apply() -> None:
    import vllm.envs as envs

    known = _ours()
    for name in sorted(known):
        envs.environment_variables.setdefault(name, functools.partial(os.environ.get, name))
    warn_unknown_ling_variables(known)


def warn_unknown_ling_variables(known: set[str]) -> None:
    from vllm_ling.options import closest_known

    for name in sorted(k for k in os.environ if k.startswith("VLLM_LING_") and k not in known):
        meant = closest_known(name)
        log_once(logger, logging.WARNING, f"unknown-env-{name}",
                 "%s is not a vllm-ling variable and is ignored%s (see `vllm_ling/options.py`)",
                 name, f"; did you mean {meant}?" if meant else "")
