"""Plain torch optimizer state dicts <-> the local optimizer's state, keyed by global index.

See [Note: Global parameter index].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from shardkit.optim._layout import _Layout

__all__: list[str] = []


def _hyperparams(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _local_groups(layout: _Layout, rank: int, n_groups: int) -> list[list[torch.Tensor]]:
    """The params of each wrapper group owned by ``rank`` (one list per group, maybe empty)."""
    groups: list[list[torch.Tensor]] = [[] for _ in range(n_groups)]
    for i in layout.owned(rank):
        groups[layout.group_index[i]].append(layout.params[i])
    return groups


def _owned_state(
    optim_state: Mapping[torch.Tensor, Any],
    layout: _Layout,
    rank: int,
    key: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[int, dict[str, Any]]:
    """Live (not copied) state of this rank's params, keyed by global index.

    ``key`` maps a param to the tensor the optimizer's state is keyed by (its master, see
    [Note: Master weights]); the param itself when ``None``.
    """
    out: dict[int, dict[str, Any]] = {}
    for i in layout.owned(rank):
        p = layout.params[i]
        st = optim_state.get(p if key is None else key(p))
        if st:
            out[i] = dict(st)
    return out


def _validate_plain_state_dict(state_dict: Any, param_groups: Sequence[Mapping[str, Any]]) -> None:
    """Raises if ``state_dict`` is not a plain torch optimizer dict for these param groups."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_state_dict expects a dict with 'state' and 'param_groups' (the format of "
            f"torch.optim.Optimizer.state_dict()), got {type(state_dict).__name__}"
        )
    missing = {"state", "param_groups"} - set(state_dict)
    if missing:
        raise ValueError(
            f"optimizer state dict is missing {sorted(missing)}; got keys {sorted(state_dict)}. "
            f"Pass the dict returned by ShardedOptimizer.state_dict() after "
            f"consolidate_state_dict(), or by a plain torch optimizer's state_dict()."
        )
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, Sequence) or len(saved_groups) != len(param_groups):
        n = len(saved_groups) if isinstance(saved_groups, Sequence) else saved_groups
        raise ValueError(
            f"state dict has {n} param groups but this optimizer has {len(param_groups)}: it was "
            f"saved for a different model or param group layout."
        )
    saved_lens = [len(g["params"]) for g in saved_groups]
    lens = [len(g["params"]) for g in param_groups]
    if saved_lens != lens:
        raise ValueError(
            f"state dict param groups hold {saved_lens} params but this optimizer's hold {lens}: "
            f"it was saved for a different model or param group layout."
        )
    expected = list(range(sum(lens)))
    flat = [i for g in saved_groups for i in g["params"]]
    if sorted(flat) != expected:
        raise ValueError(
            f"state dict param indices must be 0..{len(expected) - 1} in param-group order, got "
            f"{flat[:10]}{'...' if len(flat) > 10 else ''}"
        )
    params = [p for g in param_groups for p in g["params"]]
    state = state_dict["state"]
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict['state'] must be a dict, got {type(state).__name__}")
    for key, entry in state.items():
        if not isinstance(key, int) or not 0 <= key < len(params):
            raise ValueError(
                f"state dict has a state entry for param {key!r} ({type(key).__name__}); expected "
                f"int indices in [0, {len(params)}). It was saved for a different model."
            )
        p = params[key]
        for name, value in dict(entry).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            # As many elements as the param: the same shape, exactly (see [Note: Load
            # validation]); other state (factored statistics) may broadcast against it.
            exact = value.numel() == p.numel()
            if (exact and value.shape != p.shape) or (
                not exact
                and value.dim() == p.dim()
                and any(a != b and a != 1 for a, b in zip(value.shape, p.shape, strict=True))
            ):
                raise ValueError(
                    f"state dict entry {key}[{name!r}] has shape {tuple(value.shape)} but "
                    f"param {key} has shape {tuple(p.shape)}: it was saved for a different "
                    f"model."
                )


def _local_load_dict(
    state_dict: Mapping[str, Any],
    layout: _Layout,
    rank: int,
    n_groups: int,
    current: Mapping[torch.Tensor, Any],
) -> dict[str, Any]:
    """The dict to feed the local optimizer's ``load_state_dict``.

    Tensors are cloned so the caller's dict is never aliased by live optimizer state; entries
    whose tensors are ``meta`` placeholders (params skipped at consolidation) keep this rank's
    current state.
    """
    groups = _local_groups(layout, rank, n_groups)
    index = layout.index_of()
    saved_groups = state_dict["param_groups"]
    # The saved dict may number params in any order inside a group: map by position.
    saved_flat = [i for g in saved_groups for i in g["params"]]
    state_in = state_dict["state"]
    local_state: dict[int, dict[str, Any]] = {}
    local_groups: list[dict[str, Any]] = []
    j = 0
    for gi, params in enumerate(groups):
        ids = []
        for p in params:
            g = saved_flat[index[id(p)]]
            entry = state_in.get(g)
            if entry is not None:
                if any(isinstance(v, torch.Tensor) and v.is_meta for v in entry.values()):
                    if current.get(p):
                        local_state[j] = dict(current[p])
                else:
                    local_state[j] = {
                        k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                        for k, v in entry.items()
                    }
            ids.append(j)
            j += 1
        local_groups.append({**_hyperparams(saved_groups[gi]), "params": ids})
    return {"state": local_state, "param_groups": local_groups}
