"""What runs outside vLLM, around it: ``vllm-ling serve``'s supervisor of the vLLM process group,
the local server manager (start, wait, scrape, stop), the memory guard before loading, the smoke
generation after startup and the Ray cluster helper. Imports the base modules, models and the
report of :mod:`vllm_ling.runtime`; never the layers vLLM runs, patches or the CLI."""
