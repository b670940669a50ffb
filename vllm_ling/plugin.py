"""Plugin registration: what vLLM learns from vllm-ling, in one idempotent function."""

from __future__ import annotations

from vllm_ling.log import get_logger
from vllm_ling.models.names import DRAFT_ARCH, DSPARK_ARCH, TARGET_ARCH
from vllm_ling.patches.registry import Stage, apply_all
from vllm_ling.versions import check_vllm_version

logger = get_logger("plugin")

MODEL_CLASSES = {
    TARGET_ARCH: "vllm_ling.models.ling3:LingForCausalLM",
    DRAFT_ARCH: "vllm_ling.models.ling3_mtp:LingMTPModel",
    DSPARK_ARCH: "vllm_ling.models.ling3_dspark:LingDSparkForCausalLM",
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

    from vllm_ling.models.configuration import LING_MODEL_TYPE, LingHybridConfig

    # transformers' public registry (tokenizer and processor lookups); vLLM's is patch P1.
    AutoConfig.register(LING_MODEL_TYPE, LingHybridConfig, exist_ok=True)
    return [f"config {LING_MODEL_TYPE} -> LingHybridConfig"]


def _register_layers() -> list[str]:
    from vllm_ling.layers.registration import register_layers

    return register_layers()


def _default_report_path() -> None:
    """Give the server one report path before vLLM spawns its engine and worker processes
    (they inherit the environment), so workers write where the front end reads; refuse one
    that cannot be written now, naming the variable, rather than after the weights load."""
    import os

    from vllm_ling.runtime.report import ENV_REPORT_PATH, check_report_path, default_report_path

    if not os.environ.get(ENV_REPORT_PATH):
        os.environ[ENV_REPORT_PATH] = default_report_path(f"report-{os.getpid()}.json")
    check_report_path(os.environ[ENV_REPORT_PATH])


def _observe_humming_jit() -> None:
    """On CUDA, count humming JIT compiles and cache hits in this process from its start, so
    vLLM's own humming use (an opted-out MoE backend) is counted too (vllm_ling.ops.humming_jit)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        from vllm_ling.ops.humming_jit import observe

        observe()


def _no_humming_builds_without_cuda() -> None:
    """humming's kernels are CUDA-only: elsewhere its import-time background builds only cost
    CPU (vllm_ling.ops.humming_cache.skip_background_builds)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        from vllm_ling.ops.humming_cache import skip_background_builds

        skip_background_builds()


def register() -> list[str]:
    """Apply the runtime patches and register models, config and layers once per process;
    return what was registered."""
    global _registered
    if _registered is not None:
        return _registered
    from vllm_ling.refusal import ensure_file, install_excepthook, install_log_filter

    install_excepthook()  # first: a refusal below is one line, not a traceback
    install_log_filter()  # ... also when vLLM catches it and logs it (a worker's verification)
    ensure_file()  # plain vllm serve: a worker's refusal reaches the API server's last line
    from vllm_ling.runtime import clean_stop

    clean_stop.install()  # a requested stop does not log EngineDeadError at ERROR
    check_vllm_version()
    _default_report_path()
    _observe_humming_jit()
    _no_humming_builds_without_cuda()
    # Runtime patches first, in the registry's order; refuses a vLLM they were not written for.
    patches = apply_all(Stage.REGISTER)
    done = _register_config() + _register_models() + _register_layers() + [f"patches {', '.join(patches)}"]
    _registered = done
    logger.info("vllm-ling registered: %s", "; ".join(done))
    return done


def prime_model_info_cache() -> list[str]:
    """Write vLLM's model-info cache (``$VLLM_CACHE_ROOT/modelinfos``) for vllm-ling's
    architectures; what was cached. vLLM inspects a lazily registered model class in a fresh
    Python process (seconds: it imports vLLM and torch) unless that cache holds it, and writes
    the cache at start-up: an image primes it at build time, so a container (read-only root)
    neither inspects nor fails to write it."""
    from vllm import ModelRegistry

    register()
    done = []
    for arch in MODEL_CLASSES:
        ModelRegistry.models[arch].inspect_model_cls()  # vLLM's own lazy inspection and cache writer
        done.append(arch)
    return done
