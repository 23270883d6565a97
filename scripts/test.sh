#!/usr/bin/env bash
# Installs everything the tests need (Python packages and Debian's Chromium), then runs them.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k api`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements-test.txt
# The int4 test quantizes the tiny model with GPT-QModel (see requirements-quant.txt for why --no-deps).
python -m pip install -q --no-deps -r requirements-quant.txt
if [ ! -x /usr/bin/chromium ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq chromium >/dev/null
fi
python -m pytest "$@"
