"""Coverage-guided fuzzing of the checkpoint load with atheris (by hand; not collected by pytest).

The hypothesis suite (``tests/test_fuzz.py``) runs in CI; this target lets libFuzzer steer the
same mutations, and raw bytes as ``.metadata`` or as the commit record, by coverage of the load
path (``shardkit.checkpoint.load`` into the job's state dict). Every input must satisfy ``_fuzzkit.check_load``: the saved state, or a clean
``ValueError`` / ``FileNotFoundError``; no code run; bounded memory. A violation raises, and
atheris saves the crashing input.

Run from the repository root (Linux, CPython with atheris wheels)::

    hatch run pip install atheris
    hatch run python packages/checkpoint/tests/fuzz/atheris_load.py -atheris_runs=100000 /tmp/corpus

Without atheris installed, ``--smoke N`` runs N random inputs through the same entry point.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _fuzzkit, _ckpt_testkit

try:
    import atheris  # type: ignore[import-not-found]
except ImportError:  # --smoke only
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["shardkit"]):  # coverage of the load path
        from shardkit.checkpoint import load
else:
    from shardkit.checkpoint import load
from _fuzzkit import (
    MUTATORS,
    apply,
    check_load,
    destination,
    forged,
    make_checkpoint,
    state_bytes,
    version_of,
)

_WORK = Path(tempfile.mkdtemp(prefix="shardkit-atheris-"))
_BASE, _EXPECTED = make_checkpoint(_WORK / "base")
_NBYTES = state_bytes(_EXPECTED)
_MARKER = _WORK / "pwned"


def _ints(data: bytes, n: int) -> list[int]:
    padded = data + bytes(4 * n)
    return [int.from_bytes(padded[4 * i : 4 * i + 4], "little") for i in range(n)]


def test_one_input(data: bytes) -> None:
    """Byte 0 picks the mode: mutations drawn from the rest, or the rest as a raw file."""
    if not data:
        return
    mode, rest = data[0] % 3, data[1:]
    case = _WORK / "case"
    exact = True
    if mode == 0:
        draws = _ints(rest, 15)
        mutations = [(draws[5 * i] % len(MUTATORS), draws[5 * i + 1 : 5 * i + 5]) for i in range(3)]
        mutations = mutations[: 1 + draws[0] % 3]
        apply(_BASE, case, mutations, str(_MARKER))
        exact = not forged(mutations)
    else:
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(_BASE, case)
        name = ".metadata" if mode == 1 else "SHARDKIT_COMMIT"
        (version_of(case) / name).write_bytes(rest)
    _MARKER.unlink(missing_ok=True)

    def run() -> dict[str, object]:
        dest = destination()
        load(dest, case)
        return dest

    check_load(run, _EXPECTED, _MARKER, _NBYTES, exact=exact)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--smoke":
        rng = random.Random(0)
        for _ in range(int(sys.argv[2])):
            test_one_input(rng.randbytes(rng.randrange(1, 200)))
        print(f"{sys.argv[2]} inputs, no violation")
        return
    if atheris is None:
        raise SystemExit(
            "atheris is not installed: `hatch run pip install atheris`, or use --smoke N"
        )
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(_WORK, ignore_errors=True)
