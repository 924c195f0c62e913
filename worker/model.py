"""A tiny decoder-only transformer with seeded random weights: real attention over real K/V, no training.

One forward pass serves both paths: `forward` takes the attention of each layer as a callable, so the
dense reference (`dense_logits`, causal SDPA over the whole sequence) and the runner's paged cache share
the projections, RoPE and MLP bit for bit and differ only in how attention is computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> out [T, Hq, D]; q and k already rotated.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Random weights give logits of standard deviation ~1 over 4096 tokens, where the top two are often within
# a float32 rounding error of each other; a wider spread keeps greedy decoding comparable across paths.
_LM_HEAD_GAIN = 8.0


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 32
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_size",
            "intermediate_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads} (GQA)")
        if self.head_size % 2 != 0:
            raise ValueError(f"head_size {self.head_size} must be even (RoPE rotates pairs of dimensions)")


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [H, (Hq + 2 * Hkv) * D]
    o: torch.Tensor  # [Hq * D, H]
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [H, 2 * I]
    down: torch.Tensor  # [I, H]


class TinyTransformer:
    """Llama-shaped: RMSNorm, RoPE, GQA attention, SwiGLU MLP, final norm, LM head (weights on `device`)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = c = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(c.seed)

        def weight(fan_in: int, fan_out: int, gain: float = 1.0) -> torch.Tensor:
            w = torch.randn(fan_in, fan_out, generator=gen) * (gain / math.sqrt(fan_in))
            return w.to(device=self.device, dtype=c.dtype)

        def ones() -> torch.Tensor:
            return torch.ones(c.hidden_size, device=self.device, dtype=c.dtype)

        qkv_size = (c.num_heads + 2 * c.num_kv_heads) * c.head_size
        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=gen).to(device=self.device, dtype=c.dtype)
        self.layers = [
            _Layer(
                attn_norm=ones(),
                qkv=weight(c.hidden_size, qkv_size),
                o=weight(c.num_heads * c.head_size, c.hidden_size),
                mlp_norm=ones(),
                gate_up=weight(c.hidden_size, 2 * c.intermediate_size),
                down=weight(c.intermediate_size, c.hidden_size),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = ones()
        self.lm_head = weight(c.hidden_size, c.vocab_size, gain=_LM_HEAD_GAIN)
        self.scale = 1.0 / math.sqrt(c.head_size)
        half = c.head_size // 2
        self._inv_freq = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float32, device=self.device) / half))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Hidden states (before the final norm) of tokens `input_ids` [T] at absolute `positions` [T].

        `attention(layer_idx, q, k, v)` attends the step's tokens to whatever context it keeps (the dense
        reference: the tokens themselves; the runner: its paged cache).
        """
        c = self.config
        num_tokens = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
        cos, sin = self._rope(positions)
        x = self.embed[input_ids]
        for layer_idx, layer in enumerate(self.layers):
            qkv = self._rms_norm(x, layer.attn_norm) @ layer.qkv
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = _rotate(q.view(num_tokens, c.num_heads, c.head_size), cos, sin)
            k = _rotate(k.view(num_tokens, c.num_kv_heads, c.head_size), cos, sin)
            v = v.view(num_tokens, c.num_kv_heads, c.head_size)
            attn = attention(layer_idx, q, k, v)
            x = x + attn.reshape(num_tokens, q_size) @ layer.o
            gate, up = (self._rms_norm(x, layer.mlp_norm) @ layer.gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, vocab]` of hidden rows `[N, H]` from `forward`."""
        return (self._rms_norm(hidden, self.final_norm) @ self.lm_head).float()

    def dense_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reference logits `[T, vocab]` of a whole sequence: causal SDPA over all of it, no cache."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(ids.shape[0], device=self.device)
        return self.logits(self.forward(ids, positions, self._dense_attention))

    def _dense_attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = self.config.num_heads // self.config.num_kv_heads
        # Query head h reads KV head h // group, as the paged kernels do.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(),
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            is_causal=True,
            scale=self.scale,
        )
        return out.transpose(0, 1).to(q.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]  # [T, D/2]
        dtype = self.config.dtype
        return freqs.cos()[:, None, :].to(dtype), freqs.sin()[:, None, :].to(dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.config.rms_eps)
        return xf.to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style RoPE on `[T, heads, D]`: dimension i pairs with i + D/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
