# The README's entry points.  Each sets up what it needs (scripts/bootstrap.sh is idempotent).
PY := .venv/bin/python
DEMO_ARGS ?=
TEST_ARGS ?=
# test processes (pytest-xdist), each with one torch/BLAS thread, handed tests as they free up
# (worksteal).  More processes than the 2 cores: in 2 the cores sit idle for 22 % of the suite, waiting
# on Milvus servers, browsers and started processes; in 4 they are 99 % busy (docs/development.md)
TEST_WORKERS ?= 4
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal
# what `make test-fast` leaves out: a real browser, Milvus (Lite and a server), and tests that start several processes
SLOW_MARKERS := not browser and not milvus and not multiprocess

.PHONY: setup setup-dev setup-test demo test test-fast lint clean

# the project (pip install -e .) with its runtime dependencies, and the fonts kanji is rendered from
setup:
	bash scripts/bootstrap.sh

# + the test and lint tools (the `test` extra); no browser, no Milvus
setup-dev:
	WITH_TEST=1 bash scripts/bootstrap.sh

# + Debian's chromium for the browser tests and the `milvus` extra for the Milvus tests (Milvus Lite, and
# the Milvus server the tests start on 127.0.0.1)
setup-test:
	WITH_BROWSER=1 WITH_MILVUS=1 WITH_TEST=1 bash scripts/bootstrap.sh

demo: setup
	$(PY) -m demo $(DEMO_ARGS)

# ruff (pyproject.toml [tool.ruff]) and mypy ([tool.mypy]) over every package
lint: setup-dev
	$(PY) -m ruff check .
	$(PY) -m mypy

# the whole suite (CI runs `make lint` first)
test: setup-test
	$(PYTEST) $(TEST_ARGS)

# the suite without the browser, Milvus and multi-process tests: for a quick check while working
test-fast: setup-dev
	$(PYTEST) -m "$(SLOW_MARKERS)" $(TEST_ARGS)

clean:
	rm -rf .venv runs cache artifacts
