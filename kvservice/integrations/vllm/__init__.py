"""vLLM 0.33.0 integration: `core` is a drop-in for vLLM's v1 KV-cache core backed by kvservice.core."""
