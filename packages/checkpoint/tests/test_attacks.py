"""The README's promises against checkpoints crafted to break them (issue 46).

Each case rewrites a sound checkpoint as an attacker would (payloads where the attack puts them,
every CRC-32 recomputed) and loads it the README's ways in a child process (4 GiB address-space
limit): ``dcp.load`` with ``SafeFileSystemReader``, ``shardkit.checkpoint.load``, ``inspect``
and ``verify`` (and shardkit-optim's ``load_consolidated`` where it is installed). Each must
refuse it with ``UnsafeCheckpointError`` (raised, or what :func:`checkpoint_error` finds in DCP's
``CheckpointException``) within :data:`SECONDS` of wall time and :data:`RSS_BYTES` of peak
resident growth above the checkpoint files' size. ``inspect`` reads the metadata and the layout
only: a payload attack must leave it within the bounds, and it must refuse every attack on what
it reads. Code never runs: no case may create its marker file.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _attackkit import (
    ENTRIES,
    OPTIM_ENTRIES,
    append_blob,
    as_object,
    binint,
    colliding_int_dict,
    global_,
    long1,
    object_index,
    pk,
    read_md,
    run_child,
    save_optim,
    saved,
    tensor_index,
    unicode,
    version_dir,
    with_pickle,
    write_md,
)
from _ckpt_testkit import laughs_pickle, model_and_optim, state_of
from shardkit.checkpoint import load, save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc"),
]

SECONDS = 2.0
"""The wall-time bound of every entry on every case (2-core CI box, other tests running)."""
RSS_BYTES = 64 << 20
"""The peak resident growth bound above the size of the checkpoint's files."""


def _base(tmp: Path) -> Path:
    """A shardkit checkpoint of an MLP, its Adam state, a step, a config and a 16-element
    tensor ``extra.b`` (the chunk-tiling cases rewrite it)."""
    model, opt = model_and_optim()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    state = state_of(model, opt)
    state["extra"] = {"b": torch.arange(16.0), "m": torch.arange(16.0).view(4, 4)}
    path = tmp / "ckpt"
    save(state, path)
    return path


# ------------------------------------------------------------------ payload attacks


def _object(pkl: bytes) -> Callable[[Path], None]:
    return lambda path: append_blob(path, object_index(path), with_pickle(pkl))


def _tensor(blob: Callable[[Path], bytes], fqn: str = "extra.b") -> Callable[[Path], None]:
    return lambda path: append_blob(path, tensor_index(path, fqn), blob(path))


def _legacy_prefix(path: Path) -> bytes:
    """The legacy format's magic and protocol, then a bomb, then a sound torch.save zip: a zip
    reader finds the zip from its end; torch.load, seeing no ``PK`` first, decodes the prefix."""
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
    return magic + laughs_pickle(60, as_dict_key=True) + saved(torch.arange(16.0))


def _hooks_laughs(path: Path) -> bytes:
    """A tensor pickle that rebuilds the tensor and also carries a dict keyed by a 60-deep
    billion-laughs tuple (as the backward hooks argument)."""
    laughs = laughs_pickle(60, as_dict_key=True)[2:-1]  # its opcodes, no PROTO / STOP
    storage = (
        b"((" + unicode("storage") + global_("torch", "FloatStorage") + unicode("0")
        + unicode("cpu") + b"K\x10tQ"
    )  # fmt: skip
    pkl = pk(
        global_("torch._utils", "_rebuild_tensor_v2"),
        storage, b"K\x00K\x10\x85K\x01\x85\x89", laughs, b"tR",
    )  # fmt: skip
    return with_pickle(pkl, {"0": torch.arange(16.0).numpy().tobytes()})


def _view_past_storage(path: Path) -> bytes:
    storage = (
        b"((" + unicode("storage") + global_("torch", "FloatStorage") + unicode("0")
        + unicode("cpu") + b"K\x10tQ"
    )  # fmt: skip
    hooks = global_("collections", "OrderedDict") + b")R"
    pkl = pk(
        global_("torch._utils", "_rebuild_tensor_v2"),
        storage, binint(8), b"K\x10\x85K\x01\x85\x89", hooks, b"tR",
    )  # fmt: skip
    return with_pickle(pkl, {"0": torch.arange(16.0).numpy().tobytes()})


