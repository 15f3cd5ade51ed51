"""Parameter descriptions (:class:`ParamSpec`), input normalisation and the default cost model."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ParamSpec", "param_costs"]


@dataclass(frozen=True)
class ParamSpec:
    """What the partitioners need to know about one parameter, without its storage.

    Build one from a tensor with :meth:`from_tensor`, or directly from a shape (for planning
    memory before a model exists, see ``load_shapes``).
    """

    shape: tuple[int, ...]
    """Size of every dimension; ``()`` for a scalar. Dimensions must be non-negative ints."""
    dtype: torch.dtype
    """Element type; fixes the element size used by the default cost model."""
    requires_grad: bool = True
    """Whether the parameter is trainable. Frozen parameters carry no optimizer state."""
    _numel: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        shape = self.shape
        if not isinstance(shape, (tuple, list, torch.Size)):
            raise TypeError(
                f"ParamSpec.shape must be a tuple of non-negative ints, got "
                f"{type(shape).__name__} {shape!r}; pass e.g. shape=(768, 3072)"
            )
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(
                    f"ParamSpec.shape must contain ints, got {type(dim).__name__} {dim!r} in "
                    f"shape {tuple(shape)!r}; convert the dimensions with int()"
                )
            if dim < 0:
                raise ValueError(
                    f"ParamSpec.shape must not contain negative sizes, got {dim} in shape "
                    f"{tuple(shape)!r}; every dimension must be >= 0"
                )
        # Normalise lists and torch.Size to a plain tuple of ints so that equality and hashing
        # do not depend on how the spec was built.
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"ParamSpec.dtype must be a torch.dtype, got {type(self.dtype).__name__} "
                f"{self.dtype!r}; pass e.g. dtype=torch.float32"
            )
        if not isinstance(self.requires_grad, bool):
            raise TypeError(
                f"ParamSpec.requires_grad must be a bool, got "
                f"{type(self.requires_grad).__name__} {self.requires_grad!r}"
            )
        object.__setattr__(self, "_numel", math.prod(self.shape))

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> ParamSpec:
        """Describe ``t`` (any tensor, including ``meta`` tensors and ``nn.Parameter``).

        Raises:
            TypeError: ``t`` is not a tensor.
        """
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"ParamSpec.from_tensor expects a torch.Tensor, got {type(t).__name__} {t!r}"
            )
        return cls(tuple(t.shape), t.dtype, bool(t.requires_grad))

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar)."""
        return self._numel

    @property
    def element_size(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter itself: ``numel * element_size``."""
        return self._numel * self.dtype.itemsize


def _as_specs(params: Iterable[torch.Tensor | ParamSpec], what: str) -> tuple[ParamSpec, ...]:
    """Normalise ``params`` to specs, rejecting modules, param-group dicts and duplicate tensors."""
    if isinstance(params, torch.nn.Module):
        raise TypeError(
            f"{what} expects a sequence of tensors or ParamSpec, got the module "
            f"{type(params).__name__}; pass list(module.parameters()) instead"
        )
    if isinstance(params, (torch.Tensor, ParamSpec, str, bytes, dict)):
        raise TypeError(
            f"{what} expects a sequence of tensors or ParamSpec, got a single "
            f"{type(params).__name__}; wrap it in a list"
        )
    try:
        items: list[object] = list(params)
    except TypeError:
        raise TypeError(
            f"{what} expects a sequence of tensors or ParamSpec, got {type(params).__name__} "
            f"{params!r}"
        ) from None
    if not items:
        raise ValueError(
            f"{what} got no parameters; pass at least one tensor or ParamSpec (an empty "
            f"parameter list usually means the model was built on another rank or the "
            f"generator was already consumed)"
        )
    specs: list[ParamSpec] = []
    seen: dict[int, int] = {}
    for i, p in enumerate(items):
        if isinstance(p, ParamSpec):
            specs.append(p)
        elif isinstance(p, torch.Tensor):
            first = seen.setdefault(id(p), i)
            if first != i:
                raise ValueError(
                    f"{what} got the same tensor at indices {first} and {i}; a parameter "
                    f"listed twice would be owned (and updated) twice. Remove the duplicate "
                    f"(tied weights appear once in module.parameters())"
                )
            specs.append(ParamSpec.from_tensor(p))
        elif isinstance(p, dict):
            raise TypeError(
                f"{what} expects tensors or ParamSpec, got a dict at index {i} (a param "
                f"group?); pass the tensors, e.g. [p for g in groups for p in g['params']], "
                f"and group_sizes=[len(g['params']) for g in groups]"
            )
        else:
            raise TypeError(
                f"{what} expects tensors or ParamSpec, got {type(p).__name__} {p!r} at "
                f"index {i}"
            )
    return tuple(specs)


def param_costs(
    params: Iterable[torch.Tensor | ParamSpec],
    *,
    per_element: float | None = None,
    frozen_cost: float = 1.0,
) -> tuple[float, ...]:
    """The default cost model: what each parameter adds to its owner's optimizer-state memory.

    A trainable parameter costs ``numel * per_element`` (``per_element`` defaults to the
    element size of its dtype, so the cost is its size in bytes); a frozen parameter costs
    ``frozen_cost`` (1 by default: almost nothing, but still spread one tensor at a time as
    fairscale's OSS does).

    Args:
        params: Tensors or :class:`ParamSpec`, in registration order.
        per_element: Cost of one element of a trainable parameter, e.g. ``8`` for fp32 Adam
            state (two moments), ``12`` for mixed-precision Adam (master copy plus moments),
            ``1`` to count elements as fairscale and torch's ZeroRedundancyOptimizer do.
        frozen_cost: Cost of one frozen parameter, whatever its size.

    Returns:
        One non-negative cost per parameter.

    Raises:
        ValueError: ``per_element`` or ``frozen_cost`` is negative or not finite.
    """
    for name, value in (("per_element", per_element), ("frozen_cost", frozen_cost)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    specs = _as_specs(params, "param_costs")
    return _default_costs(specs, per_element=per_element, frozen_cost=frozen_cost)


def _default_costs(
    specs: Sequence[ParamSpec], *, per_element: float | None = None, frozen_cost: float = 1.0
) -> tuple[float, ...]:
    out: list[float] = []
    for s in specs:
        if not s.requires_grad:
            out.append(float(frozen_cost))
        elif per_element is None:
            out.append(float(s.nbytes))
        else:
            out.append(float(s.numel) * float(per_element))
    return tuple(out)


def _check_costs(costs: Sequence[float], n: int, what: str) -> tuple[float, ...]:
    """Validate caller-given costs: one finite non-negative number per parameter."""
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Iterable):
        raise TypeError(
            f"{what}: costs must be a sequence of numbers (one per parameter), got "
            f"{type(costs).__name__} {costs!r}"
        )
    values: list[object] = list(costs)
    if len(values) != n:
        raise ValueError(
            f"{what}: costs has {len(values)} entries but there are {n} parameters; pass "
            f"exactly one cost per parameter, in the same order"
        )
    out: list[float] = []
    for i, c in enumerate(values):
        if isinstance(c, torch.Tensor) and c.numel() == 1:
            c = c.item()
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            raise TypeError(
                f"{what}: costs[{i}] must be a number, got {type(c).__name__} {c!r}"
            )
        f = float(c)
        if not math.isfinite(f) or f < 0:
            raise ValueError(
                f"{what}: costs[{i}] must be a finite number >= 0, got {c!r}; costs are "
                f"memory-like quantities (e.g. bytes of optimizer state)"
            )
        out.append(f)
    try:
        total = math.fsum(out)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):
        raise ValueError(
            f"{what}: the costs sum to more than a float can hold (largest "
            f"{max(out)!r}); scale them down, e.g. count elements or MiB instead of bytes"
        )
    return tuple(out)


def _check_world_size(world_size: object, what: str) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(
            f"{what}: world_size must be an int >= 1, got {type(world_size).__name__} "
            f"{world_size!r}; pass e.g. dist.get_world_size()"
        )
    if world_size < 1:
        raise ValueError(
            f"{what}: world_size must be >= 1, got {world_size}; pass the number of ranks "
            f"sharing the work (dist.get_world_size(group))"
        )
    return world_size
