#!/usr/bin/env bash
# Installs everything the study needs on a Debian/Ubuntu machine, idempotently:
#   - the embedded data set, Fashion-MNIST, from Debian's dataset-fashion-mnist package;
#   - the pinned Python packages (envs/requirements.txt) and this project (editable).
# Set PYTHON to choose the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  if command -v apt-get >/dev/null; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "setup: installing dataset-fashion-mnist (apt)"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "setup: no apt-get here; set dataset.root to a Fashion-MNIST folder (or dataset.download: true)" >&2
  fi
fi

echo "setup: installing Python packages (envs/requirements.txt)"
"$PYTHON" -m pip install -q --disable-pip-version-check -r envs/requirements.txt
"$PYTHON" -m pip install -q --disable-pip-version-check --no-deps -e .
echo "setup: done"
