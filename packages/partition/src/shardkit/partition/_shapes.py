"""Shape files: parameter lists of real architectures, for planning without the model."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from shardkit.partition._spec import ParamSpec

__all__ = ["ShapeFile", "available_shapes", "load_shapes"]


@dataclass(frozen=True)
class ShapeFile:
    """A model's parameters (registration order) as read from a shape file."""

    name: str
    """Model name (a shipped name such as ``"gpt2-small"``, or the file stem)."""
    source: str
    """Where the shapes come from (the configuration they were derived from)."""
    names: tuple[str, ...]
    """Parameter names, as ``named_parameters()`` would give them."""
    specs: tuple[ParamSpec, ...]
    """One :class:`ParamSpec` per parameter."""

    @property
    def numel(self) -> int:
        """Total number of parameter elements."""
        return sum(s.numel for s in self.specs)

    def freeze(self, pattern: str) -> ShapeFile:
        """A copy whose parameters with a name matching the regex ``pattern`` are frozen."""
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"freeze: invalid regular expression {pattern!r}: {exc}") from None
        specs = tuple(
            ParamSpec(s.shape, s.dtype, False) if rx.search(n) else s
            for n, s in zip(self.names, self.specs, strict=True)
        )
        return ShapeFile(self.name, self.source, self.names, specs)


def _shipped_dir() -> Any:
    return resources.files("shardkit.partition").joinpath("shapes")


def available_shapes() -> tuple[str, ...]:
    """Names of the shape files shipped with the package, sorted."""
    return tuple(
        sorted(p.name[: -len(".json")] for p in _shipped_dir().iterdir() if p.name.endswith(".json"))
    )


def load_shapes(name_or_path: str | Path) -> ShapeFile:
    """Load a shipped shape file by name (see :func:`available_shapes`) or any file by path.

    The JSON format: ``{"name": str, "source": str, "params": [{"name": str, "shape":
    [int, ...], "dtype": "float32", "requires_grad": bool}, ...]}`` (``requires_grad``
    defaults to true, ``dtype`` to float32).

    Raises:
        FileNotFoundError: neither a shipped name nor an existing file.
        ValueError: the file is not valid shape JSON.
    """
    text: str
    where: str
    key = str(name_or_path)
    shipped = _shipped_dir().joinpath(f"{key}.json")
    if isinstance(name_or_path, str) and "/" not in key and shipped.is_file():
        text, where = shipped.read_text(), f"shipped shape file {key!r}"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"load_shapes: {key!r} is neither a shipped shape file "
                f"({', '.join(available_shapes())}) nor an existing file"
            )
        text, where = path.read_text(), str(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"load_shapes: {where} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("params"), list):
        raise ValueError(
            f"load_shapes: {where} must be a JSON object with a 'params' list, got "
            f"{type(doc).__name__}"
        )
    names: list[str] = []
    specs: list[ParamSpec] = []
    for i, entry in enumerate(doc["params"]):
        if not isinstance(entry, dict) or "shape" not in entry:
            raise ValueError(f"load_shapes: {where}: params[{i}] needs a 'shape', got {entry!r}")
        dtype_name = entry.get("dtype", "float32")
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"load_shapes: {where}: params[{i}] has unknown dtype {dtype_name!r}; use a "
                f"torch dtype name such as 'float32' or 'bfloat16'"
            )
        shape = entry["shape"]
        if not isinstance(shape, list):
            raise ValueError(f"load_shapes: {where}: params[{i}].shape must be a list, got {shape!r}")
        try:
            spec = ParamSpec(tuple(shape), dtype, bool(entry.get("requires_grad", True)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"load_shapes: {where}: params[{i}]: {exc}") from None
        names.append(str(entry.get("name", f"param{i}")))
        specs.append(spec)
    if not specs:
        raise ValueError(f"load_shapes: {where} lists no parameters")
    name = str(doc.get("name", Path(key).stem))
    return ShapeFile(name, str(doc.get("source", where)), tuple(names), tuple(specs))
