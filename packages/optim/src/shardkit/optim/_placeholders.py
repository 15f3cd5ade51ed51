"""The ``.grad`` of a param whose gradient ``ShardedDataParallel`` reduce-scattered.

[Note: Reduced-grad placeholders]
Once a synchronised backward has staged a param's gradient, ``.grad`` is not left ``None``
(torch's ``clip_grad_norm_`` would then see no gradient and return 0.0 without clipping): it is
set to that param's :class:`_ReducedGrad`, a ``torch.Tensor`` subclass of the param's shape,
dtype and device that expands one shared 0-d zero per (dtype, device), so it holds no memory.
Its ``__torch_function__`` lets metadata through (``shape``, ``dtype``, ``device``,
``is_sparse``, ``size()``, ...) and turns what ``zero_grad(set_to_none=False)`` of
``nn.Module`` and ``torch.optim`` calls on a ``.grad`` (``zero_``, ``requires_grad_``,
``detach_``, ``_foreach_zero_``) into no-ops; every other torch op (``torch.linalg.vector_norm``,
``torch._foreach_norm``, ``mul_``, ...) raises a RuntimeError that says what to do for that
op: ``ShardedDataParallel.clip_grad_norm_`` for a clip's ops, ``no_sync()`` or ``zero_grad()``
first for any other. Metadata predicates (``is_leaf``, ``_is_view``: what ``torch.compile``'s
fake-tensor conversion reads of every ``.grad``, so a compiled eval between ``step()`` and
``zero_grad()`` runs as under DDP), dtype / device conversions (``model.double()``, which
give a placeholder of the new dtype) and ``share_memory_`` pass. The reduced gradient itself lives in the owners' grad
shards, cut at element boundaries that need not follow any dimension of the param (a rank may
hold 7 rows and 15 elements of a 12 x 16 weight), so it has no DTensor form (``Shard(dim)`` /
``Replicate`` placements per param, FSDP2's answer) that torch's clip could reduce; hence an
error, not a value.

A placeholder never reaches autograd: every bucketed param carries a tensor hook (run before
``AccumulateGrad`` reads ``.grad``) that drops it, so the next backward, ``no_sync()`` or not,
accumulates into ``None`` exactly as after ``zero_grad()``; the reduced gradient is still in the
shard. Placeholders stay after ``step()`` (torch's clip after the step raises too, where DDP
would measure the stale gradients) and are dropped by the wrapper's and the optimizer's
``zero_grad`` (both ``set_to_none`` values: the shards are consumed, so there is no gradient).
``copy.deepcopy`` of a param does not copy ``.grad`` (``nn.Parameter.__deepcopy__``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch

__all__ = ["METADATA_READS", "is_placeholder"]


class _ReducedGrad(torch.Tensor):
    """``.grad`` of a param whose gradient was reduce-scattered into the owners' shards.

    See [Note: Reduced-grad placeholders]. Metadata reads work, torch ops raise.
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__") or name in _METADATA or name.startswith(_IS):
            return cast(Any, super()).__torch_function__(func, types, args, kwargs)
        if name in _CONVERSIONS and args and isinstance(args[0], _ReducedGrad):
            # model.double() / .to(...) convert every .grad: a placeholder of the new dtype
            # and device (a 0-d zero converted, then expanded: no memory)
            zero = torch.zeros((), dtype=args[0].dtype, device=args[0].device)
            out = cast(Any, super()).__torch_function__(func, types, (zero, *args[1:]), kwargs)
            if isinstance(out, torch.Tensor):
                new = torch.zeros((), dtype=out.dtype, device=out.device)
                return new.expand(args[0].shape).as_subclass(_ReducedGrad)
        if name in _NO_OPS:  # what zero_grad(set_to_none=False) calls on a .grad
            return args[0] if args else None
        if name == "_foreach_zero_":  # torch.optim's zero_grad(set_to_none=False), foreach
            for t in args[0]:
                if not isinstance(t, _ReducedGrad):
                    t.zero_()
            return None
        raise RuntimeError(_reduced_grad_error(func, args))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"_ReducedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: "
            f"reduce-scattered by ShardedDataParallel into the owners' gradient shards)"
        )

    def __format__(self, spec: str) -> str:
        return repr(self)


METADATA_READS = frozenset(
    (
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "storage_offset",
        "element_size",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "__hash__",
        "__len__",
    )
)
"""Tensor methods that read a tensor's metadata, never its values (shared with the param-access
guard, ``shardkit.optim._gather``)."""
_METADATA = METADATA_READS | {"untyped_storage", "data_ptr", "_has_compatible_shallow_copy_type"}
_NO_OPS = frozenset(("zero_", "requires_grad_", "detach_", "share_memory_"))
_IS = ("is_", "_is_")
"""Predicates on a tensor's metadata (``is_leaf``, ``_is_view``, ...; what ``torch.compile``'s
fake-tensor conversion reads of every ``.grad``): they pass."""
_CONVERSIONS = frozenset(("to", "type", "double", "float", "half", "bfloat16", "cpu", "cuda"))
"""Dtype / device conversions (``nn.Module._apply`` runs them on every ``.grad``)."""


_CLIP_OPS = ("norm", "clip", "clamp", "mul")
"""Ops of a gradient clip (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``)."""


def _reduced_grad_error(func: Callable[..., Any], args: Sequence[Any]) -> str:
    where = [a for a in args if isinstance(a, _ReducedGrad)]
    where += [
        t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, _ReducedGrad)
    ]
    what = f"shape {tuple(where[0].shape)}, {where[0].dtype}" if where else "a param's"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    short = getattr(func, "__name__", "")
    head = (
        f"{name} was called on the .grad of a param ({what}) wrapped by "
        f"shardkit.ddp.ShardedDataParallel, whose gradient was reduce-scattered into the "
        f"gradient shards of the ranks that own it: .grad is a placeholder without values. "
    )
    if any(k in short for k in _CLIP_OPS):
        return head + (
            "To clip, call ShardedDataParallel.clip_grad_norm_(max_norm) (or "
            "optimizer.clip_grad_norm(max_norm), collective, on every rank) after backward and "
            "before optimizer.step(); torch.nn.utils.clip_grad_norm_ cannot see the shards. For "
            "full local gradients in .grad, run the backward under ddp.no_sync() (ddp.reduce() "
            "then reduces them); for all-reduced full gradients, use torch "
            "DistributedDataParallel."
        )
    return head + (
        "To read or log gradients, run that backward under ddp.no_sync() (full local "
        "gradients in .grad, reduced later by ddp.reduce()) or use torch "
        "DistributedDataParallel; if this code does not need the gradient (an evaluation, a "
        "model copy or conversion between step() and zero_grad()), call "
        "optimizer.zero_grad() first: it drops the placeholders, as it drops DDP's gradients."
    )


def is_placeholder(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a reduced-grad placeholder (see [Note: Reduced-grad placeholders])."""
    return type(t) is _ReducedGrad
