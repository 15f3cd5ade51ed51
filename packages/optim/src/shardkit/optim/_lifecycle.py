"""The state machine of one bucket group: the only writer of what decides its next move.

[Note: Bucket group state]
A bucket group (one wrapped optimizer's buckets) goes through one cycle per step, from the
grad hooks to the next forward. Everything that decides what happens next lives in one
:class:`GroupLife` and is written only by its transitions, each of which checks the current
state first and raises a ``RuntimeError`` naming the call and the state when it is illegal:

- per bucket (:class:`BucketLife`): its :class:`BucketPhase` (``IDLE`` -> ``STAGING`` when it
  takes a staging buffer -> ``IN_FLIGHT`` when its reduce-scatter launches -> ``IDLE`` when it
  is waited for), the params still to stage in this pass, the params that staged a real
  gradient since the shard was last consumed, the staging buffer, the in-flight work and where
  it writes, whether the live reduced gradient was clipped, the pending param gather; and the
  ``grad_fresh`` flag of its shardkit-optim ``FlatBucket`` (the shard holds no unconsumed
  reduced gradient), which only these transitions write;
- per group, the :class:`GroupState`:

  - ``IDLE``: no reduced gradient held (after construction, a step whose gathers were waited
    for, ``zero_grad``); a backward under ``no_sync()`` keeps it (``.grad`` accumulates).
  - ``REDUCING``: a reduce-scatter of one of its buckets was launched and the group's buckets
    are not all launched and waited for (also the next synchronised backward from ``REDUCED``:
    gradients accumulate into the shards).
  - ``REDUCED``: every bucket reduced and waited for; the shards wait for ``step()``.
  - ``STEPPED``: the local step ran and consumed the shards (inside ``step()``).
  - ``GATHERING``: the param all-gathers are in flight (``overlap_param_gather``); back to
    ``IDLE`` when the last is waited for. The next backward may start first (a bucket no
    forward touched): ``REDUCING`` then, and the pending gathers are still recorded.

Across the groups of one wrapper, the backward pass's own state (whether a synchronised
backward is running, the next bucket to launch in the order over every group, the launched
buckets not waited for yet) is one :class:`PassLife`, written only by its transitions too.

Two pieces stay with their own concern: the param-access guard's list of wrappers with
gathers pending is thread-wide, across wrappers (written only by ``arm`` / ``disarm`` in
``shardkit.optim._gather``, driven by the pending gathers recorded here), and the gradient
factors of a pending unscale or clip belong to the local step (shardkit-optim's
``ShardStepper``, shared in form with ZeRO-1's masters).

The group (``shardkit.optim._bucket_group``) does the work (copies, collectives, the local step)
and calls a transition at each point where the state changes; the wrapper's backward pass
(``shardkit.optim._reducer``) decides *when* (bucket order over every group, the staging pool).
Everything else reads.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from shardkit.optim._flat import FlatBucket

__all__ = ["BucketLife", "BucketPhase", "GroupLife", "GroupState", "PassLife", "Transition"]


class GroupState(enum.Enum):
    """Where a bucket group is in its step cycle; see [Note: Bucket group state]."""

    IDLE = "idle"
    REDUCING = "reducing"
    REDUCED = "reduced"
    STEPPED = "stepped"
    GATHERING = "gathering"


class BucketPhase(enum.Enum):
    """Where one bucket's reduction is; see [Note: Bucket group state]."""

    IDLE = "idle"
    """Holds no staging buffer and no reduce-scatter in flight."""
    STAGING = "staging"
    """Holds a staging buffer that this pass's gradients are staged into."""
    IN_FLIGHT = "in_flight"
    """Its reduce-scatter was launched and is not waited for yet."""


Transition = tuple[str, GroupState, GroupState]
"""(the transition's name, the group state before, the group state after)."""


