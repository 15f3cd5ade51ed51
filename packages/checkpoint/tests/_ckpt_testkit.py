"""Helpers shared by shardkit-checkpoint's tests: a model and optimizer state as DCP sees it,
hostile objects and pickles, deep comparison.
"""

from __future__ import annotations

import itertools
import os
import pickle
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

__all__ = [
    "Evil",
    "assert_same",
    "billion_laughs",
    "laughs_pickle",
    "model_and_optim",
    "pickled",
    "state_of",
    "torch_save_with_pickle",
    "train",
]


class Evil:
    """Unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def model_and_optim(
    sizes: tuple[int, ...] = (4, 8, 2), seed: int = 0, lr: float = 0.01
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP and an Adam over two param groups (``betas`` a tuple, a second ``lr``)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    ps = list(model.parameters())
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": lr * 2}]
    return model, torch.optim.Adam(groups, lr=lr, betas=(0.8, 0.99))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    """``steps`` seeded MSE steps (batch ``s`` from a generator seeded with ``s``)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(8, linears[0].in_features, generator=g)
        y = torch.randn(8, linears[-1].out_features, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The DCP state dict of a training job: model, optimizer (``get_state_dict``: keyed by
    parameter name, its state initialised), and a step count and a config (non-tensors)."""
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": 0, "config": {"name": "mlp", "betas": (0.8, 0.99)}}


def assert_same(a: Any, b: Any, where: str = "state", *, values: bool = True) -> None:
    """Nested dicts / lists / tuples equal, every tensor bit for bit (same dtype and shape);
    with ``values=False`` the same structure, tensor shapes and dtypes only."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        assert a.dtype == b.dtype and a.shape == b.shape, (
            where,
            a.dtype,
            b.dtype,
            a.shape,
            b.shape,
        )
        assert not values or torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, list(a)[:5], list(b)[:5])
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]", values=values)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]", values=values)
    else:
        assert not values or a == b, (where, a, b)


def billion_laughs(depth: int, leaf: Any = "a") -> tuple[Any, ...]:
    """A tuple holding the same tuple twice, ``depth`` times: ``depth + 1`` objects, ``2**depth``
    leaves to anything that walks it as a tree. Pickled, it is a few bytes per level."""
    x: tuple[Any, ...] = (leaf,)
    for _ in range(depth):
        x = (x, x)
    return x


def pickled(obj: Any) -> bytes:
    """``pickle.dumps`` at protocol 4 (what DCP writes)."""
    return pickle.dumps(obj, protocol=4)


def _put(i: int) -> bytes:
    return b"q" + bytes([i]) if i < 256 else b"r" + i.to_bytes(4, "little")


def _get(i: int) -> bytes:
    return b"h" + bytes([i]) if i < 256 else b"j" + i.to_bytes(4, "little")


def laughs_pickle(depth: int, *, as_dict_key: bool) -> bytes:
    """A pickle (protocol 2) of a billion-laughs tuple (see :func:`billion_laughs`), written
    opcode by opcode, alone or as the key of a one-entry dict: building such a dict in this
    process would hash the key, which takes 2**depth steps, so the bytes are made by hand.
    Only opcodes torch's weights-only unpickler knows: each level is ``BINGET`` of the level
    below (on the stack), ``TUPLE2``, ``BINPUT``."""
    out = [b"\x80\x02", b"}" if as_dict_key else b"", b"X\x01\x00\x00\x00a\x85", _put(0)]
    for i in range(depth):
        out += [_get(i), b"\x86", _put(i + 1)]
    if as_dict_key:
        out.append(b"K\x01s")  # value 1, SETITEM
    out.append(b".")
    return b"".join(out)


def torch_save_with_pickle(pkl: bytes) -> bytes:
    """A ``torch.save`` blob (zip of uncompressed records) whose ``data.pkl`` is ``pkl``."""
    import io
    import zipfile

    src = io.BytesIO()
    torch.save({"placeholder": 1}, src)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src.getvalue())) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_STORED)
    return out.getvalue()
