# Two commands for a newcomer (see README):  make demo   and   make test
# Both create or update the Python 3.11 virtual environment in .venv first.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
FAIRSEQ_VERSION := 0.12.3.1
STAMP := $(VENV)/.fastgen-installed

.PHONY: demo test venv clean

venv: $(STAMP)

# torch first, then fairseq-fixed compiled against that torch (--no-build-isolation:
# otherwise pip builds it against a fresh multi-GB CUDA torch), then this package.
$(STAMP): requirements.txt setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation fairseq-fixed==$(FAIRSEQ_VERSION)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Importing fairseq configures the root logger at DEBUG (fairseq/models/wav2vec/wav2vec2_classification.py)
# and then prints install hints and hydra's debug lines; configured first, it shows warnings only.
demo: venv
	$(BIN)/python -c 'import logging; logging.basicConfig(level=logging.WARNING); \
		from fastgen_demo.demo import main; main()'

test: venv
	$(BIN)/python -m pytest tests -q -n 2 --dist loadgroup

clean:
	rm -rf demo_out .pytest_cache
