"""Deterministic sampling: greedy, or Gumbel-max with noise seeded by (sequence seed, position), so a
dense reference run reproduces every sampled token exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    n: int = 1  # parallel samples: n - 1 children forked from the prompt (copy-on-write)
    temperature: float = 0.0  # 0: greedy
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """The token for `logits` ([vocab]) at sequence position `position`."""
    if temperature == 0.0:
        return int(torch.argmax(logits).item())
    gen = torch.Generator().manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
    u = torch.rand(logits.shape[-1], generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    gumbel = -torch.log(-torch.log(u))
    return int(torch.argmax(logits.double() / temperature + gumbel).item())
