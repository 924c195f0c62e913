"""Checks an engine's outputs against the dense reference: the same model run without any cache
(full causal attention over the whole sequence), sampled with the same seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model import TinyTransformer
from worker.sampling import sample


@dataclass(slots=True)
class Verification:
    sequences: int
    matched: int
    max_logit_error: float
    mismatches: list[str]

    @property
    def ok(self) -> bool:
        return self.matched == self.sequences


@torch.inference_mode()
def verify(model: TinyTransformer, seqs) -> Verification:
    """Every generated token must equal what the dense model samples at its position; logits the engine
    recorded (EngineRequest.logits_seen) must be close to the dense ones."""
    matched, max_err, mismatches = 0, 0.0, []
    for seq in seqs:
        logits = model.dense_logits(seq.tokens[:-1])  # row p predicts position p + 1
        ok = True
        for position in range(seq.num_prompt_tokens, len(seq.tokens)):
            expected = sample(logits[position - 1], seq.params.temperature, seq.seed, position)
            if expected != seq.tokens[position]:
                ok = False
                mismatches.append(f"{seq.request_id}: position {position} got {seq.tokens[position]}, dense {expected}")
                break
        for position, row in seq.logits_seen:
            max_err = max(max_err, float((row - logits[position - 1]).abs().max()))
        matched += ok
    return Verification(len(seqs), matched, max_err, mismatches)
