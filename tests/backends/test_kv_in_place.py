"""Every round writes the K/V arena in place: only the round's rows, into the arena's own memory, compiled or eager.

Why it needs its own test: every layer's keys and values are views of one arena tensor (``kv_cache.KVArena``).
Were the compiler unable to prove those views disjoint, or a K/V write lowered out of place, every round would
copy whole layers (on a GPU an 8B model's whole arena per round) and its output would stay exact: no exactness
test would see it. Checks:

* compiled (``torch.compile``, as on a GPU minus the capture): inductor's generated code for the round
  (``torch._inductor.utils.run_and_get_code``, which also hands over code loaded from inductor's caches) read
  by ``read_round_code``: no buffer, extern operand or kernel loop the size of the arena's capacity, and each K/V
  view written by a kernel that stores into that graph input itself (the ``index_copy`` of ``ArenaLayer.update``);
* compiled, a second and independent check: the round's time on two arenas 8x apart in capacity (same rows, same
  live width) does not grow with the capacity;
* eager: the arena keeps its address, each layer's K/V reaches it through ``index_copy_`` of the round's rows
  into a view of it, and no copy into it and no tensor made during the round is as large as a layer.

Negative control: ``whole_layer_update`` writes the same K/V but rewrites every slot of each layer (a select over
the whole capacity, as a round that copies whole layers would); every check above must report it, so none passes
vacuously. The model's rounds read the live K/V width (its attention is taken by keyword), so on this path no
per-round work may scale with the capacity at all. The compiling tests are slow (some 20 s each on two cores).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from helpers import job_region, one_round, random_prompt, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.kv_cache import ArenaLayer, KVArena

ROWS, PREFIX = 8, 40  # the timed round: 8 rows after 40 cached positions (one bucket, one K/V width)
SMALL, LARGE = 32_768, 262_144  # arena capacities 8x apart (each plus the bucketed adapter's spare slots)
REPEATS = 15  # timed rounds per arena, alternating between the two so a change in the machine's load hits both
SLOWER = 2.0  # the larger arena's round may take at most this many times the smaller's (a whole-layer copy: ~10x)


# ------------------------------------------------------------------------------------------- generated code


@dataclass
class RoundCode:
    """What the generated code of a round does with the K/V arena (``read_round_code``)."""

    capacity_symbols: set[str]  # the symbols bound to the arena's capacity
    kv_inputs: list[str]  # the graph inputs that are K/V views of the arena (keys and values of every layer)
    whole_arena: list[str] = field(default_factory=list)  # lines whose work has the size of the capacity
    writers: dict[str, list[str]] = field(default_factory=dict)  # K/V input -> kernels that store into it


def _between(code: str, start: str, end: str) -> str:
    return code[code.index(start) : code.index(end, code.index(start))]


def _names(expression: str, names: set[str]) -> bool:
    """True when ``expression`` mentions one of ``names`` (whole words: ``s3`` is not in ``s39``)."""
    return any(re.search(rf"\b{name}\b", expression) for name in names)


def _arguments(call: str) -> list[str]:
    """A call's top-level arguments: ``f(a, g(b, c), 2*s6)`` -> [a, g(b, c), 2*s6]."""
    inner, out, depth, current = call[call.index("(") + 1 : call.rindex(")")], [], 0, ""
    for ch in inner:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    return [*out, current.strip()] if current.strip() else out