def _expanded(path: Path) -> bytes:
    """An item ``{"t": <a 1-element storage viewed as 2**40 elements, stride 0>}``: nothing
    allocated, then 2**40 steps for whoever touches it."""
    storage = (
        b"((" + unicode("storage") + global_("torch", "FloatStorage") + unicode("0")
        + unicode("cpu") + b"K\x01tQ"
    )  # fmt: skip
    hooks = global_("collections", "OrderedDict") + b")R"
    view = (
        global_("torch._utils", "_rebuild_tensor_v2") + storage + b"K\x00"
        + long1(1 << 40) + b"\x85K\x00\x85\x89" + hooks + b"tR"
    )  # fmt: skip
    return with_pickle(pk(b"}(", unicode("t"), view, b"u"), {"0": torch.ones(1).numpy().tobytes()})


def _trailing(path: Path) -> bytes:
    return saved(torch.arange(16.0)) + b"\0" * 64


def _punycode() -> bytes:
    text = "".join(chr(0x100 + i) for i in range(16_000))
    return pk(global_("_codecs", "encode"), unicode(text), unicode("punycode"), b"\x86R")


def _set_of_shared_list() -> bytes:
    """A list of 50,000 ints, memoized, then ``set(list)`` 5,000 times: 250 M insertions from
    about 300 KB."""
    ints = b"".join(binint(i) for i in range(50_000))
    calls = (b"h\x00" + b"h\x01" + b"\x85R0") * 5_000  # set, (list,) -> REDUCE, POP
    return pk(global_("__builtin__", "set"), b"q\x00](", ints, b"eq\x01", calls, b"N")


PAYLOAD: dict[str, Callable[[Path], None]] = {
    "bytearray of 2**30": _object(pk(global_("__builtin__", "bytearray"), binint(1 << 30), b"\x85R")),
    "punycode CPU bomb": _object(_punycode()),
    "hash flooding in an item": _object(pk(colliding_int_dict(60_000))),
    "set of a shared list, again and again": _object(_set_of_shared_list()),
    "an expanded view of 2**40 elements in an item": lambda p: append_blob(
        p, object_index(p), _expanded(p)
    ),
    "another codec": _object(pk(global_("_codecs", "encode"), unicode("a"), unicode("rot13"), b"\x86R")),
    "lists nested 100,000 deep": _object(pk(b"(" * 100_000 + b"l" * 100_000)),
    "code in an item": _object(pk(global_("posix", "system"), unicode("touch pwned"), b"\x85R")),
    "tensor pickle with laughs": _tensor(_hooks_laughs),
    "tensor pickle is a laughs dict": _tensor(lambda p: with_pickle(laughs_pickle(60, as_dict_key=True))),
    "legacy-format prefix": _tensor(_legacy_prefix),
    "view past its storage": _tensor(_view_past_storage),
    "bytes after the zip": _tensor(_trailing),
    "another dtype than declared": _tensor(lambda p: saved(torch.arange(16.0, dtype=torch.float64))[:2000]),
}  # fmt: skip


# ------------------------------------------------------------------ metadata attacks


def _flood_metadata(path: Path) -> None:
    """The metadata's ``planner_data`` replaced by 60,000 int keys of one hash (780 KB)."""
    md = read_md(path)
    md.planner_data = "PLACEHOLDER-PLANNER-DATA"
    raw = pickle.dumps(md, protocol=2)
    needle = pickle.dumps("PLACEHOLDER-PLANNER-DATA", protocol=2)[2:-1]  # BINUNICODE + memo
    at = raw.index(needle[:29])
    end = at + len(needle)
    # (the commit record's CRC-32s cover stored chunks only: nothing to recompute)
    (version_dir(path) / ".metadata").write_bytes(raw[:at] + colliding_int_dict(60_000) + raw[end:])


def _chunks(
    fqn: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> Callable[[Path], None]:
    """Item ``fqn`` stored as the chunks ``(offsets, sizes)``, each with its own sound blob."""

    def build(path: Path) -> None:
        md = read_md(path)
        item = md.state_dict_metadata[fqn]
        full = torch.arange(float(torch.Size(item.size).numel())).view(tuple(item.size))
        old = [MetadataIndex(fqn, c.offsets) for c in item.chunks]
        template = md.storage_data[old[0]]
        for index in old:
            del md.storage_data[index]
        item.chunks = []
        for offsets, sizes in boxes:
            index = MetadataIndex(fqn, torch.Size(offsets))
            info = type(template)(template.relative_path, 0, 0, template.transform_descriptors)
            md.storage_data[index] = info
            item.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            part = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].clone()
            append_blob(path, index, saved(part), md)
        write_md(path, md)

    return build


