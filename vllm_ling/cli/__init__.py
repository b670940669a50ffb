"""The ``vllm-ling`` command line: one module per subcommand, dispatched by :mod:`.main`."""
