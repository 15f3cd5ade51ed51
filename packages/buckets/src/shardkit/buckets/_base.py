"""The flat buffer and slot bookkeeping of ``ParamBucket`` (the layout ``plan_buckets`` predicts)."""

from __future__ import annotations

import torch
from shardkit.buckets._validation import (
    _check_device,
    _check_dtype,
    _check_int,
    _describe,
)

__all__: list[str] = []


def _align_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= value``."""
    return -(-value // multiple) * multiple


# [Note: Bucket views]
# A bucket owns one 1-D tensor, ``buffer``. Each registered tensor gets a *slot*: the
# contiguous range ``buffer[offset : offset + numel]``, viewed with the tensor's shape. The
# registered tensor (``p.data`` of a ParamBucket's params) is then set to that view, so the
# tensor and the buffer share storage and an in-place write to either one is visible through
# the other: this is what lets a single collective on ``buffer`` act on every param.
#
# Layout rules, identical in the buckets and in plan_buckets so that a plan's offsets are the
# offsets a bucket will use:
#   * slots are laid out in registration order;
#   * each slot starts at the next multiple of ``alignment`` (in elements) after the previous
#     slot's end; the gap is zero padding;
#   * the bucket accepts tensors while ``offset + numel <= size``; ``buffer`` itself has
#     ``_align_up(size, pad_to_multiple)`` elements, so with ``pad_to_multiple=world_size`` it
#     splits evenly into one shard per rank (reduce-scatter, all-gather); the tail is zeros.
#
# Whether a tensor is "still a view of its slot" is decided by _is_slot_view: same storage,
# same storage offset, same shape, contiguous. Anything else (a fresh tensor assigned by the
# user, or by ``module.to()``) is *detached* and is re-attached by ``reattach()``, which copies
# its value into the slot.


def _is_slot_view(
    tensor: torch.Tensor | None, buffer: torch.Tensor, offset: int, shape: torch.Size
) -> bool:
    """Whether ``tensor`` is exactly the view of ``buffer[offset:]`` with ``shape``.

    See [Note: Bucket views].
    """
    if tensor is None:
        return False
    return (
        tensor.device == buffer.device
        and tensor.dtype == buffer.dtype
        and tensor.shape == shape
        and tensor.is_contiguous()
        and tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and tensor.storage_offset() == buffer.storage_offset() + offset
    )


class _FlatBucket:
    """A fixed-capacity flat buffer with registered tensors laid out as slots.

    See [Note: Bucket views] for the layout.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        device: torch.device | str | int,
        *,
        alignment: int = 1,
        pad_to_multiple: int = 1,
    ) -> None:
        kind = type(self).__name__
        self._size = _check_int(size, f"{kind}: size (capacity in elements)", minimum=0)
        self._alignment = _check_int(alignment, f"{kind}: alignment (in elements)", minimum=1)
        self._pad_to_multiple = _check_int(pad_to_multiple, f"{kind}: pad_to_multiple", minimum=1)
        dtype = _check_dtype(dtype, f"{kind}: dtype")
        device = _check_device(device, f"{kind}: device")
        self._buffer = torch.zeros(
            _align_up(self._size, self._pad_to_multiple), dtype=dtype, device=device
        )
        self._params: list[torch.Tensor] = []
        self._names: list[str | None] = []
        self._offsets: list[int] = []
        self._index_by_id: dict[int, int] = {}
        self._fill = 0

    # ------------------------------------------------------------------ properties
    def _target_probe(
        self, device: object, dtype: object, keep_param_alignment: object
    ) -> torch.Tensor:
        """Validates the arguments of ``to()``; an empty tensor on the target device and dtype."""
        target_device = self.device if device is None else _check_device(device, "to: device")
        target_dtype = self.dtype if dtype is None else _check_dtype(dtype, "to: dtype")
        if not isinstance(keep_param_alignment, bool):
            raise TypeError(
                f"to: keep_param_alignment must be a bool; got "
                f"{type(keep_param_alignment).__name__}."
            )
        return torch.empty(0, dtype=target_dtype, device=target_device)

    @property
    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor holding every slot (``numel`` is ``size`` padded up to
        ``pad_to_multiple``)."""
        return self._buffer

    @property
    def size(self) -> int:
        """Capacity in elements: registered tensors must end at or before this offset."""
        return self._size

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the buffer."""
        return self._buffer.dtype

    @property
    def device(self) -> torch.device:
        """Device of the buffer."""
        return self._buffer.device

    @property
    def fill(self) -> int:
        """Elements used so far: the end offset of the last slot (alignment gaps included)."""
        return self._fill

    @property
    def alignment(self) -> int:
        """Every slot starts at a multiple of this many elements."""
        return self._alignment

    @property
    def pad_to_multiple(self) -> int:
        """``buffer.numel()`` is a multiple of this."""
        return self._pad_to_multiple

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Registered tensors, in registration (slot) order."""
        return tuple(self._params)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start offset (in elements) of each registered tensor's slot, in registration order."""
        return tuple(self._offsets)

    def __len__(self) -> int:
        return len(self._params)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self._size}, dtype={self.dtype}, device={self.device}, "
            f"params={len(self._params)}, fill={self._fill}, alignment={self._alignment}, "
            f"pad_to_multiple={self._pad_to_multiple})"
        )

    # ------------------------------------------------------------------ slots
    def index(self, param: torch.Tensor) -> int:
        """Registration index of ``param`` (by identity).

        Raises:
            ValueError: ``param`` is not registered in this bucket.
        """
        idx = self._index_by_id.get(id(param))
        if idx is None or self._params[idx] is not param:
            raise ValueError(
                f"{type(self).__name__}: {_describe_any(param)} is not registered in this "
                f"bucket ({len(self._params)} registered)."
            )
        return idx

    def slot(self, param: torch.Tensor | int) -> torch.Tensor:
        """The 1-D view of the buffer that backs ``param`` (a registered tensor or its index)."""
        if isinstance(param, bool) or not isinstance(param, int | torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}.slot expects a registered tensor or its int index; got "
                f"{type(param).__name__}."
            )
        if isinstance(param, int):
            if not 0 <= param < len(self._params):
                raise ValueError(
                    f"{type(self).__name__}.slot: index {param} is out of range for a bucket "
                    f"with {len(self._params)} registered tensors."
                )
            idx = param
        else:
            idx = self.index(param)
        offset = self._offsets[idx]
        return self._buffer.narrow(0, offset, self._params[idx].numel())

    def shard(self, rank: int, world_size: int) -> torch.Tensor:
        """Rank ``rank``'s contiguous 1/``world_size`` of the buffer (a view).

        The buffer must split evenly: create the bucket with ``pad_to_multiple=world_size``.
        """
        world_size = _check_int(world_size, "shard: world_size", minimum=1)
        rank = _check_int(rank, "shard: rank", minimum=0)
        if rank >= world_size:
            raise ValueError(f"shard: rank must be < world_size={world_size}; got {rank}.")
        numel = self._buffer.numel()
        if numel % world_size != 0:
            raise ValueError(
                f"shard: the buffer has {numel} elements, which is not a multiple of "
                f"world_size={world_size}; create the bucket with "
                f"pad_to_multiple={world_size} (or a multiple of it)."
            )
        chunk = numel // world_size
        return self._buffer.narrow(0, rank * chunk, chunk)

    def _view(self, buffer: torch.Tensor, idx: int) -> torch.Tensor:
        """The slot of registered tensor ``idx`` in ``buffer``, shaped like the tensor."""
        param = self._params[idx]
        return buffer.narrow(0, self._offsets[idx], param.numel()).view(param.shape)

    def _reserve(self, tensor: torch.Tensor, name: str | None, what: str) -> int:
        """Check that ``tensor`` is new and fits; return its slot offset (not yet committed)."""
        if (
            id(tensor) in self._index_by_id
            and self._params[self._index_by_id[id(tensor)]] is tensor
        ):
            idx = self._index_by_id[id(tensor)]
            raise ValueError(
                f"{what}: {_describe(tensor, name)} is already in this bucket (slot {idx}, "
                f"offset {self._offsets[idx]}); each tensor can be added once."
            )
        offset = _align_up(self._fill, self._alignment)
        end = offset + tensor.numel()
        if end > self._size:
            raise ValueError(
                f"{what}: {_describe(tensor, name)} does not fit: it needs elements "
                f"[{offset}, {end}) but the bucket capacity is {self._size} elements "
                f"({self._fill} used by {len(self._params)} tensors, alignment "
                f"{self._alignment}). Use a larger bucket, or size buckets with plan_buckets."
            )
        return offset

    def _commit(self, tensor: torch.Tensor, name: str | None, offset: int) -> None:
        self._index_by_id[id(tensor)] = len(self._params)
        self._params.append(tensor)
        self._names.append(name)
        self._offsets.append(offset)
        self._fill = offset + tensor.numel()

    def _label(self, idx: int) -> str:
        return _describe(self._params[idx], self._names[idx])


def _describe_any(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return _describe(obj, None)
    return f"{type(obj).__name__} {obj!r:.80}"
