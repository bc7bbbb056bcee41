#!/usr/bin/env bash
# Create .venv with Python 3.12 and install this project (editable) with its test tools.
# megatron-core 0.17+ needs Python >= 3.12. We look for one in this order:
#   $PYTHON, python3.12 on PATH, pyenv's installed 3.12.x, python3 if it is 3.12+.
# (A pyenv shim named python3.12 exists even when pyenv has no active 3.12 and then fails;
# each candidate is therefore run, not just found.)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

is_py312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
    local candidates=()
    [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
    candidates+=("$(command -v python3.12 || true)")
    if command -v pyenv >/dev/null 2>&1; then
        local root; root=$(pyenv root)
        for p in $(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
            candidates+=("$p")
        done
    fi
    candidates+=("$(command -v python3 || true)")
    for c in "${candidates[@]}"; do
        [ -n "$c" ] && is_py312 "$c" && { echo "$c"; return 0; }
    done
    return 1
}

if [ -x "$VENV/bin/python" ] && is_py312 "$VENV/bin/python" && [ -f "$VENV/.megagpt-installed" ] \
   && [ "$VENV/.megagpt-installed" -nt pyproject.toml ]; then
    exit 0  # already set up for this pyproject.toml
fi

PY=$(find_python) || {
    echo "error: no Python >= 3.12 found (megatron-core needs it). Install one, e.g." >&2
    echo "  pyenv install 3.12   or set PYTHON=/path/to/python3.12" >&2
    exit 1
}
echo "setup: using $PY ($("$PY" --version))"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch from PyPI on Linux is the CUDA build: it runs on CPUs too (CPU mode, tests).
"$VENV/bin/python" -m pip install --quiet -e ".[test]"
touch "$VENV/.megagpt-installed"
echo "setup: $VENV ready"
