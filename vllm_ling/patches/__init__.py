"""Runtime patches of vLLM 0.32 that cannot be expressed through its plugin interfaces.

One module per patch (``p<n>_*.py``); ``registry.py`` is the ordered list that declares
and applies them (at the plugin's ``register()`` or the vLLM CLI entry, never at import)
and refuses a vLLM whose patched source differs; README.md here is generated from it.
``config_hooks.py`` holds the Ling decisions that patches P4, P5 and P9 let vLLM run.
"""
