"""The param all-gathers of ``ShardedDataParallel``, overlapped with the next forward.

[Note: Deferred param gather]
With ``overlap_param_gather`` (default) the all-gathers of a step stay in flight when ``step()``
returns, issued in *reverse* bucket order (buckets are planned in reverse registration order,
so this is roughly the order forward needs them; the order is the same on every rank). A
pending gather is waited on (and forgotten) by the forward pre-hook of each submodule that
holds params of that bucket (FSDP2's pre-forward unshard, Megatron's ``overlap_param_gather``),
and, for every other access, by the param-access guard ([Note: Param access guard] in
``shardkit.optim._guard``): any torch function on the training thread that touches the storage of
a pending bucket waits for it first, so reads and writes between ``step()`` and the next
forward, or in a forward on a path no pre-hook covers, see what DDP would show. The wrapper's
own entry points that read every param (the next step, clipping, ``wait_params()``,
``state_dict()`` / ``load_state_dict()`` of any module holding params, ``copy.deepcopy``, the
optimizer's state dicts and checkpoints) wait for all of them at once. ``zero_grad()`` touches
no param and does not wait (the usual loop calls it right before the forward the gathers
overlap). A bucket whose params nothing touches is waited for by the next step at the latest.

[Note: Gloo gathers and the profiler]
torch's profiler (2.13, CPU) can crash the process (SIGSEGV or abort, in ``key_averages()`` or
when the profiler stops) when a Gloo collective launched while it profiles is still in flight
when it stops: Gloo runs the collective on a worker thread of its own, which records its
profiler event there. Plain torch shows it (a world-2 loop of ``with profile(): w =
dist.all_gather(outs, x, async_op=True)`` then ``w.wait()`` after the ``with``: 2 crashes in 3
runs of 100 iterations; a collective launched *before* the profiler starts: none in 300). A
deferred gather is exactly that when a profile ends after ``step()``, as
``torch.profiler.schedule`` ends its window in ``prof.step()`` after the optimizer's step. So on
Gloo, ``step()`` issued while a profiler runs waits for its gathers before it returns (logged
once); without a profiler, and on NCCL (its collectives are recorded on the launching thread),
gathers stay deferred.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from shardkit.optim._codecs import BlockFormat
from shardkit.optim._flat import FlatBucket
from shardkit.optim._guard import _ParamGuard, _Spans, arm, disarm, leave_when_safe, settle
from shardkit.optim._lifecycle import GroupLife
from shardkit.optim._profiling import zero2_phase as phase
from shardkit.optim._torch_compat import profiling
from shardkit.optim._wire import Wire, _Pending
from torch import nn

__all__: list[str] = []

logger = logging.getLogger("shardkit.optim")
_logged_profiling = False


class _ParamGather:
    """Issues and waits for the param all-gathers of one bucket group's buckets; see [Note:
    Deferred param gather]. Built by its :class:`~shardkit.optim._bucket_group.BucketGroup`
    with each bucket layout.

    Args:
        comm: The wrapper's communication layer.
        overlap: ``overlap_param_gather``: leave the gathers in flight after ``issue``.
        module_buckets: Buckets (indices) of the params each module owns directly.
        buckets: The group's buckets (their flat buffers are what the guard watches).
        life: The group's state machine, which records the pending gathers ([Note: Bucket
            group state] in ``shardkit.optim._lifecycle``).
        deltas: With a quantized param wire, its block format and what writes a bucket's
            ``exact - replica`` of this rank's range (``ShardStepper.delta_shard``): the
            gathers move weight deltas ([Note: Weight deltas] in ``shardkit.optim._wire``).
    """

    def __init__(
        self,
        comm: Wire,
        overlap: bool,
        module_buckets: dict[nn.Module, list[int]],
        buckets: Sequence[FlatBucket],
        life: GroupLife,
        deltas: tuple[BlockFormat, Callable[[FlatBucket, torch.Tensor], None]] | None = None,
    ) -> None:
        self.comm = comm
        self.deltas = deltas
        if deltas is not None:
            for b in buckets:
                comm.reserve_deltas(deltas[0], b.device, b.numel)
        self.overlap = overlap
        self.life = life
        self.module_buckets = module_buckets
        """Buckets of the params each module owns directly (``recurse=False``)."""
        self.buckets = list(buckets)
        self.spans = _Spans((b.index, b.flat) for b in buckets)
        """Byte ranges of the flat buffers, read again at every :meth:`issue` (see [Note:
        Param access guard])."""
        self.guard: _ParamGuard | None = None
        """The guard this gather is registered with while something is pending."""
        # See [Note: The window belongs to the wrapper] in shardkit.optim._guard
        collected = weakref.finalize(self, _collected, comm, life.gathers)
        collected.atexit = False

    @property
    def pending(self) -> Mapping[int, _Pending]:
        """The pending gathers, by bucket index (the state machine's record)."""
        return self.life.gathers

    def issue(self, buckets: Sequence[FlatBucket]) -> None:
        """All-gathers every rank's range of ``buckets`` (async); waits at once unless
        overlapped (or on Gloo under a profiler: [Note: Gloo gathers and the profiler]), else
        arms the guard ([Note: Param access guard])."""
        # The buckets' storage may have moved since the last step (``share_memory()``, a state
        # dict pickled through a multiprocessing queue): the spans are read again each time.
        self.spans = _Spans((b.index, b.flat) for b in self.buckets)
        with torch.no_grad():
            for b in reversed(buckets):
                # In place: this rank's range is both the input and its own output chunk (NCCL
                # supports it; Gloo gathers into a buffer of its own and copies back). Nothing
                # writes the range before the gather is waited for: the guard makes every
                # access wait first.
                if self.deltas is None:
                    work = self.comm.all_gather(b.flat, b.shard_view(self.comm.rank), b.index)
                else:
                    fmt, delta = self.deltas
                    work = self.comm.all_gather_deltas(
                        b.flat, fmt, functools.partial(delta, b), b.index
                    )
                self.life.gather_issued(b.index, work)
        if not self.overlap or (self.comm.gloo and profiling()):
            if self.overlap:
                _log_profiling_once()
            self.wait_all()
        elif self.pending:
            self.guard = arm(self)

    def wait(self, index: int) -> None:
        """Waits for bucket ``index``'s gather if it is pending."""
        if index in self.life.gathers:
            with phase("wait_params", index):
                self.comm.wait(self.life.gather_done(index))
            self._drained()

    def wait_all(self) -> None:
        """Waits for every gather still in flight."""
        if self.pending:
            with phase("wait_params"):
                # one at a time, the pending set read again each time: a wait can complete
                # others (the guard's poll runs on any torch call a completion makes)
                while self.pending:
                    self.comm.wait(self.life.gather_done(max(self.pending)))
            self._drained()
        settle()

    def before_module(self, module: nn.Module) -> None:
        """Forward pre-hook body: waits for the buckets ``module``'s own params are in."""
        if self.pending:
            for index in self.module_buckets.get(module, ()):
                self.wait(index)
        settle()

    def forget_finished(self) -> None:
        """Forgets the gathers whose work has finished (nothing to wait for): a wrapper whose
        last gathers nothing touches leaves the guard ([Note: Param access guard])."""
        for index, pending in list(self.pending.items()):
            if pending.done():
                self.wait(index)

    def _drained(self) -> None:
        if not self.pending:
            if self.guard is not None:
                disarm(self.guard, self)
                self.guard = None


def _collected(comm: Wire, pending: Mapping[int, _Pending]) -> None:
    """The gather of a collected wrapper: its works still in flight are waited for (Gloo and
    NCCL keep the buffers they write alive anyway), with nothing decoded into params nobody
    holds (a weight-delta gather's completion would run inside the collection), and the guard
    leaves the stack if nothing else is pending ([Note: Leaving after a collection] in
    ``shardkit.optim._guard``)."""
    for work in list(pending.values()):
        comm.abandon(work)
    leave_when_safe()


def _log_profiling_once() -> None:
    global _logged_profiling
    if not _logged_profiling:
        _logged_profiling = True
        logger.info(
            "ShardedDataParallel on Gloo: a torch profiler is running, so step() waits for its "
            "param all-gathers instead of overlapping them with the next forward (torch's "
            "profiler can crash when a Gloo collective it saw start is still in flight when it "
            "stops; [Note: Gloo gathers and the profiler]); logged once"
        )