def _link(name: str | None) -> Callable[[Path], None]:
    """A file of the version (or, ``None``, the version directory itself) replaced by a link to
    a copy of it outside the checkpoint."""

    def build(path: Path) -> None:
        version = version_dir(path)
        target = version if name is None else version / name
        outside = path.parent / f"outside-{target.name}"
        (shutil.copytree if target.is_dir() else shutil.copy)(target, outside)
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        os.symlink(outside, target)

    return build


def _distcp(path: Path, fqn: str = "extra.b") -> str:
    return str(read_md(path).storage_data[tensor_index(path, fqn)].relative_path)


def _fifo(path: Path, fqn: str = "extra.b") -> None:
    target = version_dir(path) / _distcp(path, fqn)
    target.unlink()
    os.mkfifo(target)


LAYOUT: dict[str, Callable[[Path], None]] = {
    "hash flooding in the metadata": _flood_metadata,
    "overlapping chunks [0, 8) + [4, 12)": _chunks("extra.b", [((0,), (8,)), ((4,), (8,))]),
    "2-D overlap and gap of equal volume": _chunks(
        "extra.m", [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((1, 2), (2, 2))]
    ),
    "a chunk twice": _chunks("extra.b", [((0,), (8,)), ((0,), (8,)), ((8,), (8,))]),
    "symlinked .distcp file": lambda p: _link(_distcp(p))(p),
    "symlinked version directory": _link(None),
    "symlinked .metadata": _link(".metadata"),
    "symlinked commit record": _link("SHARDKIT_COMMIT"),
    "FIFO as a .distcp file": _fifo,
}


def _latest_link(path: Path) -> None:
    outside = path.parent / "outside-LATEST"
    shutil.copy(path / "LATEST", outside)
    (path / "LATEST").unlink()
    os.symlink(outside, path / "LATEST")


LAYOUT["symlinked LATEST"] = _latest_link


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _base(tmp_path_factory.mktemp("attacks"))


def _files_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


REASONS: dict[str, str] = {
    "an expanded view of 2**40 elements in an item": "a tensor view at offset",
    "another codec": "_codecs.encode is allowed only",
    "another dtype than declared": "holds a Tensor where the metadata declares",
    "bytearray of 2**30": "bytearray is allowed only of bytes",
    "bytes after the zip": "not one torch.save zip",
    "code in an item": "global 'posix.system' is not allowed",
    "hash flooding in an item": "share a hash value",
    "legacy-format prefix": "not one torch.save zip",
    "lists nested 100,000 deep": "nested more than 256 deep",
    "punycode CPU bomb": "_codecs.encode is allowed only",
    "set of a shared list, again and again": "share a hash value",
    "tensor pickle is a laughs dict": "a key of type tuple is not allowed",
    "tensor pickle with laughs": "a key of type tuple is not allowed",
    "view past its storage": "reaches past its storage",
    "2-D overlap and gap of equal volume": "do not tile it exactly",
    "FIFO as a .distcp file": "is absent or not a regular file",
    "a chunk twice": "do not tile it exactly",
    "hash flooding in the metadata": "share a hash value",
    "overlapping chunks [0, 8) + [4, 12)": "do not tile it exactly",
    **dict.fromkeys(
        ["symlinked .distcp file", "symlinked version directory", "symlinked .metadata",
         "symlinked commit record", "symlinked LATEST"],
        "is a symbolic link",
    ),
}  # fmt: skip
"""Per case, what every refusal must say: the check meant to catch it caught it (a malformed
payload would be refused too, for another reason, and test nothing)."""


def _check(
    results: dict[str, Any], size: int, *, inspect_refuses: bool, reason: str | None = None
) -> None:
    for entry, r in results.items():
        if r is None:
            continue  # not installed here
        where = f"{entry}: {r}"
        assert r["seconds"] < SECONDS, f"{where}: took {r['seconds']:.2f} s"
        assert r["grew"] < RSS_BYTES + size, f"{where}: grew {r['grew'] >> 20} MiB"
        if entry == "inspect" and not inspect_refuses:
            assert r["error"] is None or r["typed"], where
        else:
            assert r["typed"], f"{where}: not refused with UnsafeCheckpointError"
        if r["typed"] and reason is not None:
            assert re.search(reason, r["message"]), f"{where}: not refused for {reason!r}"


def _attack(base: Path, tmp_path: Path, build: Callable[[Path], None]) -> Path:
    path = tmp_path / "case" / "ckpt"
    shutil.copytree(base, path, symlinks=True)
    build(path)
    return path


