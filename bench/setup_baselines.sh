#!/usr/bin/env bash
# Install the baselines the benchmarks compare against, outside the project's .venv:
#   .bench/dynamo-venv   Dynamo 1.6.1: its runtime (ai-dynamo-runtime) and, for the frontend
#                        benchmark, ai-dynamo (python -m dynamo.frontend, python -m dynamo.mocker)
#   .bench/aiperf-venv   aiperf 0.13, the load generator Dynamo benchmarks with (bench/mocker_compare.py);
#                        its own venv because its pins may conflict with the others
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .bench
for venv in dynamo-venv aiperf-venv; do
  if [ ! -x ".bench/$venv/bin/python" ]; then
    python3 -m venv ".bench/$venv"
  fi
done
pip_into() {  # pip_into VENV ARGS...
  local venv="$1"; shift
  ".bench/$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" \
    2> >(grep -v -e "is ignored: it is neither" -e "pip's dependency resolver does not currently" \
             -e "ai-dynamo 1.6.1 requires aisimulate" -e "ai-dynamo 1.6.1 requires certifi" >&2)
}
pip_install() { pip_into dynamo-venv "$@"; }
pip_install "ai-dynamo-runtime==1.6.1" uvloop
# ai-dynamo requires aisimulate, which cannot be installed here (and which the frontend and the
# mocker's default path do not import): install it without dependencies, then its other requirements
# (certifi unpinned: the registry here has nothing as new as the >=2026.10.19 it asks for).
pip_install --no-deps "ai-dynamo==1.6.1"
pip_install "aiohttp>=3.14.3,<4" certifi "kubernetes>=32.0.1,<33" "msgspec>=0.19.0" \
  "prometheus-client>=0.23.1,<1" "pyzmq>=26.0.0" "redis>=6.2.0,<9" "tqdm>=4.0.0" "transformers>=4.56.0" \
  "typing-extensions>=4.10.0" "zstandard>=0.23.0,<1"
pip_into aiperf-venv "aiperf==0.13.*"
.bench/aiperf-venv/bin/aiperf --help >/dev/null
echo "baselines ready in .bench/"
