# The two commands of the README:
#   make demo  - install, make the scripted tiny Ling-3.0 checkpoint, serve it with real vLLM + vllm-ling
#                and the ling3 parsers on localhost, print a chat answer (reasoning, tool call), the
#                MTP accept length from /metrics and the verification table
#   make test  - install, then run the whole test suite (what CI runs); `make tools` first installs
#                prometheus, docker.io and debootstrap with apt (as root) and helm into the venv
#                (README "Two commands": what it starts, stops and keeps)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test test-gpu tools clean check-monitoring
install:
	bash scripts/install.sh

tools: install
	bash scripts/install_test_tools.sh

demo: install
	$(PY) -m vllm_ling.cli.demo

test: install tools
	bash scripts/run_tests.sh $(PYTEST_ARGS)

# The whole gpu suite on a CUDA machine (kernels, layers through real vLLM, `vllm-ling serve` end to
# end); `make test` collects them too and they skip without CUDA. tests/README.md: the H200 recipe.
# The two modules ignored hold no gpu test and import deploy extras a GPU box may lack (ray,
# kubernetes-validate): their import errors would stop the collection.
GPU_SUITE := -m gpu tests --ignore=tests/deploy/test_helm_chart.py --ignore=tests/deploy/test_ray_two_nodes.py
test-gpu: install
	$(PY) -m pytest -q -rA $(GPU_SUITE) $(PYTEST_ARGS)

# promtool (Debian's prometheus package, installed by `make tools`) on the one copy of the
# scrape config and alert rules; the test suite runs the same checks.
check-monitoring:
	promtool check config helm/vllm-ling/files/prometheus/prometheus.yml
	promtool check rules helm/vllm-ling/files/prometheus/alerts.yml

clean:
	rm -rf $(VENV) out
