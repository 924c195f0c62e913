"""Ray-managed workers: the engine, the ranks of its pool, and the kernels they run.

    engine (scheduler: one allocator Step per step, step_plan, request) -> StepBatch (batch) -> every rank
      actor (a Ray actor per DCP rank, or LocalWorkers) -> runner (block_table, KV caches) -> model + kernels
    deploy/ brings pools up on a Ray cluster; demo is `make run`.
"""
