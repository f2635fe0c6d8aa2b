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

demo: $(VENV)/.installed-demo
	$(VENV)/bin/clip-train --help

test: $(VENV)/.installed-dev+demo
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

lint: $(VENV)/.installed-dev+demo
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
