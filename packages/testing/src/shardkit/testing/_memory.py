"""Memory is what is alive: every live tensor storage, counted once."""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch

__all__ = ["live_storages"]


def live_storages(
    extra: Iterable[torch.Tensor | None] = (), device_type: str | None = None
) -> dict[int, int]:
    """``storage data_ptr -> bytes`` of every live tensor, each storage counted once.

    Counts every tensor reachable from Python (``gc.get_objects()``) and the tensors in
    ``extra`` (pass each param's ``.grad``: a gradient held only by autograd has no Python
    object until it is read). Views share their storage's entry; meta tensors and empty
    storages are left out, and so are wrapper subclasses without a storage of their own (a
    ``DTensor``: its local tensor is counted instead). Subtract the keys alive before the code under test ran to get what
    that code holds. C++-only allocations (a backend's internal buffers, allocator caches) are
    not Python objects and are not counted.

    Args:
        extra: more tensors to count (``None`` entries are skipped).
        device_type: count only storages on devices of this type (e.g. ``"cpu"``).
    """
    gc.collect()
    out: dict[int, int] = {}
    for obj in [*gc.get_objects(), *extra]:
        # type(), not isinstance(): isinstance reads __class__, which some lazy module
        # objects answer with a deprecation warning.
        if obj is None or not issubclass(type(obj), torch.Tensor) or obj.is_meta:
            continue
        if device_type is not None and obj.device.type != device_type:
            continue
        try:
            st = obj.untyped_storage()
            if st.nbytes():
                out[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            # a wrapper subclass without storage of its own (DTensor, FSDP2's params): the
            # tensors it wraps are Python objects too, counted on their own
            continue
    return out
