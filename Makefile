# The two commands: `make demo` and `make test`. Each sets up .venv on its own (idempotent).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO_DATA ?= data/digits

.PHONY: demo test test-floor gpu-wheels gpu-check gpu-bench lint clean

# pip installs without compiling the packages' 16,000 source files (--no-compile): Python compiles
# a module when it first imports it and caches that (5,762 files after a whole test run). The
# install took 1 min 56 s instead of 3 min 22 s on 2 cores; the first import of the trainer 17 s more.
# The caching must be on, so an inherited PYTHONDONTWRITEBYTECODE is dropped for these commands:
# with it, every new process would compile its imports again.
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL = -m pip install --quiet --no-compile

# The pip that `venv` bundles (23.2 with Python 3.11) is brought up to date first. On 2 cores pip
# 26 installs .[dev,demo] in 96-103 s against 124-130 s (venv and upgrade included), and resolves
# `make gpu-wheels`' 73 packages for Python 3.12 in 24-25 s against 46-49 s, with 17-18 s of CPU
# against 43-44 s.
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) --upgrade "pip>=25"

# One stamp per set of extras, redone when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(PY)
	$(PY) $(PIP_INSTALL) -e ".[$(subst +,$(comma),$*)]"
	touch $@

comma := ,

# make demo DEMO_CONFIG=configs/demo-digits-siglip.yaml runs the demo with the sigmoid loss.
DEMO_CONFIG ?= configs/demo-digits.yaml
DEMO_RUN ?= runs/$(basename $(notdir $(DEMO_CONFIG)))

# The main job: build the digits shards, train a tiny CLIP on DEMO_PROCS CPU processes (on a GPU
# machine too: DEMO_ARGS=train.device=auto uses a GPU each, DEMO_PROCS=1 where it has one), report
# zero-shot.
DEMO_PROCS ?= 2
demo: $(VENV)/.installed-demo
	$(VENV)/bin/clip-train make-shards digits $(DEMO_DATA)
	rm -rf $(DEMO_RUN)
	OMP_NUM_THREADS=1 NPROC_PER_NODE=$(DEMO_PROCS) PYTHON=$(PY) launch/train.sh $(DEMO_CONFIG) \
		data.train=$(DEMO_DATA)/train data.val=$(DEMO_DATA)/val \
		eval.zeroshot=$(DEMO_DATA)/zeroshot.json eval.zeroshot_data=$(DEMO_DATA)/val \
		train.out_dir=$(DEMO_RUN) train.device=cpu $(DEMO_ARGS)
	$(VENV)/bin/clip-train report $(DEMO_RUN) --prefix demo

# Test files run on TEST_WORKERS processes (pytest-xdist), each file on one worker so that its
# module fixtures (trained reference runs) are built once, the longest files first (the order of
# tests/conftest.py, which --no-loadscope-reorder keeps). The run is CPU-bound (85 % busy on 2
# cores, a fifth of it in the kernel; a third worker gained nothing), so CI's time is the tests'
# work. The 25 slowest tests close the log, for whoever works on CI's time next.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# PyTorch on the CPU hands each large tensor's memory back to the kernel when it is freed (glibc's
# mmap threshold and heap trim) and page-faults the next one in again: a fifth of a test run's CPU
# time went to the kernel. The tests keep freed memory in each process's heap instead (the floor's
# tests ran in 0.92x the time, two alternating pairs on 2 cores; the demo's tiny model, whose
# tensors stay under the threshold, ran no faster, so it runs as users' runs do).
CPU_MALLOC := glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=8589934592:glibc.malloc.top_pad=268435456
test test-floor: export GLIBC_TUNABLES ?= $(CPU_MALLOC)

test: $(VENV)/.installed-dev+demo
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_PARALLEL)

