"""One allocation for the native products' packed weights (``lp_runner/backends/cpu/arena.py``), in huge pages
where asked (``advanced.huge_pages``).

Oracles: the tensors' own addresses (aligned, in order, disjoint, one storage); the kernel's view of the region
(``/proc/self/smaps``: the VMA that holds the weights marked eligible for transparent huge pages, or not); and the
packed model's logits, bit for bit those of the same model packed in ordinary pages. Whole generations against HF
greedy with the native kernel run in tests/test_prepack.py and tests/test_native_layers.py on the arena.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import FAMILIES

from lp_runner.backends.cpu import native
from lp_runner.backends.cpu.arena import ALIGN_BYTES, HUGE_PAGE_BYTES, Arena, thp_mode
from lp_runner.backends.cpu.backend import CpuBackend
from lp_runner.backends.cpu.prepack import (
    HUGE_PAGES_SUFFIX,
    KERNELS,
    PackedLinear,
    SharedInputProduct,
    apply_prepack,
    linear_kernels,
    native_unavailable_reason,
    prepack_linears,
)
from lp_runner.jobs.report import backend_lines
from lp_runner.models.loading import default_cache_dir

THP_MODE = thp_mode()
GRANTED = THP_MODE in ("madvise", "always")
NATIVE_REASON = native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir())


def thp_eligible(address: int) -> bool:
    """Whether the VMA holding ``address`` may take transparent huge pages (``THPeligible`` in smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a VMA's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no VMA holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_lie_in_order_aligned_and_apart_in_one_allocation(dtype: torch.dtype) -> None:
    shapes = [(3, 5, 32), (1,), (7, 9), (2, 576, 32), (0, 4), (31,)]
    arena = Arena(shapes, dtype)
    assert [tuple(t.shape) for t in arena.tensors] == shapes and all(t.dtype == dtype for t in arena.tensors)
    assert all(t.is_contiguous() for t in arena.tensors)
    storage = arena.tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in arena.tensors if t.numel())
    assert arena.tensors[0].data_ptr() % HUGE_PAGE_BYTES == 0  # the region starts on a huge page
    ends = 0
    for t in (t for t in arena.tensors if t.numel()):  # torch gives an empty tensor no address
        assert t.data_ptr() % ALIGN_BYTES == 0 and t.data_ptr() >= ends, "each after the last, on a cache line"
        ends = t.data_ptr() + t.numel() * t.element_size()
    for i, t in enumerate(arena.tensors):  # disjoint: each keeps what was written into it
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(arena.tensors))


@pytest.mark.skipif(not GRANTED, reason=f"transparent huge pages: {THP_MODE}")
def test_the_region_is_asked_for_huge_pages_only_when_told() -> None:
    shapes = [(4, 1024, 32)] * 8  # 4 MB
    huge, plain = Arena(shapes, torch.float32, huge=True), Arena(shapes, torch.float32)
    assert huge.huge_pages and not plain.huge_pages
    assert thp_eligible(huge.tensors[0].data_ptr()) and thp_eligible(huge.tensors[-1].data_ptr())
    if THP_MODE == "madvise":  # "always" makes every large region eligible, asked or not
        assert not thp_eligible(plain.tensors[0].data_ptr())


@pytest.mark.skipif(NATIVE_REASON is not None, reason=f"no native kernel: {NATIVE_REASON}")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_native_model_packs_into_one_region_in_module_order_with_the_same_bits(tiny, family: str) -> None:
    """Every packed weight in one storage, in the order the model's modules (its forward) use them; the logits
    bit for bit those of the model packed in ordinary pages (where the weights lie changes no arithmetic)."""
    huge, plain = copy.deepcopy(tiny(family)), copy.deepcopy(tiny(family))
    prepack_linears(huge, kernel=KERNELS["native"], huge_pages=True)
    prepack_linears(plain, kernel=KERNELS["native"])
    packed = [m.packed_weight for m in huge.modules() if isinstance(m, (PackedLinear, SharedInputProduct))]
    assert len(packed) > 2 and len({w.untyped_storage().data_ptr() for w in packed}) == 1
    assert [w.data_ptr() for w in packed] == sorted(w.data_ptr() for w in packed)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 8, 17):
            ids = torch.randint(0, huge.config.vocab_size, (1, rows), generator=gen)
            assert torch.equal(huge(ids).logits, plain(ids).logits), f"{family}, {rows} rows"


