"""The one implementation of master weights, ZeRO-1's and ZeRO-2's: a set of stepped tensors.

A *stepped tensor* (:class:`Stepped`) is what a rank's local optimizer updates for one param:
the whole param (ZeRO-1's ``LocalShards``, a whole-param bucket of ZeRO-2's ``ShardStepper``)
or this rank's 1-D piece of it (a view of a fragment bucket's flat buffer). A
:class:`MasterSet` gives the stepped tensors of another dtype than ``master_dtype`` their
master ([Note: Master weights] in ``_master.py``): a full copy in ``master_dtype``, or, with
remainders, an int16 remainder beside the bf16 tensor ([Note: Remainder masters]). It owns
everything the masters do, for both engines: making them (:meth:`MasterSet.attach`), reading
and writing their exact values (:meth:`Stepped.value`, :meth:`Stepped.set`), re-seeding them
from params written by someone else (:meth:`MasterSet.reseed_written`), the step of one part
of them (:meth:`MasterSet.step`: :meth:`~MasterSet.load` the gradients upcast with the pending
factors and the remainder masters joined, the local optimizer's step, :meth:`~MasterSet.write_back`
cast or split back, :meth:`~MasterSet.release`),
the parts' scratch bytes (:meth:`MasterSet.cost`, :func:`pack`) and the bytes held
(:meth:`MasterSet.nbytes`). The engines decide which tensors are stepped, which gradient each
one has and which memory a part's scratch is (ZeRO-1's own buffers, :meth:`MasterSet.kept`;
ZeRO-2's lent staging buffers).

[Note: Remainder masters]
With ``master_remainder=True`` (and ``master_dtype=torch.float32``) the exact fp32 master of a
bf16 stepped tensor is the tensor itself (its high 16 bits) plus a persistent int16 remainder
(see [Note: Exact 16-bit remainder masters] in ``_remainder.py``): 2 bytes per element
instead of 4. Tensors of other dtypes (fp16: no exact 16-bit scheme) keep a full master
(logged once). The local optimizer stays a plain torch optimizer class that keys its state by
tensor object, so each such tensor has a persistent fp32 *handle* in its groups, which holds
no memory of its own outside the step: it is a stride-0 view of one fp32 element per device
(right shape, dtype and device: torch's ``load_state_dict`` and the compact class read those),
so reading it outside the step gives zeros, not the master. A step of one part:

1. the part's grads are upcast as for fp32 masters; for each remainder tensor,
   ``join_master(tensor, remainder)`` is written into the part's second scratch slice (beside
   the upcast gradients: a part's :meth:`MasterSet.cost` counts both) and the handle is
   re-pointed at it (``Tensor.set_``);
2. the local optimizer steps the part (the handles are the exact fp32 masters);
3. ``split_master`` writes the new value back into the tensor (rounded to nearest, ties away
   from zero) and its remainder, in place, and the handle goes back to the idle view.

So the updates are bit for bit those of ``master_dtype=torch.float32`` and the params too except
at exact ties (the Note in ``_remainder.py``). Joins and splits run on blocks of ``_BLOCK``
elements, so their int32 temporaries stay bounded whatever the tensor's size. Everything that
reads or writes a master goes through :meth:`Stepped.value` / :meth:`Stepped.set`: state
dicts, consolidation, repartition, ``master_model_state_dict`` and checkpoints carry the
joined, exact fp32 value (interchangeable with an fp32-master run's), and a loaded fp32
master is split once: exact, but the tensor is written (rounded ties away from zero) since it
is the master's high half. Written params ([Note: Params written outside the optimizer]): a
write replaces the high half, and what the old master was cannot be told from the remainder
alone, so on a changed version counter the remainder is reset to 0 and the master is exactly
the written bf16 value, even where the same values were written (they lose their low 16
bits: at most half a bf16 unit). So load the model's weights *before* the optimizer state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from shardkit.optim._master import needs_master
from shardkit.optim._remainder import join_master, split_master
from shardkit.optim._torch_compat import tensor_version

__all__ = [
    "GradFactors",
    "MasterSet",
    "Scratch",
    "ShardPart",
    "Stepped",
    "log_reseeded",
    "pack",
    "step_shard",
]

logger = logging.getLogger("shardkit.optim")
_logged_full = False
_logged_reseed = False

_BLOCK = 1 << 20
"""Elements per join / split call (bounds their temporaries at about 20 bytes per element)."""

Scratch = Callable[[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]]
"""``(device, n, joined) -> (grads, values)``: flat fp32 (``master_dtype``) scratch of ``n``
elements for a part's upcast gradients and of ``joined`` for its joined remainder masters."""

