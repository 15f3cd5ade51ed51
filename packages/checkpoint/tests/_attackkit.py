"""Hostile checkpoints, built as an attacker would, and a child process that loads them.

Every builder takes a sound checkpoint directory (a plain DCP one, or one written by
``shardkit.checkpoint.save``) and rewrites it in place: the payload goes where the class of attack
puts it, and every CRC-32 of a shardkit checkpoint is recomputed (an attacker writes matching
checksums: CRC-32 detects damage, not tampering). :func:`run_child` loads a checkpoint the
README's ways in a fresh interpreter with a 4 GiB address-space limit and a 20 s wall limit, and
reports, per entry point, what was raised, the wall time and the peak resident growth (VmHWM,
reset through ``/proc/self/clear_refs`` before each call).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from shardkit.checkpoint._unpickle import restricted_loads
from torch.distributed.checkpoint.metadata import MetadataIndex

HERE = Path(__file__).resolve().parent


def version_dir(path: Path) -> Path:
    """The directory holding DCP's files (a committed version, or ``path`` itself)."""
    pointer = path / "LATEST"
    return path / pointer.read_text().strip() if pointer.is_file() else path


def read_md(path: Path) -> Any:
    return restricted_loads((version_dir(path) / ".metadata").read_bytes(), "m")


def write_md(path: Path, md: Any, protocol: int = 4) -> None:
    (version_dir(path) / ".metadata").write_bytes(pickle.dumps(md, protocol=protocol))
    fix_checksums(path)


def fix_checksums(path: Path) -> None:
    """Recomputes every CRC-32 of a shardkit checkpoint's commit record (a forger's step)."""
    version = version_dir(path)
    marker = version / "SHARDKIT_COMMIT"
    if not marker.is_file():
        return
    record = json.loads(marker.read_text())
    md = read_md(path)
    sums = []
    for index, info in md.storage_data.items():
        with open(version / info.relative_path, "rb") as f:
            f.seek(info.offset)
            crc = zlib.crc32(f.read(info.length))
        sums.append([index.fqn, None if index.offset is None else list(index.offset), crc])
    record["storage_checksums"] = sums
    marker.write_text(json.dumps(record))


def append_blob(path: Path, index: MetadataIndex, blob: bytes, md: Any | None = None) -> Any:
    """Stores ``blob`` as the bytes of item ``index`` (appended to its file); returns the
    metadata, written back with fixed checksums unless ``md`` is given (the caller writes)."""
    own = md is None
    md = read_md(path) if md is None else md
    info = md.storage_data[index]
    with open(version_dir(path) / info.relative_path, "ab") as f:
        info.offset = f.tell()
        f.write(blob)
    info.length = len(blob)
    if own:
        write_md(path, md)
    return md


def saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def with_pickle(pkl: bytes, storages: dict[str, bytes] | None = None) -> bytes:
    """A ``torch.save`` zip whose ``data.pkl`` is ``pkl`` (and whose storage records are
    ``storages``, by key), written record by record as torch.save lays them out."""
    src = saved({"placeholder": 1})
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w") as zout:
        archive = zin.infolist()[0].filename.split("/")[0]
        for info in zin.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_STORED)
        for key, data in (storages or {}).items():
            zout.writestr(f"{archive}/data/{key}", data, compress_type=zipfile.ZIP_STORED)
    return out.getvalue()


def object_index(path: Path) -> MetadataIndex:
    """The first non-tensor item of the checkpoint."""
    md = read_md(path)
    for fqn, item in sorted(md.state_dict_metadata.items()):
        if not hasattr(item, "chunks"):
            return MetadataIndex(fqn)
    raise AssertionError("the checkpoint has no non-tensor item")


def tensor_index(path: Path, fqn: str | None = None) -> MetadataIndex:
    """A stored chunk of the first tensor item (or of ``fqn``)."""
    md = read_md(path)
    for name, item in sorted(md.state_dict_metadata.items()):
        if hasattr(item, "chunks") and (fqn is None or name == fqn):
            return MetadataIndex(name, item.chunks[0].offsets)
    raise AssertionError("the checkpoint has no tensor item")


def pk(*ops: bytes) -> bytes:
    """A protocol-2 pickle from raw opcodes (STOP added)."""
    return b"\x80\x02" + b"".join(ops) + b"."


