# `make run` and `make test` do all the set-up on a fresh machine: a virtual environment in
# .venv, the pinned requirements, then the app or the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: run test install clean demo-models eval-demo-models

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) app.py $(ARGS)

test: install
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadgroup tests

# Re-train the embedded demo pair (about 45 minutes on 2 CPU cores; needs Debian's
# python3.11-doc, which the script installs when run as root) and measure it.
demo-models: install
	$(PY) scripts/make_sample_document.py
	$(PY) scripts/train_demo_models.py

eval-demo-models: install
	HF_HUB_OFFLINE=1 $(PY) scripts/eval_demo_models.py --json artifacts/demo-eval.json

clean:
	rm -rf $(VENV) .pytest_cache