_T = TypeVar("_T")


class GradFactors:
    """Multiplications queued for the next step's upcast (master-dtype) gradients, in order.

    Gradients stepped through a master are never unscaled or clipped in place: the loss
    scaler's ``1/scale`` and the clip coefficient are queued here and applied to the upcast
    gradient, one multiplication each in order, which gives bit for bit what unscaling and
    clipping fp32 gradients in place gives. The step consumes them; ``zero_grad`` and a
    skipped step drop them. See [Note: Master weights].
    """

    def __init__(self) -> None:
        self._factors: list[torch.Tensor] = []

    def add(self, factor: torch.Tensor) -> None:
        """Queues a multiplication by ``factor`` (a one-element tensor, kept as an fp32 0-d
        copy)."""
        self._factors.append(factor.detach().to(dtype=torch.float32).reshape(()).clone())

    def apply(self, grad: torch.Tensor) -> None:
        """Multiplies ``grad`` in place by every queued factor, in order (cast to its dtype)."""
        for f in self._factors:
            grad.mul_(f.to(device=grad.device, dtype=grad.dtype))

    def clear(self) -> None:
        """Drops every queued factor."""
        self._factors.clear()

    def __len__(self) -> int:
        return len(self._factors)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._factors)


def _blocks(first: torch.Tensor, *others: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
    """Matching flat slices of ``first`` and ``others`` (one shape), at most ``_BLOCK``
    elements each; the whole tensors when one is not contiguous."""
    if not all(t.is_contiguous() for t in (first, *others)):
        yield (first, *others)
        return
    flat = [t.view(-1) for t in (first, *others)]
    for lo in range(0, first.numel(), _BLOCK):
        yield tuple(t[lo : lo + _BLOCK] for t in flat)


def _point(handle: torch.Tensor, at: torch.Tensor) -> None:
    """Re-points ``handle`` at ``at``'s memory, shape and strides (``Tensor.set_``)."""
    handle.set_(at.untyped_storage(), at.storage_offset(), at.shape, at.stride())


@dataclass(eq=False)
class Stepped:
    """One tensor a local optimizer steps, and its master if it has one."""

    tensor: torch.Tensor
    """The model-side tensor: the param itself, or a 1-D piece of it (a bucket view)."""
    param: torch.Tensor
    """The whole param (its version counter: [Note: Params written outside the optimizer])."""
    master: torch.Tensor | None = None
    """Its master in ``master_dtype`` (stepped instead of ``tensor``), or, with a remainder,
    its handle ([Note: Remainder masters]); ``None`` without a master."""
    remainder: torch.Tensor | None = None
    """The int16 remainder of a bf16 tensor: its master is ``join_master(tensor, remainder)``."""

    @property
    def opt(self) -> torch.Tensor:
        """What the local optimizer steps: the master (or handle), else the tensor."""
        return self.tensor if self.master is None else self.master

    def value(self) -> torch.Tensor:
        """The exact master value: the live master, or a new joined tensor for a remainder."""
        r = self.remainder
        if r is None:
            if self.master is None:
                raise RuntimeError("value() of a stepped tensor without a master")
            return self.master
        out = torch.empty(self.tensor.shape, dtype=torch.float32, device=self.tensor.device)
        with torch.no_grad():
            for hi, lo, o in _blocks(self.tensor.detach(), r, out):
                join_master(hi, lo, out=o)
        return out

    def set(self, value: torch.Tensor | None) -> None:
        """Sets the master exactly to ``value`` (any shape of as many elements), or to the live
        tensor when ``None``; a remainder master is split into the tensor (rounded) and its
        remainder."""
        with torch.no_grad():
            r = self.remainder
            if r is not None:
                if value is None:
                    r.zero_()
                    return
                v = value.detach().to(self.tensor.device, torch.float32)
                v = v.reshape(self.tensor.shape).contiguous()
                for m, hi, lo in _blocks(v, self.tensor.detach(), r):
                    split_master(m, param_out=hi, remainder_out=lo)
            elif self.master is not None:
                self.master.copy_(
                    self.tensor if value is None else value.reshape(self.master.shape)
                )


def pack(items: Iterable[_T], cost: Callable[[_T], int], budget: int | None) -> list[list[_T]]:
    """``items`` in order, cut into parts of at most ``budget`` bytes of :meth:`MasterSet.cost`
    each (one part when ``None``); an item larger than the budget is a part of its own, items
    of no cost never open a part."""
    out: list[list[_T]] = [[]]
    used = 0
    for item in items:
        c = cost(item)
        if budget is not None and used and used + c > budget:
            out.append([])
            used = 0
        out[-1].append(item)
        used += c
    return [part for part in out if part]


# [Note: Params written outside the optimizer]
# A master is the truth of its param: each step casts it into the param. A value written into
# the param by anyone else after the master was made (``model.load_state_dict`` of weights after
# the optimizer was built, ``nn.init``, a clamp) would be overwritten by the next step, silently,
# where DDP and a plain optimizer step from the written value. So the owner records each param's
# version counter (``_torch_compat.tensor_version``) when the master was made, loaded or cast
# into the param; before a param is stepped again a changed counter means someone wrote it, and
# if its value is no longer the master's rounding the master is re-seeded from it (logged once).
# Reading a counter costs nothing next to the step; values are compared only for written params.
# Writes through ``p.data`` (and raw pointers, other processes) do not move the counter: they
# stay unseen, as they are for autograd (documented in the README's Limits). The counter is read
# on the whole param, the values compared are the stepped tensor (the param, or this rank's
# piece of it under ZeRO-2): :meth:`MasterSet.reseed_written`, for both engines.
@dataclass(frozen=True)
class ShardPart:
    """One optimizer step of a shard step ([Note: One shard step]): ``run()`` steps the local
    optimizer over some of this rank's tensors; ``stepped`` are those of them with a master
    (their gradients ``grads``, upcast by :meth:`MasterSet.step` around ``run``), empty for a
    part of tensors stepped as they are."""

    run: Callable[[], object]
    """Steps the local optimizer over the part's tensors only."""
    stepped: Sequence[Stepped] = ()
    """The part's tensors with a master, in order."""
    grads: Sequence[torch.Tensor] = ()
    """Their gradients (the params' dtype), one each."""


# [Note: One shard step]
# ZeRO-1 (``LocalShards``, also under the overlap hook) and ZeRO-2 (``ShardStepper``) step a
# rank's shard the same way, here: the masters of every tensor about to be stepped are re-seeded
# from params written outside the optimizer ([Note: Params written outside the optimizer]),
# then each part runs (a part with masters through :meth:`MasterSet.step`: upcast gradients
# times the pending factors, the step, the cast or split back; a part without through its
# ``run`` alone), and the pending gradient factors are dropped whether or not the step
# finished. What differs is only how each cuts its tensors into parts and narrows its local
# optimizer to one part: ZeRO-1 edits the wrapped optimizer's groups to the part's whole
# params, packed by ``master_grad_bucket_bytes``; ZeRO-2 sets the ``.grad`` of the part's
# pieces (the others are skipped for having none), a bucket at a time, packed by the scratch
# it is lent.
def step_shard(
    masters: MasterSet | None,
    factors: GradFactors,
    reseed: Iterable[Stepped],
    parts: Iterable[ShardPart],
    scratch: Scratch | None,
) -> None:
    """Runs one shard step; see [Note: One shard step].

    Args:
        masters: The shard's masters (``None``: no tensor has one; every part is plain).
        factors: The pending gradient factors, dropped at the end.
        reseed: The stepped tensors whose masters follow a written param.
        parts: The parts, in order (a generator may build each when its turn comes).
        scratch: Where the parts with masters upcast their gradients.
    """
    try:
        if masters is not None:
            log_reseeded(masters.reseed_written(reseed))
        for part in parts:
            if part.stepped:
                if masters is None or scratch is None:
                    raise RuntimeError("a part with masters needs the masters and a scratch")
                masters.step(part.stepped, part.grads, scratch, part.run)
            else:
                part.run()
    finally:
        factors.clear()


def log_reseeded(written: Sequence[torch.Tensor]) -> None:
    """Logs (once per process) that masters were re-seeded from written params."""
    global _logged_reseed
    if written and not _logged_reseed:
        _logged_reseed = True
        logger.warning(
            "%d param(s) with fp32 master weights were written outside the optimizer since it "
            "last stepped them (e.g. model.load_state_dict() after the optimizer was built); "
            "their masters now start from the written values, as a plain optimizer would "
            "(logged once)",
            len(written),
        )


class MasterSet:
    """The masters of a rank's stepped tensors (at most one per param), keyed by param.

    Args:
        dtype: ``master_dtype``.
        remainder: bf16 tensors keep an int16 remainder instead of a full master ([Note:
            Remainder masters]); needs ``dtype=torch.float32``.
    """

    def __init__(self, dtype: torch.dtype, remainder: bool = False, replicas: bool = False) -> None:
        if replicas and remainder:
            raise ValueError(
                "master_remainder=True keeps a bf16 param's master as the param plus a remainder, "
                "so the param must be the master's rounding; a quantized param wire (weight "
                "deltas) keeps the params as replicas that differ from it. Use "
                "master_remainder=False with a quantized wire_params"
            )
        self.dtype = dtype
        self.remainder = remainder and dtype == torch.float32
        self.replicas = replicas
        """Replica mode ([Note: Weight deltas] in ``shardkit.optim._wire``): every floating
        tensor has a master, and the step does not write the tensors (the wire's weight-delta
        gather does)."""
        self._size = torch.empty((), dtype=dtype).element_size()
        self._stepped: dict[int, Stepped] = {}
        """``id(param) -> its stepped tensor``, for those with a master."""
        self.factors = GradFactors()
        """Pending gradient multipliers (the scaler's 1/scale, clip coefficients), in order."""
        self.versions: dict[int, int] = {}
        """``id(param) -> its version counter`` when its master was last made, loaded or cast
        into it ([Note: Params written outside the optimizer])."""
        self._idle: dict[torch.device, torch.Tensor] = {}
        """Per device, the one fp32 element every idle handle is a stride-0 view of."""
        self._kept: dict[tuple[int, torch.device], torch.Tensor] = {}
        """:meth:`kept`'s buffers: ``(0: gradients, 1: joined masters; device) -> flat``."""

    # ------------------------------------------------------------------ making masters
    def attach(
        self,
        items: Sequence[Stepped],
        values: Sequence[torch.Tensor | None] | None = None,
        pooled: bool = False,
    ) -> None:
        """Gives each of ``items`` (of another dtype than ``dtype``) its master, from its
        ``values`` entry (a moved or kept master value) or the live tensor.

        ``pooled``: the masters and remainders are views of one flat buffer per device,
        allocated once (a buffer per piece would scatter the allocator's heap); else one
        tensor each (they travel, live, in state dicts).
        """
        global _logged_full
        split = [s for s in items if self.remainder and s.tensor.dtype == torch.bfloat16]
        full = [s for s in items if not (self.remainder and s.tensor.dtype == torch.bfloat16)]
        if self.remainder and full and not _logged_full:
            _logged_full = True
            logger.info(
                "master_remainder=True: %s params have no exact 16-bit remainder scheme and "
                "keep full fp32 masters (only bf16 params get remainders; logged once)",
                full[0].tensor.dtype,
            )
        masters = self._alloc(full, self.dtype, pooled, torch.empty)
        remainders = self._alloc(split, torch.int16, pooled, torch.zeros)
        with torch.no_grad():
            for s, m in zip(full, masters, strict=True):
                s.master = m
                m.copy_(s.tensor.detach())
        for s, r in zip(split, remainders, strict=True):
            s.remainder = r
            s.master = torch.empty(0, dtype=torch.float32, device=s.tensor.device)
            _point(s.master, self._idle_view(s.tensor))
        for i, s in enumerate(items):
            self._stepped[id(s.param)] = s
            value = None if values is None else values[i]
            if value is not None:
                s.set(value)
        self.mark_current(s.param for s in items)

    @staticmethod
    def _alloc(
        items: Sequence[Stepped],
        dtype: torch.dtype,
        pooled: bool,
        make: Callable[..., torch.Tensor],
    ) -> list[torch.Tensor]:
        """One tensor of each item's shape in ``dtype``, made by ``make`` (``torch.empty`` or
        ``torch.zeros``): views of one flat buffer per device if ``pooled``."""
        if not pooled:
            return [make(s.tensor.shape, dtype=dtype, device=s.tensor.device) for s in items]
        sizes: dict[torch.device, int] = {}
        for s in items:
            sizes[s.tensor.device] = sizes.get(s.tensor.device, 0) + s.tensor.numel()
        flats = {d: make(n, dtype=dtype, device=d) for d, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        out: list[torch.Tensor] = []
        for s in items:
            d, n = s.tensor.device, s.tensor.numel()
            out.append(flats[d][offsets[d] : offsets[d] + n].view(s.tensor.shape))
            offsets[d] += n
        return out

    def _idle_view(self, like: torch.Tensor) -> torch.Tensor:
        """A stride-0 fp32 view of ``like``'s shape on the device's one idle element."""
        base = self._idle.get(like.device)
        if base is None:
            base = self._idle[like.device] = torch.zeros(1, device=like.device)
        idle: torch.Tensor = base.as_strided(like.shape, (0,) * like.dim())
        return idle

    # ------------------------------------------------------------------ lookups
    def get(self, p: torch.Tensor) -> Stepped | None:
        """``p``'s stepped tensor here, if it has a master."""
        return self._stepped.get(id(p))

    def has(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has a master here."""
        return id(p) in self._stepped

    def opt_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """What the local optimizer steps for a whole param ``p``: its master, or ``p``."""
        s = self._stepped.get(id(p))
        return p if s is None else s.opt

    def covers(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is handled in ``dtype`` (by its master, on its owner):
        such gradients are never unscaled or clipped in place, owned or not."""
        return needs_master(p, self.dtype)

    def __len__(self) -> int:
        return len(self._stepped)

    # ------------------------------------------------------------------ values
    def value(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s exact master value (:meth:`Stepped.value`), if it has a master here."""
        s = self._stepped.get(id(p))
        return None if s is None else s.value()

    def set(self, p: torch.Tensor, value: torch.Tensor | None) -> None:
        """Sets ``p``'s master (it has one here) with :meth:`Stepped.set`; a remainder master's
        split writes the param, whose version is then recorded where the stepped tensor is the
        param itself."""
        s = self._stepped[id(p)]
        s.set(value)
        if s.remainder is not None and s.tensor is s.param:
            self.versions[id(s.param)] = tensor_version(s.param)

    def mirror(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """For a param another rank owns: writes what the owner's load of master ``value``
        writes into it, so the replicas agree before the next sync. Nothing for full masters
        (a load of them writes no param); a remainder master's rounding for a bf16 param."""
        if not self.remainder or p.dtype != torch.bfloat16 or not needs_master(p, self.dtype):
            return
        with torch.no_grad():
            v = value.detach().to(p.device, torch.float32).contiguous()
            for m, hi in _blocks(v, p.detach()):
                split_master(m, param_out=hi)

    def mark_current(self, params: Iterable[torch.Tensor]) -> None:
        """Records ``params``' versions: their masters are the truth from here (made, loaded)."""
        for p in params:
            if id(p) in self._stepped:
                self.versions[id(p)] = tensor_version(p)

    def reseed_written(self, items: Iterable[Stepped]) -> list[torch.Tensor]:
        """Re-seeds the masters of ``items`` whose param was written since its version was
        recorded; returns those params. See [Note: Params written outside the optimizer].

        A full master is re-seeded where the written value is no longer its rounding; a
        remainder is reset to 0 ([Note: Remainder masters])."""
        items = [s for s in items if s.master is not None]
        written: dict[int, int] = {}
        for s in items:
            seen, now = self.versions.get(id(s.param)), tensor_version(s.param)
            if seen is not None and seen != now:
                written[id(s.param)] = now
        out: list[torch.Tensor] = []
        if written:
            with torch.no_grad():
                for s in items:
                    if id(s.param) not in written:
                        continue
                    if s.remainder is not None:
                        s.remainder.zero_()
                        out.append(s.param)
                    elif self.replicas or not torch.equal(s.tensor, s.opt.to(s.tensor.dtype)):
                        s.opt.copy_(s.tensor)
                        out.append(s.param)
            self.versions.update(written)
        return out

    # ------------------------------------------------------------------ the step
    def grad_bytes(self, s: Stepped) -> int:
        """Bytes of ``s``'s upcast gradient (0 without a master)."""
        return 0 if s.master is None else s.tensor.numel() * self._size

    def cost(self, s: Stepped) -> int:
        """Scratch bytes of ``s``'s step: its upcast gradient, and its joined master beside it
        when it keeps a remainder ([Note: Remainder masters])."""
        return self.grad_bytes(s) * (2 if s.remainder is not None else 1)

    def kept(self, device: torch.device, n: int, joined: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A :data:`Scratch` of buffers kept here, one per role and device, allocated by the
        first step (the size of the largest part) and reused by every part and step after it,
        so no step allocates a gradient-sized tensor (see [Note: Master weights])."""
        grads = self._kept.get((0, device))
        if grads is None or grads.numel() < n:  # the first step, or a larger part
            grads = self._kept[(0, device)] = torch.empty(n, dtype=self.dtype, device=device)
        if not joined:
            return grads[:n], grads[:0]
        values = self._kept.get((1, device))
        if values is None or values.numel() < joined:
            values = self._kept[(1, device)] = torch.empty(joined, dtype=self.dtype, device=device)
        return grads[:n], values[:joined]

    def step(
        self,
        part: Sequence[Stepped],
        grads: Sequence[torch.Tensor],
        scratch: Scratch,
        run: Callable[[], object],
    ) -> None:
        """Steps ``part`` (stepped tensors with a master, one gradient each): :meth:`load`,
        ``run()`` (the local optimizer's step over them), :meth:`write_back`; then
        :meth:`release`, whether the step was done or failed. See [Note: Master weights]."""
        flats = self.load(part, grads, scratch)
        try:
            run()
            self.write_back(part)
        finally:
            self.release(part)
        del flats

    def load(
        self, part: Sequence[Stepped], grads: Sequence[torch.Tensor], scratch: Scratch
    ) -> list[torch.Tensor]:
        """Step 1 of [Note: Master weights] for ``part`` (stepped tensors with a master, one
        gradient each): the upcast gradients, times the pending factors, become the masters'
        ``.grad``; remainder masters are joined and their handles pointed at them.

        Returns the flat gradient buffers (one per device), to keep alive until the step is
        done; :meth:`write_back` and :meth:`release` end the part's step.
        """
        flats: list[torch.Tensor] = []
        with torch.no_grad():
            for device in dict.fromkeys(s.tensor.device for s in part):
                on = [(s, g) for s, g in zip(part, grads, strict=True) if s.tensor.device == device]
                numel = sum(s.tensor.numel() for s, _ in on)
                joined = sum(s.tensor.numel() for s, _ in on if s.remainder is not None)
                flat, values = scratch(device, numel, joined)
                off = joined_off = 0
                for s, grad in on:
                    master = s.master
                    assert master is not None  # parts hold tensors with masters only
                    n = s.tensor.numel()
                    if s.remainder is not None:  # [Note: Remainder masters]
                        view = values[joined_off : joined_off + n].view(s.tensor.shape)
                        for hi, lo, o in _blocks(s.tensor.detach(), s.remainder, view):
                            join_master(hi, lo, out=o)
                        _point(master, view)
                        joined_off += n
                    g = flat[off : off + n].view(s.tensor.shape)
                    g.copy_(grad)
                    master.grad = g
                    off += n
                self.factors.apply(flat)  # one multiply each, in order: as if applied in place
                flats.append(flat)
        return flats

    def write_back(self, part: Sequence[Stepped]) -> None:
        """Step 3 of [Note: Master weights]: the stepped masters cast into their tensors, or
        split into the tensors and remainders; the version of a param written in place is
        recorded (our own write). Nothing in replica mode (the wire's weight deltas update
        the tensors: [Note: Weight deltas] in ``shardkit.optim._wire``)."""
        if self.replicas:
            return
        with torch.no_grad():
            for s in part:
                master = s.master
                assert master is not None  # parts hold tensors with masters only
                if s.remainder is not None:
                    for m, hi, lo in _blocks(master, s.tensor.detach(), s.remainder):
                        split_master(m, param_out=hi, remainder_out=lo)
                else:
                    s.tensor.copy_(master)
                if s.tensor is s.param:
                    self.versions[id(s.param)] = tensor_version(s.param)

    def release(self, part: Sequence[Stepped]) -> None:
        """Ends ``part``'s step, done or failed: the masters' ``.grad`` dropped, the handles
        back to their idle view."""
        for s in part:
            if s.master is not None:
                s.master.grad = None
                if s.remainder is not None:
                    _point(s.master, self._idle_view(s.tensor))

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``"remainders"``, ``"masters"`` (full ones) and ``"scratch"`` (the kept
        buffers and the handles' elements)."""
        items = self._stepped.values()
        scratch = [*self._kept.values(), *self._idle.values()]
        return {
            "remainders": sum(s.remainder.nbytes for s in items if s.remainder is not None),
            "masters": sum(
                s.master.nbytes for s in items if s.master is not None and s.remainder is None
            ),
            "scratch": sum(t.nbytes for t in scratch),
        }
