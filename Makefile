# The two commands: `make demo` and `make test`. Each sets up .venv on its own (idempotent).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO_DATA ?= data/digits

.PHONY: demo test gpu-check lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras, redone when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[$(subst +,$(comma),$*)]"
	touch $@

comma := ,

# make demo DEMO_CONFIG=configs/demo-digits-siglip.yaml runs the demo with the sigmoid loss.
DEMO_CONFIG ?= configs/demo-digits.yaml
DEMO_RUN ?= runs/$(basename $(notdir $(DEMO_CONFIG)))

# The main job: build the digits shards, train a tiny CLIP on 2 CPU processes, report zero-shot.
demo: $(VENV)/.installed-demo
	$(VENV)/bin/clip-train make-shards digits $(DEMO_DATA)
	rm -rf $(DEMO_RUN)
	OMP_NUM_THREADS=1 NPROC_PER_NODE=2 PYTHON=$(PY) launch/train.sh $(DEMO_CONFIG) \
		data.train=$(DEMO_DATA)/train data.val=$(DEMO_DATA)/val \
		eval.zeroshot=$(DEMO_DATA)/zeroshot.json eval.zeroshot_data=$(DEMO_DATA)/val \
		train.out_dir=$(DEMO_RUN) $(DEMO_ARGS)
	$(VENV)/bin/clip-train report $(DEMO_RUN) --prefix demo

test: $(VENV)/.installed-dev+demo
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# On a CUDA machine: the CUDA tests, then the loss and step benchmarks whose JSON and plots the
# README's GPU figures come from. Elsewhere: one line, exit 0.
FIGURES ?= docs/figures
gpu-check: $(VENV)/.installed-dev+demo
	@if ! $(PY) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then \
		echo "gpu-check: no CUDA GPU on this machine; nothing to check"; \
	else \
		set -ex; \
		$(PY) -m pytest -m cuda tests; \
		for dtype in float32 bfloat16; do \
			$(VENV)/bin/clip-train bench loss --device cuda --dtype $$dtype --dim 512 --repeats 5 \
				--batch 16384,32768,65536,131072,262144 --impl vanilla,inf --kernel torch,triton \
				--json $(FIGURES)/gpu-loss-$$dtype.json --plot $(FIGURES)/gpu-loss-$$dtype.png; \
		done; \
		$(VENV)/bin/clip-train bench step --device cuda --model configs/model/vit-b16-bert-base-random.yaml \
			--precision bf16 --batch 512,2048,8192 --image-chunk 256 --text-chunk 1024 --lit --repeats 3 \
			--json $(FIGURES)/gpu-step.json --plot $(FIGURES)/gpu-step.png; \
	fi

lint: $(VENV)/.installed-dev+demo
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
