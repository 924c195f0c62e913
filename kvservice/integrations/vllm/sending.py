"""The remote manager's one RPC per scheduler step: the ops it recorded leave as one Step, sent and checked
on a background thread (pipelined) or in place, and the reply is checked against what the replica answered.

A mixin of RemoteKVCacheManager (remote.py): it reads the manager's recorded `_ops` and their `_expected`
answers, its `client`, `pool_id`, `block_pool` and `pipeline` and `step_interval_s` settings.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvservice.integrations.vllm.expected import InFlight, PoolDiverged, check_step
from kvservice.ops import NewStepOp, StepResult

logger = logging.getLogger("kvservice.integrations.vllm")


class StepSender:
    """Sending, waiting for and checking the Step of each scheduler step (see the module's docstring)."""

    @property
    def num_pending_ops(self) -> int:
        """Ops waiting for a Step (a lone step boundary is none: it waits for the ops that follow it)."""
        ops = self._ops
        return 0 if len(ops) == 1 and type(ops[0]) is NewStepOp else len(ops)

    def _close_step(self) -> None:
        """The scheduler step's recording ends: the next step's rows open an AllocateBatchOp of their own and
        fold only into that step's cache rows."""
        self._rows = None
        self._cache_rows.clear()
        self._position = self._last_barrier = 0

    def end_step(self) -> StepResult | None:
        """The end of a scheduler step: its ops leave as one Step (`flush`), unless `step_interval_s` has not
        passed since the last one left; then they wait in the replica for a later step's Step, and the Step in
        flight is checked only if it was answered already (its failure raises here)."""
        self.num_steps += 1
        if self.num_pending_ops and time.monotonic() - self._sent_at < self.step_interval_s:
            self._close_step()
            sent = self._in_flight
            return self.wait() if sent is not None and sent.future.done() else None
        return self.flush()

    def flush(self) -> StepResult | None:
        """Sends the recorded ops as one Step (none: no RPC). First the Step before it is waited for: its
        failure or divergence raises here. Unpipelined this Step is waited for and checked too; its result is
        returned (pipelined: the one before it, None if there was none)."""
        previous = self.wait()
        if not self.num_pending_ops:
            return previous
        ops, expected = self._ops, self._expected
        self._ops, self._expected = [], []
        self._close_step()
        sent = InFlight(Future(), ops, expected, self.block_pool.get_num_free_blocks())
        self.num_rpcs += 1
        self._sent_at = time.monotonic()
        if self.pipeline:
            try:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvservice-step-{self.pool_id}")
                sent.future = self._executor.submit(self._send, sent)
            except BaseException as exc:  # never sent: the replica is ahead of the pool
                self._failed = repr(exc)
                raise
            self._in_flight = sent
            # The sending thread takes the GIL now and keeps it until its call waits on the network: a scheduler
            # that went on at once would hold the GIL for a switch interval (5 ms) before the Step left.
            sent.started.wait()
            return previous
        try:
            sent.future.set_result(self._send(sent))
        except Exception as exc:
            sent.future.set_exception(exc)
        self._in_flight = sent
        return self.wait()

    def wait(self) -> StepResult | None:
        """The Step in flight, answered and checked (None: none in flight). Raises what failed it, or
        PoolDiverged — and, once one has, PoolDiverged on every later call."""
        sent, self._in_flight = self._in_flight, None
        if sent is not None:
            try:
                result = sent.future.result()
            except PoolDiverged as exc:
                self._failed = str(exc)
                raise
            except Exception as exc:  # the replica applied them, the pool may not have: nothing may follow
                self._failed = repr(exc)
                raise PoolDiverged(
                    f"kvservice allocator at {self.client.target}: the Step RPC for pool {self.pool_id!r} failed "
                    f"({exc}); this engine's scheduler cannot go on without it (its replica is ahead of the pool). "
                    f"Restart the allocator if it is down, then restart the engine: it registers the pool at a new "
                    f"epoch and its requests are recomputed") from exc
            self.last_result = result
            return result
        if self._failed is not None:
            raise PoolDiverged(f"kvservice pool {self.pool_id!r} at {self.client.target}: an earlier Step failed "
                               f"({self._failed}); the replica is ahead of the pool: restart the engine (a new pool "
                               f"epoch)")
        return None

    def close(self) -> None:
        """Sends what is recorded, waits for it, and stops the sending thread (after a failed Step nothing
        more is sent: the engine is shutting down on that error, already raised)."""
        try:
            if self._failed is not None:
                logger.warning("pool %r: closing after a failed Step; nothing more is sent", self.pool_id)
                return
            self.flush()
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _send(self, sent: InFlight) -> StepResult:
        """One Step and its check (on the sending thread when pipelined: it reads only what `sent` holds)."""
        sent.started.set()
        result = self.client.step(self.pool_id, sent.ops)
        try:
            check_step(self.pool_id, sent, result, self.num_kv_cache_groups)
        except PoolDiverged as exc:
            logger.error("%s", exc)
            raise
        except Exception as exc:  # a reply the checks cannot even read
            logger.error("pool %r: malformed Step reply: %r", self.pool_id, exc)
            raise PoolDiverged(f"pool {self.pool_id!r} answered a Step the scheduler cannot read ({exc!r}); "
                               f"restart the engine (a new pool epoch)") from exc
        return result