@dataclass(eq=False)
class BucketLife:
    """One bucket's reduction and gather state. Read anywhere; written only by
    :class:`GroupLife`'s transitions."""

    bucket: FlatBucket
    """The bucket (shardkit-optim's layout; its ``grad_fresh`` is written by the transitions)."""
    gaps: list[tuple[int, int]]
    """Element ranges covered by no param (padding), zeroed in a fresh staging buffer."""
    phase: BucketPhase = BucketPhase.IDLE
    """Where the bucket's reduction is."""
    pending: set[int] = field(default_factory=set)
    """Positions (in ``bucket.params``) whose gradient this pass has not staged yet."""
    used: set[int] = field(default_factory=set)
    """Positions of the params that staged a real gradient on this rank since the grad shard
    was last consumed (see [Note: Per-param fragments] in ``shardkit.optim._shard_stepper``)."""
    staging: torch.Tensor | None = None
    """The bucket's staging buffer (a prefix of ``base``) while it holds one."""
    base: torch.Tensor | None = None
    """The pool buffer ``staging`` is a prefix of (given back when the reduction finishes)."""
    work: Any = None
    """The in-flight reduce-scatter (``shardkit.optim._wire``'s pending record)."""
    clipped: bool = False
    """The live reduced gradient was clipped (see [Note: Clip agreement])."""


