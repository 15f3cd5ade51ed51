"""Element-level partitions of the flattened parameters (DeepSpeed ZeRO / Megatron style)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import NamedTuple

import torch
from shardkit.partition._format import _human, _imbalance, _table
from shardkit.partition._spec import ParamSpec, _as_specs, _check_world_size

__all__ = ["FlatPartition", "Fragment", "flat_partition"]


class Fragment(NamedTuple):
    """A contiguous run of one parameter's elements owned by one rank (an immutable tuple
    ``(param, rank, start, end, shard_offset)``)."""

    param: int
    """Index of the parameter (registration order)."""
    rank: int
    """Owning rank."""
    start: int
    """First element, in the parameter's flattened (``view(-1)``) numbering."""
    end: int
    """One past the last element (exclusive)."""
    shard_offset: int
    """Where ``start`` lies in the owning rank's shard of the flat buffer."""

    @property
    def numel(self) -> int:
        """Number of elements, ``end - start``."""
        return self.end - self.start


@dataclass(frozen=True)
class FlatPartition:
    """Equal contiguous shards of one flat buffer holding the (trainable) parameters.

    # [Note: Flat layout]
    # The buffer holds the included parameters in registration order; parameter i starts at
    # ``param_offsets[i]``, rounded up to a multiple of ``param_align`` (the gap is padding).
    # After the last parameter the buffer is padded to ``padded_numel`` (with ``pad=True``, a
    # multiple of world_size * align, so every shard has exactly ``shard_size`` elements, as
    # a reduce-scatter of the flat gradient needs). Rank r owns the elements
    # ``[r * shard_size, min((r + 1) * shard_size, padded_numel))``; ``shard_size`` is a
    # multiple of ``align``, so every shard starts aligned. A parameter may straddle ranks;
    # its pieces are the :class:`Fragment` s. Loads count real (non-padding) elements, so
    # max load <= shard_size < total / world_size + align when ``param_align`` is 1, i.e.
    # imbalance < 1 + align / mean load.
    """

    world_size: int
    """Number of ranks."""
    align: int
    """Every shard size (and therefore shard start) is a multiple of this many elements."""
    param_align: int
    """Every parameter starts at a multiple of this many elements in the flat buffer."""
    shard_size: int
    """Elements per rank (the last ranks may hold fewer when ``pad=False``)."""
    numel: int
    """Real elements in the buffer (sum of the included parameters' numel)."""
    padded_numel: int
    """Length of the buffer including all padding."""
    param_offsets: tuple[int, ...]
    """Start of each parameter in the flat buffer; -1 for parameters left out (frozen)."""
    fragments: tuple[Fragment, ...]
    """All fragments, ordered by (rank, shard_offset)."""
    loads: tuple[int, ...]
    """Real elements owned by each rank."""
    imbalance: float
    """``max(loads) / mean(loads)`` (1.0 when there are no elements)."""
    specs: tuple[ParamSpec, ...] = ()
    """Description of each parameter (empty if not recorded)."""
    _by_rank: tuple[tuple[Fragment, ...], ...] = field(
        init=False, repr=False, compare=False, default=()
    )
    _by_param: dict[int, tuple[Fragment, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        by_rank: list[list[Fragment]] = [[] for _ in range(self.world_size)]
        by_param: dict[int, list[Fragment]] = {}
        for f in self.fragments:
            if not 0 <= f.rank < self.world_size:
                raise ValueError(f"fragment {f} has a rank outside [0, {self.world_size})")
            by_rank[f.rank].append(f)
            frags = by_param.get(f.param)
            if frags is None:
                by_param[f.param] = [f]
            else:
                frags.append(f)
        for frags in by_param.values():
            if len(frags) > 1 and any(
                a.start >= b.start for a, b in pairwise(frags)
            ):
                frags.sort(key=lambda f: f.start)
        object.__setattr__(self, "_by_rank", tuple(tuple(v) for v in by_rank))
        object.__setattr__(self, "_by_param", {k: tuple(v) for k, v in by_param.items()})

    @property
    def algorithm(self) -> str:
        """Always ``"flat"`` (for tables that mix partition kinds)."""
        return "flat"

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``(start, end)`` of ``rank``'s shard in the flat buffer (end exclusive)."""
        self._check_rank(rank)
        start = min(rank * self.shard_size, self.padded_numel)
        return start, min(start + self.shard_size, self.padded_numel)

    def fragments_of(self, rank: int) -> tuple[Fragment, ...]:
        """Fragments owned by ``rank``, in buffer order."""
        self._check_rank(rank)
        return self._by_rank[rank]

    def fragments_of_param(self, index: int) -> tuple[Fragment, ...]:
        """Fragments of parameter ``index`` in element order (empty if it was left out)."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(
            self.param_offsets
        ):
            raise IndexError(
                f"parameter index must be an int in [0, {len(self.param_offsets)}), got "
                f"{index!r}"
            )
        return self._by_param.get(index, ())

    def owners_of(self, index: int) -> tuple[int, ...]:
        """Ranks holding a piece of parameter ``index``, ascending."""
        return tuple(f.rank for f in self.fragments_of_param(index))

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank must be an int in [0, {self.world_size}), got {type(rank).__name__} "
                f"{rank!r}"
            )

    def describe(self) -> str:
        """A per-rank table (fragments, straddling params, elements, padding, load / mean)."""
        mean = self.numel / self.world_size
        rows = []
        for r in range(self.world_size):
            start, end = self.shard_range(r)
            frags = self._by_rank[r]
            split = sum(1 for f in frags if len(self._by_param[f.param]) > 1)
            rows.append(
                [
                    str(r),
                    f"[{start}, {end})",
                    str(len(frags)),
                    str(split),
                    _human(self.loads[r], "elements"),
                    str(end - start - self.loads[r]),
                    f"{self.loads[r] / mean:.4f}" if mean > 0 else "-",
                ]
            )
        head = (
            f"FlatPartition(world_size={self.world_size}, align={self.align}, "
            f"param_align={self.param_align}, numel={self.numel}, "
            f"padded_numel={self.padded_numel}, shard_size={self.shard_size})"
        )
        table = _table(
            ["rank", "shard", "fragments", "split params", "elements", "padding", "load/mean"],
            rows,
        )
        bound = 1 + self.align / mean if mean > 0 else 1.0
        return "\n".join(
            [head, table, f"imbalance (max/mean): {self.imbalance:.6f}   bound 1 + align/mean: "
             f"{bound:.6f}"]
        )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"flat_partition: {name} must be an int >= 1 (in elements), got "
            f"{type(value).__name__} {value!r}"
        )
    return value


def flat_partition(
    params: Iterable[torch.Tensor | ParamSpec],
    world_size: int,
    *,
    align: int = 1,
    param_align: int = 1,
    pad: bool = True,
    include_frozen: bool = False,
) -> FlatPartition:
    """Split the concatenated trainable parameters into ``world_size`` contiguous shards.

    See [Note: Flat layout]. Parameters may straddle ranks; each rank gets
    :class:`Fragment` s ``(param, start, end)``.

    Args:
        params: Tensors or :class:`ParamSpec`, in the same order on every rank. All included
            parameters must share one dtype (one flat buffer); call once per dtype otherwise.
        world_size: Number of ranks (>= 1).
        align: Shard size (and so every shard start) is a multiple of this many elements,
            e.g. 128 / element size for 128-byte aligned shards.
        param_align: Every parameter starts at a multiple of this many elements (Megatron
            pads parameter starts so each can be viewed with aligned storage).
        pad: Pad the buffer to a multiple of ``world_size * align`` so all shards have equal
            length (needed by reduce-scatter / all-gather into a flat buffer). Without it the
            last shard(s) are shorter.
        include_frozen: Also place frozen parameters in the buffer (default: trainable only,
            as DeepSpeed does; frozen parameters get offset -1 and no fragments).

    Raises:
        TypeError / ValueError: bad arguments, empty ``params`` or mixed dtypes.
    """
    world_size = _check_world_size(world_size, "flat_partition")
    align = _check_positive_int(align, "align")
    param_align = _check_positive_int(param_align, "param_align")
    specs = _as_specs(params, "flat_partition")
    included = [i for i, s in enumerate(specs) if include_frozen or s.requires_grad]
    dtypes = sorted(str(d) for d in {specs[i].dtype for i in included})
    if len(dtypes) > 1:
        first = {d: next(i for i in included if str(specs[i].dtype) == d) for d in dtypes}
        raise ValueError(
            f"flat_partition: the parameters to flatten mix dtypes "
            f"{', '.join(f'{d} (first at index {i})' for d, i in first.items())}; one flat "
            f"buffer holds one dtype. Call flat_partition once per dtype group"
        )
    offsets = [-1] * len(specs)
    sizes = [specs[i].numel for i in included]
    cursor = 0
    for i, n in zip(included, sizes, strict=True):
        start = _round_up(cursor, param_align) if param_align > 1 else cursor
        offsets[i] = start
        cursor = start + n
    numel = sum(sizes)
    if pad:
        padded = _round_up(cursor, world_size * align)
        shard = padded // world_size
    else:
        padded = cursor
        shard = _round_up(-(-cursor // world_size), align)
    fragments: list[Fragment] = []
    loads = [0] * world_size
    # Walking the buffer in order yields fragments already sorted by (rank, shard_offset).
    for i, n in zip(included, sizes, strict=True):
        lo = offsets[i]
        hi = lo + n
        pos = lo
        while pos < hi:
            rank = pos // shard
            stop = min(hi, (rank + 1) * shard)
            fragments.append(Fragment(i, rank, pos - lo, stop - lo, pos - rank * shard))
            loads[rank] += stop - pos
            pos = stop
    return FlatPartition(
        world_size=world_size,
        align=align,
        param_align=param_align,
        shard_size=shard,
        numel=numel,
        padded_numel=padded,
        param_offsets=tuple(offsets),
        fragments=tuple(fragments),
        loads=tuple(loads),
        imbalance=_imbalance([float(x) for x in loads]),
        specs=specs,
    )
