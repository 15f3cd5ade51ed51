"""The flat, owner-contiguous bucket layout of ZeRO-2 (the element-range half of the engine).

[Note: Owner-contiguous buckets]
Every trainable param lives in exactly one :class:`FlatBucket`; a bucket holds params of one
param group, one dtype and one device, planned by ``shardkit.buckets.plan_buckets`` (reverse
registration order, size-capped, so bucket 0 fills first in backward). A bucket's flat buffer
has ``numel = N * S`` elements (``N`` the world size) and rank ``r`` owns the contiguous range
``[r*S, (r+1)*S)``. The model's params are views of the buffer (``p.data`` is re-pointed), so:

- reduce-scattering the bucket's gradients hands rank ``r`` exactly the gradient of the
  elements it owns (its ``grad_shard``), and
- all-gathering every rank's range rebuilds every param of the bucket,

each of them one collective moving ``(N-1)/N`` of the buffer per rank: the two together move
exactly what DDP's all-reduce of the same bucket moves (``2(N-1)/N``).

Two kinds of buckets, by the param group's optimizer (see :func:`is_elementwise`):

- *fragment* buckets (element-wise optimizers: SGD, Adam, AdamW, Adagrad, ...): params are
  packed back to back and the buffer is padded at the end to a multiple of ``N``; a param may
  straddle two owners. The owner steps its range one piece per param (:meth:`FlatBucket.pieces`,
  [Note: Per-param fragments] in ``shardkit.optim._shard_stepper``), which for an element-wise
  update is the same arithmetic as stepping each param. Padding is below ``N`` elements per
  bucket.
- *whole-param* buckets (anything else: Muon orthogonalises a whole matrix, so an element range
  of it cannot be stepped alone): the bucket's params are assigned to ranks with
  ``shardkit.partition.partition`` and rank ``r``'s params are packed in ``[r*S, (r+1)*S)``,
  ``S`` the largest rank's share; the owner steps its params themselves (views of the buffer),
  exactly as a plain optimizer would. Padding is the imbalance of the assignment.

The ZeRO-1 partition (:class:`~shardkit.optim.ShardLayout`) is the other half of the same
vocabulary: which rank owns which *whole* param, by global index. A whole-param bucket is that
partition restricted to one bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from shardkit.buckets import BucketSpec, plan_buckets
from shardkit.optim._compact import compact_formats, moment_formats
from shardkit.optim._compact_optim import is_compact_class
from shardkit.partition import partition
from torch.optim import Optimizer

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "FlatBucket",
    "aligned_views",
    "build_flat_buckets",
    "compact_block",
    "is_elementwise",
]

ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
    )
    if hasattr(torch.optim, name)
)
"""torch optimizers whose update of an element depends only on that element's value, gradient
and state (plus scalar hyper-parameters and step counts): they may step any flat range of the
params. Subclasses are not included (a subclass may change that); pass ``elementwise=True``."""


def is_elementwise(optim_cls: type[Optimizer], override: bool | None = None) -> bool:
    """Whether params of ``optim_cls`` may be sharded element by element.

    Args:
        optim_cls: The optimizer class that steps the params.
        override: Wins when not ``None``; otherwise exact members of
            :data:`ELEMENTWISE_OPTIMIZERS` are element-wise and everything else is stepped by
            whole params.
    """
    if override is not None:
        return override
    # compact_state's Adam / AdamW (see [Note: Compact state under ZeRO-1]) are element-wise too
    return optim_cls in ELEMENTWISE_OPTIMIZERS or is_compact_class(optim_cls)


@dataclass(eq=False)
class FlatBucket:
    """One owner-contiguous bucket. See [Note: Owner-contiguous buckets].

    The layout fields are fixed once built; ``grad_shard`` / ``grad_fresh`` are the reduced
    gradient the driver hands to :class:`~shardkit.optim.ShardStepper`. A driver may subclass
    it (a dataclass) to keep its own per-bucket state; :func:`build_flat_buckets` builds the
    subclass it is given.
    """

    index: int
    """Position of the bucket in its driver's launch order."""
    group: int
    """Index of the param group (of the sharded optimizer) its params belong to."""
    elementwise: bool
    """Fragment bucket (element ranges) when true, whole-param bucket otherwise."""
    params: list[torch.Tensor]
    """The bucket's params, in layout order; each is a view of ``flat``."""
    offsets: list[int]
    """Start element of each param in ``flat``."""
    owners: list[int]
    """Owner rank of each param (whole-param buckets; -1 for fragment buckets)."""
    shard: int
    """``S``: elements owned by each rank."""
    world: int
    """``N``: ranks sharing the bucket."""
    flat: torch.Tensor
    """The param buffer, ``world * shard`` elements; params are views of it."""
    grad_shard: torch.Tensor | None = None
    """This rank's reduced gradient, ``shard`` elements (the driver allocates it)."""
    grad_fresh: bool = True
    """Whether ``grad_shard`` holds no gradient yet since the last step / zero_grad (written by
    the owner of the bucket's life: shardkit-optim's [Note: Bucket group state])."""
    numel: int = field(init=False, repr=False)
    """Elements of the (padded) flat buffer, ``world * shard``."""
    dtype: torch.dtype = field(init=False, repr=False)
    """Dtype of the params (and of ``flat``)."""
    device: torch.device = field(init=False, repr=False)
    """Device of the params (and of ``flat``)."""

    def __post_init__(self) -> None:
        # plain attributes, not properties: read on every gradient and launch (``flat`` is
        # never replaced; its storage may move, its dtype and device do not)
        self.numel = self.shard * self.world
        self.dtype = self.flat.dtype
        self.device = self.flat.device

    def attach_grad_shard(self, grad_shard: torch.Tensor) -> None:
        """Gives the bucket the buffer its reduced gradient is written into (the driver
        allocates it, once per layout).

        Args:
            grad_shard: ``shard`` elements of the bucket's dtype, on its device.

        Raises:
            ValueError: ``grad_shard`` does not have ``shard`` elements, or the dtype or
                device differ from ``flat``'s.
        """
        if (
            grad_shard.numel() != self.shard
            or grad_shard.dtype != self.dtype
            or grad_shard.device != self.device
        ):
            raise ValueError(
                f"grad_shard of bucket {self.index} must have {self.shard} elements of "
                f"{self.dtype} on {self.device}, got {grad_shard.numel()} of {grad_shard.dtype} "
                f"on {grad_shard.device}"
            )
        self.grad_shard = grad_shard

    def mark_reduced(self) -> None:
        """Records that ``grad_shard`` now holds (or is being written) a reduced gradient:
        :class:`~shardkit.optim.ShardStepper` steps it (``grad_fresh`` becomes false)."""
        self.grad_fresh = False

    def mark_consumed(self) -> None:
        """Records that the reduced gradient was consumed (a step or ``zero_grad``): the next
        reduction overwrites ``grad_shard`` (``grad_fresh`` becomes true)."""
        self.grad_fresh = True

    def range_of(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``flat`` owned by ``rank``."""
        return rank * self.shard, (rank + 1) * self.shard

    def shard_view(self, rank: int) -> torch.Tensor:
        """``rank``'s range of ``flat`` (a view)."""
        start, end = self.range_of(rank)
        return self.flat[start:end]

    def owned_params(self, rank: int) -> list[tuple[int, torch.Tensor]]:
        """(position, param) of the params ``rank`` owns (whole-param buckets)."""
        return [(i, p) for i, p in enumerate(self.params) if self.owners[i] == rank]

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(position, lo, hi)``: the range ``[lo, hi)`` of ``flat`` that ``rank`` steps for
        each param of a fragment bucket, in param order.

        A param of no elements belongs to the rank whose range holds its offset, so that its
        (empty) state has exactly one home. See [Note: Per-param fragments].
        """
        start, end = self.range_of(rank)
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
            n = p.numel()
            lo, hi = max(off, start), min(off + n, end)
            if hi > lo:
                out.append((i, lo, hi))
            elif n == 0 and min(off // max(self.shard, 1), self.world - 1) == rank:
                out.append((i, off, off))
        return out


B = TypeVar("B", bound=FlatBucket)


def build_flat_buckets(
    param_groups: Sequence[dict[str, Any]],
    elementwise: Sequence[bool],
    world: int,
    cap_bytes: int,
    first_cap_bytes: int,
    *,
    first_index: int = 0,
    bucket_type: type[B] = FlatBucket,  # type: ignore[assignment]
    compact_state: str | None = None,
) -> tuple[list[B], list[str]]:
    """Plans the buckets of every param group and re-points the params into their buffers.

    Args:
        param_groups: The sharded optimizer's param groups; their trainable params are laid out
            (frozen ones are left alone).
        elementwise: Per group, whether it is laid out as fragment buckets (see
            :func:`is_elementwise`).
        world: Ranks sharing every bucket.
        cap_bytes: Size cap of a bucket (``shardkit.buckets.plan_buckets``).
        first_cap_bytes: Size cap of each group's first bucket.
        first_index: Index of the first bucket built.
        bucket_type: :class:`FlatBucket` or a dataclass subclass of it with defaults for its
            extra fields.
        compact_state: The optimizer's ``compact_state`` (``"int8"`` / ``"int4"``): fragment
            buckets are then laid out block-aligned ([Note: Block-aligned fragment buckets]).

    Returns:
        The buckets (in launch order: by group, then plan order) and one fingerprint string
        per group, for a cross-rank check of the plan.
    """
    planned: list[tuple[int, list[torch.Tensor], list[int], list[int], int, BucketSpec]] = []
    prints: list[str] = []
    for gi, g in enumerate(param_groups):
        params = [p for p in g["params"] if isinstance(p, torch.Tensor) and p.requires_grad]
        if not params:
            prints.append("empty")
            continue
        plan = plan_buckets(
            params,
            cap_bytes,
            first_cap_bytes,
            pad_to_multiple=world if elementwise[gi] else 1,
        )
        block = compact_block(compact_state) if elementwise[gi] else 0
        prints.append(plan.fingerprint() + (f";compact={compact_state}/{block}" if block else ""))
        for spec in plan.buckets:
            ps = [params[i] for i in spec.indices]
            if elementwise[gi]:
                offsets = list(spec.offsets)
                owners = [-1] * len(ps)
                shard = spec.padded_numel // world
                if block and any(_compact(compact_state, p) for p in ps):
                    offsets, shard = _aligned_layout(ps, world, compact_state)
            else:
                offsets, owners, shard = _whole_param_layout(ps, world)
            planned.append((gi, ps, offsets, owners, shard, spec))
    # See [Note: Flat buffers in one allocation]
    flats = _one_buffer_each(
        [(spec.dtype, spec.device, shard * world) for *_, shard, spec in planned]
    )
    buckets: list[B] = []
    for (gi, ps, offsets, owners, shard, _), flat in zip(planned, flats, strict=True):
        with torch.no_grad():
            flat.zero_()  # the padding stays zero
            for p, off in zip(ps, offsets, strict=True):
                view = flat[off : off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
        buckets.append(
            bucket_type(
                first_index + len(buckets),
                gi,
                elementwise[gi],
                ps,
                offsets,
                owners,
                shard,
                world,
                flat,
            )
        )
    return buckets, prints


_FLAT_ALIGN = 64
"""Elements between the starts of two flat buffers in one allocation (a multiple of every
vector width and of NCCL's 16-byte alignment, for every dtype)."""


def _one_buffer_each(
    sizes: Sequence[tuple[torch.dtype, torch.device, int]],
) -> list[torch.Tensor]:
    """One flat buffer per entry of ``sizes`` (dtype, device, elements), left uninitialised:
    on a CPU one allocation each; on any other device (CUDA, and ``meta`` in the tests) views
    of one allocation per (dtype, device).

    [Note: Flat buffers in one allocation]
    On CUDA the buckets' flat buffers are laid out in one allocation per dtype and device, each
    view starting at a multiple of :data:`_FLAT_ALIGN` elements. A bucket is planned to the cap
    plus whatever its last param brings, so its buffer is rarely a round size: a 2048 x 2048
    weight and its bias are 16.01 MiB, which CUDA's caching allocator serves from an 18 MiB
    segment (it rounds a large request up to 2 MiB), 2 MiB per bucket that nothing else fits in
    (0.4 bytes per param of reserved memory for the 33.6M-param benchmark model at any world
    size, read off the allocator trace of ``shardkit-ddp``'s ``benchmarks/cuda_segments.py``).
    One allocation rounds once (on every device but the CPU). A CPU allocation of that size
    is mapped page by page, so there is nothing to gain, and one storage per bucket keeps what
    works on whole storages per bucket: ``share_memory()`` moves a storage with every byte of
    it, so over one storage it would copy buckets whose gathers are still in flight (the
    param-access guard waits for the bucket of the param it is called on). On CUDA
    ``share_memory_()`` does nothing, and ``torch.save`` of one param alone writes the whole
    storage, as for any view (``state_dict()`` saved whole writes it once).
    """
    merged = iter(aligned_views([s for s in sizes if s[1].type != "cpu"], _FLAT_ALIGN))
    return [
        torch.empty(n, dtype=dtype, device=device) if device.type == "cpu" else next(merged)
        for dtype, device, n in sizes
    ]


def aligned_views(
    sizes: Sequence[tuple[torch.dtype, torch.device, int]], align: int
) -> list[torch.Tensor]:
    """One view per entry of ``sizes`` (dtype, device, elements) of one uninitialised
    allocation per (dtype, device), in order, each starting at a multiple of ``align``
    elements (the flat buffers off the CPU, the grad shards)."""
    totals: dict[tuple[torch.dtype, torch.device], int] = {}
    starts: list[int] = []
    for dtype, device, n in sizes:
        key = (dtype, device)
        starts.append(totals.get(key, 0))
        totals[key] = starts[-1] + -(-n // align) * align
    whole = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in totals.items()}
    return [
        whole[(dtype, device)][start : start + n]
        for (dtype, device, n), start in zip(sizes, starts, strict=True)
    ]


def compact_block(compact_state: str | None) -> int:
    """The alignment of ``compact_state``'s fragment buckets: its largest block (0 for
    ``None``). See [Note: Block-aligned fragment buckets]."""
    if compact_state is None:
        return 0
    return max(fmt.block for fmt in moment_formats(compact_state))


def _compact(compact_state: str | None, p: torch.Tensor) -> bool:
    """Whether ``p`` may hold compact moments (see [Note: One compact decider])."""
    return compact_formats(compact_state, p.numel(), p.dtype) is not None


def _aligned_layout(
    params: list[torch.Tensor], world: int, compact_state: str | None
) -> tuple[list[int], int]:
    """Offsets and shard size of a block-aligned fragment bucket.

    [Note: Block-aligned fragment buckets]
    Compact moments are quantized in blocks of a param's *global* flat index (see [Note:
    Blocks on the global flat index] in ``shardkit.optim._compact``), so a rank's piece of a
    compact param must hold whole blocks. With ``compact_state``, every param that may store
    compact state (decided on its whole size and dtype, by the optimizer's decider: [Note: One
    compact decider] in ``shardkit.optim._compact``) starts at a multiple of ``block`` in the bucket, and the shard size ``S`` is a
    multiple of ``block``: every cut ``r * S`` then falls on a block boundary of every param it
    cuts, and each piece's blocks are the param's own. The padding (under ``block`` elements
    before each compact param, under ``N * block`` at the end) is never stepped, and its
    gradient is kept at zero like any padding. Buckets without such params keep the packed
    layout. The bits of the state are then the same at every world size.
    """
    block = compact_block(compact_state)
    offsets: list[int] = []
    pos = 0
    for p in params:
        if _compact(compact_state, p):
            pos = -(-pos // block) * block
        offsets.append(pos)
        pos += p.numel()
    return offsets, -(-pos // (world * block)) * block


def _whole_param_layout(params: list[torch.Tensor], world: int) -> tuple[list[int], list[int], int]:
    """Offsets, owners and shard size of a whole-param bucket (largest rank share)."""
    part = partition(params, world, algorithm="sorted_greedy")
    owners = [0] * len(params)
    loads = [0] * world
    for r in range(world):
        for i in part.params_of(r):
            owners[i] = r
            loads[r] += params[i].numel()
    shard = max(max(loads), 1)
    offsets = [0] * len(params)
    fill = [r * shard for r in range(world)]
    for i, p in enumerate(params):
        offsets[i] = fill[owners[i]]
        fill[owners[i]] += p.numel()
    return offsets, owners, shard
