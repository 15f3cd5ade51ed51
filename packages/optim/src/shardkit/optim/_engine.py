"""The ZeRO-2 engine's one public face: :class:`Zero2Engine`, what a module adapter drives.

[Note: One engine, one adapter]
shardkit-optim owns the life of every bucket group, from the gradient hook to the next forward
(the owner: ``_bucket_group.BucketGroup``; its state machine: [Note: Bucket group state] in
``_lifecycle.py``). A module adapter (shardkit-ddp's ``ShardedDataParallel``) owns the module
side only: it plans the buckets of the module's params, forwards its forward pre-hooks and
DDP's API (``no_sync``, buffers, ``reduce()``, ``zero_grad``, clipping, the optimizer state
dicts) to this class, and never reaches past it: every call of the adapter into the engine
goes through one of its methods below, and the engine never calls back into the adapter (the
agreement at the first gradient of a synchronised backward, on the number of ``no_sync()``
entries since the last reduction, is the engine's: :meth:`Zero2Engine.enter_no_sync` counts
them). So the adapter depends on this class, :class:`EngineOptions` and
:class:`~shardkit.optim.CommStats` (and the bucket planning it already used), and an optim
release that keeps their signatures keeps it working (``tests/test_engine.py`` pins the
surface).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from shardkit.optim._agreement import register_call
from shardkit.optim._bucket_group import BucketGroup, agree, clip_groups
from shardkit.optim._flat import FlatBucket
from shardkit.optim._host_heap import release_host_heap
from shardkit.optim._options import EngineOptions
from shardkit.optim._placeholders import _ReducedGrad
from shardkit.optim._reducer import _Reducer, drop_grads, param_map
from shardkit.optim._sharded_optimizer import ShardedOptimizer
from shardkit.optim._wire import CommStats, Wire
from torch import nn

__all__ = ["Zero2Engine"]

BACKWARD = register_call("ShardedDataParallel backward (gradient reduce-scatter)")
REDUCE = register_call("ShardedDataParallel.reduce()")


class Zero2Engine:
    """The ZeRO-2 engine of one wrapped module: one bucket group per optimizer, the backward
    pass over all of them, the collectives. See [Note: One engine, one adapter].

    Args:
        optimizers: The wrapped optimizers (disjoint params, one process group).
        options: The engine's options.
    """

    def __init__(self, optimizers: Sequence[ShardedOptimizer], options: EngineOptions) -> None:
        if not optimizers:
            raise ValueError("Zero2Engine needs at least one ShardedOptimizer, got none")
        self.optimizers = list(optimizers)
        self.options = options
        self.comm = Wire(self.optimizers[0].group)
        self.no_sync_entries = 0
        """``no_sync()`` blocks entered since the last reduction (agreed at the next one)."""
        self.reducer = _Reducer(self.comm, options, self._agree_backward)
        self.groups: list[BucketGroup] = []
        """One owner per optimizer, in the order given (see [Note: Bucket group state])."""

    # ------------------------------------------------------------------ layout
    def lay_out(self, per_optimizer: Sequence[list[FlatBucket]], module: nn.Module) -> None:
        """Takes the (re)built buckets of each optimizer (``build_flat_buckets``; on a rebuild
        every reduction and gather of the old layout was waited for): the groups, the staging
        pool, the ``.grad`` placeholders and the gradient hooks."""
        where = param_map(per_optimizer)  # the layout's one param map
        for k, (opt, buckets) in enumerate(zip(self.optimizers, per_optimizer, strict=True)):
            if k < len(self.groups):
                self.groups[k].rebuild(buckets, module, where)
            else:
                group = BucketGroup(
                    k, opt, self.comm, self.options, self.reducer, buckets, module, where
                )
                self.groups.append(group)
        # See [Note: Reduced-grad placeholders] in shardkit.optim._placeholders
        self.reducer.lay_out(self.groups, where)
        _release_freed_blocks(self.buckets)  # See [Note: The parameters' old blocks go back]

    def attach(self) -> None:
        """Makes each group its optimizer's ``ShardOwner`` (see [Note: Optimizer hand-over])."""
        for g in self.groups:
            g.opt.attach_driver(g)

    @property
    def buckets(self) -> list[FlatBucket]:
        """Every bucket of every group, in launch order."""
        return [b for g in self.groups for b in g.buckets]

    def trainable_changed(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether ``requires_grad`` of one of ``params`` changed since the layout was built
        (a param is in it iff it was trainable then)."""
        where = self.reducer.where
        return any(p.requires_grad != (id(p) in where) for p in params)

    @property
    def stats(self) -> CommStats:
        """Counters of every collective the engine issued."""
        return self.comm.stats

    def broadcast(self, t: torch.Tensor, src_group_rank: int) -> None:
        """Blocking, counted broadcast over the engine's group (buffers, startup sync)."""
        self.comm.broadcast(t, src_group_rank)

    # ------------------------------------------------------------------ the module side
    def before_forward(self, module: nn.Module) -> None:
        """Forward pre-hook body of ``module``: waits for the param gathers of the buckets its
        own params are in ([Note: Deferred param gather] in ``shardkit.optim._gather``)."""
        for g in self.groups:
            g.gather.before_module(module)

    def refuse_graph_grads(self) -> None:
        """Raises if a param's ``.grad`` requires grad (a backward with ``create_graph=True``
        under ``no_sync()`` accumulated a graph into it): the engine reduces detached gradients.
        A module adapter calls it before a forward in training with grad enabled. Reduced-grad
        placeholders ([Note: Reduced-grad placeholders]) are skipped without being read.

        Raises:
            RuntimeError: naming the param's shape and what to use instead.
        """
        for b in self.buckets:
            for p in b.params:
                g = p.grad
                if g is not None and type(g) is not _ReducedGrad and g.requires_grad:
                    raise RuntimeError(
                        f"a param of shape {tuple(p.shape)} has a .grad that requires grad "
                        f"(double backward / create_graph=True): ShardedDataParallel reduces "
                        f"detached gradients; use torch DDP for higher-order gradients"
                    )

    def forward_started(self) -> None:
        """A forward starts: forgets a backward that raised before its end."""
        self.reducer.end_aborted_pass()

    def enter_no_sync(self) -> None:
        """A ``no_sync()`` block starts: hooks leave ``.grad`` to accumulate; the entry is
        counted and agreed at the next reduction."""
        self.no_sync_entries += 1
        self.reducer.set_enabled(False)

    def set_sync(self, enabled: bool) -> None:
        """Gradient hooks reduce (``True``) or leave ``.grad`` to accumulate (``no_sync()``)."""
        self.reducer.set_enabled(enabled)

    @property
    def in_backward(self) -> bool:
        """Whether a synchronised backward is between its first gradient and its end."""
        return self.reducer.passes.in_backward

    def reduce(self) -> None:
        """Reduces the gradients accumulated in ``.grad`` now (outside a backward). Collective."""
        self._agree_reduction(REDUCE)
        self.reducer.start_pass()
        self.reducer.flush()

    def _agree_backward(self) -> None:
        self._agree_reduction(BACKWARD)

    def _agree_reduction(self, call: str) -> None:
        """Every rank starts reduction ``call`` after as many ``no_sync()`` blocks (bounded;
        see [Note: Wrapper agreements] in ``shardkit.ddp._checks``)."""
        entries, self.no_sync_entries = self.no_sync_entries, 0
        if not agree(call, self.optimizers[0], digest=entries):
            raise RuntimeError(
                f"{call}: ranks entered no_sync() a different number of times since the last "
                f"reduction (this rank: {entries}); every rank must accumulate under no_sync() "
                f"alike, or the reduced gradients mix different numbers of micro-batches"
            )

    def wait_params(self) -> None:
        """Waits for every param all-gather still in flight."""
        for g in self.groups:
            g.wait_params()

    def close(self) -> None:
        """Ends the engine's hold on the module: waits for every pending param gather (the
        param-access guard leaves the stack), removes the gradient hooks and the ``.grad``
        placeholders; the groups then refuse ``step()``. Local; never touches the process
        group. See [Note: The window belongs to the wrapper] in ``shardkit.optim._gather``."""
        if self.in_backward:
            raise RuntimeError(
                "ShardedDataParallel.close() was called inside a backward pass; call it after "
                "the last optimizer.step() (or zero_grad())"
            )
        self.wait_params()
        self.reducer.close()
        for g in self.groups:
            g.close()

    def zero_grad(self, params: Any, set_to_none: bool) -> None:
        """Drops the reduced gradients of every group and the ``.grad`` of ``params``."""
        for g in self.groups:
            g.discard_gradients()
        drop_grads(params, set_to_none)

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clips every group's reduced gradients by their global norm. Collective."""
        return clip_groups(self.groups, max_norm, norm_type)

    def has_reduced_grads(self) -> bool:
        """Whether any group holds a reduced gradient not consumed yet."""
        return any(g.has_reduced_grads() for g in self.groups)

    # ------------------------------------------------------------------ state
    def full_state_dict(self, k: int) -> dict[str, Any]:
        """Optimizer ``k``'s full state dict in plain torch format, on every rank. Collective."""
        return self.groups[k].full_state_dict()

    def load_full_state_dict(self, k: int, state_dict: dict[str, Any]) -> None:
        """Loads a full state dict into this rank's shards of optimizer ``k``."""
        self.groups[k].load_full_state_dict(state_dict)

    @property
    def last_closure_loss(self) -> Any:
        """The loss of the last closure a wrapped optimizer's ``step(closure)`` ran."""
        return max(self.groups, key=lambda g: g.closure_order).last_closure_loss

    def memory_bytes(self) -> Mapping[str, int]:
        """Bytes of this rank's live tensors by kind: ``params``, ``grads``, ``staging``,
        ``optimizer`` (see [Note: Staging lifetime] in ``shardkit.optim._reducer``)."""
        each = [g.memory_bytes() for g in self.groups]
        return {
            "params": sum(m["params"] for m in each),
            "grads": sum(m["grads"] for m in each),
            "staging": self.reducer.staging_bytes(),
            "optimizer": sum(m["optimizer"] for m in each),
        }


# [Note: The parameters' old blocks go back]
# Laying out the flat buckets moves every param into them: the blocks that held the params
# before are freed, and the allocator keeps them for later requests. Those come in other sizes
# (autograd's gradients reuse a few; the moments the first step makes are cut out of the rest
# or, on the CPU, do not fit the holes and take new pages), so the allocator ends up holding
# memory nothing uses, resident all the same: on CUDA reserved memory, what ``nvidia-smi`` and
# an out-of-memory error see; on the CPU resident pages of glibc's heap, what the kernel's
# out-of-memory killer sees. So once the buckets are laid out, the engine hands that memory
# back, per device type of the buckets: the CUDA cache's unused blocks to the driver
# (``torch.cuda.empty_cache()``, on each CUDA device), the free pages of glibc's heap to the
# kernel (``malloc_trim(0)``, ``_host_heap.py``; nothing where the C library is not glibc,
# logged once). Once per layout, not per step: a release per step would cost a fault per page
# at the next use. On CUDA the stepper also makes a rank's moments in one allocation ([Note:
# Moments in one allocation] in ``shardkit.optim._state``). Measured on an H200 (world 2, Gloo
# ranks sharing it, the 33.6M-param benchmark model, fp32): peak reserved 17.5 bytes per param
# with neither, 16.4 with the release alone, 17.3 with the moments alone, 14.9 with both
# (torch ZeRO: 14.7); the allocated peak is 14.1 in every case. On the CPU (shardkit-ddp's
# README, ``bench_memory``), the release lowers the peak resident set most where the model was
# cast before wrapping (bf16 params: their fp32 originals raise glibc's mmap threshold, so the
# bf16 blocks come from the heap and stay resident once freed).
def _release_freed_blocks(buckets: Sequence[FlatBucket]) -> None:
    """See [Note: The parameters' old blocks go back]."""
    devices = {b.device for b in buckets}
    for device in sorted((d for d in devices if d.type == "cuda"), key=str):
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    if any(d.type == "cpu" for d in devices):
        release_host_heap()
