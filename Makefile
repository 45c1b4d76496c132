# Two commands on a fresh Debian/Ubuntu machine with Python 3.11: `make demo` and `make test`.
# Both depend on `make setup`, which creates .venv on first use and is a no-op afterwards
# (until pyproject.toml changes).

PYTHON   ?= python3.11
VENV     ?= .venv
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.setup-stamp
# CPU wheels of torch; skipped where that host cannot be resolved (pip then takes torch from
# its configured indexes).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_EXTRA := $(shell getent hosts download.pytorch.org >/dev/null 2>&1 && echo --extra-index-url $(TORCH_INDEX))
DEMO     ?= build/demo
BENCH_VENV ?= .venv-bench

.PHONY: setup demo online-demo test test-fast bench bench-env lint clean system-packages compose-data compose-secrets

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null 2>&1 && command -v docker-compose >/dev/null 2>&1 || $(MAKE) --no-print-directory system-packages
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_EXTRA) torch==2.13.0
	$(BIN)/pip install --quiet -e '.[cpu,dev]'
	@$(BIN)/python -c "import torch, fbgemm_gpu; print('setup ok: torch', torch.__version__, '+ fbgemm_gpu')"
	@$(BIN)/python -c "from embedding_server.idmap import native; print('id maps C kernel:', native.build())" \
		|| echo "note: no C compiler: the id maps run their torch version (slower)"
	@touch $(STAMP)

demo: setup
	BIN=$(BIN) DEMO=$(DEMO) bash scripts/demo.sh

online-demo: setup
	BIN=$(BIN) bash scripts/online_demo.sh

# Debian's redis-server and docker-compose, for the integration tests (which skip them when
# missing; CI installs them itself).
system-packages:
	@if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=sudo; \
	else echo "note: redis-server / docker-compose need root: sudo apt-get install redis-server docker-compose"; exit 0; fi; \
	$$SUDO apt-get install -y -q redis-server docker-compose >/dev/null 2>&1 || { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q redis-server docker-compose >/dev/null; }; \
	command -v redis-server >/dev/null && echo "installed $$(redis-server --version | cut -d' ' -f3), docker-compose $$(docker-compose version --short)"

# Secrets for `docker compose -f docker/compose.yaml up` (docker/secrets/, kept when they exist).
compose-secrets:
	$(PYTHON) scripts/compose_secrets.py docker/secrets

# Data for `docker compose -f docker/compose.yaml up` (mounted at /data).
compose-data: setup
	$(BIN)/dlrm data synth --train-rows 200000 --test-rows 20000 --seed 0 --out build/compose-data > /dev/null

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Benchmarks run one at a time (2 cores: parallel runs distort each other). TorchRec lives in a
# separate environment, installed with --no-deps so that it cannot replace fbgemm-gpu-cpu.
bench-env: $(BENCH_VENV)/.stamp

$(BENCH_VENV)/.stamp: pyproject.toml bench/requirements-torchrec.txt bench/requirements-peers.txt
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet $(TORCH_EXTRA) torch==2.13.0
	$(BENCH_VENV)/bin/pip install --quiet -e '.[cpu,dev]' -r bench/requirements-torchrec.txt \
		-r bench/requirements-peers.txt
	$(BENCH_VENV)/bin/pip install --quiet --no-deps torchrec==1.8.0
	@touch $@

bench: setup bench-env
	$(BENCH_VENV)/bin/python bench/train_throughput.py
	$(BENCH_VENV)/bin/python bench/distributed_throughput.py
	$(BIN)/python bench/quality.py
	$(BIN)/python bench/defaults.py
	$(BENCH_VENV)/bin/python bench/peers.py
	$(BIN)/python bench/serving.py
	$(BIN)/python bench/dmt.py

clean:
	rm -rf build .pytest_cache
