"""Which Hugging Face decoder models run on kvservice's paged KV, and how their layers map to KV-cache groups.

    config.json (+ generation_config.json) -> ModelSpec: architecture, layer -> group, group specs, EOS ids
    Refused fields raise UnsupportedModelError naming the field and its value; nothing is approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvservice.core import FullAttentionSpec, SlidingWindowSpec

# model_type -> what the architecture brings to the paged path (README's table).
SUPPORTED: dict[str, str] = {
    "llama": "Llama: GQA, RoPE",
    "qwen2": "Qwen2: QKV bias (sliding-window layers when use_sliding_window)",
    "qwen3": "Qwen3: q/k RMSNorm (sliding-window layers when use_sliding_window)",
    "mistral": "Mistral: sliding window on every layer",
    "gemma3_text": "Gemma 3 text: alternating sliding-window and global layers (two KV-cache groups)",
}
LAYER_TYPES = {"full_attention": None, "sliding_attention": "sliding"}


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something the paged path does not compute."""


@dataclass(slots=True, frozen=True)
class ModelSpec:
    path: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    layer_groups: tuple[int, ...]  # layer -> KV-cache group
    sliding_windows: tuple[int | None, ...]  # group -> window (None: full attention)
    eos_token_ids: tuple[int, ...]

    def kv_cache_groups(self, block_size: int) -> tuple[FullAttentionSpec | SlidingWindowSpec, ...]:
        """Under DCP full attention is sharded across the ranks and a sliding window is replicated on
        each (vLLM's `dcp_sharded`); with one rank the two are the same."""
        return tuple(FullAttentionSpec(block_size) if w is None else SlidingWindowSpec(block_size, w, dcp_sharded=False)
                     for w in self.sliding_windows)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.dtype.itemsize


def _refuse(path: str, field: str, value: object, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{path}: config field {field}={value!r} is not supported: {why}")


def load_model_spec(path: str | Path, dtype: str | torch.dtype = "auto") -> ModelSpec:
    """Reads a `save_pretrained` directory's config (no weights) and checks it can run paged.

    Args:
        dtype: "auto" (the config's dtype, float32 when it names none) or a torch dtype.
    Raises:
        FileNotFoundError: no config.json there.
        UnsupportedModelError: an architecture or a config field the paged path would not compute exactly.
    """
    path = str(Path(path).expanduser())
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json; point --model at a directory written by save_pretrained")
    cfg = json.loads(config_file.read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise _refuse(path, "model_type", model_type, f"supported model types are {sorted(SUPPORTED)} "
                      f"(architectures {cfg.get('architectures')})")
    for field, why in (("attn_logit_softcapping", "the paged kernels compute plain softmax attention"),
                       ("attention_chunk_size", "chunked local attention has no worker kernel"),
                       ("quantization_config", "quantized checkpoints are not loaded")):
        if cfg.get(field) is not None:
            raise _refuse(path, field, cfg[field], why)
    if cfg.get("use_bidirectional_attention"):
        raise _refuse(path, "use_bidirectional_attention", True, "decoding is causal")
    num_layers = cfg["num_hidden_layers"]
    num_heads = cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_key_value_heads") or num_heads
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    if num_heads % num_kv_heads:
        raise _refuse(path, "num_key_value_heads", num_kv_heads, f"must divide num_attention_heads {num_heads}")
    layer_groups, windows = _layer_groups(path, model_type, cfg, num_layers)
    return ModelSpec(path, model_type, num_layers, num_kv_heads, head_size, cfg["vocab_size"],
                     cfg.get("max_position_embeddings", 2048), _dtype(path, cfg, dtype), layer_groups, windows,
                     _eos_token_ids(path, cfg))


def _layer_groups(path: str, model_type: str, cfg: dict, num_layers: int):
    """Layer -> group index and the groups' windows: full attention first, then the sliding window."""
    window = cfg.get("sliding_window")
    if model_type == "mistral":  # every layer attends through config.sliding_window when it is set
        types = ["sliding_attention" if window else "full_attention"] * num_layers
    elif model_type == "llama":
        types = ["full_attention"] * num_layers
    else:
        types = cfg.get("layer_types") or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise _refuse(path, "layer_types", types, f"{len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise _refuse(path, "layer_types", unknown, f"layer types must be among {sorted(LAYER_TYPES)}")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise _refuse(path, "sliding_window", window, "sliding-window layers need a positive window")
    kinds = [t for t in ("full_attention", "sliding_attention") if t in types]
    windows = tuple(None if t == "full_attention" else window for t in kinds)
    return tuple(kinds.index(t) for t in types), windows


def _dtype(path: str, cfg: dict, dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (cfg.get("dtype") or cfg.get("torch_dtype") or "float32") if dtype == "auto" else dtype
    resolved = getattr(torch, str(name), None)
    if not isinstance(resolved, torch.dtype) or resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise _refuse(path, "dtype", name, "the KV caches are float32, float16 or bfloat16")
    return resolved


def _eos_token_ids(path: str, cfg: dict) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (what `generate` stops on), else config.json's."""
    gen_file = Path(path) / "generation_config.json"
    eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
