"""Keep freed memory in the process, so a training step does not fault its pages in anew.

A training step allocates and frees the same activations, gradients and messages every step. With
glibc's default malloc, a buffer over the mmap threshold (128 KiB, raised on the fly up to 32 MiB)
is mapped fresh from the kernel when allocated and unmapped when freed, and free memory at the top
of the heap goes back to the kernel beyond 128 KiB; either way the next step faults every page of
it in again. On the 2-core development VM this cost WRN-10-1 on batches of 128 a quarter of its
speed (6.2-7.7 against 9.2-9.7 it/s) and doubled the system time of a WRN-16-4 ``psgrad bench``
run (100 s against 48); psgrad's ranks, which also code and frame messages, lost more than DDP
did (docs/benchmarks.md).

``keep_freed_memory``:
1. Does nothing when the C library has no ``mallopt`` (not glibc), when ``PSGRAD_MALLOC=system``
   (``keep``, the default, tunes), or when the user already chose: a ``MALLOC_*_`` variable,
   ``GLIBC_TUNABLES``, or another allocator in ``LD_PRELOAD`` (jemalloc, tcmalloc).
2. Sets the mmap threshold to 1 GiB (32 MiB, the most older glibc accepts, if refused): buffers come
   from the heap, and a freed one is reused by the next allocation of its size.
3. Sets the trim threshold to 1 GiB: free memory at the heap's top stays unless it exceeds that.
The cost: the process keeps its peak memory until it exits. It is done once per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import warnings

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GIB = 1 << 30
_OLD_GLIBC_MMAP_MAX = 32 << 20

_state: str | None = None


def user_choice(environ: dict[str, str] | os._Environ) -> str | None:
    """Why malloc is left as it is, if the environment says so; None when psgrad may tune it.
    ``PSGRAD_MALLOC`` other than ``keep``, ``system`` or empty warns and counts as ``keep``."""
    setting = environ.get("PSGRAD_MALLOC", "")
    if setting == "system":
        return "PSGRAD_MALLOC=system"
    if setting not in ("", "keep"):
        warnings.warn(f"PSGRAD_MALLOC must be keep or system, got {setting!r}: keeping freed memory", stacklevel=2)
    tuned = sorted(k for k in environ if k.startswith("MALLOC_") and k.endswith("_"))
    if tuned:
        return f"{tuned[0]} is set"
    if environ.get("GLIBC_TUNABLES"):
        return "GLIBC_TUNABLES is set"
    if environ.get("LD_PRELOAD"):
        return "LD_PRELOAD is set"
    return None


def keep_freed_memory() -> str:
    """Tune glibc's malloc for repeated training steps (see the module docstring); what was done."""
    global _state
    if _state is None:
        _state = _tune()
    return _state


def _tune() -> str:
    reason = user_choice(os.environ)
    if reason is not None:
        return f"left as it is: {reason}"
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return "left as it is: the C library has no mallopt"
    if not libc.mallopt(_M_MMAP_THRESHOLD, _GIB) and not libc.mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_MMAP_MAX):
        return "left as it is: mallopt refused the mmap threshold"
    libc.mallopt(_M_TRIM_THRESHOLD, _GIB)
    return "freed memory is kept"
