"""Sampling parameters (vLLM's names) and deterministic sampling: greedy, or Gumbel-max with noise seeded
by (sequence seed, position), so a dense reference run reproduces every sampled token exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """What to generate for one prompt.

    Args:
        max_tokens: tokens to generate at most.
        n: parallel samples: n - 1 children forked from the computed prompt (copy-on-write).
        temperature: 0 is greedy.
        seed: the sampling noise's seed (None: one the engine picks per request).
        stop_token_ids: tokens that end a sequence (kept in its output, as vLLM does).
        ignore_eos: keep generating past the model's end-of-sequence tokens.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got "
                                 f"{self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)  # frozen: a tuple, whatever was passed


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """The token for `logits` ([vocab]) at sequence position `position`."""
    if temperature == 0.0:
        return int(torch.argmax(logits).item())
    gen = torch.Generator().manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
    u = torch.rand(logits.shape[-1], generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    gumbel = -torch.log(-torch.log(u))
    return int(torch.argmax(logits.double() / temperature + gumbel).item())
