# vlmcp: `make demo` trains the offline digits demo on 2 CPU ranks, `make test` runs the suite.
# Both create .venv when it is missing: torch first (pinned, so that nothing later pulls a
# different build), then this package. On a CPU machine the torch wheel must be a CPU build
# without triton (with triton, transformers routes Qwen3.5's DeltaNet to GPU kernels that fail on a
# CPU): where pip's default source is not one, pass TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.vlmcp-installed
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)

# One thread per rank (2 ranks share 2 cores), DeepSpeed's CPU accelerator without probing.
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test install clean

demo: $(STAMP)
	$(BIN)/python -m vlmcp demo --out runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf runs .pytest_cache
