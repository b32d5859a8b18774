"""CPU weights and KV cache in transparent huge pages (engine/kernels/huge_pages.py): the copies
hold the same values, land in 2 MiB pages where the kernel gives them (read back from
/proc/self/smaps), and their memory goes back with their last tensor."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine.kernels import huge_pages
from engine.kernels.quant import Int4Weight, quantize_int4

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not huge_pages.supported() or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages on this system",
)


def mapping_of(address: int) -> dict | None:
    """The /proc/self/smaps entry (its fields, in kB) of the mapping that holds `address`."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {} if start <= address < end else None
        elif entry is not None and line.split()[-1] == "kB":
            entry[head.rstrip(":")] = int(line.split()[1])
        elif entry is not None and head == "VmFlags:":
            entry["flags"] = line.split()[1:]
            return entry
    return entry


@needs_thp
def test_a_copy_holds_the_same_values_in_huge_pages():
    t = torch.randn(3 << 20)  # 12 MiB
    copy = huge_pages.Arena().copy(t)
    assert torch.equal(copy, t) and copy.data_ptr() != t.data_ptr()
    assert copy.data_ptr() % huge_pages.ALIGN == 0 and copy.is_contiguous()
    region = mapping_of(copy.data_ptr())
    assert "hg" in region["flags"]  # madvise(MADV_HUGEPAGE) took
    assert region["AnonHugePages"] >= 4096, region  # at least two whole 2 MiB pages


def test_small_tensors_and_other_devices_stay_where_they_are():
    arena = huge_pages.Arena()
    small = torch.ones(huge_pages.SMALL // 4 - 1)
    assert arena.copy(small) is small
    if torch.cuda.is_available():
        on_gpu = torch.ones(1 << 20, device="cuda")
        assert arena.copy(on_gpu) is on_gpu


@needs_thp
def test_tensors_share_a_mapping_and_it_goes_with_the_last_of_them():
    arena = huge_pages.Arena()
    a, b = arena.copy(torch.randn(1 << 18)), arena.copy(torch.randn(1 << 18))
    assert b.data_ptr() - a.data_ptr() == a.numel() * 4  # packed one after the other
    address = a.data_ptr()
    del a
    gc.collect()
    assert mapping_of(address) is not None  # b still lives in it
    del b, arena
    gc.collect()
    assert mapping_of(address) is None


@needs_thp
def test_a_tensor_larger_than_a_chunk_gets_a_mapping_of_its_own():
    arena = huge_pages.Arena()
    big = arena.copy(torch.zeros(huge_pages.CHUNK // 4 + 1))
    after = arena.copy(torch.ones(1 << 16))
    assert torch.equal(after, torch.ones(1 << 16)) and big.sum() == 0


def test_zeros_are_zero_in_any_dtype():
    arena = huge_pages.Arena()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        z = arena.zeros((1 << 10, 64), dtype)
        assert z.dtype == dtype and z.shape == (1 << 10, 64) and not z.any()


def test_a_quantized_weight_is_placed_whole():
    qw = quantize_int4(torch.randn(1024, 256), 32)
    placed = huge_pages.Arena().place(qw)
    assert isinstance(placed, Int4Weight) and placed.group_size == qw.group_size
    for before, after in zip(qw.tensors(), placed.tensors()):
        assert torch.equal(before, after)
    assert placed.packed.data_ptr() != qw.packed.data_ptr()  # 128 KiB: copied
    assert huge_pages.Arena().place("not a weight") == "not a weight"


@needs_thp
def test_a_cpu_model_reads_its_matrices_and_allocates_its_kv_cache_in_huge_pages(
    tiny_model_dir, monkeypatch
):
    from engine.models.llama import LlamaModel

    monkeypatch.setattr(huge_pages, "SMALL", 0)  # the tiny model's matrices are a few KiB each
    model = LlamaModel.from_pretrained(tiny_model_dir)
    for name in ("0.qkv", "0.gate_up", "embed"):
        assert "hg" in mapping_of(model.w[name].data_ptr())["flags"], name
    k, v = model.allocate_kv_cache(64, 16)[0]
    assert "hg" in mapping_of(k.data_ptr())["flags"] and not k.any() and not v.any()
