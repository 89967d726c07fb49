"""glibc's heap, which keeps memory that Python and torch have freed: return it to the system
before measuring what a process holds, and map large blocks while building a partitioned model
so that freeing them gives them back. Elsewhere than glibc (macOS, musl) these do nothing."""

from __future__ import annotations

import ctypes
import functools

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_DEFAULT_MAX_THRESHOLD = 32 << 20  # how far glibc may raise the threshold by itself (64-bit)


@functools.cache
def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (RSS then counts what is in use)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def map_allocations_from(nbytes: int | None) -> None:
    """Allocations of `nbytes` and more get their own mapping, returned to the system when freed;
    None restores glibc's usual ceiling (it then adapts the threshold itself again)."""
    if (libc := _glibc()) is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _DEFAULT_MAX_THRESHOLD if nbytes is None else nbytes)
