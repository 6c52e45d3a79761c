# The two commands a user runs on a fresh machine: `make demo` and `make test`.
# Both create .venv if it is missing, install torch 2.13.0 (CPU) first, then the package at the versions
# constraints.txt pins.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the tests set torch to one thread each, so one worker per core keeps the machine busy
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

.PHONY: demo test test-all fuzz install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[all,test]"
	# the public DFlash reference, which the tests load our drafts into (it needs only torch and transformers;
	# its own pins would replace ours)
	$(BIN)/python -m pip install --quiet --no-deps dflash==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/blockspec demo

# the fast tier: every behaviour, each checked once
test: $(STAMP)
	$(PYTEST) -m "not slow"

# the fast tier and the long one (sweeps over many prompts, families, widths and seeds; CI runs this)
test-all: $(STAMP)
	$(PYTEST)

# the HTTP API and the command line under many more generated inputs than the suite's bounded run
fuzz: $(STAMP)
	BLOCKSPEC_FUZZ_REQUESTS=2000 BLOCKSPEC_FUZZ_COMMANDS=500 $(BIN)/python -m pytest -q tests/test_fuzz.py

clean:
	rm -rf $(VENV)
