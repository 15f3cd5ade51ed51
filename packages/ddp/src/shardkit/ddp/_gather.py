"""The param all-gathers of ``ShardedDataParallel``, overlapped with the next forward.

[Note: Deferred param gather]
With ``overlap_param_gather`` (default) the all-gathers of a step stay in flight when ``step()``
returns, issued in *reverse* bucket order (buckets are planned in reverse registration order,
so this is roughly the order forward needs them; the order is the same on every rank). A
pending gather is waited on (and forgotten) by the forward pre-hook of each submodule that
holds params of that bucket (FSDP2's pre-forward unshard, Megatron's ``overlap_param_gather``),
and by everything that reads or writes the flat buffers outside forward: ``wait_params()``,
the wrapper's ``parameters()`` / ``named_parameters()``, the next step, clipping,
``state_dict()`` and ``load_state_dict()`` of the wrapper, the wrapped module or any submodule
holding params, ``copy.deepcopy``, the optimizer's state dicts and checkpoints. ``zero_grad()`` touches no param and does not wait (the usual loop calls
it right before the forward the gathers overlap). A bucket whose params no forward touches is
waited for by the next step at the latest. Reading a param anywhere else before the next
forward (an EMA update, logging its norm, the wrapped module's own ``parameters()``) needs
``wait_params()`` first.

[Note: Gather probe]
The pre-hook of a module waits for the buckets of the params that module *owns*. A param read
in a forward before any of its bucket's owners ran (a weight tied into an earlier module, a
param used functionally by a parent, a param of a module that never runs) would read the
previous step's values. So the first forward after the layout is built runs under a
``TorchFunctionMode`` that records, for every op, which bucketed params it reads, and whether
their bucket was waited for by an owner's pre-hook earlier in that forward. The buckets read
too early are gathered synchronously at the end of every later step (logged once, naming the
params), the others stay overlapped. A later forward that takes another path than the probed
one is not re-checked: call ``wait_params()`` before such a forward, or pass
``overlap_param_gather=False``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from shardkit.ddp._comm import _Comm, _Pending
from shardkit.ddp._layout import _Bucket
from shardkit.ddp._ranges import phase
from torch import nn
from torch.overrides import TorchFunctionMode

__all__: list[str] = []

logger = logging.getLogger("shardkit.ddp")
_logged_sync = False


class _ParamGather:
    """Issues and waits for the param all-gathers; see [Note: Deferred param gather]."""

    def __init__(self, comm: _Comm, rank: int, overlap: bool) -> None:
        self.comm = comm
        self.rank = rank
        self.overlap = overlap
        self.pending: dict[int, _Pending] = {}
        self.module_buckets: dict[nn.Module, list[int]] = {}
        """Buckets of the params each module owns directly (``recurse=False``)."""
        self.bucket_of: dict[int, int] = {}
        """``id(param)`` -> bucket index."""
        self.names: dict[int, str] = {}
        self.sync: set[int] = set()
        """Buckets the probe found read before their owners' pre-hooks ([Note: Gather probe])."""
        self.probe_next = True
        self._waited: set[int] | None = None

    def rebuild(self, buckets: Sequence[_Bucket], module: nn.Module) -> None:
        """Takes a (re)built bucket layout; the next forward is probed again."""
        self.bucket_of = {id(p): b.index for b in buckets for p in b.params}
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.module_buckets = {}
        for sub in module.modules():
            own = sorted({self.bucket_of[id(p)] for p in sub.parameters(recurse=False)
                          if id(p) in self.bucket_of})  # fmt: skip
            if own:
                self.module_buckets[sub] = own
        self.sync = set()
        self.probe_next = True

    def issue(self, buckets: Sequence[_Bucket]) -> None:
        """All-gathers every rank's range of ``buckets`` (async); waits at once unless
        overlapped (then only for the buckets the probe found read too early)."""
        with torch.no_grad():
            for b in reversed(buckets):
                # In place: this rank's range is both the input and its own output chunk (NCCL
                # supports it; Gloo gathers into a buffer of its own and copies back). Nothing
                # writes the range before the gather is waited for: the next step waits first.
                self.pending[b.index] = self.comm.all_gather(b.flat, b.shard_view(self.rank))
        if not self.overlap:
            self.wait_all()
            return
        for b in buckets:
            if b.index in self.sync:
                self._wait(b.index)

    def _wait(self, index: int) -> None:
        pending = self.pending.pop(index, None)
        if pending is not None:
            with phase("wait_params", index):
                self.comm.wait(pending)

    def wait_all(self) -> None:
        """Waits for every gather still in flight."""
        if not self.pending:
            return
        with phase("wait_params"):
            for index in sorted(self.pending, reverse=True):
                self.comm.wait(self.pending.pop(index))

    def before_module(self, module: nn.Module) -> None:
        """Forward pre-hook body: waits for the buckets ``module``'s own params are in."""
        own = self.module_buckets.get(module, ())
        if self._waited is not None:
            self._waited.update(own)
        if self.pending:
            for index in own:
                self._wait(index)

    @contextmanager
    def probed(self) -> Iterator[None]:
        """Runs the enclosed forward under the probe if one is due ([Note: Gather probe])."""
        if not (self.overlap and self.probe_next and self.bucket_of):
            yield
            return
        self.probe_next = False
        self._waited = set()
        early: dict[int, str] = {}
        try:
            with _ReadProbe(self.bucket_of, self._waited, self.names, early):
                yield
        finally:
            self._waited = None
        self.sync = set(early)
        global _logged_sync
        if early and not _logged_sync:
            _logged_sync = True
            logger.warning(
                "ShardedDataParallel(overlap_param_gather=True): params read in forward before "
                "any module owning them ran (%s); their %d bucket(s) are gathered synchronously "
                "at the end of each step, the others overlap the next forward (logged once)",
                ", ".join(sorted(set(early.values()))[:5]),
                len(early),
            )


class _ReadProbe(TorchFunctionMode):
    """Records bucketed params read before their bucket was waited for."""

    def __init__(
        self,
        bucket_of: dict[int, int],
        waited: set[int],
        names: dict[int, str],
        early: dict[int, str],
    ) -> None:
        super().__init__()
        self.bucket_of = bucket_of
        self.waited = waited
        self.names = names
        self.early = early

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for t in _shallow(args, kwargs):
            index = self.bucket_of.get(id(t))
            if index is not None and index not in self.waited and index not in self.early:
                self.early[index] = self.names.get(id(t), f"a param of bucket {index}")
        return func(*args, **kwargs)


def _shallow(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """Tensors among the arguments and one level of lists / tuples in them."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))