@pytest.mark.parametrize("name", sorted(PAYLOAD))
def test_payload_attacks_are_refused_within_bounds(base: Path, tmp_path: Path, name: str) -> None:
    path = _attack(base, tmp_path, PAYLOAD[name])
    results = run_child(path, (*ENTRIES, "load_consolidated"))
    results.pop("load_consolidated", None)  # not an optimizer checkpoint: see the optimizer's
    _check(results, _files_size(path), inspect_refuses=False, reason=re.escape(REASONS[name]))
    assert not (Path.cwd() / "pwned").exists() and not (path / "pwned").exists()


@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_metadata_and_layout_attacks_are_refused_within_bounds(
    base: Path, tmp_path: Path, name: str
) -> None:
    path = _attack(base, tmp_path, LAYOUT[name])
    _check(
        run_child(path), _files_size(path), inspect_refuses=True, reason=re.escape(REASONS[name])
    )


def test_a_plain_dcp_checkpoint_with_a_legacy_prefix_is_refused_by_the_reader(
    tmp_path: Path,
) -> None:
    """A plain DCP checkpoint (no commit record, no CRC-32s): the reader alone guards it."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "plain"
    dcp.save({"b": torch.arange(16.0), "cfg": {"k": 1}}, checkpoint_id=str(path), no_dist=True)
    append_blob(path, tensor_index(path, "b"), _legacy_prefix(path))
    _check(run_child(path, ("reader",)), _files_size(path), inspect_refuses=True)
    _object(pk(global_("__builtin__", "bytearray"), binint(1 << 30), b"\x85R"))(path)
    _check(run_child(path, ("reader",)), _files_size(path), inspect_refuses=True)


# ------------------------------------------------------------------ optimizer checkpoints

_BIAS = "state/3/exp_avg"  # 16 elements, like extra.b: the tensor builders fit it as they are
_HEADER = "shardkit/header"  # a JSON record, stored as a uint8 tensor

OPTIM_PAYLOAD: dict[str, Callable[[Path], None]] = {
    "header as a bytearray of 2**30": lambda p: as_object(
        p, _HEADER, pk(global_("__builtin__", "bytearray"), binint(1 << 30), b"\x85R")
    ),
    "header as a punycode CPU bomb": lambda p: as_object(p, _HEADER, _punycode()),
    "header as 60,000 int keys of one hash": lambda p: as_object(
        p, _HEADER, pk(colliding_int_dict(60_000))
    ),
    "header as code": lambda p: as_object(
        p, _HEADER, pk(global_("posix", "system"), unicode("touch pwned"), b"\x85R")
    ),
    "moment pickle with laughs": _tensor(_hooks_laughs, _BIAS),
    "moment with a legacy-format prefix": _tensor(_legacy_prefix, _BIAS),
    "moment viewing past its storage": _tensor(_view_past_storage, _BIAS),
    "moment in another dtype than declared": _tensor(
        lambda p: saved(torch.arange(16.0, dtype=torch.float64)), _BIAS
    ),
}
"""The payload classes above on a ``save_sharded`` checkpoint (its items are tensors: an object
payload goes where an attacker would put it, in place of the header record)."""

OPTIM_LAYOUT: dict[str, Callable[[Path], None]] = {
    "hash flooding in the metadata": _flood_metadata,
    "overlapping moment chunks": _chunks(_BIAS, [((0,), (8,)), ((4,), (8,))]),
    "symlinked .distcp file": lambda p: _link(_distcp(p, _BIAS))(p),
    "symlinked version directory": _link(None),
    "symlinked .metadata": _link(".metadata"),
    "symlinked commit record": _link("SHARDKIT_COMMIT"),
    "symlinked LATEST": _latest_link,
    "FIFO as a .distcp file": lambda p: _fifo(p, _BIAS),
}
"""The metadata and layout classes above on a ``save_sharded`` checkpoint."""


_RECORD = "is not a 1-D uint8 record"  # shardkit-optim refuses the record before decoding it
_OPTIM_REASONS: dict[str, str] = {
    "an expanded view of 2**40 elements in an item": "a tensor view at offset",
    "header as a bytearray of 2**30": f"{REASONS['bytearray of 2**30']}|{_RECORD}",
    "header as a punycode CPU bomb": f"{REASONS['punycode CPU bomb']}|{_RECORD}",
    "header as 60,000 int keys of one hash": f"{REASONS['hash flooding in an item']}|{_RECORD}",
    "header as code": f"{re.escape(REASONS['code in an item'])}|{_RECORD}",
    "moment pickle with laughs": REASONS["tensor pickle with laughs"],
    "moment with a legacy-format prefix": REASONS["legacy-format prefix"],
    "moment viewing past its storage": REASONS["view past its storage"],
    "moment in another dtype than declared": REASONS["another dtype than declared"],
    "hash flooding in the metadata": REASONS["hash flooding in the metadata"],
    "overlapping moment chunks": REASONS["a chunk twice"],
    "FIFO as a .distcp file": REASONS["FIFO as a .distcp file"],
    **{k: REASONS[k] for k in OPTIM_LAYOUT if k.startswith("symlinked")},
}
"""What each refusal on the optimizer's checkpoint must say (a regex)."""


