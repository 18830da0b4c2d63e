#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine that has only Python 3.11:
# a virtual environment with the project installed editable (its pinned
# requirements, and the extras asked for), and the Debian font packages the
# kanji data set is rendered from.  Re-running is cheap: each step is skipped
# when its stamp/package is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" - <<'PYEOF' || { echo "bootstrap: Python 3.11 is required (found $($PY --version 2>&1))" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)
PYEOF

# --- Debian fonts -----------------------------------------------------------
mapfile -t FONT_PKGS < scripts/fonts.txt
# the browser test (make test) drives Debian's chromium; the demo does not need it
[ "${WITH_BROWSER:-0}" = 1 ] && FONT_PKGS+=(chromium)
missing=()
for p in "${FONT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  cmd="apt-get install -y --no-install-recommends ${missing[*]}"
  if [ "$(id -u)" -eq 0 ]; then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $cmd >/dev/null
  else
    echo "bootstrap: missing Debian packages. Run as root:" >&2
    echo "  sudo apt-get update && sudo $cmd" >&2
    exit 1
  fi
fi

# --- Python environment -----------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The project itself, editable (`pip install -e .`: one .pth line, nothing written into the
# checkout), with the dependencies pyproject.toml reads from requirements.txt and the extras asked
# for: `test` (requirements-test.txt: pytest, ruff, mypy, playwright) for make test/test-fast/lint,
# `milvus` (requirements-milvus.txt: Milvus Lite, and the Milvus server the tests start) for make
# test.  One stamp per part, so moving between make targets never reinstalls what is already there.
parts=(base)
[ "${WITH_TEST:-0}" = 1 ] && parts+=(test)
[ "${WITH_MILVUS:-0}" = 1 ] && parts+=(milvus)
stamp_of() {  # what the part was installed from: pyproject.toml and its requirements file
  case $1 in
    base) cat pyproject.toml requirements.txt ;;
    test) cat pyproject.toml requirements.txt requirements-test.txt ;;
    milvus) cat pyproject.toml requirements.txt requirements-milvus.txt ;;
  esac | sha256sum | cut -d' ' -f1
}
todo=()
for part in "${parts[@]}"; do
  [ "$(cat ".venv/.installed-$part" 2>/dev/null)" = "$(stamp_of "$part")" ] || todo+=("$part")
done
if [ ${#todo[@]} -gt 0 ]; then
  extras=$(IFS=,; echo "${parts[*]:1}")
  echo "bootstrap: pip install -e .${extras:+[$extras]}"
  # --no-compile: with the bytecode prefix below, Python never reads the .pyc files pip would write
  # beside the sources; each module is compiled into the prefix on its first import instead
  .venv/bin/python -m pip install -q --no-compile -e ".${extras:+[$extras]}"
  for part in "${parts[@]}"; do stamp_of "$part" > ".venv/.installed-$part"; done
fi

# --- bytecode outside the checkout ------------------------------------------
# Python would write __pycache__/ beside every module it imports: a cache inside the source tree.
# A .pth line runs at interpreter start, before any module of ours is imported.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$site/_pycache_outside_checkout.pth" <<'PTH'
import os, sys; sys.pycache_prefix = sys.pycache_prefix or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dml-retrieval", "pycache")
PTH
