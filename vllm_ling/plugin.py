"""Plugin registration: what vLLM learns from vllm-ling, in one idempotent function."""

from __future__ import annotations

from vllm_ling.log import get_logger
from vllm_ling.versions import check_vllm_version

logger = get_logger("plugin")

TARGET_ARCH = "BailingMoeV3ForCausalLM"
DRAFT_ARCH = "BailingMoeV3MTPModel"
MODEL_CLASSES = {
    TARGET_ARCH: "vllm_ling.models.ling3:LingForCausalLM",
    DRAFT_ARCH: "vllm_ling.models.ling3_mtp:LingMTPModel",
}

_registered: list[str] | None = None


def _register_models() -> list[str]:
    from vllm import ModelRegistry

    done = []
    for arch, target in MODEL_CLASSES.items():
        # Overriding an in-tree architecture only logs at DEBUG upstream; we say it at INFO below.
        ModelRegistry.register_model(arch, target)
        done.append(f"{arch} -> {target}")
    return done


def _register_config() -> list[str]:
    from transformers import AutoConfig
    from vllm.transformers_utils import config as vllm_config_utils

    from vllm_ling.models.configuration import LING_MODEL_TYPE, LingHybridConfig

    vllm_config_utils._CONFIG_REGISTRY[LING_MODEL_TYPE] = LingHybridConfig  # patch P1
    AutoConfig.register(LING_MODEL_TYPE, LingHybridConfig, exist_ok=True)
    return [f"config {LING_MODEL_TYPE} -> LingHybridConfig"]


def _register_layers() -> list[str]:
    from vllm_ling.layers.registration import register_layers

    return register_layers()


def _default_report_path() -> None:
    """Give the server one report path before vLLM spawns its engine and worker processes
    (they inherit the environment), so workers write where the front end reads."""
    import os
    import tempfile

    if not os.environ.get("VLLM_LING_REPORT_PATH"):
        os.environ["VLLM_LING_REPORT_PATH"] = os.path.join(
            tempfile.gettempdir(), f"vllm-ling-report-{os.getpid()}.json")


def _declare_env_vars() -> None:
    """Tell vLLM about our variables: it warns about (or, with --fail-on-environ-validation,
    refuses) every VLLM_* variable it does not know. A VLLM_LING_* name we do not read is
    most likely a typo: say so."""
    import functools
    import logging
    import os

    import vllm.envs as envs

    from vllm_ling.log import log_once
    from vllm_ling.options import known_env_vars

    known = known_env_vars()
    for name in known:
        envs.environment_variables.setdefault(name, functools.partial(os.environ.get, name))
    for name in sorted(k for k in os.environ if k.startswith("VLLM_LING_") and k not in known):
        log_once(logger, logging.WARNING, f"unknown-env-{name}",
                 "%s is not a vllm-ling variable and is ignored (see `vllm_ling/options.py`)", name)


def _install_hooks() -> list[str]:
    from vllm.platforms import current_platform

    from vllm_ling.patches.config_hooks import install_config_hook, install_speculative_default

    install_config_hook()
    install_speculative_default()
    from vllm_ling.patches import verify_after_load

    done = ["config hooks P4/P5 (Ling defaults and option conflicts)",
            f"P6 verification after load_model ({len(verify_after_load.apply())} runners)"]
    if current_platform.is_cpu():
        from vllm_ling.patches import cpu_mla_hybrid_blocks

        cpu_mla_hybrid_blocks.apply()
        done.append("P3 CPU MLA hybrid blocks")
    return done


def register() -> list[str]:
    """Register models, config and layers once per process; return what was registered."""
    global _registered
    if _registered is not None:
        return _registered
    check_vllm_version()
    _default_report_path()
    _declare_env_vars()
    done = _register_config() + _register_models() + _register_layers() + _install_hooks()
    _registered = done
    logger.info("vllm-ling registered: %s", "; ".join(done))
    return done