def global_(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def unicode(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def binint(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def long1(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def colliding_int_dict(n: int) -> bytes:
    """Opcodes (no STOP) of a dict of ``n`` int keys that all hash to 1: ``1 + k (2**61 - 1)``."""
    body = [b"}("]
    for k in range(n):
        body += [long1(1 + k * ((1 << 61) - 1)), b"N"]
    body.append(b"u")
    return b"".join(body)


CHILD = r"""
import json, os, sys, time, traceback
sys.path.insert(0, {here!r})
path, entries = sys.argv[1], sys.argv[2].split(",")

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import shardkit.checkpoint as sc
from _attackkit import destination

calls = {{
    "reader": lambda: dcp.load(destination(path), storage_reader=sc.SafeFileSystemReader(path),
                               no_dist=True),
    "load": lambda: sc.load(destination(path), path),
    "inspect": lambda: sc.inspect(path),
    "verify": lambda: sc.verify(path),
}}
try:
    import shardkit.optim as so
    calls["load_consolidated"] = lambda: so.load_consolidated(path)
    if "load_sharded" in entries:  # the group first: its setup is not the load's cost
        import torch.distributed as dist
        from _attackkit import optim_model
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        calls["load_sharded"] = lambda: so.load_sharded(optim_model()[1], path)
except ImportError:
    pass
out = {{}}
for entry in entries:
    if entry not in calls:
        out[entry] = None
        continue
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    t0 = time.perf_counter()
    err = None
    try:
        calls[entry]()
    except BaseException as e:
        err = e
    took = time.perf_counter() - t0
    grew = status("VmHWM") - base
    cause = sc.checkpoint_error(err) if err is not None else None
    out[entry] = {{
        "error": None if err is None else type(err).__name__,
        "cause": None if cause is None else type(cause).__name__,
        "typed": isinstance(cause, sc.UnsafeCheckpointError),
        "message": "" if err is None else str(cause)[:600],
        "seconds": took,
        "grew": grew,
    }}
print("RESULT " + json.dumps(out))
"""


def destination(path: str) -> dict[str, Any]:
    """A state dict shaped like the checkpoint's (from its metadata, read safely): what a user
    resuming from it passes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = restricted_loads((version_dir(Path(path)) / ".metadata").read_bytes(), "m")
        items = md.state_dict_metadata
    except Exception:
        return {"w": torch.zeros(1)}
    out: dict[str, Any] = {}
    for fqn, item in items.items():
        if isinstance(item, TensorStorageMetadata):
            size = tuple(item.size)
            n = 1
            for d in size:
                n *= d
            out[fqn] = torch.zeros(size, dtype=item.properties.dtype) if n < 1 << 24 else None
        else:
            out[fqn] = 0
    return out


ENTRIES = ("reader", "load", "inspect", "verify")
OPTIM_ENTRIES = (*ENTRIES, "load_sharded", "load_consolidated")
"""Every entry point, for a checkpoint of shardkit-optim's ``save_sharded``."""


def optim_model() -> tuple[torch.nn.Module, Any]:
    """The model and ``ShardedOptimizer(AdamW)`` of :func:`save_optim` (a process group must
    exist): its items ``state/<i>/{step,exp_avg,exp_avg_sq}``, ``state/3/*`` of 16 elements,
    and the JSON records ``shardkit/header`` and ``shardkit/param_groups``."""
    from shardkit.optim import ShardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 16))
    return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)


SAVE_OPTIM = r"""
import sys
sys.path.insert(0, {here!r})
import torch
import torch.distributed as dist
from shardkit.optim import save_sharded
from _attackkit import optim_model

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model, opt = optim_model()
model(torch.ones(2, 4)).sum().backward()
opt.step()
save_sharded(opt, sys.argv[1])
dist.destroy_process_group()
"""


def save_optim(path: Path) -> None:
    """A world-1 ``save_sharded`` checkpoint of :func:`optim_model` after one step (a child:
    the process group stays out of the test process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_OPTIM.format(here=str(HERE)), str(path)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def as_object(path: Path, fqn: str, pkl: bytes) -> None:
    """Turns tensor item ``fqn`` into a non-tensor item whose stored bytes are a ``torch.save``
    zip with ``pkl`` as its ``data.pkl`` (what DCP writes for a non-tensor value)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = read_md(path)
    old = [i for i in md.storage_data if i.fqn == fqn]
    template = md.storage_data[old[0]]
    for index in old:
        del md.storage_data[index]
    md.state_dict_metadata[fqn] = BytesStorageMetadata()
    index = MetadataIndex(fqn)
    md.storage_data[index] = type(template)(template.relative_path, 0, 0)
    append_blob(path, index, with_pickle(pkl), md)
    write_md(path, md)


def run_child(path: Path, entries: tuple[str, ...] = ENTRIES) -> dict[str, Any]:
    """Loads ``path`` through each entry in a fresh child (see the module docstring)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(here=str(HERE)), str(path), ",".join(entries)],
        capture_output=True,
        text=True,
        timeout=20 + 10 * len(entries),
        preexec_fn=limit,
        env=env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])  # type: ignore[no-any-return]
    raise AssertionError(f"the child died (exit {proc.returncode}): {proc.stderr[-3000:]}")


Builder = Callable[[Path], None]
