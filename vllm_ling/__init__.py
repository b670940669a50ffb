"""vllm-ling: a vLLM plugin that makes Ling-3.0-flash fast and proves it.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in every process,
sometimes twice; it is idempotent and imports vLLM lazily.
"""

__version__ = "0.1.0"


def register() -> None:
    from vllm_ling.plugin import register as _register

    _register()
