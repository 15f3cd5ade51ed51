"""Structural bombs: untrusted input whose *shape* costs, not its size (issue 38, item 3).

Each case is a small file (a few KB unless stated) built to make a naive reader spend time or
memory far beyond its size: shared references nested 60 deep ("billion laughs": 2**60 leaves
to anything that walks them as a tree), deep nesting, lengths and counts that claim gigabytes,
memo abuse, text opcodes that defeat a per-opcode copy, JSON nested or numbered beyond reason.
Every case is refused with a clean ``UnsafeCheckpointError`` (or loaded, where it is legal
data) within the bounds :func:`_bounded` states: **2 s** of wall time and **64 MiB** of peak
resident growth, measured on the process's own counters (``VmHWM``, reset through
``/proc/self/clear_refs``). See [Note: Bounded work on untrusted input].

A reader that expanded shared references (the ``repr()`` in an error message that made a
1,917-byte ``.metadata`` spin forever before this issue) never finishes the 60-deep cases:
the test's own timeout (60 s) fails it.
"""

from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt_testkit import (
    billion_laughs,
    laughs_pickle,
    model_and_optim,
    pickled,
    state_of,
    torch_save_with_pickle,
)
from _fuzzkit import proc_status
from shardkit.checkpoint import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    describe,
    from_record,
    inspect,
    load,
    open_checkpoint,
    save,
    verify,
)
from shardkit.checkpoint._unpickle import UnsafePickleError, restricted_loads
from torch.distributed.checkpoint.api import CheckpointException

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc"),
]

SECONDS = 2.0
"""The wall-time bound of every case (the slowest measured on the 2-core CI box: see
docs/security.md)."""
RSS_BYTES = 64 << 20
"""The peak resident growth bound of every case."""


def _bounded(fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Runs ``fn`` within the bounds; returns what it raised (None) and its wall time."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = proc_status("VmRSS")
    t0 = time.perf_counter()
    error: BaseException | None = None
    try:
        fn()
    except (Exception, CheckpointException) as e:
        error = e
    took = time.perf_counter() - t0
    grew = proc_status("VmHWM") - base
    assert took < SECONDS, f"took {took:.2f} s (bound {SECONDS} s)"
    assert grew < RSS_BYTES, f"grew the resident set by {grew >> 20} MiB (bound {RSS_BYTES >> 20})"
    return error, took


def _refused(fn: Callable[[], Any], match: str) -> float:
    error, took = _bounded(fn)
    text = str(error)
    assert error is not None, "the bomb was not refused"
    assert isinstance(error, (UnsafeCheckpointError, CheckpointException)), repr(error)[:500]
    assert match in text, text[-2000:]
    return took


# ------------------------------------------------------------------ the metadata pickle


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain DCP checkpoint of a model and its Adam state (``dcp.save``)."""
    path = tmp_path_factory.mktemp("bombs") / "plain"
    model, opt = model_and_optim()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    dcp.save(state_of(model, opt), checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same state, saved by shardkit.checkpoint.save."""
    path = tmp_path_factory.mktemp("bombs") / "ckpt"
    model, opt = model_and_optim()
    save(state_of(model, opt), path)
    return path


def _with_metadata(src: Path, dst: Path, edit: Callable[[Any], Any]) -> Path:
    """A copy of ``src`` whose ``.metadata`` is ``edit``'s result (an object to pickle, or the
    pickle's bytes)."""
    shutil.copytree(src, dst)
    version = dst if not (dst / "LATEST").exists() else dst / (dst / "LATEST").read_text().strip()
    meta = version / ".metadata"
    out = edit(restricted_loads(meta.read_bytes(), "m"))
    meta.write_bytes(out if isinstance(out, bytes) else pickled(out))
    return dst


def _dcp_load(path: Path) -> None:
    model, opt = model_and_optim(seed=1)
    dcp.load(state_of(model, opt), storage_reader=SafeFileSystemReader(path), no_dist=True)


def _laughs_attribute(md: Any) -> Any:
    md.__dict__["extra"] = billion_laughs(60)
    return md


def test_the_issue_billion_laughs_in_an_extra_attribute(plain: Path, tmp_path: Path) -> None:
    """The reported case: one extra attribute of Metadata nesting shared references 60 deep
    (2**60 leaves if expanded). Refused by every entry point, fast; the error message
    describes it with bounds instead of repr()."""
    bomb = _with_metadata(plain, tmp_path / "c", _laughs_attribute)
    assert (bomb / ".metadata").stat().st_size < 16384  # 60 levels: about 600 bytes of it
    _refused(lambda: _dcp_load(bomb), "unknown field(s) 'extra'")
    _refused(lambda: restricted_loads((bomb / ".metadata").read_bytes(), "m"), "'extra'")


def test_billion_laughs_in_a_shardkit_checkpoint(committed: Path, tmp_path: Path) -> None:
    """Through shardkit.checkpoint.load / open_checkpoint / inspect / verify and the CLI."""
    bomb = _with_metadata(committed, tmp_path / "c", _laughs_attribute)
    model, opt = model_and_optim(seed=1)
    dest = state_of(model, opt)
    for fn in (lambda: load(dest, bomb), lambda: open_checkpoint(bomb), lambda: inspect(bomb),
               lambda: verify(bomb)):  # fmt: skip
        _refused(fn, "'extra'")
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "shardkit.checkpoint", "verify", str(bomb)],
        capture_output=True, text=True, timeout=60, check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert res.returncode == 1 and "'extra'" in res.stderr, res.stderr
    assert time.perf_counter() - t0 < 30  # a fresh interpreter importing torch, then the check


