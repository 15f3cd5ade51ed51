"""Drop-in classes: torch's ``ZeroRedundancyOptimizer`` and fairscale's ``OSS`` signatures.

Both are :class:`ShardedOptimizer` underneath; only the constructor, a few method signatures
and (for torch) the ``Join`` protocol and the state-dict staleness rule differ, so a torch or
fairscale training loop switches by changing its import.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._dist import _comm_device
from shardkit.optim._sharded_optimizer import ShardedOptimizer
from shardkit.optim._state import global_params
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.optim import Optimizer

__all__ = ["OSS", "ZeroRedundancyOptimizer"]


class _ZeroJoinHook(JoinHook):
    """Shadows the optimizer step of a rank that ran out of inputs (``torch...Join``)."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        """Steps (nothing, without gradients) and takes part in the step's collectives."""
        self.zero.step()


class ZeroRedundancyOptimizer(ShardedOptimizer, Joinable):
    """``torch.distributed.optim.ZeroRedundancyOptimizer``'s interface on shardkit's optimizer.

    Change ``from torch.distributed.optim import ZeroRedundancyOptimizer`` to
    ``from shardkit.optim import ZeroRedundancyOptimizer``: same constructor, same methods,
    ``Join`` support for uneven inputs. Differences that are shardkit's behaviour: params are
    always views of flat buckets (``parameters_as_bucket_view`` is accepted either way), the
    consolidated state is gathered point to point onto ``to`` only, and the partition is
    shardkit-partition's.

    Args:
        params: params or param-group dicts.
        optimizer_class: the torch optimizer class to shard.
        process_group: the group to shard over (default: the default group).
        parameters_as_bucket_view: accepted for compatibility (shardkit always uses flat
            buckets).
        overlap_with_ddp: step from DDP's comm hook: register
            ``shardkit.overlap.hook_with_zero_step(hook, ddp, zero)`` (same signature as
            torch's ``ddp_zero_hook.hook_with_zero_step``); ``step()`` in the loop then only
            checks that the hook stepped.
        **defaults: the optimizer's arguments.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        for name, value in (
            ("parameters_as_bucket_view", parameters_as_bucket_view),
            ("overlap_with_ddp", overlap_with_ddp),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")
        ShardedOptimizer.__init__(self, params, optimizer_class, process_group, **defaults)
        Joinable.__init__(self)
        self.process_group = self.group
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.overlap_with_ddp = overlap_with_ddp
        self._last_consolidated: dict[str, Any] | None = None

    def consolidate_state_dict(
        self, to: int = 0, skip: Callable[[torch.Tensor], bool] | None = None
    ) -> None:
        """Gathers the full state on rank ``to`` of the group. Collective (torch's name)."""
        self._last_consolidated = None
        ShardedOptimizer.consolidate_state_dict(self, recipient_rank=to, skip=skip)
        if self._consolidations.copy is not None:
            self._last_consolidated = ShardedOptimizer.state_dict(self)

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The last state consolidated onto this rank, as torch's returns it: after
        ``consolidate_state_dict(to=r)`` it may be older than the last step (consolidate again
        for the current one).

        Unlike torch's, in a program that never consolidates explicitly it is a collective that
        consolidates onto every rank, so ``torch.distributed.checkpoint.state_dict`` works with
        it: see [Note: Implicit consolidation].

        Raises:
            RuntimeError: nothing was consolidated onto this rank.
        """
        if all_ranks:
            self.consolidate_state_dict(to=-1)
        elif self._consolidations.needs_implicit(self._state_version):
            self._consolidate_implicitly()
            self._last_consolidated = ShardedOptimizer.state_dict(self)
        if self._last_consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant "
                "to save the global state."
            )
        sd = self._last_consolidated
        return {**sd, "state": {i: dict(st) for i, st in sd["state"].items()}}

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every param in group order (torch's attribute, read by join hooks written for it)."""
        return global_params(self.param_groups)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows this optimizer's step for ``torch.distributed.algorithms.Join``."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the join context's all-reduces."""
        return _comm_device(self.group)

    @property
    def join_process_group(self) -> Any:
        """The process group of the join context."""
        return self.group


class OSS(ShardedOptimizer):
    """``fairscale.optim.OSS``'s constructor on shardkit's optimizer (change the import).

    fairscale's deprecated keywords are accepted with a ``DeprecationWarning`` and ignored:
    ``broadcast_buffer_size`` (shardkit broadcasts whole flat buckets) and
    ``force_broadcast_object`` (shardkit consolidates tensors as tensors).

    Args:
        params: params or param-group dicts.
        optim: the torch optimizer class to shard.
        group: the process group (default: the default group).
        broadcast_buffer_size: deprecated, ignored.
        broadcast_fp16: send updated params as fp16.
        force_broadcast_object: deprecated, ignored.
        **default: the optimizer's arguments.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optim: type[Optimizer] = torch.optim.SGD,
        group: dist.ProcessGroup | None = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        **default: Any,
    ) -> None:
        if broadcast_buffer_size != -1:
            warnings.warn(
                "OSS(broadcast_buffer_size=...) is deprecated in fairscale and ignored by "
                "shardkit (it broadcasts whole flat buckets); drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
        if force_broadcast_object:
            warnings.warn(
                "OSS(force_broadcast_object=True) is ignored by shardkit (the state is always "
                "consolidated as tensors); drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
        super().__init__(params, optim, group, broadcast_fp16, **default)
