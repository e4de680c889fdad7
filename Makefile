# `make run` and `make test` do all the set-up on a fresh machine: a virtual environment in
# .venv, the pinned requirements, then the app or the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: run test install clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) app.py $(ARGS)

test: install
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV) .pytest_cache
