# The README's two commands. Each sets up everything it needs (scripts/setup.sh is idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast setup bench clean-runs

demo:
	@bash scripts/setup.sh
	@$(PY) -m kvlab.cli demo

# the browser test runs on its own after the parallel tiers: it times a live UI, so it gets the
# whole machine rather than sharing two cores with model tests
# KVLAB_STRICT=1: a test that would skip fails instead (a tier a user cannot run is a failure)
test:
	@bash scripts/setup.sh browser
	@KVLAB_STRICT=1 $(PY) -m pytest -q -n 2 --durations=15 -m "not browser" tests
	@KVLAB_STRICT=1 $(PY) -m pytest -q -m browser tests

test-fast:
	@$(PY) -m pytest -q -m "not model and not notebook and not browser" tests

setup:
	@bash scripts/setup.sh browser

bench:
	@bash scripts/setup.sh
	@$(PY) -m kvlab.cli bench --model smollm2 --repeats 3 --write BENCHMARKS.md

clean-runs:
	rm -rf runs test-artifacts
