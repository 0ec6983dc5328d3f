# Two commands for a new user: `make demo` and `make test`. Both create/reuse .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export XLA_PYTHON_CLIENT_PREALLOCATE ?= false

.PHONY: venv demo test test-all bench bench-device clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	@rm -f $(VENV)/.installed-*; touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/vidax generate --model wan2.1-t2v-1.3b --preset tiny --store vidax-runs \
		--prompt "A red panda paddling a canoe across a misty lake at sunrise"

# the fast tier (CI): every check, exhaustive sweeps sampled (VIDAX_TEST_SEED reproduces a sample);
# PYTEST_ARGS adds options (e.g. --junitxml=times.xml for python -m benchmarks.test_times)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist load -q --durations=25 $(PYTEST_ARGS) tests

# everything: every item of every sweep
test-all: $(STAMP)
	$(BIN)/ruff check .
	VIDAX_TEST_ALL=1 $(BIN)/python -m pytest -n 2 --dist load -q --durations=25 $(PYTEST_ARGS) tests

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run && $(BIN)/python -m benchmarks.scale && $(BIN)/python -m benchmarks.store --big && $(BIN)/python -m benchmarks.plan && $(BIN)/python -m benchmarks.compile

# on a lent GPU / TPU machine: its own venv (.venv-device, the accelerator's jax and torch), the
# paired benchmarks at accelerator sizes (benchmarks/device.sh; --dry-run is in `make test`)
bench-device:
	bash benchmarks/device.sh

clean:
	rm -rf $(VENV) vidax-runs benchmarks/results
