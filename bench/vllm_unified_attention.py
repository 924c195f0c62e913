"""vLLM 0.33.0's Triton paged attention (`unified_attention`), loaded from its Python tree without vLLM installed.

`triton_unified_attention.py` imports five vLLM modules; this loader registers small stand-ins for them
(env flags off, a logger, a CUDA platform, the real triton, and `KVQuantMode` taken from vLLM's own source
by parsing just that class) and then loads the two real files, the kernel module and
`triton_attention_helpers.py`. Only torch, triton and the standard library are imported here.

`TritonAttentionCall` reproduces how vLLM's TRITON_ATTN backend calls it: split-K ("3D") for batches of
fewer than `128 // num_kv_heads` sequences, with 16 segments, into preallocated scratch.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import sys
import types
from enum import IntEnum
from pathlib import Path

import torch
import triton
import triton.language as tl

OPS = "vllm/v1/attention/ops"
MIN_LAUNCH_GRID_SIZE_2D = 128  # vLLM's TRITON_ATTN backend constants
NUM_PAR_SOFTMAX_SEGMENTS = 16


class _Logger(logging.LoggerAdapter):
    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)

    info_once = warning_once = debug_once


class _Platform:
    """The `current_platform` attributes the kernel module reads."""

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn

    @staticmethod
    def is_cuda() -> bool:
        return True

    @staticmethod
    def is_device_capability_family(capability: int, device_id: int = 0) -> bool:
        major, minor = torch.cuda.get_device_capability(device_id)
        return (major * 10 + minor) // 10 == capability // 10


def _kv_quant_mode(src: Path) -> type[IntEnum]:
    """vLLM's `KVQuantMode` enum, executed alone from `kv_cache_interface.py` (the rest needs vLLM)."""
    tree = ast.parse((src / "vllm/v1/kv_cache_interface.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVQuantMode")
    namespace: dict[str, object] = {"IntEnum": IntEnum}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "kv_cache_interface.py", "exec"), namespace)
    return namespace["KVQuantMode"]  # type: ignore[return-value]


def _module(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so submodules resolve
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_unified_attention(src: str | Path) -> types.ModuleType:
    """The `triton_unified_attention` module of the vLLM tree at `src` (the directory holding `vllm/`)."""
    src = Path(src)
    if not (src / OPS / "triton_unified_attention.py").is_file():
        raise FileNotFoundError(f"{src / OPS / 'triton_unified_attention.py'} does not exist")
    if "vllm" in sys.modules and not hasattr(sys.modules["vllm"], "_kvservice_stub"):
        raise RuntimeError("a real vllm package is already imported; run the benchmark without it")
    _module("vllm", _kvservice_stub=True)
    _module("vllm.envs", VLLM_BATCH_INVARIANT=False, VLLM_TRITON_FORCE_FIRST_CONFIG=False)
    _module("vllm.logger", init_logger=lambda name: _Logger(logging.getLogger(name), {}))
    _module("vllm.platforms", current_platform=_Platform())
    _module("vllm.triton_utils", triton=triton, tl=tl)
    _module("vllm.v1")
    _module("vllm.v1.kv_cache_interface", KVQuantMode=_kv_quant_mode(src))
    _module("vllm.v1.attention")
    _module("vllm.v1.attention.ops")
    _load_file("vllm.v1.attention.ops.triton_attention_helpers", src / OPS / "triton_attention_helpers.py")
    return _load_file("vllm.v1.attention.ops.triton_unified_attention", src / OPS / "triton_unified_attention.py")


class TritonAttentionCall:
    """`unified_attention` as the TRITON_ATTN backend runs it for one layer (no window, no softcap)."""

    def __init__(self, module: types.ModuleType, num_q_heads: int, num_kv_heads: int, head_size: int,
                 device: torch.device, max_num_seqs: int = 1024):
        self.fn = module.unified_attention
        self.seq_threshold_3d = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
        rows = min(self.seq_threshold_3d, max_num_seqs)  # decode: one query token per sequence
        pad = triton.next_power_of_2(head_size)
        segments = NUM_PAR_SOFTMAX_SEGMENTS
        self.segm_output = torch.empty(rows, num_q_heads, segments, pad, dtype=torch.float32, device=device)
        self.segm_max = torch.empty(rows, num_q_heads, segments, dtype=torch.float32, device=device)
        self.segm_expsum = torch.empty(rows, num_q_heads, segments, dtype=torch.float32, device=device)

    def __call__(self, q, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
                 max_query_len: int, max_seq_len: int) -> torch.Tensor:
        out = torch.empty_like(q)
        self.fn(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=query_start_loc, max_seqlen_q=max_query_len,
            seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True, window_size=(-1, -1),
            block_table=block_table, softcap=0, q_descale=None, k_descale=None, v_descale=None,
            seq_threshold_3D=self.seq_threshold_3d, num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS,
            softmax_segm_output=self.segm_output, softmax_segm_max=self.segm_max,
            softmax_segm_expsum=self.segm_expsum,
        )
        return out
