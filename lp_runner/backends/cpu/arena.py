"""One allocation for the native products' packed weights, in transparent huge pages when asked
(``advanced.huge_pages``).

Why one allocation: the weights lie in the order a forward reads them, and a region asked for 2 MB pages wastes at
most one page (2 MB pages per tensor round each up: 663 MB for the embedded model's 538 MB, measured before).

Why huge pages: a one-row forward streams every weight, and in 4 KB pages the embedded model's 538 MB are 131,000
address translations a forward. Asked for 2 MB pages (``madvise(MADV_HUGEPAGE)`` before any page is touched;
Linux's default THP mode, ``madvise``, gives them only to regions that ask), the one-row forward ran 1.04-1.19x
faster on a 2-core x86 virtual machine and 8 rows 1.01-1.05x, bits equal (``benchmarks/weight_pages.py``;
``docs/results.md``, "The packed weights in huge pages").

Why not by default: on that same VM, fresh 2 MB pages cost about 5-15 ms each to fault in (presumably the host
backs them anew, free memory in 2 MB blocks having gone back to it, while 4 KB pages reuse what the load has just
freed): 2.6-3.6 s to pack the embedded model, against 0.4-0.5 s in 4 KB pages, and the README's one-prompt
command ran 1.35x longer. The gain is per forward and the cost once a process, so long jobs ask for them
(``advanced.huge_pages: true``).
A small probe at start-up could not tell the two cases apart: the first few huge pages came from recently freed
blocks and faulted as fast as 4 KB pages (1.5 ms per 2 MB), the next hundreds did not.
"""

from __future__ import annotations

import ctypes
import sys

import torch

ALIGN_BYTES = 64  # each tensor starts on a cache line (the kernels load whole vectors)
HUGE_PAGE_BYTES = 2 << 20  # x86-64's and most arm64 kernels' transparent huge page
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux (every architecture)


def _ask_huge_pages(address: int, length: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on [address, address + length): whether the OS accepted (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def thp_mode() -> str:
    """The OS's transparent huge page mode (``always``, ``madvise`` or ``never``), or why there is none."""
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        with open(path) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "none here" if not sys.platform.startswith("linux") else f"unknown ({path} unreadable)"


class Arena:
    """Uninitialized tensors of ``shapes``, one after the other in a single CPU allocation, each starting on an
    ``ALIGN_BYTES`` boundary; asked for transparent huge pages (before any page is touched) when ``huge``.
    ``huge_pages``: whether the OS accepted. The tensors keep the allocation alive."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, huge: bool = False) -> None:
        item = torch.empty((), dtype=dtype).element_size()
        step = ALIGN_BYTES // item
        sizes = [int(torch.Size(shape).numel()) for shape in shapes]
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end += -(-size // step) * step
        pages = -(-end * item // HUGE_PAGE_BYTES)  # the region, in whole huge pages
        flat = torch.empty((pages + 1) * HUGE_PAGE_BYTES // item, dtype=dtype)  # + 1: room to align its start
        start = (-flat.data_ptr() % HUGE_PAGE_BYTES) // item  # malloc aligns to the element size at least
        self.huge_pages = huge and end > 0 and _ask_huge_pages(flat.data_ptr() + start * item, pages * HUGE_PAGE_BYTES)
        self.tensors = [
            flat[start + o : start + o + size].view(shape)
            for o, size, shape in zip(offsets, sizes, shapes, strict=True)
        ]
