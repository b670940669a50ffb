"""Runtime patches of vLLM 0.32 that cannot be expressed through its plugin interfaces.

Each module documents what it changes, why, the upstream reference and when to delete
it; README.md in this folder is the registry. Patches are applied at defined moments
(the plugin's ``register()`` or the vllm-cpu CLI entry), never at import.
"""
