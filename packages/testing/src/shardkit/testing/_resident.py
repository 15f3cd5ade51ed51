"""Memory as a user sees it: the resident set of this process (and CUDA's allocator peaks).

``live_storages`` counts what is alive; a user sees what the process keeps: on CPU the resident
set (what ``top`` and the OOM killer see), on CUDA the caching allocator's reserved memory
(what ``nvidia-smi`` shows). An allocator keeps pages that were freed (glibc does not return
most freed heap blocks to the kernel; CUDA's caching allocator keeps every block), so a
program that frees and allocates large buffers every step holds more than its live tensors.
:func:`memory_sample` reads both, :func:`reset_peak_memory` starts a new peak, so the peak
*during* one phase (a backward, a step) can be measured, not only what is alive after it.

Linux only (``/proc/self/status``; the peak reset needs Linux 4.0 or later).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MemorySample", "memory_sample", "reset_peak_memory"]

_FIELDS = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "rss_anon", "RssFile": "rss_file"}


@dataclass(frozen=True)
class MemorySample:
    """This process's memory at one instant, in bytes (see :func:`memory_sample`)."""

    rss: int
    """Resident set size now (``VmRSS``)."""
    peak_rss: int
    """Peak resident set size since the process started or the last :func:`reset_peak_memory`
    (``VmHWM``)."""
    rss_anon: int
    """Resident anonymous memory (``RssAnon``): the heap, mapped buffers, stacks."""
    rss_file: int
    """Resident file-backed memory (``RssFile``): the pages of the libraries and files mapped,
    which grow as code runs for the first time."""
    cuda_allocated: int | None = None
    """``torch.cuda.memory_allocated(device)`` (``None`` without a CUDA device)."""
    cuda_reserved: int | None = None
    """``torch.cuda.memory_reserved(device)``: what the caching allocator holds."""
    cuda_peak_allocated: int | None = None
    """``torch.cuda.max_memory_allocated(device)`` since the last reset."""
    cuda_peak_reserved: int | None = None
    """``torch.cuda.max_memory_reserved(device)`` since the last reset."""


def _cuda(device: torch.device | str | int | None) -> torch.device | None:
    if device is None:
        return None
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return dev if dev.type == "cuda" else None


def memory_sample(device: torch.device | str | int | None = None) -> MemorySample:
    """Reads this process's resident memory, and CUDA's allocator figures for ``device``.

    Args:
        device: a CUDA device to read ``memory_allocated`` / ``memory_reserved`` and their
            peaks for; ``None`` or a CPU device reads the resident set only.

    Raises:
        RuntimeError: not on Linux (no ``/proc/self/status``).
    """
    values: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _FIELDS:
                    values[_FIELDS[key]] = int(rest.split()[0]) * 1024  # kB
    except OSError as exc:
        raise RuntimeError(
            f"memory_sample reads /proc/self/status, which this system does not have ({exc}); "
            f"resident memory is measured on Linux only"
        ) from exc
    missing = sorted(set(_FIELDS.values()) - set(values))
    if missing:
        raise RuntimeError(f"/proc/self/status has no {missing} (Linux 4.5 or later has them)")
    cuda = _cuda(device)
    if cuda is not None:
        values.update(
            cuda_allocated=torch.cuda.memory_allocated(cuda),
            cuda_reserved=torch.cuda.memory_reserved(cuda),
            cuda_peak_allocated=torch.cuda.max_memory_allocated(cuda),
            cuda_peak_reserved=torch.cuda.max_memory_reserved(cuda),
        )
    return MemorySample(**values)


def reset_peak_memory(device: torch.device | str | int | None = None) -> bool:
    """Starts a new peak: ``VmHWM`` becomes the current resident set (writing ``5`` to
    ``/proc/self/clear_refs``), and CUDA's peak statistics of ``device`` are reset.

    Returns:
        Whether the resident peak was reset (``False`` where the kernel refuses it, before
        Linux 4.0 or under a restrictive sandbox; ``peak_rss`` then stays the process's peak).
    """
    cuda = _cuda(device)
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(cuda)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
