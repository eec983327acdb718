# Two commands for a fresh machine:
#   make run    sets up .venv, installs hybridspec, starts the gRPC server on the embedded default model in the
#               background, streams a short generation from it through the client, and stops the server
#   make test   sets up .venv with the test extra and runs the test suite (what CI runs) on TEST_WORKERS processes
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= def fibonacci(n):
PORT   ?= 50051
# test files run on this many worker processes (pytest-xdist; a file stays on one worker, so its module fixtures
# run once); CI's machine has 2 cores: 18 min of tests on one worker, 10 min on two
TEST_WORKERS ?= 2

.PHONY: run test venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

run: venv
	@$(BIN)/hybridspec serve --port $(PORT) & server=$$!; \
	$(BIN)/hybridspec generate "$(PROMPT)" --server 127.0.0.1:$(PORT) --wait 120 --max-new-tokens 48 --ignore-eos; status=$$?; \
	kill -TERM $$server 2>/dev/null; wait $$server; exit $$status

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info