def read_round_code(code: str, capacity: int) -> RoundCode:
    """Read inductor's generated module for the round (a CPU's: a Python ``call`` running C++ kernels).

    The capacity is a symbol there (``dynamic=True``; only the arena's other dimensions are static), bound in
    ``call`` from an input (``s39 = arg20_1``) whose example value the benchmark harness writes (``arg20_1 =
    1280``): those symbols name the capacity. K/V inputs are the inputs the harness builds with a capacity
    dimension (``arg21_1 = torch.as_strided(_shared_storage_8, (1, 2, s39, 16), ...)``). Reported as whole-arena
    work: an allocation (``empty_strided_cpu``) or an extern operand (``reinterpret_tensor``) whose sizes name the
    capacity, a K/V input handed whole to anything but a kernel, and a kernel loop whose bound names the capacity
    (``for(... x0<static_cast<int64_t>(32L*ks1) ...)`` where the call passes ``s39`` as ``ks1``). A kernel stores
    into a K/V input where the call passes it as an ``out_ptr`` or ``in_out_ptr``."""
    body = _between(code, "    def call(self, args):", "\n        return ")
    harness = _between(code, "def get_args():", "\n    return ")
    example = dict(re.findall(r"^\s+(arg\d+_1) = (\d+)$", harness, re.M))
    symbols = {s for s, arg in re.findall(r"^\s+(s\d+) = (arg\d+_1)$", body, re.M) if example.get(arg) == str(capacity)}
    kv = [
        arg
        for arg, size in re.findall(r"^\s+(arg\d+_1) = torch\.as_strided\(\w+, \(([^)]*)\)", harness, re.M)
        if _names(size, symbols)
    ]
    kernels = {
        name: source
        for name, source in re.findall(
            r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[.*?\], r'''(.*?)'''\)", code, re.M | re.S
        )
    }
    read = RoundCode(symbols, kv, writers={arg: [] for arg in kv})
    for line in body.splitlines()[2:]:  # past the unpacking of the arguments
        line = line.strip()
        if line.startswith(("del ", "#")) or re.fullmatch(r"s\d+ = arg\d+_1", line):
            continue
        name = line.split("(", 1)[0]
        if name in kernels:
            params = [
                p.split()[-1].lstrip("*") for p in _arguments(re.search(r"kernel\((.*?)\)", kernels[name], re.S)[0])
            ]
            passed = dict(zip(params, _arguments(line), strict=True))
            sized = {p for p, arg in passed.items() if _names(arg, symbols)}
            bounds = re.findall(r"for\(int64_t \w+=.*?<static_cast<int64_t>\((.*?)\);", kernels[name])
            if not bounds:  # every kernel loops: none read means this reading no longer fits inductor's C++
                raise ValueError(f"no loop bound read in {name}")
            for bound in bounds:
                if _names(bound, sized):
                    read.whole_arena.append(f"{line}  # loops to {bound}")
            for param, arg in passed.items():
                if arg in read.writers and param.startswith(("out_ptr", "in_out_ptr")):
                    read.writers[arg].append(name)
            continue
        sizes = re.findall(r"(?:empty_strided_\w+|reinterpret_tensor)\((?:\w+, )?\(([^)]*)\)", line)
        operands = re.sub(r"reinterpret_tensor\(\w+, ", "", line)
        if any(_names(size, symbols) for size in sizes) or _names(operands, set(kv)):
            read.whole_arena.append(line)
    return read


def _compiled_round_code(adapter: ModelAdapter) -> str:
    """The generated code of ``adapter``'s round, compiled by its warm-up (one compilation serves every shape).
    ``benchmark_harness`` is inductor's default, set here because ``read_round_code`` reads its example inputs."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    with config.patch(benchmark_harness=True):
        _, codes = run_and_get_code(adapter.compile, [64])  # resets dynamo first: the round compiles here
    assert len(codes) == 1  # one compiled graph: the whole round (``fullgraph``), no backward
    return codes[0]


def _check_code(adapter: ModelAdapter) -> RoundCode:
    """``read_round_code`` of the adapter's compiled round, asserting it found the capacity and every K/V view."""
    code = _compiled_round_code(adapter)
    with adapter.arena() as arena:  # the arena the warm-up compiled the round on
        pass
    read = read_round_code(code, arena.capacity)
    layers = len(arena.layers())
    assert len(read.capacity_symbols) == 1 and len(read.kv_inputs) == 2 * layers  # the reading found the arena
    return read


# ------------------------------------------------------------------------------------------------- timing


