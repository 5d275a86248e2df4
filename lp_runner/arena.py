"""One allocation, in transparent huge pages where the OS gives them, for the native products' packed weights.

Why: a CPU forward of this project's models streams every weight once, and in 4 KB pages the stream pays for the
address translation of 131,000 pages (the embedded model's 538 MB), on a virtual machine through two levels of
page tables. Asked for 2 MB pages (``madvise(MADV_HUGEPAGE)``; Linux's default THP mode, ``madvise``, gives them
only to regions that ask), the same weights take 270 translations. Measured on this project's EPYC (Zen 4, 2
threads, KVM guest; ``docs/results.md``, "The packed weights in huge pages"): the one-row forward 1.06-1.27x
faster, the 8-row forward 0.99-1.08x, bits equal. One allocation for all of a model's weights, because 2 MB pages
per tensor round every tensor up to whole pages (663 MB for 538 MB of weights, measured before); one region wastes
at most one page.

Where the OS refuses (not Linux, THP ``never``, a madvise error) the weights lie in ordinary pages, as before: same
bits, same memory. ``Arena.huge_pages`` says which.
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


class Arena:
    """Uninitialized tensors of ``shapes``, one after the other in a single CPU allocation, each starting on an
    ``ALIGN_BYTES`` boundary, the allocation asked for transparent huge pages (before any page is touched) unless
    ``huge_pages`` is off (benchmarks/weight_pages.py compares the two). The tensors keep the allocation alive."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, huge_pages: bool = True) -> None:
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
        self.huge_pages = (
            huge_pages and end > 0 and _ask_huge_pages(flat.data_ptr() + start * item, pages * HUGE_PAGE_BYTES)
        )
        self.tensors = [
            flat[start + o : start + o + size].view(shape)
            for o, size, shape in zip(offsets, sizes, shapes, strict=True)
        ]
