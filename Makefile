# Quick start: `make demo` and `make test`. Both create .venv when absent and install into it.
# GPU users: make test TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
NPROC ?= 8

.PHONY: setup demo test test-quick test-full bench gpu-check lint mutate corpus docs clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
		examples/train_gpt.py --dp 2 --tp 2 --pp 2

# Tiers (tests/harness/tiers.py): quick on every change, the CI tier (what .ci/run runs), full before resolving.
test: setup
	$(PY) -m pytest -q -m "not full"

test-quick: setup
	$(PY) -m pytest -q -m quick

test-full: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/run.py && $(PY) bench/collect.py

# On a machine with one GPU (a CUDA build of torch): one-rank goldens, every axis's goldens on two ranks sharing the
# GPU, and an HF Llama step's tokens/s and MFU, into bench/results_gpu.md. GPU_CHECK_ARGS=--dry-run runs it on the CPU.
gpu-check: setup
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# Seeded one-line bugs, each against the tests that must catch it, in a copy of HEAD (tests/harness/mutations.py).
mutate: setup
	$(PY) tests/mutate.py

# The architecture corpus at every mesh into bench/corpus.md (resumable: bench/corpus.json caches each cell).
corpus: setup
	HF_HUB_OFFLINE=1 $(PY) bench/corpus.py $(CORPUS_ARGS)

# The guides in docs/ as a site (mkdocs, strict: a broken link fails), into site/.
docs: setup
	$(PY) -m pip install --quiet mkdocs && $(VENV)/bin/mkdocs build --strict

lint: setup
	$(PY) -m pip install --quiet ruff && $(VENV)/bin/ruff check autoshard tests examples bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
