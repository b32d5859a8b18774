"""CPU weights and KV cache in 2 MiB pages (Linux transparent huge pages, asked for with
`madvise(MADV_HUGEPAGE)`): a decode step streams every weight once, and in 4 KiB pages that is one
TLB miss per 4 KiB read, each a page walk (in a virtual machine a walk through two page tables).
Measured on a 2-vCPU Intel Xeon VM (AMX, 480 MB L3; docs/performance.md, 2026-12-05 eighth
session): the GGUF model's 121 matrices streamed 1.25-1.3× faster from huge pages, and a batch-1
decode step took 5.2-5.4 ms instead of 6.1-6.2. Where the system gives no huge pages (THP off,
another OS) the memory is ordinary pages and nothing else changes."""

from __future__ import annotations

import dataclasses
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK = 16 << 20  # bytes mapped at a time; a larger tensor gets a mapping of its own size
SMALL = 64 << 10  # smaller tensors (norms, biases) stay where they are: too few pages to matter
ALIGN = 64  # every tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def supported() -> bool:
    """Whether this Python can ask the OS for huge pages (Linux; the kernel may still say no)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def describe() -> str:
    """Which pages the CPU weights and KV cache get here, for a benchmark's conditions."""
    try:
        setting = THP_SETTING.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        setting = None
    setting = setting or "none"
    pages = "4 KiB" if not supported() or setting in ("none", "never") else "2 MiB"
    return f"CPU weights and KV cache in {pages} pages (transparent huge pages: {setting})"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory, uint8, starting on a 2 MiB boundary, advised as huge pages (an
    anonymous mapping: pages are given, zeroed, when first touched). It lives while any tensor
    made from it does."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start : start + nbytes]


class Arena:
    """CPU tensors packed one after another in huge-page mappings of CHUNK bytes (a bump
    allocator: nothing is freed alone; a mapping goes when no tensor in it is left, so one arena
    holds tensors that live and die together: one model's weights, one KV cache). A mapping per
    tensor would leave most of a 2 MiB page unused after each."""

    def __init__(self) -> None:
        self._free = torch.empty(0, dtype=torch.uint8)

    def _take(self, nbytes: int) -> torch.Tensor:
        if self._free.numel() < nbytes:
            self._free = mapping(max(CHUNK, _round_up(nbytes, HUGE_PAGE)))
        taken = self._free[:nbytes]
        self._free = self._free[min(_round_up(nbytes, ALIGN), self._free.numel()) :]
        return taken

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in huge pages (torch.zeros where that cannot help), its pages touched
        now, as torch.zeros touches them: the memory is taken at start, not at first use."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not supported() or nbytes < SMALL:
            return torch.zeros(shape, dtype=dtype)
        return self._take(nbytes).view(dtype).view(shape).zero_()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `t` in huge pages; `t` itself where that cannot help (not on the
        CPU, small, or no huge pages here)."""
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or not supported() or nbytes < SMALL:
            return t
        out = self._take(nbytes).view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def place(self, weight):
        """A tensor, or a dataclass of tensors (a quantized weight), with its tensors copied into
        huge pages; anything else as it is."""
        if isinstance(weight, torch.Tensor):
            return self.copy(weight)
        if dataclasses.is_dataclass(weight) and not isinstance(weight, type):
            tensors = {
                f.name: self.copy(getattr(weight, f.name))
                for f in dataclasses.fields(weight)
                if isinstance(getattr(weight, f.name), torch.Tensor)
            }
            return dataclasses.replace(weight, **tensors)
        return weight
