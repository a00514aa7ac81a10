"""How much of the machine's memory is left, for work that must stop before the kernel's OOM
killer ends the whole process without a word (``psgrad simulate``, which holds every rank).

``short_of(needed)``:
1. Reads MemAvailable and MemTotal from /proc/meminfo (Linux); elsewhere it never says short.
2. Short means that after ``needed`` more bytes less would be left than the floor: the larger of
   256 MiB and 3 % of the machine's memory.
"""

from __future__ import annotations

FLOOR_BYTES = 256 << 20
FLOOR_SHARE = 0.03
_PAGE = 4096


def available_memory() -> tuple[int, int] | None:
    """(available, total) bytes of this machine's memory, or None where /proc/meminfo has none."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) << 10, int(fields["MemTotal"].split()[0]) << 10
    except (OSError, KeyError, ValueError):
        return None


def short_of(needed: int = 0) -> tuple[int, int] | None:
    """(available, total) bytes when ``needed`` more bytes would leave less than the floor, else None."""
    memory = available_memory()
    if memory is None:
        return None
    available, total = memory
    return memory if available - needed < max(FLOOR_BYTES, FLOOR_SHARE * total) else None


def resident() -> int:
    """This process's resident bytes (/proc/self/statm), or 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