@pytest.mark.parametrize(
    ("where", "match"),
    [
        ("planner_data value", "not a key path"),
        ("chunk sizes", "outside its size"),
        ("tensor size", "has size"),
        ("storage meta", "storage_meta"),
        ("item", "is tuple of 2"),
        ("relative path", "names file"),
    ],
)
def test_billion_laughs_in_every_field(plain: Path, tmp_path: Path, where: str, match: str) -> None:
    """The bomb where every field of DCP's metadata may hold a value: each check looks at one
    node and describes it with bounds."""
    bomb = billion_laughs(60)

    def edit(md: Any) -> Any:
        first = next(iter(md.state_dict_metadata.values()))
        if where == "planner_data value":
            md.planner_data = {"x": bomb}
        elif where == "chunk sizes":
            first.chunks[0].__dict__["sizes"] = bomb
        elif where == "tensor size":
            first.__dict__["size"] = bomb
        elif where == "storage meta":
            md.storage_meta.__dict__["modules"] = [bomb]
        elif where == "item":
            md.state_dict_metadata["laughs"] = bomb
        else:
            next(iter(md.storage_data.values())).__dict__["relative_path"] = bomb
        return md

    _refused(lambda: _dcp_load(_with_metadata(plain, tmp_path / "c", edit)), match)


def _metadata_pickle_with(plain: Path, tail: bytes) -> bytes:
    """The real metadata pickle with ``tail`` run before its STOP (the object on top of the
    stack: Metadata); ``tail`` must leave the stack as it found it."""
    data = (plain / ".metadata").read_bytes()
    assert data.endswith(b".")
    return data[:-1] + tail + b"."


@pytest.mark.parametrize("kind", ["dict key", "set item", "frozenset item", "torch.Size"])
def test_billion_laughs_where_it_would_be_hashed(kind: str) -> None:
    """As a dict key or a set item the bomb would be hashed (2**60 steps for a tuple; Python
    does not cache tuple hashes): keys and items must be flat, so it is refused before any
    hash. As torch.Size's argument it is refused at its first element."""
    laughs = laughs_pickle(60, as_dict_key=False)[2:-1]  # the opcodes that build it
    body = {
        "dict key": b"}" + laughs + b"K\x01s",
        "set item": b"\x8f(" + laughs + b"\x90",
        "frozenset item": b"(" + laughs + b"\x91",
        "torch.Size": b"\x8c\x05torch\x8c\x04Size\x93" + laughs + b"\x85R",
    }[kind]
    blob = b"\x80\x04" + body + b"."
    assert len(blob) < 1024
    error, _ = _bounded(lambda: restricted_loads(blob, "m"))
    assert isinstance(error, UnsafePickleError), repr(error)
    assert ("key of type tuple" in str(error)) or ("torch.Size" in str(error)), str(error)


