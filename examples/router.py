"""The router for stock vLLM fleets is `kvservice route` now (kvservice/router, docs/integrations/routing.md): an
OpenAI-compatible front door that scores each engine by its estimated time to first token (its own cache from
its KV events, the stores, its load), with streaming, retries, health checks, tenants, P/D and metrics. This
script runs it with the arguments given, the old ones included (`--backend POOL=URL`: the pool is the name):

    python examples/router.py --allocator 127.0.0.1:50051 \
        --backend vllm-0=http://10.0.0.1:8000 --backend vllm-1=http://10.0.0.2:8000 --port 8080
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout without installing

from kvservice.router.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
