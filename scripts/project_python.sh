# Sourced by the examples: PYTHON, the interpreter they run (no activated environment needed).
#   $PYTHON if set; else the active virtual environment's (VIRTUAL_ENV); else the project's
#   .venv (make venv); else python3 on PATH if it finds megatron-core; else one error line.
# Usage: source "$REPO/scripts/project_python.sh" "$REPO"

_megagpt_has_megatron() {
    "$1" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("megatron") is None)' \
        >/dev/null 2>&1
}

if [[ -z ${PYTHON:-} ]]; then
    if [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]] \
            && _megagpt_has_megatron "$VIRTUAL_ENV/bin/python"; then
        PYTHON=$VIRTUAL_ENV/bin/python
    elif [[ -x $1/.venv/bin/python ]]; then
        PYTHON=$1/.venv/bin/python
    elif command -v python3 >/dev/null && _megagpt_has_megatron python3; then
        PYTHON=python3
    else
        echo "error: no Python with megatron-core: run \`make venv\` in $1 (it creates" \
             ".venv, which the examples then use), or set PYTHON" >&2
        exit 2
    fi
fi
