"""The connector's namespace: engines whose pages would differ never share them. A checkpoint rewritten in place
(same path and config, new weights) gets another namespace; a copy of it elsewhere keeps its own."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
from kvservice.integrations.vllm.connector.identity import (  # noqa: E402
    MAX_WINDOWS,
    WINDOW,
    _spread,
    checkpoint_fingerprint,
    model_namespace,
)


def save_checkpoint(path, seed: int, shapes=((64, 32), (128,), (8, 8, 8))) -> None:
    gen = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"layer.{i}.weight": torch.randn(*s, generator=gen) for i, s in enumerate(shapes)}
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 3}')


def test_weights_rewritten_in_place_change_the_fingerprint(tmp_path):
    model = tmp_path / "model"
    save_checkpoint(model, seed=1)
    before = checkpoint_fingerprint(str(model))
    stat = os.stat(model / "model.safetensors")
    save_checkpoint(model, seed=2)  # same names, shapes, size and config: new weights
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even the same mtime
    assert os.path.getsize(model / "model.safetensors") == stat.st_size
    assert checkpoint_fingerprint(str(model)) != before


def test_a_copy_elsewhere_shares_the_fingerprint_and_the_config_counts(tmp_path):
    model = tmp_path / "model"
    save_checkpoint(model, seed=1)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(model, copy)
    os.utime(copy / "model.safetensors", (1, 1))  # another node's copy: another mtime
    assert checkpoint_fingerprint(str(copy)) == checkpoint_fingerprint(str(model))
    (copy / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 4}')
    assert checkpoint_fingerprint(str(copy)) != checkpoint_fingerprint(str(model))


def test_a_hub_snapshot_is_fingerprinted_by_its_blob_names(tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    (blobs / ("a" * 64)).write_bytes(b"weights one")
    os.symlink(blobs / ("a" * 64), snap / "model.safetensors")
    first = checkpoint_fingerprint(str(snap))
    (blobs / ("b" * 64)).write_bytes(b"weights two")
    os.unlink(snap / "model.safetensors")
    os.symlink(blobs / ("b" * 64), snap / "model.safetensors")
    assert checkpoint_fingerprint(str(snap)) != first
    assert checkpoint_fingerprint("org/model-name") == "name:org/model-name"  # not a local directory


def test_sampling_is_bounded_for_a_huge_file():
    offsets = _spread(0, 100 << 30, MAX_WINDOWS)  # a 100 GiB file
    assert len(offsets) == MAX_WINDOWS and offsets[0] == 0 and offsets[-1] == (100 << 30) - WINDOW
    assert _spread(10, 10 + WINDOW, 3) == [10] and _spread(5, 5, 3) == []


def config(model: str, **kw) -> SimpleNamespace:
    m = dict(model=model, revision=None, dtype="bfloat16", quantization=None)
    c = dict(cache_dtype="auto", block_size=16)
    p = dict(tensor_parallel_size=1)
    for key, value in kw.items():
        (m if key in m else c if key in c else p)[key] = value
    return SimpleNamespace(model_config=SimpleNamespace(**m), cache_config=SimpleNamespace(**c),
                           parallel_config=SimpleNamespace(**p))


def test_the_namespace_separates_what_makes_pages_differ(tmp_path):
    model = tmp_path / "model"
    save_checkpoint(model, seed=1)
    base = model_namespace(config(str(model)))
    assert model_namespace(config(str(model))) == base
    others = [model_namespace(config(str(model), cache_dtype="fp8")),
              model_namespace(config(str(model), cache_dtype="fp8_e5m2")),
              model_namespace(config(str(model), dtype="float16")),
              model_namespace(config(str(model), block_size=32)),
              model_namespace(config(str(model), tensor_parallel_size=2)),
              model_namespace(config(str(model)), page_family="opaque:cpu-amx")]
    assert len({base, *others}) == len(others) + 1
