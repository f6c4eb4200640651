PY ?= python3
PYTEST_ARGS ?=

.PHONY: install test lint run-runtime

# Installs the project with everything the test suite needs.
install:
	$(PY) -m pip install --quiet -e ".[dev]"

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint:
	ruff check .

# Serves a small model made on the spot: the runtime's main job on a machine without a GPU.
run-runtime: install
	$(PY) -m goodput_runtime.tools.make_model --out .cache/models/tiny-llama
	$(PY) -m goodput_runtime --model .cache/models/tiny-llama --served-model-name tiny --port 8000