class GroupLife:
    """The state machine of one bucket group; see [Note: Bucket group state].

    Args:
        name: What the errors call the group (e.g. ``"ShardedDataParallel optimizer 0"``).
        buckets: The group's buckets, in their order in the group.
    """

    def __init__(self, name: str, buckets: Sequence[FlatBucket]) -> None:
        self.name = name
        self.buckets: list[BucketLife] = [
            BucketLife(b, _gaps(b), pending=set(range(len(b.params)))) for b in buckets
        ]
        self.state = GroupState.IDLE
        self._gathers: dict[int, Any] = {}
        self.record: list[Transition] | None = None
        """When a list, every transition but the per-param ones (``take_staging``, ``stage``,
        ``issued``) appends itself to it (for tests and debugging); ``None`` (the default)
        records nothing."""

    # ------------------------------------------------------------------ reads
    @property
    def gathers(self) -> Mapping[int, Any]:
        """The pending param gathers, by bucket index (read only)."""
        return self._gathers

    def holds_reduced(self) -> bool:
        """Whether a reduced gradient waits for ``step()`` / ``zero_grad()``."""
        return any(not b.bucket.grad_fresh for b in self.buckets)

    def in_flight(self) -> bool:
        """Whether a reduce-scatter of the group is in flight."""
        return any(b.phase is BucketPhase.IN_FLIGHT for b in self.buckets)

    # ------------------------------------------------------------------ checks
    def _illegal(self, call: str, why: str) -> RuntimeError:
        return RuntimeError(
            f"{self.name}: illegal transition {call}() in state {self.state.name}: {why}. This "
            f"is a bug in shardkit (or a call made from inside one of its hooks); please report "
            f"it with the traceback"
        )

    def _expect(self, call: str, k: int, phase: BucketPhase) -> BucketLife:
        b = self.buckets[k]
        if b.phase is not phase:
            raise self._illegal(
                call, f"bucket {b.bucket.index} is {b.phase.name}, expected {phase.name}"
            )
        return b

    def _no_flight(self, call: str) -> None:
        for b in self.buckets:
            if b.phase is BucketPhase.IN_FLIGHT:
                raise self._illegal(
                    call, f"bucket {b.bucket.index}'s reduce-scatter is still in flight"
                )

    def _move(self, call: str, to: GroupState) -> None:
        if self.record is not None:
            self.record.append((call, self.state, to))
        self.state = to

    # ------------------------------------------------------------------ backward
    def begin_pass(self) -> None:
        """A reduction pass starts: every param of every bucket is still to stage.

        Legal when no reduce-scatter of the group is in flight (the pass waits for the last
        one first) and not inside a step. A bucket left ``STAGING`` by a backward that raised
        keeps its staging buffer.
        """
        if self.state is GroupState.STEPPED:
            raise self._illegal("begin_pass", "a step is running")
        self._no_flight("begin_pass")
        for b in self.buckets:
            b.pending = set(range(len(b.bucket.params)))
        self._move("begin_pass", self.state)

    def take_staging(self, k: int, base: torch.Tensor) -> torch.Tensor:
        """Bucket ``k`` takes the pool buffer ``base``: ``IDLE -> STAGING``; returns the
        staging buffer (a prefix of ``base``, its padding still to zero)."""
        b = self._expect("take_staging", k, BucketPhase.IDLE)
        b.base = base
        b.staging = base[: b.bucket.numel]
        b.phase = BucketPhase.STAGING
        return b.staging

    def stage(self, k: int, i: int, real: bool) -> None:
        """Param ``i`` of bucket ``k`` was staged (``real``: a gradient of this rank, not
        zeros); legal once per pass, while the bucket is ``STAGING``."""
        b = self._expect("stage", k, BucketPhase.STAGING)
        if i not in b.pending:
            raise self._illegal("stage", f"param {i} of bucket {b.bucket.index} was staged already")
        b.pending.discard(i)
        if real:
            b.used.add(i)  # See [Note: Per-param fragments] in shardkit.optim._shard_stepper

    def launch(self, k: int) -> bool:
        """Bucket ``k``'s reduce-scatter is about to be issued: ``STAGING -> IN_FLIGHT`` once
        every param is staged; the group goes ``REDUCING``. Returns whether the grad shard was
        fresh (held no unconsumed gradient): the reduce-scatter may then write it directly."""
        b = self._expect("launch", k, BucketPhase.STAGING)
        if b.pending:
            raise self._illegal(
                "launch", f"bucket {b.bucket.index} has {len(b.pending)} params still to stage"
            )
        if self.state is GroupState.STEPPED:
            raise self._illegal("launch", "a step is running")
        fresh = b.bucket.grad_fresh
        b.bucket.grad_fresh = False
        b.clipped = False
        b.phase = BucketPhase.IN_FLIGHT
        self._move("launch", GroupState.REDUCING)
        return fresh

    def issued(self, k: int, work: Any) -> None:
        """Records bucket ``k``'s issued reduce-scatter (its work; the wire writes or adds the
        result into the grad shard when it completes)."""
        b = self._expect("issued", k, BucketPhase.IN_FLIGHT)
        if b.work is not None:
            raise self._illegal("issued", f"bucket {b.bucket.index} already has a work")
        b.work = work

    def finish(self, k: int) -> torch.Tensor:
        """Bucket ``k``'s reduce-scatter was waited for and folded into its shard:
        ``IN_FLIGHT -> IDLE``; returns the pool buffer it held. The group goes ``REDUCED``
        once every bucket is staged, launched and waited for."""
        b = self._expect("finish", k, BucketPhase.IN_FLIGHT)
        base = b.base
        if base is None:
            raise self._illegal("finish", f"bucket {b.bucket.index} holds no staging buffer")
        b.work = b.base = b.staging = None
        b.phase = BucketPhase.IDLE
        done = self.state is GroupState.REDUCING and all(
            x.phase is BucketPhase.IDLE and not x.pending for x in self.buckets
        )
        self._move("finish", GroupState.REDUCED if done else self.state)
        return base

    def mark_clipped(self) -> None:
        """The live reduced gradients were clipped (no reduce-scatter in flight)."""
        self._no_flight("mark_clipped")
        for b in self.buckets:
            if not b.bucket.grad_fresh:
                b.clipped = True

    # ------------------------------------------------------------------ step
    def stepped(self) -> None:
        """The local step consumed the grad shards: ``-> STEPPED`` (from ``IDLE``,
        ``REDUCING`` with nothing in flight (a backward that raised) or ``REDUCED``)."""
        if self.state in (GroupState.STEPPED, GroupState.GATHERING):
            raise self._illegal("stepped", "the previous step's gathers were not waited for")
        self._no_flight("stepped")
        self._consume()
        self._move("stepped", GroupState.STEPPED)

    def gather_issued(self, index: int, work: Any) -> None:
        """The param all-gather of the bucket of index ``index`` was issued (in a step)."""
        if self.state is not GroupState.STEPPED:
            raise self._illegal("gather_issued", "param gathers are issued by a step only")
        if index in self._gathers:
            raise self._illegal("gather_issued", f"bucket {index}'s gather is pending already")
        self._gathers[index] = work
        self._move("gather_issued", self.state)

    def step_done(self) -> None:
        """The step returns: ``STEPPED -> GATHERING`` (gathers pending) or ``IDLE``."""
        if self.state is not GroupState.STEPPED:
            raise self._illegal("step_done", "no step is running")
        self._move("step_done", GroupState.GATHERING if self._gathers else GroupState.IDLE)

    def gather_done(self, index: int) -> Any:
        """Bucket ``index``'s pending gather is being waited for: forgets it and returns its
        work; the group leaves ``GATHERING`` for ``IDLE`` with the last one."""
        work = self._gathers.pop(index, None)
        if work is None:
            raise self._illegal("gather_done", f"bucket {index} has no pending gather")
        drained = not self._gathers and self.state is GroupState.GATHERING
        self._move("gather_done", GroupState.IDLE if drained else self.state)
        return work

    def discard(self) -> None:
        """``zero_grad``: the reduced gradients are dropped (nothing in flight; not inside a
        step): ``-> IDLE``, or ``GATHERING`` while gathers are pending."""
        if self.state is GroupState.STEPPED:
            raise self._illegal("discard", "a step is running")
        self._no_flight("discard")
        self._consume()
        self._move("discard", GroupState.GATHERING if self._gathers else GroupState.IDLE)

    def _consume(self) -> None:
        for b in self.buckets:
            b.bucket.grad_fresh = True  # the next reduce-scatter overwrites the shard
            b.used.clear()
            b.clipped = False