def test_deep_nesting_is_linear(plain: Path, tmp_path: Path) -> None:
    """Lists nested 50,000 deep (150 KB): the allow-list interpreter has no recursion (it
    loads, as plain data), and as a ``.metadata`` it is refused with a message that describes
    three levels of it."""
    depth = 50_000
    bomb = b"\x80\x04" + b"]\x94" * depth + b"a" * (depth - 1) + b"."
    error, _ = _bounded(lambda: restricted_loads(bomb, "m"))
    assert error is None
    path = tmp_path / "c"
    shutil.copytree(plain, path)
    (path / ".metadata").write_bytes(bomb)
    _refused(lambda: _dcp_load(path), "holds list of 1: (list of 1: (list of 1: (list of 1)))")


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (b"\x80\x04\x8d" + struct.pack("<Q", 1 << 60) + b"abc.", "truncated"),  # BINUNICODE8
        (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 60) + b"abc.", "truncated"),  # BINBYTES8
        (b"\x80\x04X" + struct.pack("<I", 0xFFFFFFFF) + b"abc.", "truncated"),  # BINUNICODE
        (b"\x80\x04B" + struct.pack("<I", 0xFFFFFFFF) + b"abc.", "truncated"),  # BINBYTES
        (b"\x80\x04\x8b" + struct.pack("<i", 1 << 30) + b"abc.", "truncated"),  # LONG4
        (b"\x80\x04\x95" + struct.pack("<Q", 1 << 62) + b"N.", "frame longer"),  # FRAME
        (b"\x80\x04j\xff\xff\xff\xff.", "memo key 4294967295 is not defined"),  # LONG_BINGET
        (b"\x80\x04I" + b"9" * 5000 + b"\n.", "integer literal too long"),
        (b"\x80\x04c" + b"m" * 70000 + b"\nx\n.", "unterminated line"),
    ],
)
def test_huge_declared_lengths_are_refused_without_allocating(blob: bytes, match: str) -> None:
    error, _ = _bounded(lambda: restricted_loads(blob, "m"))
    assert isinstance(error, UnsafePickleError) and match in str(error), repr(error)


@pytest.mark.parametrize(
    "body",
    [
        b"]" + b"(" + b"K\x01" * 100_000 + b"e",  # a list of 100k ints (APPENDS)
        b"}" + b"(" + b"".join(b"J" + struct.pack("<i", i) + b"N" for i in range(50_000)) + b"u",
        b"N" + b"\x94" * 100_000,  # 100k MEMOIZE of one object
        b"N\x94" + b"h\x000" * 100_000 + b"h\x00",  # BINGET / POP loops
        b"(" + b"I1\n" * 100_000 + b"l",  # text opcodes: a line search per opcode, bounded
        b"N" + b"r\xff\xff\xff\xff" * 10 + b"j\xff\xff\xff\xff",  # huge memo indices
    ],
    ids=[
        "100k-item list",
        "50k-entry dict",
        "100k memoize",
        "get loop",
        "text ints",
        "huge memo index",
    ],
)
def test_huge_counts_and_memo_abuse_cost_linear_time(body: bytes) -> None:
    """Legal pickles of many items: they load (plain data), in time linear in their size."""
    blob = b"\x80\x04" + body + b"."
    error, _ = _bounded(lambda: restricted_loads(blob, "m"))
    assert error is None, repr(error)


def test_a_tensor_claiming_a_huge_size_is_refused_before_allocating(
    plain: Path, tmp_path: Path
) -> None:
    """An item declaring 2**62 elements (and chunks to match): its bytes are not on disk."""

    def edit(md: Any) -> Any:
        item = next(v for v in md.state_dict_metadata.values() if len(getattr(v, "size", ())) == 1)
        item.__dict__["size"] = torch.Size([1 << 62])
        item.chunks[0].__dict__["sizes"] = torch.Size([1 << 62])
        return md

    bomb = _with_metadata(plain, tmp_path / "c", edit)
    _refused(lambda: _dcp_load(bomb), "bytes stored in")


# ------------------------------------------------------------------ non-tensor items


def _object_item_checkpoint(tmp_path: Path, pkl: bytes) -> Path:
    """A DCP checkpoint whose non-tensor item ``cfg`` is a torch.save blob of ``pkl``."""
    path = tmp_path / "obj"
    dcp.save({"w": torch.ones(2), "cfg": {"k": 1}}, checkpoint_id=str(path), no_dist=True)
    md = restricted_loads((path / ".metadata").read_bytes(), "m")
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = md.storage_data[MetadataIndex("cfg.k")]
    blob = torch_save_with_pickle(pkl)
    with open(path / info.relative_path, "ab") as f:
        info.offset = f.tell()
        f.write(blob)
    info.length = len(blob)
    (path / ".metadata").write_bytes(pickled(md))
    return path


def _load_object_item(path: Path) -> None:
    dcp.load(
        {"w": torch.empty(2), "cfg": {"k": 0}},
        storage_reader=SafeFileSystemReader(path),
        no_dist=True,
    )


def test_billion_laughs_in_a_non_tensor_item(tmp_path: Path) -> None:
    """A dict keyed by shared references nested 60 deep, as a non-tensor item: torch's
    weights-only unpickler would hash the key for ever. The opcode scan refuses it first."""
    path = _object_item_checkpoint(tmp_path, laughs_pickle(60, as_dict_key=True))
    _refused(lambda: _load_object_item(path), "billion laughs")


