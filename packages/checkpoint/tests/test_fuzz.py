"""Fuzzing the load of a real checkpoint (moved from shardkit-optim, issue 38).

Hypothesis draws sequences of mutations over a real checkpoint of a training job (an MLP's and
its Adam's state, a step count, a config, saved by ``shardkit.checkpoint.save``): flipped and
truncated bytes in every file, deleted and swapped files, edited metadata fields (absurd sizes,
file names outside the directory, a ``__reduce__`` payload, shared references nested 60 deep)
and commit-record fields, an emptied record, non-tensor items replaced by hostile pickles with
every CRC-32 recomputed (as an attacker with write access would). Every case must either load
exactly the saved state or raise a clear ``ValueError`` / ``FileNotFoundError``, never run code
and never grow memory beyond a small multiple of the state (see ``_fuzzkit.check_load``). Most
cases load in one process; a few load at world 2, where every rank must reach the same outcome
within the world's timeout.

The coverage-guided counterpart (not collected by pytest, atheris not needed in CI) is
``tests/fuzz/atheris_load.py``; see its docstring for the command.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _fuzzkit import (
    Violation,
    apply,
    base_state,
    check_load,
    destination,
    forged,
    make_checkpoint,
    state_bytes,
    version_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit.checkpoint import load
from shardkit.testing import world

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

_MUTATION = st.tuples(st.integers(0, 8), st.lists(st.integers(0, 1 << 24), min_size=4, max_size=4))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    return make_checkpoint(tmp_path_factory.mktemp("fuzz_base"))


def _loader(path: Path) -> Any:
    def run() -> dict[str, Any]:
        dest = destination()
        load(dest, path)
        return dest

    return run


def test_the_unmutated_checkpoint_loads(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, expected = base
    nbytes = state_bytes(expected)
    assert nbytes > 1 << 20  # large enough for the memory bound to mean something
    assert check_load(_loader(path), expected, tmp_path / "m", nbytes) == "ok"


@pytest.mark.timeout(300)
@settings(
    max_examples=300,
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
        check_load(
            _loader(case), expected, marker, state_bytes(expected), exact=not forged(mutations)
        )
    except Violation as e:
        raise AssertionError(f"mutations {mutations}: {e}") from None


@pytest.mark.parametrize("draw", [0, 1, 2, 3])
def test_a_declared_huge_tensor_is_refused_not_allocated(
    base: tuple[Path, dict[str, Any]], tmp_path: Path, draw: int
) -> None:
    """Metadata edited to declare a first dim of 2**20 .. 2**62 for an item: refused (its bytes
    are not on disk, and it does not fit the destination) before anything is read."""
    path, expected = base
    case = apply(path, tmp_path / "case", [(4, [2, 0, 0, draw])], str(tmp_path / "m"))
    out = check_load(_loader(case), expected, tmp_path / "m", state_bytes(expected))
    assert out.startswith(("UnsafeCheckpointError", "CheckpointMismatchError")), out


def test_hostile_object_items_are_refused_even_with_valid_checksums(
    base: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A non-tensor item replaced by a __reduce__ payload, or by a dict keyed by shared
    references nested 60 deep (torch's weights-only unpickler would hash it for ever), with
    every CRC-32 recomputed: refused by the item checks themselves, the code never runs."""
    path, expected = base
    for which, message in ((1, "weights-only allow-list"), (0, "billion laughs")):
        marker = tmp_path / f"pwned{which}"
        case = apply(path, tmp_path / f"case{which}", [(8, [0, which, 0, 0])], str(marker))
        out = check_load(_loader(case), expected, marker, state_bytes(expected))
        assert out.startswith("UnsafeCheckpointError") and message in out, out


def test_the_oracle_catches_an_allocation_and_code(
    base: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The oracle's bounds have teeth: a "load" that allocates 1 GiB, or whose marker file
    appears, is a violation, not a pass."""
    path, expected = base
    nbytes = state_bytes(expected)
    with pytest.raises(Violation, match=r"can.t allocate|MemoryError|resident set"):
        check_load(lambda: torch.ones(1 << 28), expected, tmp_path / "m", nbytes)  # type: ignore[arg-type, return-value]
    assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY  # restored
    marker = tmp_path / "ran"
    marker.touch()
    with pytest.raises(Violation, match="ran code"):
        check_load(_loader(path), expected, marker, nbytes)


# Mutations for the distributed variant: (mutator, draws), chosen to reach every refusal path
# once: a flipped payload bit, a truncated payload, a deleted payload, a huge declared size,
# a __reduce__ payload in the metadata, shared references nested 60 deep in the metadata, an
# emptied commit record plus a flipped bit, a hostile object item with valid CRC-32s.
_WORLD_CASES = [
    [(0, [1, 5000, 3, 0])],
    [(1, [1, 100, 0, 0])],
    [(2, [1, 0, 0, 0])],
    [(4, [3, 0, 0, 2])],
    [(4, [0, 0, 9, 0])],
    [(4, [0, 0, 10, 0])],
    [(6, [1, 7000, 2, 0])],
    [(8, [0, 1, 0, 0])],
]


@world(2, timeout=180)
def test_mutated_checkpoints_every_rank_refuses_alike(tmp_path: Path) -> None:
    base = tmp_path / "base"
    expected = base_state()  # the same on every rank (seeded)
    solo = dist.new_group([0])  # rank 0 writes the base alone
    if dist.get_rank() == 0:
        make_checkpoint(base, solo)
    dist.barrier()
    nbytes = state_bytes(expected)
    for i, mutations in enumerate(_WORLD_CASES):
        marker = tmp_path / f"pwned{i}"
        case = tmp_path / f"case{i}"
        if dist.get_rank() == 0:
            apply(base / "ckpt", case, mutations, str(marker))
            assert version_of(case).is_dir()
        dist.barrier()
        outcome = check_load(_loader(case), expected, marker, 2 * nbytes)
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome.split(":")[0])
        assert len(set(outcomes)) == 1, (mutations, outcomes)  # every rank, the same way
        assert outcomes[0] != "ok", (mutations, outcome)
