# rlpipe — the front door. `make help` lists every target.
# Targets that need the environment create it themselves (uv in .tools/, project env in .venv/).

SHELL := /bin/bash
PYTHON ?= python3
UV := .tools/bin/uv
VENV := .venv
PY := $(VENV)/bin/python
RUN ?= runs/demo
CONFIG ?= configs/demo_cats.yaml
ARGS ?=
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export JAX_PLATFORMS ?= cpu
export PYTHONHASHSEED := 0
# JAX's persistent compilation cache for every step, test and benchmark started from here: one per checkout
# (a fresh clone starts cold), shared by its processes. JAX_COMPILATION_CACHE_DIR= (empty) turns it off.
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
export JAX_COMPILATION_CACHE_MAX_SIZE ?= 4294967296

.DEFAULT_GOAL := help

.PHONY: help setup demo test test-fast test-loaded test-slow test-guides lint format typecheck docs bench bench-gpu rollout batches learn evaluate report run export replay gcs-emulator gc rescore serve clean sft recipe

help: ## List every target with a one-line description
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(UV):
	$(PYTHON) -m venv .tools
	.tools/bin/python -m pip install -q --disable-pip-version-check uv==0.13.9

# Python writes the bytecode of what it imports the first time it imports it, for every later process: the
# environment is installed without bytecode (compiling all of it, transformers' hundreds of model files included,
# took ~15 s of a ~20 s setup) and PYTHONDONTWRITEBYTECODE, if the machine sets it, is cleared for every target
# (with it set, every step process would compile the source of JAX, levanter and transformers again: ~2 s each).
unexport PYTHONDONTWRITEBYTECODE
TORCH_FIND_LINKS = $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
$(VENV)/.synced: pyproject.toml uv.lock | $(UV)
	$(UV) sync --frozen --python $(PYTHON) --quiet
	@# torch (CPU) only for the HF-export test: the CPU wheel from pip's configured find-links folder, installed by
	@# uv in ~1 s (pip, the fallback, takes ~15 s).
	-$(UV) pip install -q --python $(PY) $(foreach d,$(TORCH_FIND_LINKS),--find-links $(d)) \
	  torch==2.13.0+cpu 2>/dev/null || \
	  $(PYTHON) -m pip --python $(PY) install -q --disable-pip-version-check torch==2.13.0 2>/dev/null || \
	  $(PY) -c "import torch" 2>/dev/null || echo "note: torch CPU not installed; the HF export test needs it"
	touch $@

setup: $(VENV)/.synced ## Create the environment (uv, pinned by uv.lock)

# The program targets run `.venv/bin/rlpipe COMMAND` (steps/rlpipe.py): the same program and flags as `python -m
# steps.…`, whose exit code is the program's own (docs/reference/exit-codes.md). make turns any failed recipe into
# exit 2, so a scheduler or a container that must tell "retry later" (75) from "fix the config" (2) calls
# .venv/bin/rlpipe directly.
#
# The job targets (run, rollout, batches, learn) on an existing run root read its job config from its run.json unless
# CONFIG is given (on the command line or in the environment); the default CONFIG names the job of a new run root.
JOB_CONFIG = $(if $(filter file,$(origin CONFIG)),--default_config_path,--config_path) $(CONFIG)
REPLAY_USAGE = FROM is not set: make replay RUN=$(RUN) FROM=<checkpoint step> [TO=<last slot>] re-trains slots FROM+1..TO from checkpoint FROM

demo: setup ## Run the cats demo job on RUN (runs/demo; an existing one is refused unless FRESH=1), print rewards, write the report
	$(VENV)/bin/rlpipe demo --config_path $(CONFIG) --run_root $(RUN) $(if $(filter 1 true yes,$(FRESH)),--fresh true) $(ARGS)

