# Everything runs from .venv, which `make setup` creates (scripts/setup.sh; a no-op once done).
PY := .venv/bin/python

.PHONY: setup demo test test-fast lint

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) examples/rag/demo.py

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

lint: setup
	.venv/bin/ruff check .
