"""The suite's warning policy (root conftest.py, [Note: Warnings of ours are errors]).

FutureWarning / DeprecationWarning caused by shardkit code are errors: in the pytest process
(pyproject.toml's filterwarnings plus the re-attribution of torch's deprecated collectives to
their shardkit caller) and in the rank processes of ``@world`` (PYTHONWARNINGS). Code that is not
shardkit's keeps its warnings as warnings.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from shardkit.testing import world

# torch's deprecated collectives are ``@_exception_logger`` over ``@deprecated``: the warning is
# raised one frame inside torch and attributed to torch's wrapper, whoever the caller is.
_TORCH_LIKE = """
import warnings
def _deprecated():
    warnings.warn("`probe` is deprecated", FutureWarning, stacklevel=2)
def wrapper():
    return _deprecated()
"""
_CALLER = """
def call(f):
    return f()
"""


def _module(name: str, source: str) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace


def test_torch_deprecation_called_from_shardkit_is_an_error() -> None:
    torch_like = _module("torch.distributed._probe_logger", _TORCH_LIKE)
    caller = _module("shardkit.probe", _CALLER)
    with pytest.raises(FutureWarning, match="probe"):
        caller["call"](torch_like["wrapper"])  # type: ignore[operator]


def test_torch_deprecation_called_from_elsewhere_stays_a_warning() -> None:
    torch_like = _module("torch.distributed._probe_logger", _TORCH_LIKE)
    caller = _module("reference_library.probe", _CALLER)
    with pytest.warns(FutureWarning, match="probe"):
        caller["call"](torch_like["wrapper"])  # type: ignore[operator]


def test_shardkit_own_future_warning_is_an_error() -> None:
    shardkit_module = _module(
        "shardkit.probe", "import warnings\ndef f():\n    warnings.warn('x', FutureWarning)\n"
    )
    with pytest.raises(FutureWarning):
        shardkit_module["f"]()  # type: ignore[operator]


def _rank_rule_raises() -> None:
    # A warning attributed to a shardkit module (any real module name works) ...
    module = _module(
        "shardkit.testing._decorator",
        "import warnings\ndef f():\n    warnings.warn('x', DeprecationWarning)\n",
    )
    with pytest.raises(DeprecationWarning):
        module["f"]()  # type: ignore[operator]
    # ... and torch's mis-attributed deprecated collectives are errors in a rank.
    out = torch.empty(2 * dist.get_world_size())
    with pytest.raises(FutureWarning, match="all_gather_into_tensor"):
        dist.all_gather_into_tensor(out, torch.ones(2))


@world(2)
def test_the_rule_reaches_the_ranks() -> None:
    assert "error::FutureWarning:torch.distributed.c10d_logger" in sys.warnoptions
    assert "error::DeprecationWarning:shardkit.testing._decorator" in sys.warnoptions
    # The filters as the rank's interpreter installed them at start-up (a reused rank may run
    # this after a test that changed them for good: see the xfail below).
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]
        _rank_rule_raises()
        with warnings.catch_warnings():  # other code's warnings are untouched
            warnings.simplefilter("error")
            dist.all_gather_single(torch.empty(2 * dist.get_world_size()), torch.ones(2))


_LEAK = ("once", None, Warning, None, 0)


@world(2)
def test_a_job_changes_the_filters_for_good() -> None:
    # What torch's Join.__exit__ does (torch/distributed/algorithms/join.py, torch 2.13): a
    # process-wide simplefilter("once"), left in place after the `with Join(...)` block.
    warnings.simplefilter("once")


@world(2)
def test_the_rule_survives_an_earlier_job() -> None:
    """shardkit.testing runs each job inside ``warnings.catch_warnings()``: the previous
    job's ``simplefilter("once")`` did not outlive it."""
    assert _LEAK not in warnings.filters
    _rank_rule_raises()