def test_lists_filled_after_they_are_shared_are_measured_once_decoded(tmp_path: Path) -> None:
    """Lists referenced before they are filled escape the opcode scan (it sees them empty); the
    decoded object is measured object by object and refused (2**40 leaves)."""
    depth = 40
    # every list first, empty; then each gets the one below it twice, top down (the opcodes
    # torch's weights-only unpickler knows: what is left on the stack is ignored at STOP)
    out = [b"\x80\x02"] + [b"]" + (b"q" + bytes([i])) for i in range(depth + 1)]
    for i in range(depth, 0, -1):
        out += [b"h" + bytes([i]), b"h" + bytes([i - 1]), b"a", b"h" + bytes([i - 1]), b"a"]
    out += [b"h" + bytes([0]), b"K\x01a", b"h" + bytes([depth]), b"."]
    path = _object_item_checkpoint(tmp_path, b"".join(out))
    _refused(lambda: _load_object_item(path), "decodes to a structure whose expansion exceeds")


def test_a_storage_larger_than_its_record_is_refused(tmp_path: Path) -> None:
    """A non-tensor item holding a tensor whose pickle declares 2**30 elements for a record
    that is absent (or shorter): refused on the opcodes, before torch.load reads a byte."""
    import zipfile

    buf = io.BytesIO()
    torch.save([torch.ones(70_000)], buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    old = b"J" + struct.pack("<i", 70_000)
    assert pkl.count(old) >= 1
    pkl = pkl.replace(old, b"J" + struct.pack("<i", 1 << 30))
    path = _object_item_checkpoint(tmp_path, pkl)  # the zip holds no record of that storage
    _refused(lambda: _load_object_item(path), "declares a storage of")


# ------------------------------------------------------------------ JSON records


def _with_record(committed: Path, dst: Path, text: bytes) -> Path:
    shutil.copytree(committed, dst)
    version = dst / (dst / "LATEST").read_text().strip()
    (version / "SHARDKIT_COMMIT").write_bytes(text)
    return dst


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"[" * 1_000_000 + b"]" * 1_000_000, "nests deeper than 64"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nests deeper than 64"),
        (
            b'{"layout": "shardkit.checkpoint/1", "token": ' + b"9" * 100_000 + b"}",
            "not valid JSON",
        ),
        (b'{"x": "' + b"[" * 2_000_000 + b'"}', "field 'layout'"),  # brackets in a string: data
        (b"\xff\xfe" * 1000, "not UTF-8"),
    ],
    ids=["deep arrays", "deep objects", "100k-digit int", "brackets in a string", "not utf-8"],
)
def test_hostile_commit_records(committed: Path, tmp_path: Path, text: bytes, match: str) -> None:
    """JSON nested a million deep (json.loads would recurse: RecursionError is not a clean
    error), numbers of 100,000 digits, brackets inside strings (data, not nesting)."""
    if match == "field 'layout'":
        text = text.replace(b'{"x"', b'{"layout": 1, "x"')
    bomb = _with_record(committed, tmp_path / "c", text)
    _refused(lambda: open_checkpoint(bomb), match)


def test_hostile_record_tensors() -> None:
    """The same for a record tensor (shardkit.checkpoint.from_record)."""
    for text, match in (
        (b"[" * 1_000_000, "nests deeper than 64"),
        (b"1" + b"0" * 100_000, "not valid JSON"),
        (b"[" * 20 + b"1" + b"]" * 20, "nested deeper than 16"),
        (b"123456789012345678901234567890", "out-of-range int"),
    ):
        t = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        _refused(lambda t=t: from_record(t, "r"), match)


def test_a_huge_pointer_file_is_read_to_its_first_bytes(committed: Path, tmp_path: Path) -> None:
    """LATEST of 1 GiB (sparse): only its first bytes are read."""
    path = tmp_path / "c"
    shutil.copytree(committed, path)
    with open(path / "LATEST", "r+b") as f:
        f.truncate(1 << 30)
    error, _ = _bounded(lambda: open_checkpoint(path))
    assert error is not None and "which is not a version there" in str(error), repr(error)


def test_describe_is_bounded_on_every_bomb() -> None:
    """The message helper itself: a 60-deep bomb, a 10,000-digit int, a 10 MB string."""
    big = int("7" * 4000)
    for value in (billion_laughs(60), big * big, "x" * 10_000_000, [billion_laughs(60)] * 1000):
        error, _ = _bounded(lambda value=value: describe(value))
        assert error is None
        assert len(describe(value)) < 1000
