"""Fuzzing the load of a real checkpoint (issue 30, item 4).

Hypothesis draws sequences of mutations (flipped and truncated bytes in every file, deleted and
swapped files, edited metadata fields and commit-record fields, absurd sizes, a ``__reduce__``
payload, an emptied commit record) over a real format-2 checkpoint; every case must either load
exactly the saved state or raise a clear ``ValueError`` / ``FileNotFoundError``, never run code
and never grow memory beyond a small multiple of the state (see ``_fuzzkit.check_load``). Most
cases load offline (``load_consolidated``, one process); a few run ``load_sharded`` at world 2,
where every rank must reach the same outcome within the world's timeout.

The coverage-guided counterpart (not collected by pytest, atheris not needed in CI) is
``tests/fuzz/atheris_load.py``; see its docstring for the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _fuzzkit import Violation, apply, check_load, make_checkpoint, state_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit.optim import load_consolidated, load_sharded
from shardkit.partition import all_gather_objects
from shardkit.testing import world

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

_MUTATION = st.tuples(st.integers(0, 6), st.lists(st.integers(0, 1 << 24), min_size=4, max_size=4))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    return make_checkpoint(tmp_path_factory.mktemp("fuzz_base"))


def test_the_unmutated_checkpoint_loads(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, expected = base
    nbytes = state_bytes(expected)
    assert nbytes > 1 << 20  # large enough for the memory bound to mean something
    out = check_load(lambda: load_consolidated(path), expected, tmp_path / "m", nbytes)
    assert out == "ok"


@pytest.mark.timeout(240)
@settings(
    max_examples=500,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mutations=st.lists(_MUTATION, min_size=1, max_size=3))
def test_mutated_checkpoints_load_or_refuse(
    base: tuple[Path, dict[str, Any]], tmp_path: Path, mutations: list[tuple[int, list[int]]]
) -> None:
    path, expected = base
    marker = tmp_path / "pwned"
    marker.unlink(missing_ok=True)  # tmp_path is shared by the examples
    case = apply(path, tmp_path / "case", mutations, str(marker))
    try:
        check_load(lambda: load_consolidated(case), expected, marker, state_bytes(expected))
    except Violation as e:
        raise AssertionError(f"mutations {mutations}: {e}") from None


@pytest.mark.parametrize("draw", [0, 1, 2, 3])
def test_a_declared_huge_tensor_is_refused_not_allocated(
    base: tuple[Path, dict[str, Any]], tmp_path: Path, draw: int
) -> None:
    path, expected = base
    case = apply(path, tmp_path / "case", [(4, [2, 0, 0, draw])], str(tmp_path / "m"))
    out = check_load(
        lambda: load_consolidated(case), expected, tmp_path / "m", state_bytes(expected)
    )
    assert "state/0/exp_avg" in out and "refused before allocating" in out, out


@pytest.mark.parametrize("huge", [1 << 20, 1 << 40])
def test_the_oracle_catches_an_unchecked_allocation(
    base: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, huge: int
) -> None:
    """With the size checks switched off, a declared huge tensor (1 GiB, 1 EiB) is a
    violation: the oracle's memory bounds have teeth."""
    import shardkit.optim._load_checks as checks

    path, expected = base
    monkeypatch.setattr(checks, "_check_item", lambda *args: None)
    monkeypatch.setattr(checks, "_check_storage", lambda *args: None)
    draw = {1 << 20: 0, 1 << 40: 2}[huge]
    # item 2 in sorted order (state/0/exp_avg, 1024 x 256): its first dim set to `huge`
    case = apply(path, tmp_path / "case", [(4, [2, 0, 0, draw])], str(tmp_path / "m"))
    with pytest.raises(Violation, match=r"can.t allocate|MemoryError|resident set"):
        check_load(lambda: load_consolidated(case), expected, tmp_path / "m", state_bytes(expected))


# Mutations for the distributed variant: (mutator, draws), chosen to reach every refusal path
# once: a flipped payload bit, a truncated payload, a deleted payload, a huge declared size,
# a __reduce__ payload in the metadata, an emptied commit record plus a flipped bit.
_WORLD_CASES = [
    [(0, [1, 5000, 3, 0])],
    [(1, [1, 100, 0, 0])],
    [(2, [1, 0, 0, 0])],
    [(4, [3, 0, 0, 2])],
    [(4, [0, 0, 9, 0])],
    [(6, [1, 7000, 2, 0])],
]


@world(2, timeout=120)
def test_mutated_checkpoints_world2(tmp_path: Path) -> None:
    from _fuzzkit import _build, train, version_of
    from shardkit.optim import save_sharded

    model, opt = _build()
    train(model, opt)
    save_sharded(opt, tmp_path / "base")
    expected = opt.state_dict(all_ranks=True)
    nbytes = state_bytes(expected)
    for i, mutations in enumerate(_WORLD_CASES):
        marker = tmp_path / f"pwned{i}"
        case = tmp_path / f"case{i}"
        if dist.get_rank() == 0:
            apply(tmp_path / "base", case, mutations, str(marker))
            assert version_of(case).is_dir()
        dist.barrier()
        _, fresh = _build()

        def load() -> dict[str, Any]:
            load_sharded(fresh, case)  # noqa: B023 (called in this iteration)
            return fresh.state_dict(all_ranks=True)  # noqa: B023

        outcome = check_load(load, expected, marker, 2 * nbytes)
        outcomes = all_gather_objects(outcome.split(":")[0], None)
        assert len(set(outcomes)) == 1, (mutations, outcomes)  # every rank, the same way
        assert outcomes[0] != "ok", (mutations, outcome)