# --dist loadgroup: tests sharing a module-scoped job fixture stay on one worker, every other test (the long
# end-to-end ones included) is scheduled on its own: the mostly waiting tests first, then longest first
# (tests/conftest.py). Three workers on the two cores: many end-to-end tests wait on files, leases and retry
# timers, and a third worker fills that time (clean clone: 7 min 33 s against 8 min 05 s with two; ~3% more CPU,
# peak memory ~6.2 GB). --durations=25 prints where the time went.
PYTEST_DIST := -n 3 --dist loadgroup --durations=25

test: setup ## Run the whole test suite (what CI runs)
	$(PY) -m pytest -q $(PYTEST_DIST) --timeout 900 tests $(ARGS)

# The tier for every edit: no step process, no job, no model compiled beyond a tiny cached one (tests/tiers.py).
test-fast: setup ## Run the fast tier (under a minute): the tests neither slow nor heavy
	RLPIPE_TEST_TIER=fast $(PY) -m pytest -q -n 2 --durations=10 -m "not slow and not heavy" tests $(ARGS)

# Twice CI's load: the suite beside one busy process per core (tests/load/under_load.py). A test that fails here
# but not alone depends on timing: a defect, fixed at its cause.
test-loaded: setup ## Run the whole suite under twice CI's load (one CPU burner per core), to find timing flakes
	$(PY) tests/load/under_load.py -- $(MAKE) --no-print-directory test ARGS="$(ARGS)"

test-slow: setup ## Run only the tests marked slow (end-to-end, crash and learning tests)
	$(PY) -m pytest -q $(PYTEST_DIST) -m slow tests $(ARGS)

# The long tier (tests/test_guides_long.py, marker guides_long, deselected everywhere else): every guide command
# block of CPU-minutes to CPU-hours or a fixed port, run as written, one test at a time (each job uses both cores).
test-guides: setup ## Run every long guide command as written (recipes, tool paths, the judge on port 8000): ~90 CPU-minutes, not in CI
	$(PY) -m pytest -q -rP --durations=0 -m guides_long tests/test_guides_long.py $(ARGS)

lint: setup ## ruff check + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup ## Apply ruff format and autofixes
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

typecheck: setup ## mypy on pipeline/, schemas/ and policy/
	$(VENV)/bin/mypy pipeline schemas policy

docs: setup ## Regenerate docs/reference/configuration.md and docs/benchmarks.md's figures table (tests fail when stale)
	$(PY) -m pipeline.config.reference
	$(PY) -m bench.figures

# The bench dependency group (pyproject.toml): TRL for the side-by-side comparison, installed into .venv on first
# use (CPU torch comes with setup). If it cannot be installed, the TRL part is skipped with a note.
BENCH_PKGS := trl==1.16.0 accelerate==1.15.0

bench: setup ## CPU benchmarks: storage, BatchMaker, learner, rollout, end-to-end demo, step start, rlpipe vs TRL, latency, retention, continuous batching, verifiers lessons, scale simulation
	@$(PY) -c "import trl, accelerate" 2>/dev/null || $(UV) pip install -q --python $(PY) $(BENCH_PKGS) || \
	  echo "note: could not install $(BENCH_PKGS); the TRL comparison is skipped"
	$(PY) -m bench.run_all $$($(PY) -c "import trl, torch" 2>/dev/null || echo --skip_trl) $(ARGS)

# bench-gpu runs with the machine's own python3 (a GPU machine has the project's wheels installed, no .venv).
# BENCH_PYTHONPATH: folders put first on PYTHONPATH (e.g. where the wheels were installed with pip --target);
# DEVICE_COMPAT=1: call `device_compat.install()` (a module on that path) before JAX starts. Both empty by default.
BENCH_PYTHONPATH ?=
DEVICE_COMPAT ?=

bench-gpu: ## GPU benchmark (run on the GPU machine; see docs/benchmarks.md)
	$(if $(BENCH_PYTHONPATH),PYTHONPATH=$(BENCH_PYTHONPATH):$$PYTHONPATH) JAX_PLATFORMS= $(PYTHON) -m bench.bench_gpu \
		$(if $(DEVICE_COMPAT),--device-compat) $(ARGS)

