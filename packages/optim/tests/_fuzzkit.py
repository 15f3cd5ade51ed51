"""Checkpoint mutations and the load oracle shared by the fuzz tests and the atheris target.

``python _fuzzkit.py OUT`` writes the base checkpoint (world 1, Gloo): ``OUT/ckpt`` and
``OUT/expected.pt`` (the consolidated state it must load as).

The oracle (:func:`check_load`): a load of a mutated checkpoint either returns exactly the
saved state or raises ``ValueError`` / ``FileNotFoundError`` with a message; it never runs code
(a marker file that a ``__reduce__`` payload would create stays absent), and it never allocates
much: during the load the address-space limit is the current size plus ``_RSS_FACTOR`` times
the checkpoint's state bytes plus ``_VIRTUAL_SLACK`` (an attempt to allocate more, e.g. a
declared huge tensor, fails with torch's "can't allocate" or MemoryError, which the oracle
reports as a violation, not as a clean refusal), and the peak resident set (Linux
``VmHWM``, reset before each load through ``/proc/self/clear_refs``) may grow by at most
``_RSS_FACTOR`` times the checkpoint's state bytes plus ``_RSS_SLACK``. Nothing is patched:
these are the process's own counters.
"""

from __future__ import annotations

import os
import pickle
import resource
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MUTATORS",
    "Violation",
    "apply",
    "check_load",
    "make_checkpoint",
    "state_bytes",
    "train",
]

_VIRTUAL_SLACK = 32 << 20
_RSS_FACTOR = 3
_RSS_SLACK = 8 << 20


class Violation(AssertionError):
    """The load broke a promise: wrong state, code ran, a bad error, or too much memory."""


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _build() -> tuple[torch.nn.Module, Any]:
    from shardkit.optim import ShardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1)
    )
    ps = list(model.parameters())
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02}]
    return model, ShardedOptimizer(groups, optim=torch.optim.Adam, lr=0.01, betas=(0.8, 0.99))


def train(model: torch.nn.Module, opt: Any) -> None:
    """The two steps every fuzzed checkpoint is saved after."""
    for s in range(2):
        g = torch.Generator().manual_seed(s)
        opt.zero_grad()
        model(torch.randn(8, 256, generator=g)).square().mean().backward()
        opt.step()


def _main(out: Path) -> None:
    import torch.distributed as dist
    from shardkit.optim import save_sharded

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(out / "store"), 1), rank=0, world_size=1
    )
    model, opt = _build()
    train(model, opt)
    save_sharded(opt, out / "ckpt")
    torch.save(opt.state_dict(all_ranks=True), out / "expected.pt")
    dist.destroy_process_group()


def make_checkpoint(out: Path) -> tuple[Path, dict[str, Any]]:
    """Writes the base checkpoint in a subprocess; returns its path and the expected state."""
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"writing the fuzz checkpoint failed:\n{res.stderr[-3000:]}")
    return out / "ckpt", torch.load(out / "expected.pt", weights_only=True)


def state_bytes(expected: dict[str, Any]) -> int:
    return sum(
        v.numel() * v.element_size()
        for st in expected["state"].values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def version_of(path: Path) -> Path:
    return path / (path / "LATEST").read_text(errors="replace").strip()


# ---------------------------------------------------------------- mutations
# Each mutator takes (checkpoint path, its version dir, a list of small ints to draw from,
# the marker path) and edits the files in place. The ints come from hypothesis or atheris.


def _files(version: Path) -> list[Path]:
    return sorted(p for p in version.iterdir() if p.is_file())


def _pick(seq: list[Any], r: int) -> Any:
    return seq[r % len(seq)]


def _flip(path: Path, version: Path, r: list[int], marker: str) -> None:
    f = _pick([*_files(version), path / "LATEST"], r[0])
    data = bytearray(f.read_bytes())
    if data:
        data[r[1] % len(data)] ^= 1 << (r[2] % 8)
        f.write_bytes(bytes(data))


def _truncate(path: Path, version: Path, r: list[int], marker: str) -> None:
    f = _pick(_files(version), r[0])
    data = f.read_bytes()
    f.write_bytes(data[: r[1] % (len(data) + 1)])


def _delete(path: Path, version: Path, r: list[int], marker: str) -> None:
    _pick([*_files(version), path / "LATEST"], r[0]).unlink()


def _swap(path: Path, version: Path, r: list[int], marker: str) -> None:
    files = _files(version)
    a, b = _pick(files, r[0]), _pick(files, r[1])
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)


