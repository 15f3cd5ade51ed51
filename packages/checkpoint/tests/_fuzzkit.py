"""Checkpoint mutations and the load oracle shared by the fuzz tests and the atheris target.

The base checkpoint (:func:`make_checkpoint`) is what a training job saves with
``shardkit.checkpoint.save``: an MLP's and its Adam's state from ``get_state_dict`` (tensors,
and non-tensor items: param groups, a step count, a config), a few MiB.

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

import json
import pickle
import resource
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _ckpt_testkit import (
    Evil,
    assert_same,
    billion_laughs,
    laughs_pickle,
    model_and_optim,
    state_of,
    torch_save_with_pickle,
    train,
)

__all__ = [
    "MUTATORS",
    "Violation",
    "apply",
    "base_state",
    "check_load",
    "destination",
    "forged",
    "make_checkpoint",
    "proc_status",
    "state_bytes",
    "version_of",
]

_VIRTUAL_SLACK = 32 << 20
_RSS_FACTOR = 3
_RSS_SLACK = 8 << 20


class Violation(AssertionError):
    """The load broke a promise: wrong state, code ran, a bad error, or too much memory."""


_SIZES = (256, 1024, 1)


def base_state() -> dict[str, Any]:
    """The state the base checkpoint holds (seeded: the same in every process)."""
    model, opt = model_and_optim(_SIZES)
    train(model, opt, 2)
    state = state_of(model, opt)
    state["step"] = 2
    return state


def make_checkpoint(out: Path, group: Any = None) -> tuple[Path, dict[str, Any]]:
    """Saves the base checkpoint at ``out/ckpt`` (with a process group: over ``group``, e.g. one
    of this rank alone); returns its path and the saved state."""
    from shardkit.checkpoint import save

    state = base_state()
    save(state, out / "ckpt", process_group=group, record={"step": 2})
    return out / "ckpt", state


def destination() -> dict[str, Any]:
    """A fresh state dict of the same job to load into (other values, same structure)."""
    model, opt = model_and_optim(_SIZES, seed=1)
    return state_of(model, opt)


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of every tensor of a (nested) state dict."""
    total = 0
    stack: list[Any] = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


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
    from shardkit.checkpoint._unpickle import restricted_loads
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = version / ".metadata"
    md = restricted_loads(meta.read_bytes(), "m")  # an earlier mutation may have planted _Evil
    items = sorted(md.state_dict_metadata)
    key = _pick(items, r[0])
    item = md.state_dict_metadata[key]
    infos = sorted(md.storage_data.items(), key=lambda kv: str(kv[0]))
    index, info = _pick(infos, r[1])
    huge = [1 << 20, 1 << 31, 1 << 40, 1 << 62][r[3] % 4]
    what = r[2] % 13
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
        md.planner_data = {"x": Evil(marker)}
    elif what == 10:  # shared references nested 60 deep: 2**60 leaves if expanded
        md.planner_data = {"x": billion_laughs(60)}
    elif what == 11:
        md.state_dict_metadata[f"laughs{r[3]}"] = billion_laughs(40)  # type: ignore[assignment]
    else:
        md.storage_data[index] = infos[(r[1] + 1) % len(infos)][1]  # two items, same bytes
    meta.write_bytes(pickle.dumps(md))


def _edit_record(path: Path, version: Path, r: list[int], marker: str) -> None:
    """Edits one field of the commit record (JSON)."""
    rec = version / "SHARDKIT_COMMIT"
    h = json.loads(rec.read_text())
    field = _pick(["layout", "token", "world_size", "storage_checksums", "step"], r[0])
    value = _pick(
        [None, -1, 1 << 62, "shardkit.checkpoint/2", [[1 << 40]], {"a": 1}, [], "x" * 32, 3.5,
         [["model.0.weight", [0, 0], 1]], [["x", None, 1 << 40]]],
        r[1],
    )  # fmt: skip
    if field == "storage_checksums" and r[2] % 2 and isinstance(h.get(field), list) and h[field]:
        h[field][r[1] % len(h[field])][2] ^= 1  # one CRC off by a bit
    else:
        h[field] = value
    rec.write_text(json.dumps(h))