def _round_seconds(adapter: ModelAdapter, capacities: tuple[int, ...]) -> list[float]:
    """Median seconds of one round (``ROWS`` rows after ``PREFIX`` cached positions, the same K/V width) on a
    fresh arena of each capacity, rounds alternating between the arenas."""
    ids, positions = torch.tensor(random_prompt(ROWS, seed=2)), torch.arange(PREFIX, PREFIX + ROWS)
    regions = []
    with contextlib.ExitStack() as stack:
        for capacity in capacities:  # the job arena, then arenas of their own (a second holder's), none growable
            arena = stack.enter_context(adapter.arena([capacity // 2 + 1]))
            assert arena.capacity > capacity // 2 and not arena.growable
            region = arena.region(PREFIX + 2 * ROWS)
            prefix = torch.tensor(random_prompt(PREFIX, seed=1))
            one_round(adapter, prefix, torch.arange(PREFIX), causal(PREFIX), region, torch.tensor([PREFIX - 1]))
            regions.append(region)
        seconds: list[list[float]] = [[] for _ in regions]
        for repeat in range(REPEATS + 1):
            for region, spent in zip(regions, seconds, strict=True):
                start = time.perf_counter()
                one_round(adapter, ids, positions, causal(ROWS), region, torch.arange(ROWS))
                if repeat:  # the first round on each arena is not timed (its shape's first call)
                    spent.append(time.perf_counter() - start)
                region.crop(PREFIX)
    return [statistics.median(spent) for spent in seconds]


# -------------------------------------------------------------------------------------------------- eager


class _ArenaWrites(TorchDispatchMode):
    """The ops of a round as they reach the arena: ``index_copy_`` into a view of it (with the rows each
    writes), copies into it as large as a layer, and tensors made (not views of the arena) as large as one."""

    def __init__(self, arena: KVArena) -> None:
        super().__init__()
        self.storage = arena.tensor.untyped_storage().data_ptr()
        self.layer = arena.layers()[0].keys.numel()
        self.index_copies: list[int] = []  # rows written by each index_copy_ into the arena
        self.whole_layer: Counter[str] = Counter()

    def _in_arena(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index_copy_.default and self._in_arena(args[0]):
            self.index_copies.append(args[2].numel())
        elif func._schema.is_mutable and self._in_arena(args[0]) and args[0].numel() >= self.layer:
            self.whole_layer[f"{func} into the arena"] += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not self._in_arena(t) and t.numel() >= self.layer:
                self.whole_layer[f"{func} made {tuple(t.shape)}"] += 1
        return out


def _eager_round(adapter: ModelAdapter) -> tuple[KVArena, _ArenaWrites, int]:
    """A round of 5 rows after a prefill, on a job arena, under ``_ArenaWrites``; the arena's address before."""
    with job_region(adapter, 64) as region:
        arena = region.arena
        prefix = torch.tensor(random_prompt(10, seed=1))
        one_round(adapter, prefix, torch.arange(10), causal(10), region, torch.tensor([9]))
        address = arena.tensor.data_ptr()
        with _ArenaWrites(arena) as writes:
            ids = torch.tensor(random_prompt(5, seed=2))
            one_round(adapter, ids, torch.arange(10, 15), causal(5), region, torch.arange(5))
    return arena, writes, address


# ------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def compiled() -> tuple[ModelAdapter, RoundCode]:
    adapter = ModelAdapter(tiny_model("llama"))
    return adapter, _check_code(adapter)


@pytest.mark.slow
def test_compiled_round_writes_the_arena_in_place(compiled) -> None:
    """Inductor's code for the round allocates, hands to extern ops and loops over nothing the size of the
    arena's capacity, and stores each layer's keys and values into the arena's own views (graph inputs) with the
    kernel that lowers ``ArenaLayer.update``'s ``index_copy_``."""
    _, read = compiled
    assert read.whole_arena == []
    for arg, kernels in read.writers.items():
        assert len(kernels) == 1 and "index_copy" in kernels[0], (arg, kernels)


@pytest.mark.slow
def test_compiled_round_time_does_not_grow_with_the_arena(compiled) -> None:
    """The same round (rows, K/V width) on arenas 8x apart in capacity takes about the same time: a copy of
    whole layers would scale with the capacity (the negative control's round grows several-fold).
    The bound is loose (2x) against a loaded two-core machine; the medians of alternating rounds take the rest."""
    adapter, _ = compiled
    small, large = _round_seconds(adapter, (SMALL, LARGE))
    assert large < SLOWER * small, (small, large)


@pytest.mark.parametrize("bucketed", [False, True])
def test_eager_round_writes_the_arena_in_place(bucketed: bool) -> None:
    """An eager round (at its own rows, or at its bucket) writes each layer's K/V with one ``index_copy_`` of the
    round's rows into a view of the arena, which keeps its address; nothing as large as a layer is copied into
    it or made."""
    adapter = ModelAdapter(tiny_model("llama"), bucketed=bucketed)
    arena, writes, address = _eager_round(adapter)
    layers = len(arena.layers())
    assert arena.tensor.data_ptr() == address and arena.allocations == 1
    assert writes.index_copies == [8 if bucketed else 5] * (2 * layers)  # keys and values of every layer
    assert writes.whole_layer == Counter()


_in_place_update = ArenaLayer.update


def whole_layer_update(self: ArenaLayer, key_states, value_states, *args, **kwargs):
    """The negative control: ``ArenaLayer.update`` after writing the same K/V out of place, every slot of the
    layer rewritten (a select over its whole capacity: kept slots keep their values, so outputs stay exact)."""
    written = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)  # [capacity]
    written = written.index_fill(0, self.write_slots, True)
    for buffer, states in ((self.keys, key_states), (self.values, value_states)):
        buffer.copy_(torch.where(written[:, None], buffer.index_copy(2, self.write_slots, states), buffer))
    return _in_place_update(self, key_states, value_states, *args, **kwargs)


@pytest.mark.slow
def test_the_checks_see_a_whole_layer_write(monkeypatch) -> None:
    """Each check above reports ``whole_layer_update``: its generated code allocates buffers of a whole layer,
    loops over the capacity and writes the arena's views with a copy of them; its round slows with the arena; its
    eager round copies whole layers into the arena."""
    monkeypatch.setattr(ArenaLayer, "update", whole_layer_update)
    # dynamo does not guard on the patched method: the code capture below resets it, so the round compiles anew
    model = tiny_model("llama")
    _, writes, _ = _eager_round(ModelAdapter(model, bucketed=True))
    assert writes.whole_layer["aten.copy_.default into the arena"] == 4  # keys and values of both layers
    adapter = ModelAdapter(model)
    read = _check_code(adapter)
    assert any("empty_strided" in line for line in read.whole_arena)  # buffers of a whole layer (or slot mask)
    assert any("loops to" in line for line in read.whole_arena)  # kernels over every slot
    assert any("index_copy" not in kernel for kernels in read.writers.values() for kernel in kernels)  # a copy_ back
    small, large = _round_seconds(adapter, (SMALL, LARGE))
    assert large > SLOWER * small, (small, large)
