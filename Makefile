# The two commands of the README:
#   make demo  - install, make the tiny Ling-3.0 checkpoint, serve it with real vLLM + vllm-ling
#                on localhost, send one completion and one chat request, print /metrics excerpts
#   make test  - install, then run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test test-gpu tools clean
install:
	bash scripts/install.sh

tools: install
	bash scripts/install_test_tools.sh

demo: install
	$(PY) -m vllm_ling.cli.demo

test: install tools
	bash scripts/run_tests.sh $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) out
