"""``memory_sample`` / ``reset_peak_memory``: resident memory and its peak, as a user sees it."""

from __future__ import annotations

import pytest
import torch
from shardkit.testing import memory_sample, reset_peak_memory

_MIB = 1 << 20


def test_peak_follows_touched_memory_and_resets() -> None:
    if not reset_peak_memory():
        pytest.skip("the kernel refuses to reset VmHWM here (/proc/self/clear_refs)")
    before = memory_sample()
    assert before.rss >= before.rss_anon > 0 and before.rss_file > 0
    assert before.peak_rss >= before.rss
    big = torch.ones(64 * _MIB // 4)  # 64 MiB, touched: above glibc's mmap threshold
    during = memory_sample()
    assert during.rss - before.rss >= 60 * _MIB
    assert during.rss_anon - before.rss_anon >= 60 * _MIB
    del big  # an mmapped block goes back to the kernel when freed
    after = memory_sample()
    assert after.peak_rss - before.rss >= 60 * _MIB  # the peak remembers it
    assert after.rss < during.rss
    assert after.cuda_allocated is None and after.cuda_peak_reserved is None
    assert reset_peak_memory()
    assert memory_sample().peak_rss - after.rss < 8 * _MIB


@pytest.mark.cuda
def test_cuda_figures() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    reset_peak_memory(device)
    base = memory_sample(device)
    t = torch.empty(16 * _MIB, dtype=torch.uint8, device=device)
    del t
    s = memory_sample(device)
    assert s.cuda_peak_allocated is not None and base.cuda_allocated is not None
    assert s.cuda_peak_allocated - base.cuda_allocated >= 16 * _MIB
    assert s.cuda_peak_reserved is not None and s.cuda_peak_reserved >= s.cuda_peak_allocated
    reset_peak_memory(device)
    assert memory_sample(device).cuda_peak_allocated == s.cuda_allocated
