"""One request as the engine sees it: its tokens, where it stands, and its mirror of the worker rows.

    Engine (scheduler loop)  ->  EngineRequest (tokens, state, block-table mirror)  ->  SamplingParams
    The allocator holds the same request by id; the engine is the source of truth for its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from worker.sampling import SamplingParams


class RequestState(Enum):
    """Where a request stands. WAITING -> RUNNING -> FINISHED, back to WAITING when preempted; a forked
    child starts FORKING (its ForkOp goes with the next step) and runs from there."""

    WAITING = auto()  # queued for admission; the allocator holds nothing of it once this step's frees apply
    FORKING = auto()  # a parallel sample of a computed prompt, forked in the allocator with the next step
    RUNNING = auto()  # holds blocks and a block-table row
    FINISHED = auto()  # sampled its last token; freed with the next step


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    tokens: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    state: RequestState = RequestState.WAITING
    num_computed: int = 0
    num_sent: int = 0  # tokens the allocator knows (the last sampled one is sent with the next decode)
    row: int | None = None
    tables: list[list[int]] = field(default_factory=list)  # the engine's mirror of the worker row, per group
    num_generated: int = 0
    num_preemptions: int = 0
    hit_tokens: int = -1  # prefix-cache hit at first admission
    transferred_tokens: int = 0  # of which copied from another pool
    no_transfer: bool = False  # a transfer for it failed: recompute instead
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    parent: EngineRequest | None = None
    children_pending: int = 0  # forks to issue once the prompt is computed
    finish_reason: str | None = None  # "stop" (a stop or EOS token) or "length" (max_tokens), vLLM's names
    stop_reason: int | None = None  # the stop token that finished it (None for EOS and length)
    logits_seen: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, logits) if recorded

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def running(self) -> bool:
        return self.state is RequestState.RUNNING

    def reset(self) -> None:
        """Back to WAITING with nothing computed (its row, if any, is the caller's to release): recomputed
        from its tokens when admitted again."""
        self.state = RequestState.WAITING
        self.num_computed = self.num_sent = 0
        self.tables = []
