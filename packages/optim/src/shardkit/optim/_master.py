"""Full-precision master copies of the params this rank owns (``master_dtype``).

[Note: Master weights]
With ``master_dtype=torch.float32`` and a bf16/fp16 model, the wrapped optimizer does not step the
model's params: it steps an fp32 *master* copy of each param this rank owns (trainable, floating,
of another dtype than ``master_dtype``; a param already in ``master_dtype`` is stepped as is), so
the optimizer state is fp32 too and nothing is rounded to the model's precision but the model
params themselves. A step, per chunk of owned params (``master_grad_bucket_bytes`` of fp32
gradients at most; one chunk when ``None``):

1. the chunk's low-precision grads are upcast into one flat fp32 buffer, multiplied by the
   pending gradient factors if any (the loss scaler's ``1/scale``, then the clip coefficient,
   see below), and the buffer's views become the masters' ``.grad``;
2. the wrapped optimizer steps the chunk's masters (``_step_local`` narrows its groups, as for
   the per-bucket step of shardkit-overlap);
3. the new master values are cast into the model params (``p.copy_(master)``) and the masters'
   ``.grad`` dropped.

So no fp32 copy of every grad exists at once: the extra memory is one chunk, one buffer per
device allocated by the first step (the size of the largest chunk) and reused by every chunk
and step after it, so no step allocates a gradient-sized tensor (issue 37: a buffer freed and
allocated again every step stays resident under glibc anyway, and costs fresh pages). After the local
step, the params are synchronised as without masters (one broadcast per flat bucket, in the
model's dtype: half the bytes of fp32).

Unscaling and clipping act on the fp32 gradients, not on the model's ``.grad``: the
``ShardedGradScaler`` only checks the low-precision grads for inf/nan and hands ``1/scale`` to
the optimizer, and ``clip_grad_norm`` computes the norm in fp32 from the upcast owned grads
(times the pending factors) and queues the clip coefficient. Each factor is one multiplication
of the fp32 grads, in order, so the result is bit for bit what unscaling and clipping fp32
gradients in place gives. Unscaling fp16 grads in fp16 would underflow exactly the small
gradients loss scaling exists to keep. The factors are consumed by the next step and dropped by
``zero_grad``. The model's ``.grad`` keep their raw (scaled, unclipped) values; params without a
master (already in ``master_dtype``) are unscaled and clipped in place as usual.

Masters are created from the live params when a rank comes to own a param (construction,
``add_param_group``, ``refresh_trainable``, ``set_partition``); a param that keeps its owner
keeps its master, and one that changes owner takes its master along with its optimizer state
(its exact fp32 value, not the rounded param). In state dicts they travel under the top-level
key ``"master_params"`` (global index -> tensor), beside a plain torch ``"state"`` (the state of
the fp32 masters) and ``"param_groups"``: a plain torch optimizer loads such a dict (extra keys
are ignored) and the masters survive every save, consolidation and reshard exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from shardkit.optim._grad_factors import GradFactors
from shardkit.optim._torch_compat import tensor_version

__all__: list[str] = []

logger = logging.getLogger("shardkit.optim")

MASTER_KEY = "master_params"
"""Top-level key of the master values in state dicts (global index -> tensor)."""

# Transport key of a master value inside one param's state entry while it moves between ranks
# (consolidation, repartition); never visible outside this package.
_WIRE_KEY = "__shardkit_master__"


def check_master_dtype(master_dtype: object, broadcast_fp16: bool) -> torch.dtype | None:
    """Validates the ``master_dtype`` argument."""
    if master_dtype is None:
        return None
    if not isinstance(master_dtype, torch.dtype) or not master_dtype.is_floating_point:
        raise TypeError(
            f"master_dtype must be a floating torch.dtype (torch.float32 for fp32 master weights "
            f"of a bf16/fp16 model) or None, got {type(master_dtype).__name__}: {master_dtype!r}"
        )
    if broadcast_fp16:
        raise ValueError(
            "broadcast_fp16=True cannot be combined with master_dtype: with master weights the "
            "params are already synchronised in the model's low precision (bf16/fp16) while the "
            "masters keep full precision. Drop broadcast_fp16."
        )
    return master_dtype


def check_master_remainder(value: object, master_dtype: torch.dtype | None) -> bool:
    """Validates ``master_remainder`` (see [Note: Remainder masters under ZeRO-1])."""
    if not isinstance(value, bool):
        raise TypeError(f"master_remainder must be a bool, got {type(value).__name__}: {value!r}")
    if value and master_dtype != torch.float32:
        raise ValueError(
            f"master_remainder=True keeps the fp32 master of each bf16 param as the param plus "
            f"an int16 remainder: it needs master_dtype=torch.float32, got master_dtype="
            f"{master_dtype}. Pass master_dtype=torch.float32 too, or drop master_remainder."
        )
    return value


def needs_master(p: torch.Tensor, master_dtype: torch.dtype | None) -> bool:
    """Whether an owned param gets a master: trainable, floating, not already in that dtype."""
    return (
        master_dtype is not None
        and p.requires_grad
        and p.is_floating_point()
        and p.dtype != master_dtype
    )


@dataclass
class _Chunk:
    """Owned params stepped together: their grads are upcast into one buffer."""

    params: list[torch.Tensor]  # model params, in the order of the wrapped optimizer's groups
    grad_bytes: int = 0


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
# stay unseen, as they are for autograd (documented in the README's Limits). ZeRO-1's masters
# (``_Masters``) and ZeRO-2's (``ShardStepper``, per piece of the param) both follow it.
def reseed_written(
    items: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], versions: dict[int, int]
) -> list[torch.Tensor]:
    """Re-seeds the masters of params written since ``versions`` recorded them, where the
    written value is no longer the master's rounding; returns those params.

    ``items`` are ``(param, values, master)``: the counter is read on the param itself, the
    values compared are the whole param (ZeRO-1) or this rank's piece of it (ZeRO-2). See
    [Note: Params written outside the optimizer].
    """
    items = list(items)
    written: dict[int, int] = {}
    for p, _, _ in items:
        seen, now = versions.get(id(p)), tensor_version(p)
        if seen is not None and seen != now:
            written[id(p)] = now
    out: list[torch.Tensor] = []
    if written:
        with torch.no_grad():
            for p, values, m in items:
                if id(p) in written and not torch.equal(values, m.to(values.dtype)):
                    m.copy_(values)
                    out.append(p)
        versions.update(written)
    return out


_logged_reseed = False


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


class _Masters:
    """The masters of one partition: ``id(param) -> master`` and back."""

    def __init__(self, dtype: torch.dtype, chunk_bytes: int | None) -> None:
        self.dtype = dtype
        self.chunk_bytes = chunk_bytes
        self._master: dict[int, torch.Tensor] = {}
        self._param: dict[int, torch.Tensor] = {}
        self._grads: dict[torch.device, torch.Tensor] = {}
        """Per device, the flat buffer of a chunk's upcast grads, reused (see [Note: Master
        weights])."""
        self.factors = GradFactors()
        """Pending gradient multipliers (the scaler's 1/scale, clip coefficients), in order."""
        self.versions: dict[int, int] = {}
        """``id(param) -> its version counter`` when its master was last made, loaded or cast
        into it ([Note: Params written outside the optimizer])."""

    def add(self, p: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
        """Makes ``p``'s master from ``value`` (a moved or kept master) or the live param."""
        src = p.detach() if value is None else value.detach()
        master = torch.empty(p.shape, dtype=self.dtype, device=p.device)
        with torch.no_grad():
            master.copy_(src)
        self._master[id(p)] = master
        self._param[id(master)] = p
        self.versions[id(p)] = tensor_version(p)
        return master

    def mark_current(self, params: Iterable[torch.Tensor]) -> None:
        """Records ``params``' versions: their masters are the truth from here (just loaded)."""
        for p in params:
            if id(p) in self._master:
                self.versions[id(p)] = tensor_version(p)

    def reseed_written(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """:func:`reseed_written` over ``params``' masters; returns the re-seeded params."""
        items = [(p, p, self._master[id(p)]) for p in params if id(p) in self._master]
        return reseed_written(items, self.versions)

    def has(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has a master here (an owned param that needs one)."""
        return id(p) in self._master

    def value(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s exact master value, if it has one: the live master (state dicts of
        ``master_dtype`` masters are live) or, for remainder masters, a new joined tensor."""
        return self._master.get(id(p))

    def set(self, p: torch.Tensor, value: torch.Tensor | None) -> None:
        """Sets ``p``'s master (it has one) to ``value`` exactly, or to the live param."""
        with torch.no_grad():
            self._master[id(p)].copy_(p if value is None else value)

    def mirror(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """For a param another rank owns: writes what the owner's load of master ``value``
        writes into it, so the replicas agree before the next sync. Nothing here (a load of
        fp32 masters writes no param); remainder masters write the master's rounding."""

    def covers(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is handled in ``dtype`` (by its master, on its owner):
        such gradients are never unscaled or clipped in place, owned or not."""
        return needs_master(p, self.dtype)

    def opt_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """What the wrapped optimizer steps for ``p``: its master, or ``p`` itself."""
        return self._master.get(id(p), p)

    def __len__(self) -> int:
        return len(self._master)

    def chunks(self, params: Iterable[torch.Tensor]) -> list[_Chunk]:
        """Splits ``params`` (owned, in optimizer order) into chunks of bounded scratch bytes
        (:meth:`step_bytes`: the fp32 grads, and remainder masters' joined values).

        Params without a master or without a gradient add no bytes; a param larger than the
        budget is a chunk of its own.
        """
        out: list[_Chunk] = [_Chunk([])]
        for p in params:
            nbytes = self.step_bytes(p) if id(p) in self._master and p.grad is not None else 0
            last = out[-1]
            if (
                self.chunk_bytes is not None
                and last.grad_bytes
                and last.grad_bytes + nbytes > self.chunk_bytes
            ):
                last = _Chunk([])
                out.append(last)
            last.params.append(p)
            last.grad_bytes += nbytes
        return [c for c in out if c.params]

    def step_bytes(self, p: torch.Tensor) -> int:
        """Scratch bytes ``p``'s master needs in a step: its upcast gradient."""
        return p.numel() * torch.empty((), dtype=self.dtype).element_size()

    def load_grads(self, chunk: _Chunk) -> list[torch.Tensor]:
        """Step 1 of [Note: Master weights]: the chunk's upcast grads as the masters' ``.grad``.

        Returns the flat buffers (one per device), to keep alive until the step is done.
        """
        pairs = [
            (p, self._master[id(p)])
            for p in chunk.params
            if id(p) in self._master and p.grad is not None
        ]
        flats: list[torch.Tensor] = []
        for device in dict.fromkeys(m.device for _, m in pairs):
            on = [(p, m) for p, m in pairs if m.device == device]
            numel = sum(m.numel() for _, m in on)
            kept = self._grads.get(device)
            if kept is None or kept.numel() < numel:  # the first step, or a larger chunk
                kept = self._grads[device] = torch.empty(numel, dtype=self.dtype, device=device)
            flat = kept[:numel]
            off = 0
            for p, m in on:
                view = flat[off : off + m.numel()].view(m.shape)
                grad = p.grad
                assert grad is not None  # filtered above
                view.copy_(grad)
                m.grad = view
                off += m.numel()
            self.factors.apply(flat)  # one multiply each, in order: as if applied in place
            flats.append(flat)
        return flats

    def write_back(self, chunk: _Chunk) -> None:
        """Step 3 of [Note: Master weights]: cast the new values into the model params."""
        with torch.no_grad():
            for p in chunk.params:
                m = self._master.get(id(p))
                if m is not None and m.grad is not None:
                    p.copy_(m)
                    m.grad = None
                    self.versions[id(p)] = tensor_version(p)


def split_wire(
    entries: dict[int, dict[str, object]],
) -> tuple[dict[int, dict[str, object]], dict[int, torch.Tensor]]:
    """Separates transported master values from the optimizer state (see ``_WIRE_KEY``)."""
    masters: dict[int, torch.Tensor] = {}
    state: dict[int, dict[str, object]] = {}
    for idx, entry in entries.items():
        value = entry.get(_WIRE_KEY)
        if isinstance(value, torch.Tensor):
            masters[idx] = value
        rest = {k: v for k, v in entry.items() if k != _WIRE_KEY}
        if rest:
            state[idx] = rest
    return state, masters


def join_wire(
    state: dict[int, dict[str, object]], masters: dict[int, torch.Tensor]
) -> dict[int, dict[str, object]]:
    """The inverse of :func:`split_wire`: masters ride in their param's state entry."""
    out = {idx: dict(entry) for idx, entry in state.items()}
    for idx, value in masters.items():
        out.setdefault(idx, {})[_WIRE_KEY] = value
    return out


def check_master_values(masters: object, params: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Validates a state dict's ``"master_params"`` against the params (indices, shapes)."""
    if not isinstance(masters, dict):
        raise TypeError(
            f"state_dict[{MASTER_KEY!r}] must be a dict of global param index -> tensor, got "
            f"{type(masters).__name__}"
        )
    for idx, value in masters.items():
        if not isinstance(idx, int) or not 0 <= idx < len(params):
            raise ValueError(
                f"state_dict[{MASTER_KEY!r}] has an entry for param {idx!r}; expected int "
                f"indices in [0, {len(params)}). It was saved for a different model."
            )
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(
                f"state_dict[{MASTER_KEY!r}][{idx}] must be a floating tensor, got "
                f"{type(value).__name__}"
            )
        if tuple(value.shape) != tuple(params[idx].shape):
            raise ValueError(
                f"state_dict[{MASTER_KEY!r}][{idx}] has shape {tuple(value.shape)} but param "
                f"{idx} has shape {tuple(params[idx].shape)}: it was saved for a different model."
            )
    return masters


def unscale_grads(
    grads: Iterable[tuple[torch.Tensor, bool]], inv_scale: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """``ShardedGradScaler``'s unscale of local gradients, ZeRO-1's and ZeRO-2's alike.

    Args:
        grads: ``(gradient, stepped through a master)`` pairs. Gradients without a master are
            multiplied by ``inv_scale`` in place; those with one are left as they are (the
            caller queues ``inv_scale`` as a factor, applied in fp32 to the upcast gradient).
        inv_scale: ``1 / scale``.

    Returns:
        One found-inf flag (fp32 0-d, 1.0 if any inf/nan) per device, torch's format.
    """
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for g, has_master in grads:
            flag = found.setdefault(g.device, torch.zeros((), dtype=torch.float32, device=g.device))
            if not has_master:
                g.mul_(inv_scale.to(device=g.device, dtype=g.dtype))
            flag.copy_(torch.maximum(flag, (~torch.isfinite(g).all()).to(flag.dtype)))
    return found
