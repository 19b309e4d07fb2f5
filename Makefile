# Every target sets itself up: `make demo` and `make test` work on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# torch is pinned to the CPU build on disk first, so the CUDA build is never pulled.
TORCH   ?= torch==2.13.0

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v dot >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || \
	  echo "note: graphviz 'dot' not found; SVG rendering will be unavailable")
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/python -m tapestry.demo

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

test-all: setup
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m ''

bench: setup
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
