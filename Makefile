# The two commands of the README:
#   make demo  - install, make the scripted tiny Ling-3.0 checkpoint, serve it with real vLLM + vllm-ling
#                and the ling3 parsers on localhost, print a chat answer (reasoning, tool call), the
#                MTP accept length from /metrics and the verification table
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
