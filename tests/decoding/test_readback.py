"""A round moves its results from the device to the host once, greedy and sampling alike.

Every value the host reads from the forward's logits passes through a conversion (``tolist``, ``item``,
``numpy``, ``cpu``, ``bool``/``int``/``float``/``index``, ``to`` a CPU device). The test tags the real forward's
output with a tensor subclass that every op on it propagates (``Tracked``) and counts those conversions per round,
so a read-back added anywhere downstream of the forward, in any module, is counted, on the CPU as on a GPU.
Outputs stay checked against the oracle (greedy) or against the engine without the tag (sampling), so the count is
of a run that did the real work.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, random_prompt, shared_tiny_model

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine

READS = {"tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}


class Tracked(torch.Tensor):
    """A tensor whose conversions to host values are counted in ``Tracked.reads``."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")) if a is not None)
        if name in READS or to_cpu:
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs)


class TaggingAdapter(ModelAdapter):
    """The real adapter; its logits come back tagged, and its forwards are counted (one per round)."""

    forwards = 0

    def run(self, *args, **kwargs) -> torch.Tensor:
        TaggingAdapter.forwards += 1
        return super().run(*args, **kwargs).as_subclass(Tracked)


def _run(gen: GenerationConfig, tagged: bool) -> list[int]:
    model = shared_tiny_model("llama")
    adapter = (TaggingAdapter if tagged else ModelAdapter)(model)
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    prompt = random_prompt(12, 3) * 2  # a repeated prompt: the context lookup proposes, candidates get verified
    return LookaheadEngine(adapter, la, gen, []).generate(prompt).output_ids


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_one_read_back_per_round(do_sample: bool) -> None:
    gen = GenerationConfig(max_new_tokens=30, do_sample=do_sample, seed=11, temperature=0.9, top_k=20)
    Tracked.reads = TaggingAdapter.forwards = 0
    out = _run(gen, tagged=True)
    rounds = TaggingAdapter.forwards - 1  # the adapter's own probe forward at construction reads nothing
    assert rounds >= 5
    assert Tracked.reads == rounds, f"{Tracked.reads} device->host reads in {rounds} rounds"
    if do_sample:
        assert out == _run(gen, tagged=False)  # the tag changes nothing (same seed, same samples)
    else:
        model = shared_tiny_model("llama")
        assert out == hf_greedy(model, random_prompt(12, 3) * 2, 30)
        assert len(out) > rounds  # candidates were accepted: verification rows were read too


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_one_read_back_per_round_on_bucketed_rounds(do_sample: bool) -> None:
    """The GPU's path (bucketed static rounds, run here on the CPU): padding to the bucket, the staged inputs and
    the pooled arena add no read of the forward's output; sampling decides on the device all the same."""
    gen = GenerationConfig(max_new_tokens=30, do_sample=do_sample, seed=11, temperature=0.9, top_k=20)
    model = shared_tiny_model("llama")
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    prompt = random_prompt(12, 3) * 2
    Tracked.reads = TaggingAdapter.forwards = 0
    out = LookaheadEngine(TaggingAdapter(model, bucketed=True), la, gen, []).generate(prompt).output_ids
    rounds = TaggingAdapter.forwards - 1
    assert rounds >= 5 and Tracked.reads == rounds, f"{Tracked.reads} device->host reads in {rounds} rounds"
    if do_sample:
        assert out == LookaheadEngine(ModelAdapter(model, bucketed=True), la, gen, []).generate(prompt).output_ids
    else:
        assert out == hf_greedy(model, prompt, 30)


def test_tracked_counts_every_kind_of_read() -> None:
    """The counter itself can fail: each conversion of a tagged tensor is one read."""
    Tracked.reads = 0
    t = torch.arange(3.0).as_subclass(Tracked)
    t.tolist()
    t[0].item()
    int(t[1])
    float(t[1])
    bool(t[2])
    t.numpy()
    t.cpu()
    t.to("cpu")
    (t * 2).argmax().tolist()  # derived tensors stay tagged
    assert Tracked.reads == 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_host_argmax_is_torchs_first_maximum(dtype) -> None:
    """``argmax_rows`` (numpy's argmax for host logits) against torch's argmax, which ``generate``'s greedy step
    uses: ties to the first maximum, a NaN as the maximum (the first one), infinities, strided rows."""
    from lp_runner.decoding.verify.verifier import argmax_rows

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 3001, generator=gen).to(dtype)
    logits[0, [10, 2000]] = float("nan")
    logits[1, [3, 700, 2999]] = 100.0  # a three-way tie
    logits[2] = float("-inf")
    logits[3, 5], logits[3, 6] = float("inf"), float("nan")
    logits[4, [17, 18]] = float("inf")
    logits[5] = logits[5].round()  # many ties
    with torch.inference_mode():
        for rows in (logits, logits[::3], logits[:, 1:]):
            assert argmax_rows(rows) == rows.argmax(-1).tolist()
