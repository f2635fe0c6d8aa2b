# The two commands: `make demo` and `make test`. Each sets up .venv on its own (idempotent).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO_DATA ?= data/digits

.PHONY: demo test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras, redone when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[$(subst +,$(comma),$*)]"
	touch $@

comma := ,

DEMO_RUN ?= runs/demo-digits

# The main job: build the digits shards, train a tiny CLIP on 2 CPU processes, report zero-shot.
demo: $(VENV)/.installed-demo
	$(VENV)/bin/clip-train make-shards digits $(DEMO_DATA)
	rm -rf $(DEMO_RUN)
	OMP_NUM_THREADS=1 NPROC_PER_NODE=2 PYTHON=$(PY) launch/train.sh configs/demo-digits.yaml \
		data.train=$(DEMO_DATA)/train data.val=$(DEMO_DATA)/val \
		eval.zeroshot=$(DEMO_DATA)/zeroshot.json eval.zeroshot_data=$(DEMO_DATA)/val \
		train.out_dir=$(DEMO_RUN) $(DEMO_ARGS)
	$(PY) -m clip_train.report $(DEMO_RUN) --prefix demo

test: $(VENV)/.installed-dev+demo
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

lint: $(VENV)/.installed-dev+demo
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
