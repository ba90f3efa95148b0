#!/usr/bin/env bash
# Install the pinned engine releases the loader test runs (tests/test_engine_loaders.py) into .engines/<engine>-<version>,
# one folder each (the releases cannot share one environment), each with --no-deps beside the project's venv.
# Idempotent: a folder whose stamp matches its requirements file is left as it is.
#   bash tests/engine_loaders/install.sh [PYTHON]      (PYTHON: default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${1:-.venv/bin/python}"
for requirements in tests/engine_loaders/requirements-*.txt; do
  name="$(basename "$requirements" .txt)"; name="${name#requirements-}"
  target=".engines/$name"
  stamp="$(sha256sum "$requirements" | cut -d' ' -f1)"
  if [ -f "$target/.installed" ] && [ "$(cat "$target/.installed")" = "$stamp" ]; then
    echo "$name: installed"; continue
  fi
  rm -rf "$target"
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$target" -r "$requirements"
  # vLLM's compiled kernels (about 340 MB, built for another torch): the loader test never loads them
  rm -f "$target"/vllm/_C*.so
  echo "$stamp" > "$target/.installed"
  echo "$name: installed into $target ($(du -sh "$target" | cut -f1))"
done
