# The two entry points of the README.  Both set up everything they need.
PY := .venv/bin/python
DEMO_ARGS ?=
TEST_ARGS ?=

.PHONY: demo test setup bench clean

setup:
	bash scripts/bootstrap.sh

demo: setup
	$(PY) -m demo $(DEMO_ARGS)

test:
	WITH_BROWSER=1 WITH_MILVUS=1 bash scripts/bootstrap.sh
	$(PY) -m pytest -q $(TEST_ARGS)

clean:
	rm -rf .venv runs cache artifacts
