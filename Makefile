# meshserve: the two commands a new user needs are `make demo` and `make test`.
PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Test files are spread over JOBS processes (pytest-xdist), each file kept whole in one so its
# module fixtures (compiled engines) are built once.
JOBS ?= 2
# The torch the HF tests run on, installed before the `[test]` extra (whose `torch>=2.2` it
# satisfies) so that pip does not pick a torch itself: a bare `torch` resolves to the newest CUDA
# build, several GB. The default pins the version whose CPU build (2.13.0+cpu) a local wheel
# folder may hold, which pip then prefers; any pip requirement and options will do, e.g.
#   make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0

.PHONY: install demo test test-fast clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	# setuptools' notice that an editable install maps folders is the only line it would print.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

DEMO_FLAGS := --max-num-seqs 8 --prefill-chunk 128 --max-num-batched-tokens 256 --max-model-len 512

demo: $(STAMP)
	rm -f .cache/demo-results.jsonl
	$(VENV)/bin/meshserve batch --input serving/examples/demo_prompts.jsonl \
		--output .cache/demo-results.jsonl --show $(DEMO_FLAGS)

test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