run: setup ## Run a whole job (CONFIG=configs/….yaml RUN=…; an existing run: its run.json): learner, BatchMaker, rollout workers, evaluator
	$(VENV)/bin/rlpipe run $(JOB_CONFIG) --run_root $(RUN) $(ARGS)

rollout: setup ## One rollout worker on RUN (bounded with ARGS="--max_rollouts N")
	$(VENV)/bin/rlpipe rollout $(JOB_CONFIG) --run_root $(RUN) $(ARGS)

batches: setup ## The BatchMaker on RUN (ARGS="--follow true" or "--max_batches N")
	$(VENV)/bin/rlpipe batches $(JOB_CONFIG) --run_root $(RUN) $(ARGS)

learn: setup ## The learner on RUN (bounded with ARGS="--max_steps N")
	$(VENV)/bin/rlpipe learn $(JOB_CONFIG) --run_root $(RUN) $(ARGS)

evaluate: setup ## Evaluate policies of RUN, config from run.json (ARGS="--all true", "--steps 3,5", "--follow true", "--hf_checkpoint DIR")
	$(VENV)/bin/rlpipe evaluate --store.run_root $(RUN) $(ARGS)

export: setup ## Export policy STEP (default: the newest) of RUN as a Hugging Face folder OUT (model from run.json)
	$(VENV)/bin/rlpipe export --store.run_root $(RUN) $(if $(STEP),--step $(STEP)) $(if $(OUT),--out $(OUT)) $(ARGS)

gc: setup ## Garbage-collect RUN under its retention settings (lineage index first; bounded, safe to rerun)
	$(VENV)/bin/rlpipe gc --store.run_root $(RUN) $(ARGS)

rescore: setup ## Re-score RUN's committed rollout files into rescored/<name>/ (ARGS="--name N --config_path F"); sources untouched
	$(VENV)/bin/rlpipe rescore --store.run_root $(RUN) $(ARGS)

serve: setup ## Serve a committed policy of RUN over rlpipe's generate endpoint (ARGS="--policy_step N --port P"), e.g. as a judge
	$(VENV)/bin/rlpipe serve --run_root $(RUN) $(ARGS)

report: setup ## Write the HTML report of RUN (RUN=runs/demo) from the run root alone
	$(VENV)/bin/rlpipe report $(RUN) $(ARGS)

replay: setup ## Re-train slots FROM+1..TO of RUN from checkpoint FROM in a scratch folder; exit 0 iff bitwise equal
	$(if $(FROM),,$(error $(REPLAY_USAGE)))$(VENV)/bin/rlpipe replay --store.run_root $(RUN) --from_step $(FROM) $(if $(TO),--to_step $(TO)) $(ARGS)

SFT_CONFIG ?= configs/basic_arithmetic_sft.yaml
sft: setup ## Supervised fine-tuning (SFT_CONFIG=configs/…_sft.yaml): a policy an RL job starts from (model.init_policy)
	$(VENV)/bin/rlpipe sft --config_path $(SFT_CONFIG) $(ARGS)

RECIPE ?= basic_arithmetic
recipe: setup ## The real-task recipe (RECIPE=basic_arithmetic): SFT warm start, then RL, then held-out evaluation and report
	$(VENV)/bin/rlpipe recipe --name $(RECIPE)

GCS_PORT ?= 4443
gcs-emulator: setup ## Start the GCS emulator the tests use on 127.0.0.1:GCS_PORT (prints the env line to export)
	$(PY) tests/gcs_emulator.py --port $(GCS_PORT) $(ARGS)

clean: ## Remove the environment, local runs and the JAX compile cache
	rm -rf .venv .tools runs .cache .pytest_cache .mypy_cache .ruff_cache
