# Two commands for a fresh machine:
#   make run    sets up .venv, installs hybridspec, streams a short generation from the embedded default model
#   make test   sets up .venv with the test extra and runs the test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= def fibonacci(n):

.PHONY: run test venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(BIN)/hybridspec generate "$(PROMPT)" --max-new-tokens 48

test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
