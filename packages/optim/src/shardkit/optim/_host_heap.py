"""Hands the host heap's free pages back to the operating system (glibc's ``malloc_trim``).

The CPU side of [Note: The parameters' old blocks go back] in ``_engine.py``: what
``torch.cuda.empty_cache()`` is to CUDA's caching allocator, ``malloc_trim(0)`` is to glibc's
``malloc``, which keeps freed blocks below the top of its heap resident for later requests.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

__all__ = ["release_host_heap"]

logger = logging.getLogger("shardkit.optim")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` (logged once) where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError) as exc:  # no such symbol, or no dlopen(NULL)
        logger.info(
            "shardkit.optim: the C library has no malloc_trim (%s: not glibc); memory the "
            "parameters' old blocks held stays with the allocator (logged once)",
            type(exc).__name__,
        )
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_host_heap() -> bool:
    """Returns the free pages of every glibc arena to the OS (``malloc_trim(0)``); whether the
    C library could (``False`` where it is not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