def _edit_metadata(path: Path, version: Path, r: list[int], marker: str) -> None:
    """Edits one field of the (trusted here) unpickled metadata and pickles it back."""
    from shardkit.optim._unpickle import restricted_loads
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = version / ".metadata"
    md = restricted_loads(meta.read_bytes(), "m")  # an earlier mutation may have planted _Evil
    items = sorted(md.state_dict_metadata)
    key = _pick(items, r[0])
    item = md.state_dict_metadata[key]
    infos = sorted(md.storage_data.items(), key=lambda kv: str(kv[0]))
    index, info = _pick(infos, r[1])
    huge = [1 << 20, 1 << 31, 1 << 40, 1 << 62][r[3] % 4]
    what = r[2] % 11
    if what == 0 and hasattr(item, "size"):
        item.size = torch.Size([huge, *list(item.size)[1:]])
    elif what == 1 and hasattr(item, "chunks") and item.chunks:
        c = item.chunks[0]
        c.sizes = torch.Size([huge] * len(c.sizes))
    elif what == 2:
        info.length = huge
    elif what == 3:
        info.offset = huge
    elif what == 4:
        info.relative_path = _pick(["../../etc/passwd", "/etc/passwd", "..", "x/../y"], r[3])
    elif what == 5 and hasattr(item, "properties"):
        item.properties.dtype = _pick([torch.float64, torch.uint8, torch.complex128], r[3])
    elif what == 6:
        md.state_dict_metadata[f"state/0/extra{r[3]}"] = item
    elif what == 7:
        del md.state_dict_metadata[key]
    elif what == 8:
        md.state_dict_metadata[key] = BytesStorageMetadata()
    elif what == 9:
        md.planner_data = {"x": _Evil(marker)}
    else:
        md.storage_data[index] = infos[(r[1] + 1) % len(infos)][1]  # two items, same bytes
    meta.write_bytes(pickle.dumps(md))


def _edit_record(path: Path, version: Path, r: list[int], marker: str) -> None:
    """Edits one field of the commit record (JSON)."""
    import json

    rec = version / "SHARDKIT_COMMIT"
    h = json.loads(rec.read_text())
    field = _pick(
        ["format", "num_params", "param_shapes", "world_size", "token", "checksums"], r[0]
    )
    h[field] = _pick(
        [None, -1, 1 << 62, "shardkit.optim.sharded/1", [[1 << 40]], {"a": 1}, [], "x" * 32, 3.5],
        r[1],
    )
    rec.write_text(json.dumps(h))


def _empty_record(path: Path, version: Path, r: list[int], marker: str) -> None:
    (version / "SHARDKIT_COMMIT").write_bytes(b"")
    _flip(path, version, r, marker) if r[0] % 2 else None


MUTATORS: list[Callable[[Path, Path, list[int], str], None]] = [
    _flip, _truncate, _delete, _swap, _edit_metadata, _edit_record, _empty_record,
]  # fmt: skip


def apply(src: Path, dst: Path, mutations: list[tuple[int, list[int]]], marker: str) -> Path:
    """Copies the checkpoint at ``src`` to ``dst`` and applies the mutations in order."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for which, r in mutations:
        version = version_of(dst) if (dst / "LATEST").is_file() else dst
        if not version.is_dir() or not any(version.iterdir()):
            break
        r = [*list(r), 0, 0, 0, 0][:4]
        try:
            MUTATORS[which % len(MUTATORS)](dst, version, r, marker)
        except (OSError, pickle.UnpicklingError, ValueError, EOFError, ZeroDivisionError, KeyError):
            pass  # an earlier mutation removed or garbled what this one edits
    return dst


# ---------------------------------------------------------------- the oracle


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def check_load(
    load: Callable[[], dict[str, Any]],
    expected: dict[str, Any],
    marker: Path,
    nbytes: int,
    **opts: Any,
) -> str:
    """Runs ``load`` under the oracle (see the module docstring); returns "ok" or the error.

    Raises:
        Violation: the load broke a promise.
    """
    from _optim_testkit import assert_state_equal

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set
    base = _status("VmRSS")
    limit = _status("VmSize") + _RSS_FACTOR * nbytes + _VIRTUAL_SLACK
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        got = load()
        outcome = "ok"
    except (ValueError, FileNotFoundError) as e:
        got, outcome = None, f"{type(e).__name__}: {e}"
    except Exception as e:
        got, outcome = None, f"UNEXPECTED {type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    peak = _status("VmHWM") - base
    if marker.exists():
        raise Violation(f"the checkpoint ran code ({marker} exists)")
    if outcome.startswith("UNEXPECTED") or "can't allocate" in outcome or "MemoryError" in outcome:
        raise Violation(f"not a clean refusal: {outcome[:2000]}")
    if got is None and len(outcome.split(": ", 1)[-1]) < 20:
        raise Violation(f"an error that says nothing: {outcome!r}")
    if peak > _RSS_FACTOR * nbytes + _RSS_SLACK:
        raise Violation(f"the load grew the resident set by {peak} bytes ({outcome[:200]})")
    if got is not None:
        try:
            assert_state_equal(expected, got)
        except AssertionError as e:
            raise Violation(f"loaded state differs from the saved one: {e}") from None
    return outcome


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