# The floor of the supported range (pyproject's torch>=) as CI runs it: torch, torchvision, Triton
# and numpy at the image's pins (docker/constraints.txt), in a venv that takes every other package
# from .venv, so the two share their wheels (the CUDA libraries torch loads at import included).
# It runs the tests of the code that leans on torch's version-dependent APIs: the collectives and
# the store, the loss (its compiled tiles included), Gradient Cache's RNG replay (compiled too), the update,
# checkpoints (weights_only loads and refusals, DCP), the trainer's resume and torchrun restarts, and of FSDP2
# the sharding (from rank 0's weights), its gradient sync and a checkpoint resharded 2 -> 4 -> 1,
# the NaN guard's skip on sharded parameters (fused AdamW's found_inf) and the EMA of their shards.
# What is torch-version-neutral (the exit paths, DDP's comm hooks, signals) runs in `make test`.
FLOOR_VENV ?= .venv-floor
FLOOR_TESTS ?= tests/test_compat.py tests/test_distributed.py tests/test_loss*.py tests/test_gradcache.py \
	tests/test_optim.py tests/test_skipped_steps.py tests/test_checkpoint.py tests/test_fsdp_config.py \
	tests/test_checkpoint_verify.py::test_a_train_state_that_would_run_code_is_refused_in_one_line \
	tests/test_compile.py::test_compiled_towers_replay_exactly_with_dropout \
	tests/test_trainer.py::test_resume_from_mid_run_checkpoint_is_bit_identical \
	tests/test_trainer.py::test_sigkill_worker_restarts_and_matches_uninterrupted_run \
	tests/test_trainer.py::test_non_finite_step_is_skipped_and_leaves_weights_unchanged \
	tests/test_fsdp_gradcache.py::test_each_unit_reduce_scatters_once_per_step_or_once_per_chunk \
	tests/test_fsdp_gradcache.py::test_two_ranks_fsdp_steps_equal_one_process_full_batch_steps \
	tests/test_fsdp_gradcache.py::test_ranks_that_build_on_meta_get_rank_zeros_weights_and_buffers \
	tests/test_fsdp_trainer.py::test_a_two_rank_checkpoint_resumes_on_four_then_on_one_with_weights_and_optimizer_exact \
	tests/test_fsdp_trainer.py::test_nan_guard_clipping_and_scale_clamp_on_two_ranks \
	"tests/test_fine_tune_runs.py::test_the_ema_is_the_formula_over_the_weights_saved_at_every_step[fsdp]"
# A .pth line that appends .venv's site-packages (and its .pth files: the editable install) to sys.path.
export ADD_SITE_PTH := import site, sys; open(site.getsitepackages()[0] + "/zz-clip-train-venv.pth", "w").write(f"import site; site.addsitedir({sys.argv[1]!r})\n")

$(FLOOR_VENV)/.installed: docker/constraints.txt $(VENV)/.installed-dev+demo
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python $(PIP_INSTALL) --no-deps -c docker/constraints.txt torch torchvision triton numpy
	$(FLOOR_VENV)/bin/python -c "$$ADD_SITE_PTH" "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest $(PYTEST_PARALLEL) $(FLOOR_TESTS)

# The GPU check kit, for a GPU box without network: `make gpu-wheels` here writes the wheels such a
# box (torch and torchvision preinstalled) lacks; copy the checkout with them, and on the box
# `make gpu-check` installs them offline, runs the CUDA tests and one short benchmark into
# gpu-check/DATE/. GPU_PYTHON=3.12 builds the wheels for the box's Python when it differs.
GPU_WHEELS ?= dist/gpu-wheels
gpu-wheels: $(VENV)/.installed-dev+demo
	rm -rf $(GPU_WHEELS)
	$(PY) launch/gpu_wheels.py $(GPU_WHEELS) $(if $(GPU_PYTHON),--python-version $(GPU_PYTHON))

gpu-check:
	PYTHON=$(PYTHON) WHEELS=$(GPU_WHEELS) launch/gpu-check.sh

# One GPU session's figures, aiming at <= 10 minutes on an H100 (docs/gpu-bench.md): the loss, the trainer
# eager and compiled with MFU, OpenCLIP's trainer beside it and a profiled step, into OUT (default
# gpu-bench/DATE), with the kit installed offline as gpu-check does. Without the kit it runs on .venv,
# or on PYTHON when one is given (make gpu-bench PYTHON=...); without a CUDA GPU it is a dry run at toy sizes.
gpu-bench:
	PYTHON=$(if $(or $(wildcard $(GPU_WHEELS)/requirements.txt),$(filter-out file,$(origin PYTHON))),$(PYTHON),$(PY)) \
		WHEELS=$(GPU_WHEELS) launch/gpu-bench.sh $(OUT)

lint: $(VENV)/.installed-dev+demo
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(FLOOR_VENV) runs .pytest_cache .ruff_cache
