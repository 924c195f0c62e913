"""What makes two engines' pages interchangeable: the connector's namespace, salted into every prompt's block
hashes, so engines whose KV would differ never find each other's pages.

The namespace covers the checkpoint (its weights, by `checkpoint_fingerprint`, and with them an fp8 cache's
scales: vLLM 0.32 and 0.33 take them from the checkpoint or use 1.0), the model's dtype and quantization, the KV
cache's dtype, the block size, the tensor-parallel size (a page holds every rank's
slice at a fixed place) and the page format family. No vLLM import here: `model_namespace` reads the config's
attributes.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
IDENTITY_FILES = ("config.json",)  # the architecture: what the KV shape and the attention depend on
WINDOW = 4096  # bytes read per sampled window
MAX_WINDOWS = 4096  # per checkpoint: ~16 MiB read at most, whatever its size
BLOB_NAME = re.compile(r"^[0-9a-f]{64}$")  # a Hugging Face cache blob is named by its sha256


def checkpoint_fingerprint(model: str) -> str:
    """A fingerprint of the weights a local checkpoint directory holds, cheap for a 100 GB checkpoint.

    Covers, per weight file (sorted by name): its name and size, and either the sha256 its name carries (a
    Hugging Face cache snapshot links each file to `blobs/<sha256>`) or its content sampled: the safetensors
    header whole (every tensor's name, dtype, shape and offsets) and a 4 KiB window at the start, middle and
    end of every tensor's data (other formats: windows spread over the file), at most ~16 MiB read in all.
    Plus config.json whole. Not covered: modification times (a copy of the checkpoint elsewhere, or on another
    node, shares its pages) and bytes outside the windows (an edit of a few weights inside a tensor; a new
    training run or checkpoint changes every tensor). A model that is not a local directory (a Hub id vLLM
    downloads) is its name, and the namespace adds its revision: pin a revision, or set `namespace`.
    """
    root = Path(model)
    if not root.is_dir():
        return f"name:{model}"
    digest = xxhash.xxh3_128()
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    budget = max(3, MAX_WINDOWS // max(1, len(files)))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        blob = os.path.basename(os.path.realpath(path))
        if BLOB_NAME.match(blob):
            digest.update(blob.encode())
            continue
        with open(path, "rb") as f:
            if path.suffix == ".safetensors":
                _sample_safetensors(f, size, budget, digest)
            else:
                _sample(f, _spread(0, size, budget), digest)
    for name in IDENTITY_FILES:
        path = root / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _spread(start: int, end: int, count: int) -> list[int]:
    """Up to `count` window offsets spread over [start, end), the first and the last included."""
    span = end - start
    if span <= 0:
        return []
    if span <= WINDOW:
        return [start]
    last = end - WINDOW
    if count <= 1:
        return [start]
    return sorted({start + (last - start) * i // (count - 1) for i in range(count)})


def _sample(f, offsets: list[int], digest) -> None:
    for offset in offsets:
        f.seek(offset)
        digest.update(f.read(WINDOW))


def _sample_safetensors(f, size: int, budget: int, digest) -> None:
    head = f.read(8)
    if len(head) < 8:
        digest.update(head)
        return
    (header_len,) = struct.unpack("<Q", head)
    if header_len > min(size - 8, 100 << 20):
        _sample(f, _spread(0, size, budget), digest)  # not a safetensors header: sample it as bytes
        return
    header = f.read(header_len)
    digest.update(header)
    try:
        tensors = json.loads(header)
    except ValueError:
        _sample(f, _spread(0, size, budget), digest)
        return
    base = 8 + header_len
    spans = sorted(tuple(t["data_offsets"]) for name, t in tensors.items()
                   if name != "__metadata__" and isinstance(t, dict) and "data_offsets" in t)
    per_tensor = 3 if 3 * len(spans) <= budget else 1
    offsets: list[int] = []
    for begin, end in spans:
        windows = _spread(base + begin, base + end, per_tensor)
        offsets += windows if per_tensor == 3 else windows[len(windows) // 2:][:1]
    if len(offsets) > budget:  # a checkpoint of many tiny tensors: an even subset
        offsets = [offsets[i * len(offsets) // budget] for i in range(budget)]
    _sample(f, offsets, digest)


def model_namespace(vllm_config, page_family: str = "canonical") -> str:
    """The namespace of an engine's pages: engines share pages only when every part is equal.

    Args:
        vllm_config: vLLM's config (model, cache and parallel settings are read from it).
        page_family: how pages are laid out ("canonical": kvservice's own order, whatever the engine's
            attention layout; otherwise a name that only identical engines share).
    """
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    parts = [
        "kvc/2",
        checkpoint_fingerprint(str(model.model)),
        getattr(model, "revision", None),
        model.dtype,
        getattr(model, "quantization", None),
        getattr(model, "hf_overrides", None) or None,  # rope scaling and the like change the KV
        cache.cache_dtype,
        cache.block_size,
        f"tp={parallel.tensor_parallel_size}",
        page_family,
    ]
    return "kvc-" + xxhash.xxh3_64_hexdigest("|".join(str(p) for p in parts).encode())
