"""Copy-on-write consolidation: the recipient's own shard is aliased, not copied, when safe."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from shardkit.optim._torch_compat import _storage_use_count

__all__: list[str] = []

# [Note: Copy-on-write consolidation]
# On the recipient, the consolidated dict's entries for this rank's own CPU state are views of
# the live state tensors, not copies: copying them into fresh memory was the largest part of a
# consolidation (first-touch page faults on a full shard). The dict must still be a snapshot
# (otherwise a checkpoint saved after the next step would mix this rank's new state with the
# other ranks' old state), so every ShardedOptimizer method that is about to modify the state
# (`_step_local`, hence `step` and the comm hooks; `_rebuild`; `load_state_dict`) first calls
# `resolve`: for each aliased tensor still in the optimizer's state, if anything beyond what
# existed before the consolidation still shares its storage (the user's dict, or a view of one
# of its tensors), the optimizer's state gets a private clone and the old storage is left to the
# snapshot; if nothing does (the dict was saved and dropped: the usual case), nothing is copied at
# all. "Anything beyond" is measured by the storage's reference count
# (`_torch_compat._storage_use_count`), recorded before the aliases are made; while aliases are
# pending the first record is kept, so a second consolidation cannot raise the baseline. Where
# the count is unavailable the tensor is copied at consolidation as before. State modified
# outside ShardedOptimizer's methods (e.g. writing into `opt.optim.state` by hand) is not seen.


class _CopyOnWrite:
    """Pending aliases of live state: id(tensor) -> (param, key, tensor, storage use count)."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[torch.Tensor, str, torch.Tensor, int]] = {}

    @property
    def pending(self) -> bool:
        """Whether some consolidated dict may alias live state."""
        return bool(self._records)

    def record(
        self,
        local: Mapping[int, Mapping[str, Any]],
        skipped: set[int],
        params: Sequence[torch.Tensor],
    ) -> set[int]:
        """Records the live tensors of ``local`` that may be aliased; returns their ids.

        Args:
            local: this rank's live state by global index (``_owned_state``).
            skipped: global indices whose state is not consolidated.
            params: every param, by global index.
        """
        aliased: set[int] = set()
        for idx, st in local.items():
            if idx in skipped:
                continue
            for key, t in st.items():
                if (
                    not isinstance(t, torch.Tensor)
                    or t.device.type != "cpu"
                    or not t.is_contiguous()
                    or t.numel() == 0
                ):
                    continue
                if id(t) not in self._records:
                    count = _storage_use_count(t)
                    if count is None:
                        continue
                    self._records[id(t)] = (params[idx], key, t, count)
                aliased.add(id(t))
        return aliased

    def resolve(self, optim_state: Mapping[torch.Tensor, Any]) -> None:
        """Gives live state a private clone wherever a snapshot still shares its storage.

        The caller drops its own references to the consolidated dict first.
        """
        for param, key, t, count in self._records.values():
            st = optim_state.get(param)
            if st is None or st.get(key) is not t:
                continue  # no longer live state: nothing will modify it
            if _storage_use_count(t) != count:
                st[key] = t.clone()
        self._records.clear()
