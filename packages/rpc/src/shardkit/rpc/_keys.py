"""Stable parameter keys used by the distributed optimizer's state dict."""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__ = ["param_key", "remap_key", "split_param_key"]


# [Note: Parameter keys]
# A parameter is keyed "<owner name>:<position>", where position counts the parameters owned by
# that worker in the order the DistributedOptimizer was given them (flattened over param groups).
# The key does not depend on RRef ids, ports or process ranks, so it is the same in a fresh run
# over the same model; when owners are renamed or parameters move, `owner_map` / `key_map` in
# `load_state_dict` translate old keys to new ones.


def param_key(owner: str, position: int) -> str:
    """The key of the ``position``-th parameter owned by ``owner``. See [Note: Parameter keys]."""
    return f"{owner}:{position}"


def split_param_key(key: str) -> tuple[str, int]:
    """Inverse of :func:`param_key`; raises ``ValueError`` for a malformed key."""
    owner, sep, position = key.rpartition(":")
    if not sep or not owner or not position.isdigit():
        raise ValueError(
            f"malformed parameter key {key!r}: expected '<owner name>:<position>', e.g. "
            "'worker1:0' (keys come from DistributedOptimizer.state_dict())"
        )
    return owner, int(position)


def remap_key(
    key: str,
    owner_map: Mapping[str, str] | None,
    key_map: Mapping[str, str] | Callable[[str], str] | None,
) -> str:
    """Translate a saved key: ``key_map`` first (exact keys or a function), else ``owner_map``."""
    if key_map is not None:
        if callable(key_map):
            mapped = key_map(key)
            if not isinstance(mapped, str):
                raise TypeError(
                    f"key_map({key!r}) returned {type(mapped).__name__} {mapped!r}; it must "
                    "return the new key as a str '<owner name>:<position>'"
                )
            return mapped
        if key in key_map:
            return key_map[key]
    if owner_map:
        owner, position = split_param_key(key)
        if owner in owner_map:
            return param_key(owner_map[owner], position)
    return key
