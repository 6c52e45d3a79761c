# The two commands a user runs on a fresh machine: `make demo` and `make test`.
# Both create .venv if it is missing, install torch 2.13.0 (CPU) first, then the package.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# the public DFlash reference, which the tests load our drafts into (it needs only torch and transformers;
	# its own pins would replace ours)
	$(BIN)/python -m pip install --quiet --no-deps dflash==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/blockspec demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