@pytest.fixture(scope="module")
def optim_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("shardkit.optim", reason="the optimizer's entry points need shardkit-optim")
    path = tmp_path_factory.mktemp("optim-attacks") / "ckpt"
    save_optim(path)
    return path


@pytest.mark.parametrize("name", sorted(OPTIM_PAYLOAD) + sorted(OPTIM_LAYOUT))
def test_optimizer_checkpoint_attacks_are_refused_within_bounds(
    optim_base: Path, tmp_path: Path, name: str
) -> None:
    """Every entry point, shardkit-optim's ``load_sharded`` and ``load_consolidated`` too, refuses
    each class of attack on a ``save_sharded`` checkpoint with ``UnsafeCheckpointError`` within
    the bounds (``inspect``, which reads the metadata and the layout only, stays within the
    bounds on a payload attack)."""
    path = _attack(optim_base, tmp_path, {**OPTIM_PAYLOAD, **OPTIM_LAYOUT}[name])
    results = run_child(path, OPTIM_ENTRIES)
    _check(
        results,
        _files_size(path),
        inspect_refuses=name in OPTIM_LAYOUT,
        reason=_OPTIM_REASONS[name],
    )
    assert not (Path.cwd() / "pwned").exists() and not (path / "pwned").exists()


def test_a_sound_optimizer_checkpoint_loads_through_every_entry(optim_base: Path) -> None:
    results = run_child(optim_base, OPTIM_ENTRIES)
    for entry, r in results.items():
        assert r is not None and r["error"] is None, f"{entry}: {r}"
        assert r["seconds"] < SECONDS, f"{entry}: {r}"


def test_a_sound_checkpoint_still_loads_through_every_entry(base: Path) -> None:
    results = run_child(base)
    for entry, r in results.items():
        assert r["error"] is None, f"{entry}: {r}"
        assert r["seconds"] < SECONDS, f"{entry}: {r}"


def test_expanded_views_of_a_few_times_their_storage_load(tmp_path: Path) -> None:
    """[Note: An expanded view is work] in ``_payload.py``: what models' buffers hold (a
    ``(1, n)`` view of ``arange(n)``, an ``expand`` to four times its storage) loads equal."""
    path = tmp_path / "ckpt"
    pos = torch.arange(512).expand((1, -1))
    state = {"extra": {"pos": pos, "wide": torch.arange(64.0).expand(4, 64)}}
    save(state, path)
    results = run_child(path)
    for entry, r in results.items():
        assert r["error"] is None, f"{entry}: {r}"
    loaded = {"extra": {"pos": torch.zeros(1, 512, dtype=torch.long), "wide": torch.zeros(4, 64)}}
    load(loaded, path)
    assert torch.equal(loaded["extra"]["pos"], pos)
    assert torch.equal(loaded["extra"]["wide"], state["extra"]["wide"])


def test_many_one_element_chunks_load_in_linear_time(tmp_path: Path) -> None:
    """2,000 one-element chunks of one tensor: a sound tiling, checked and loaded within the
    bounds (the chunk lookup and the tiling check are linear in the number of chunks)."""
    path = tmp_path / "ckpt"
    save({"extra": {"b": torch.arange(2000.0)}}, path)
    _chunks("extra.b", [((i,), (1,)) for i in range(2000)])(path)
    results = run_child(path)
    for entry, r in results.items():
        assert r["error"] is None, f"{entry}: {r}"
    assert results["reader"]["seconds"] < SECONDS, results


def test_the_named_directory_may_be_a_link(base: Path, tmp_path: Path) -> None:
    """Only what lies below the directory the user names must not be a link: a job's
    ``ckpt -> /scratch/run7`` loads."""
    os.symlink(base, tmp_path / "alias")
    results = run_child(tmp_path / "alias")
    for entry, r in results.items():
        assert r["error"] is None, f"{entry}: {r}"


def test_the_cli_verify_fails_with_the_reason(base: Path, tmp_path: Path) -> None:
    import subprocess

    path = _attack(base, tmp_path, LAYOUT["symlinked .distcp file"])
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.checkpoint", "verify", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and "symbolic link" in proc.stdout + proc.stderr, proc
