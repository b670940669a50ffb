"""What runs inside a serving vLLM: startup verification and its report, the accept-length
window and guard, the stat logger, the report endpoint, the speculation policy, the smoke check
and the local server manager. Imports ops, models and layers; never patches or the CLI."""
