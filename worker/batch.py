"""What the engine sends every rank of a pool for one scheduler step (the same object to each rank).

    Engine (reply readers) -> StepBatch (RowUpdate per changed row, copies, varlen tokens) -> ModelRunner

Block-table changes come first (rows of finished requests cleared, new rows added, new blocks
appended, entries swapped by copy-on-write), then copy-on-write copies, then the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RowUpdate:
    """One request's block-table row change, one list of block ids per KV-cache group."""

    row: int
    set_blocks: list[list[int]] | None = None  # add_row: the row becomes exactly these block ids
    append_blocks: list[list[int]] = field(default_factory=list)  # append_row (empty: nothing appended)
    replace: list[tuple[int, int, int]] = field(default_factory=list)  # (group, index, block id) by copy-on-write


@dataclass(slots=True)
class StepBatch:
    """A varlen batch: request i owns tokens input_ids[query_start_loc[i]:query_start_loc[i+1]] at
    `positions`, its table row is rows[i], and its sequence is seq_lens[i] tokens long after them."""

    clear_rows: list[int]
    row_updates: list[RowUpdate]
    copies: list[tuple[int, int]]  # (src, dst) block ids, executed before any K/V of this step is written
    input_ids: list[int]
    positions: list[int]
    rows: list[int]
    query_start_loc: list[int]  # len(rows) + 1
    seq_lens: list[int]
    logits_indices: list[int]  # token indices whose logits the engine needs (in this order)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
