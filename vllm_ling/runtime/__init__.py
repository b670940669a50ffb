"""What runs inside a serving vLLM: startup verification and its report, the accept-length
window and guard, the stat logger, the report endpoint, the speculation policy, the clean-stop log
filter and the Ray environment of its workers. Imports ops, models and layers; never patches, the
launcher or the CLI (the launcher, outside vLLM, is :mod:`vllm_ling.launcher`)."""
