"""ParamSpec, the default cost model and input validation."""

from __future__ import annotations

import math

import pytest
import torch
from shardkit.partition import ParamSpec, param_costs, partition


def test_from_tensor_and_sizes() -> None:
    p = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
    s = ParamSpec.from_tensor(p)
    assert s == ParamSpec((3, 4), torch.bfloat16, True)
    assert (s.numel, s.element_size, s.nbytes) == (12, 2, 24)
    frozen = ParamSpec.from_tensor(torch.zeros(5))
    assert frozen.requires_grad is False
    assert ParamSpec((), torch.float64).numel == 1
    assert ParamSpec((0, 7), torch.float32).nbytes == 0
    meta = ParamSpec.from_tensor(torch.empty(1000, 1000, device="meta", requires_grad=True))
    assert meta.nbytes == 4_000_000


def test_shape_is_normalised() -> None:
    a = ParamSpec(torch.Size([2, 3]), torch.float32, True)  # type: ignore[arg-type]
    b = ParamSpec([2, 3], torch.float32, True)  # type: ignore[arg-type]
    assert a == b == ParamSpec((2, 3), torch.float32, True)
    assert type(a.shape) is tuple
    assert hash(a) == hash(b)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"shape": (2, -1)}, ValueError, "negative"),
        ({"shape": (2.0, 3)}, TypeError, "ints"),
        ({"shape": "23"}, TypeError, "tuple"),
        ({"dtype": "float32"}, TypeError, "torch.dtype"),
        ({"requires_grad": 1}, TypeError, "bool"),
    ],
)
def test_spec_rejects_bad_fields(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    fields: dict[str, object] = {"shape": (2, 3), "dtype": torch.float32, "requires_grad": True}
    fields.update(kwargs)
    with pytest.raises(exc, match=match):
        ParamSpec(**fields)  # type: ignore[arg-type]


def test_from_tensor_rejects_non_tensor() -> None:
    with pytest.raises(TypeError, match="got list"):
        ParamSpec.from_tensor([1, 2])  # type: ignore[arg-type]


def test_default_costs() -> None:
    specs = [
        ParamSpec((10, 10), torch.float32, True),
        ParamSpec((10, 10), torch.float16, True),
        ParamSpec((1000,), torch.float32, False),
    ]
    assert param_costs(specs) == (400.0, 200.0, 1.0)
    assert param_costs(specs, per_element=12) == (1200.0, 1200.0, 1.0)
    assert param_costs(specs, per_element=1, frozen_cost=0) == (100.0, 100.0, 0.0)
    with pytest.raises(ValueError, match="per_element"):
        param_costs(specs, per_element=-1)
    with pytest.raises(ValueError, match="frozen_cost"):
        param_costs(specs, frozen_cost=math.inf)


def test_input_errors_are_clear() -> None:
    t = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        partition(t, 0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        partition(t, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="world_size must be an int"):
        partition(t, True)
    with pytest.raises(ValueError, match="no parameters"):
        partition([], 2)
    with pytest.raises(ValueError, match="unknown algorithm 'lpt'"):
        partition(t, 2, algorithm="lpt")
    with pytest.raises(ValueError, match="unknown algorithm 'flat'"):
        partition(t, 2, algorithm="flat")
    with pytest.raises(ValueError, match="costs has 2 entries but there are 3"):
        partition(t, 2, costs=[1, 2])
    with pytest.raises(ValueError, match=r"costs\[1\] must be a finite number >= 0, got -5"):
        partition(t, 2, costs=[1, -5, 2])
    with pytest.raises(ValueError, match="costs"):
        partition(t, 2, costs=[1, math.nan, 2])
    with pytest.raises(TypeError, match=r"costs\[0\] must be a number, got str"):
        partition(t, 2, costs=["1", 2, 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"module\.parameters"):
        partition(torch.nn.Linear(2, 2), 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single Parameter; wrap it in a list"):
        partition(t[0], 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="param group"):
        partition([{"params": t}], 2)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="got int 3 at index 1"):
        partition([t[0], 3], 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="same tensor at indices 0 and 2"):
        partition([t[0], t[1], t[0]], 2)
    with pytest.raises(ValueError, match="group_sizes"):
        partition(t, 2, group_sizes=[1, 1])


def test_generator_input_is_accepted() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    p = partition(model.parameters(), 2)
    assert p.num_params == 4
    assert p.specs[0] == ParamSpec((4, 4), torch.float32, True)