def test_an_opaque_layout_packs_each_weight_on_its_own(tiny) -> None:
    """oneDNN's reordered weights are opaque tensors: no arena, each its own (as before)."""
    model = copy.deepcopy(tiny("llama"))
    prepack_linears(model, kernel=KERNELS["onednn"])
    packed = [m.packed_weight for m in model.modules() if isinstance(m, (PackedLinear, SharedInputProduct))]
    assert len(packed) > 2 and KERNELS["onednn"].packed_shape is None


@pytest.mark.skipif(NATIVE_REASON is not None, reason=f"no native kernel: {NATIVE_REASON}")
def test_huge_pages_are_off_unless_asked_and_named_where_granted(tiny) -> None:
    """``advanced.huge_pages``: off by default (no suffix, no note); asked, the kernels' name (the calibration and
    compile records' key) and the summary say so, or say why not (oneDNN's opaque weights, a THP mode of never)."""
    default = apply_prepack(copy.deepcopy(tiny("llama")), "native")
    assert not default.huge_pages and not default.kernels.endswith(HUGE_PAGES_SUFFIX)
    assert "huge pages" not in backend_lines({"backend": CpuBackend(default).describe()})[0]
    model = copy.deepcopy(tiny("llama"))
    asked = apply_prepack(model, "native", huge_pages=True)
    assert asked.huge_pages == GRANTED and asked.kernels.endswith(HUGE_PAGES_SUFFIX) == GRANTED
    assert linear_kernels(model) == asked.kernels
    line = backend_lines({"backend": CpuBackend(asked).describe()})[0]
    assert line.endswith("; weights in huge pages" if GRANTED else f"(THP: {THP_MODE})")
    opaque = apply_prepack(copy.deepcopy(tiny("llama")), "onednn", huge_pages=True)
    assert not opaque.huge_pages and opaque.huge_pages_note == "oneDNN-prepacked's weights are opaque tensors"
    assert backend_lines({"backend": CpuBackend(opaque).describe()})[0].endswith(
        "; huge pages asked, not granted (oneDNN-prepacked's weights are opaque tensors)"
    )


def reference_pack(weight: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """``native.pack``'s layout as first written (a padded copy, then a contiguous permutation): the oracle for
    packing straight into a slot."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // 32)
    padded = torch.zeros(blocks * 32, in_features, dtype=storage)
    padded[:out_features] = weight.to(storage)
    if storage == torch.float32:
        return padded.view(blocks, 32, in_features).transpose(1, 2).contiguous()
    return padded.view(blocks, 2, 16, in_features).permute(0, 3, 2, 1).contiguous().view(blocks, in_features, 32)


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [1, 31, 32, 33, 96, 100])
def test_packing_into_a_slot_gives_the_layout_bit_for_bit(storage: torch.dtype, out_features: int) -> None:
    weight = torch.randn(out_features, 24, generator=torch.Generator().manual_seed(out_features))
    expected = reference_pack(weight, storage)
    assert torch.equal(native.pack(weight, storage), expected)
    arena = Arena([native.packed_shape(out_features, 24)] * 2, storage)
    arena.tensors[1].fill_(7)  # a neighbouring slot stays untouched
    assert native.pack(weight, storage, arena.tensors[0]) is arena.tensors[0]
    assert torch.equal(arena.tensors[0], expected) and bool((arena.tensors[1] == 7).all())
    with pytest.raises(ValueError, match="needs a contiguous"):
        native.pack(weight, storage, torch.empty(native.packed_shape(out_features + 32, 24), dtype=storage))
