# Shared by scripts/run and scripts/test: make (once) the project's virtual environment and keep
# it in step with pyproject.toml. Sourced, not run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GPU_PROVIDER_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed-$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtual environment in $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
    echo "installing gpu-provider and its dependencies into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[gui,test]" >&2
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