class PassLife:
    """The state of the backward pass over every bucket group of one wrapper: see [Note:
    Bucket group state] and [Note: Staging and launch order] in ``shardkit.optim._reducer``.

    Read anywhere; written only by its transitions.
    """

    def __init__(self) -> None:
        self.in_backward = False
        """A reduction pass runs: from its first gradient (or ``reduce()``) to its flush."""
        self.next_launch = 0
        """The position, in the order over every group, of the next bucket to launch."""
        self.inflight: list[tuple[Any, int]] = []
        """The launched, unfinished buckets as (group, position), in launch order."""

    def _illegal(self, call: str, why: str) -> RuntimeError:
        state = "in a backward" if self.in_backward else "between backwards"
        return RuntimeError(
            f"backward pass: illegal transition {call}() {state}: {why}. This is a bug in "
            f"shardkit (or a call made from inside one of its hooks); please report it with the "
            f"traceback"
        )

    def reset(self) -> None:
        """A new bucket layout: nothing launched (nothing may be in flight)."""
        if self.inflight:
            raise self._illegal("reset", f"{len(self.inflight)} reduce-scatters in flight")
        self.in_backward = False
        self.next_launch = 0

    def start(self) -> None:
        """A reduction pass starts (the previous one's reduce-scatters were waited for)."""
        if self.inflight:
            raise self._illegal("start", f"{len(self.inflight)} reduce-scatters in flight")
        self.in_backward = True
        self.next_launch = 0

    def launched(self, group: Any, k: int) -> None:
        """The next bucket in the order, ``k`` of ``group``, launched its reduce-scatter."""
        self.inflight.append((group, k))
        self.next_launch += 1

    def finished(self, index: int) -> tuple[Any, int]:
        """The launched bucket at ``index`` of :attr:`inflight` is being waited for; returns
        it (group, position)."""
        if not 0 <= index < len(self.inflight):
            raise self._illegal("finished", f"no reduce-scatter in flight at {index}")
        return self.inflight.pop(index)

    def end(self) -> None:
        """The pass flushed its last buckets (the end of backward, or ``reduce()``)."""
        self.in_backward = False

    def forget_aborted(self) -> None:
        """Forgets a pass whose backward raised before its end (nothing of it in flight)."""
        if self.in_backward and not self.inflight:
            self.in_backward = False


def _gaps(b: FlatBucket) -> list[tuple[int, int]]:
    """Element ranges of the bucket covered by no param (padding), to zero in staging."""
    spans = sorted((off, off + p.numel()) for off, p in zip(b.offsets, b.params, strict=True))
    out: list[tuple[int, int]] = []
    pos = 0
    for start, end in spans:
        if start > pos:
            out.append((pos, start))
        pos = max(pos, end)
    if pos < b.numel:
        out.append((pos, b.numel))
    return out
