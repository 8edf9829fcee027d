#!/usr/bin/env bash
# Install the baselines the benchmarks compare against, outside the project's .venv:
#   .bench/dynamo-venv   Dynamo 1.6.1's runtime (ai-dynamo-runtime) from PyPI
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .bench
if [ ! -x .bench/dynamo-venv/bin/python ]; then
  python3 -m venv .bench/dynamo-venv
fi
.bench/dynamo-venv/bin/python -m pip install -q --disable-pip-version-check "ai-dynamo-runtime==1.6.1" uvloop \
  2> >(grep -v "is ignored: it is neither" >&2)
echo "baselines ready in .bench/"
