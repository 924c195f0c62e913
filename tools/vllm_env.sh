#!/usr/bin/env bash
# Builds (once per machine) the environment in which vLLM 0.33.0's pure-Python v1 core and scheduler import
# on a CPU-only machine, beside this project: a venv with torch==2.13.0 (the CPU build), the packages vLLM's
# imports ask for and this project's own dependencies; the vLLM wheel unzipped (compiled .so files removed)
# into src/; vLLM's own tests from its sdist into tests/. Everything lives under one cache dir, named by the
# Makefile (VLLM_ENV); the checkout goes on PYTHONPATH, never into the venv, so every clone shares the cache.
#
#   tools/vllm_env.sh DIR          build or refresh (a stamp per recipe; a finished step is not redone)
#   DIR/venv/bin/python ...        with PYTHONPATH=<checkout>:DIR/src  (`make test-vllm` does this)
#
# vLLM itself pins a CUDA torch and ~80 packages; none of that is installed, only what the scheduler and the
# KV-cache core import. Downloads are checked against PyPI's sha256.
set -euo pipefail
D=${1:?usage: tools/vllm_env.sh CACHE_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VLLM_VERSION=0.33.0
WHEEL=vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
WHEEL_SHA=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
SDIST=vllm-0.33.0.tar.gz
SDIST_SHA=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
# What vLLM's scheduler, KV-cache core, event publisher and their imports need (pure Python or wheels).
VLLM_DEPS=(torch==2.13.0 numpy packaging psutil pyzmq urllib3 regex msgspec pydantic cbor2 einops
  transformers==5.23.0 tokenizers aiohttp requests openai_harmony openai pillow pybase64 cachetools cloudpickle
  uvloop py-cpuinfo prometheus_client xgrammar fastapi partial_json_parser llguidance blake3 gguf
  sentencepiece tiktoken protobuf pyyaml six setuptools diskcache lark lm-format-enforcer
  mistral_common opencv-python-headless scipy ninja depyf watchfiles python-json-logger pytest pytest-timeout
  pytest-asyncio)
step() { printf '[vllm-env] %s\n' "$*" >&2; }
mkdir -p "$D/dl"
recipe=$(cat "$0" "$REPO/pyproject.toml" | sha256sum | cut -c1-16)

if [ ! -x "$D/venv/bin/python" ]; then
  step "venv in $D/venv"
  python3 -m venv "$D/venv"
fi
if [ ! -f "$D/.deps-$recipe" ]; then
  step "installing vLLM's pure-Python dependencies and this project's (a few minutes the first time)"
  "$D/venv/bin/pip" install -q --upgrade pip setuptools wheel
  "$D/venv/bin/pip" install -q "${VLLM_DEPS[@]}"
  # The project's own dependencies, read from pyproject.toml (the project itself stays on PYTHONPATH).
  mapfile -t own < <("$D/venv/bin/python" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
extra = p.get("optional-dependencies", {})
for d in p["dependencies"] + extra.get("dev", []) + extra.get("worker", []) + extra.get("models", []):
    if not d.startswith(("torch", "atheris")):
        print(d)
EOF
)
  "$D/venv/bin/pip" install -q "${own[@]}"
  rm -f "$D"/.deps-*
  touch "$D/.deps-$recipe"
fi

fetch() {  # fetch FILE SHA: from PyPI's simple index into dl/, checked
  local file=$1 sha=$2
  if [ ! -f "$D/dl/$file" ] || ! echo "$sha  $D/dl/$file" | sha256sum -c --status; then
    step "downloading $file"
    "$D/venv/bin/python" - "$file" "$D/dl/$file" <<'EOF'
import re, sys, urllib.request
name, dest = sys.argv[1], sys.argv[2]
index = urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=120).read().decode()
url = next(u for u in re.findall(r'href="([^"#]+)', index) if u.endswith("/" + name))
urllib.request.urlretrieve(url, dest)
EOF
    echo "$sha  $D/dl/$file" | sha256sum -c --status || { step "sha256 mismatch for $file"; exit 1; }
  fi
}

if [ ! -f "$D/.src-$VLLM_VERSION" ]; then
  fetch "$WHEEL" "$WHEEL_SHA"
  step "unzipping the wheel into $D/src (compiled extensions removed)"
  rm -rf "$D/src" && mkdir -p "$D/src"
  (cd "$D/src" && "$D/venv/bin/python" -m zipfile -e "$D/dl/$WHEEL" . && find . -name '*.so' -delete)
  touch "$D/.src-$VLLM_VERSION"
fi
if [ ! -f "$D/.tests-$VLLM_VERSION" ]; then
  fetch "$SDIST" "$SDIST_SHA"
  step "extracting vLLM's tests from the sdist into $D/tests"
  rm -rf "$D/tests" && mkdir -p "$D/tests"
  tar -xzf "$D/dl/$SDIST" -C "$D/tests" --strip-components=1 "vllm-$VLLM_VERSION/tests"
  touch "$D/.tests-$VLLM_VERSION"
fi
VLLM_TARGET_DEVICE=cpu PYTHONPATH="$REPO:$D/src" "$D/venv/bin/python" -c \
  "import vllm.v1.core.sched.scheduler, vllm.v1.core.kv_cache_manager; print('[vllm-env] vLLM $VLLM_VERSION scheduler and core import')"
