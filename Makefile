# Each target sets everything up first (idempotent: seconds when nothing changed).
#   make run  [ARGS="precision=amp epochs=3"]   the main job: python run.py with the defaults
#   make test [PYTEST_ARGS="-k mlflow"]         the test suite, three tests at a time (TEST_WORKERS)
VENV ?= .venv
TEST_WORKERS ?= 3
PY := $(VENV)/bin/python

.PHONY: setup run test lint format bench clean
setup:
	bash scripts/setup.sh

run: setup
	$(PY) run.py $(ARGS)

# three at a time on 2 cores: a test often waits (for its workers to start, a server to answer,
# a locked store, a signalled job), and a third test uses the cores meanwhile; each process on
# one thread (more threads only contend). Then the tests marked `alone` (they time things) by
# themselves, so that no worker idles waiting for the room (pytest exits 5 when PYTEST_ARGS
# select no such test)
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not alone" $(PYTEST_ARGS)
	$(PY) -m pytest -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ]

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/pipeline.py

clean:
	rm -rf .pytest_cache .ruff_cache build *.egg-info