def _fix_checksums(path: Path, version: Path, r: list[int], marker: str) -> None:
    """What an attacker with write access does after editing payloads: recompute every stored
    chunk's CRC-32 in the commit record, so the checks behind the checksums are reached."""
    from shardkit.checkpoint._unpickle import restricted_loads

    rec = version / "SHARDKIT_COMMIT"
    h = json.loads(rec.read_text())
    md = restricted_loads((version / ".metadata").read_bytes(), "m")
    sums = []
    for index, info in md.storage_data.items():
        data = (version / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        offsets = None if index.offset is None else list(index.offset)
        sums.append([index.fqn, offsets, zlib.crc32(data)])
    h["storage_checksums"] = sums
    rec.write_text(json.dumps(h))


def _replace_object_item(path: Path, version: Path, r: list[int], marker: str) -> None:
    """Replaces a non-tensor item's bytes in place with a hostile torch.save blob (a
    __reduce__ payload, or a dict keyed by a billion-laughs tuple), then fixes the CRC-32s."""
    import io

    from shardkit.checkpoint._unpickle import restricted_loads
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta = version / ".metadata"
    md = restricted_loads(meta.read_bytes(), "m")
    keys = sorted(
        k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    )
    info = md.storage_data[MetadataIndex(_pick(keys, r[0]))]
    buf = io.BytesIO()
    torch.save(Evil(marker), buf)
    blob = (
        buf.getvalue() if r[1] % 2 else torch_save_with_pickle(laughs_pickle(60, as_dict_key=True))
    )
    f = version / info.relative_path
    with open(f, "ab") as out:  # the new blob at the end of the file, the entry pointing at it
        info.offset = out.tell()
        out.write(blob)
    info.length = len(blob)
    meta.write_bytes(pickle.dumps(md))
    _fix_checksums(path, version, r, marker)


def _empty_record(path: Path, version: Path, r: list[int], marker: str) -> None:
    (version / "SHARDKIT_COMMIT").write_bytes(b"")
    _flip(path, version, r, marker) if r[0] % 2 else None


MUTATORS: list[Callable[[Path, Path, list[int], str], None]] = [
    _flip, _truncate, _delete, _swap, _edit_metadata, _edit_record, _empty_record,
    _fix_checksums, _replace_object_item,
]  # fmt: skip


_FORGING = ("_fix_checksums", "_replace_object_item")


def forged(mutations: list[tuple[int, list[int]]]) -> bool:
    """Whether a mutation recomputes the CRC-32s (an attacker with write access): a load may then
    succeed with other values than the saved ones, the state its writer chose (docs/security.md:
    CRC-32 detects damage, not tampering)."""
    return any(MUTATORS[w % len(MUTATORS)].__name__ in _FORGING for w, _ in mutations)


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
        except (OSError, pickle.UnpicklingError, ValueError, EOFError, ZeroDivisionError,
                KeyError, IndexError, TypeError, AttributeError):  # fmt: skip
            pass  # an earlier mutation removed or garbled what this one edits
    return dst


# ---------------------------------------------------------------- the oracle


def proc_status(key: str) -> int:
    """A byte count of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...)."""
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
    *,
    exact: bool = True,
) -> str:
    """Runs ``load`` under the oracle (see the module docstring); returns "ok" or the error.
    ``exact=False`` (a forged checkpoint, see :func:`forged`): a load that succeeds must give
    the saved structure, shapes and dtypes, not necessarily the saved values.

    Raises:
        Violation: the load broke a promise.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set
    base = proc_status("VmRSS")
    limit = proc_status("VmSize") + _RSS_FACTOR * nbytes + _VIRTUAL_SLACK
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
    peak = proc_status("VmHWM") - base
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
            assert_same(expected, got, values=exact)
        except AssertionError as e:
            raise Violation(f"loaded state differs from the saved one: {e}") from None
    return outcome
