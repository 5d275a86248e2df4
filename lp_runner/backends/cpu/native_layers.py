"""Native decoder layers: a Llama-family model's decoder layers as one C call (``lp_native_llama_layers``) for
eager CPU rounds.

Why: with the products native (the CPU backend's native kernel), a forward of a few rows is the weights' bytes over
the memory bandwidth plus what it costs to reach them. An eager transformers layer reaches them through some twenty
Python-level ops (norms, projections, rotary, the cache write, attention, the MLP's activation and the residual adds);
even compiled, the 30 layers of the embedded model cost about 6 ms of Python and dispatch per forward on a 2-core
CPU, against about 15 ms of products (a profile of the compiled one-row forward). The C layer takes the same
steps on the same packed weights and the same K/V buffer, so what is left is the products themselves; all the
layers go in one call (``native.LayerStack``), since even one return to Python per layer cost about 1 ms.

Which layers: those whose structure is the one the C function computes, checked module by module
(``layer_weights``): Llama, Mistral and Qwen2 decoder layers (pre-norm RMSNorm, rotary q/k in the rotate-half
convention, grouped-query attention, SiLU-gated MLP, optional q/k/v biases) whose q/k/v and gate/up products are
native ``SharedInputProduct``s and whose o/down products are native ``PackedLinear``s. Anything else keeps its
own forward.

When: the layers' implementation under the one round function (``rounds.Rounds``), chosen once when the backend is
made: every eager round of such a model runs ``forward_model`` (which also replaces transformers' model loop around
the layers) on the round's staged inputs and its one mask, on the K/V arena (``kv_cache.ArenaLayer``s, whose write
slots the round sets), one or more generations per round, each reading its own region, of any number of rows: a
prompt's prefill too, which ran 1.2-1.7x faster natively
than through transformers' layers on the same products (16-1200 rows of the embedded model, 2 threads; torch's
sdpa there attends over the whole buffer, the native loop only up to each row's last visible key). The model
itself is not changed (the layers' weights are held by the backend, not stored on the modules), so every other
caller (``generate``, a compiled trace, the backend's ``transformers_layers``) runs transformers' layers.

Exactness: each element is the expression transformers' eager layer evaluates, on the same products; only the
order of float sums (the norms' mean) and the exponential's implementation differ, at fp32 rounding level, as
any kernel change may. The tests compare against transformers' own greedy ``generate`` token for token and
against the original layers' logits and K/V.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lp_runner.backends.cpu import native
from lp_runner.backends.cpu.prepack import NATIVE_KERNELS, PackedLinear, ProductSlice, SharedInputProduct

# decoder layer and norm classes whose forward is the one lp_native_llama_layer computes (checked by name: the
# classes live in each model's own transformers module)
LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
MODEL_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")  # see ``forward_model``
NATIVE_LAYERS_SUFFIX = "-layers"  # appended to the backend's kernels name (another forward: its own cost curve)


@dataclass(frozen=True)
class LayerWeights:
    """What ``native.llama_layer`` reads of one decoder layer (packed weights: the products' own buffers)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    qkv: SharedInputProduct
    o: PackedLinear
    gate_up: SharedInputProduct
    down: PackedLinear
    heads: int
    intermediate: int
    scale: float

    @functools.cached_property
    def groups(self) -> int:
        """Query heads per K/V head: the packed attention rows per round row."""
        return self.qkv.sizes[0] // self.qkv.sizes[1]

    def as_args(self) -> tuple:
        return self._args

    @functools.cached_property
    def _args(self) -> tuple:  # looked up once: module attribute lookups cost ~1 us each, 240 per forward
        return (
            self.ln1,
            self.ln2,
            self.eps,
            self.qkv.packed_weight,
            self.qkv.bias,
            self.o.packed_weight,
            self.o.bias,
            self.gate_up.packed_weight,
            self.gate_up.bias,
            self.down.packed_weight,
            self.down.bias,
        )


def _shared(slices: list, count: int) -> SharedInputProduct | None:
    """The one native SharedInputProduct behind ``slices`` (in order 0..count-1), else None."""
    if not all(isinstance(s, ProductSlice) for s in slices):
        return None
    shared = slices[0].shared
    if any(s.shared is not shared for s in slices) or [s.index for s in slices] != list(range(count)):
        return None
    return shared if shared.kernel in NATIVE_KERNELS and len(shared.sizes) == count else None


def _norm(module) -> tuple[torch.Tensor, float] | None:
    if type(module).__name__ not in NORM_CLASSES or module.weight.dtype != torch.float32:
        return None
    return module.weight.detach().contiguous(), float(module.variance_epsilon)


def layer_weights(layer: torch.nn.Module) -> LayerWeights | str:
    """The layer's weights for the native layer, or why it cannot take it (one line)."""
    name = type(layer).__name__
    if name not in LAYER_CLASSES:
        return f"{name} is not a Llama, Mistral or Qwen2 decoder layer"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return f"{name} has no self_attn or mlp"
    if any(hasattr(attn, extra) for extra in ("q_norm", "k_norm", "sinks")):
        return f"{name} normalises q/k or has attention sinks"
    qkv = _shared([getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")], 3)
    gate_up = _shared([getattr(mlp, n, None) for n in ("gate_proj", "up_proj")], 2)
    o, down = getattr(attn, "o_proj", None), getattr(mlp, "down_proj", None)
    if qkv is None or gate_up is None:
        return "q/k/v or gate/up are not one native product each (the native kernel, siblings fused)"
    if not all(isinstance(m, PackedLinear) and m.kernel is qkv.kernel for m in (o, down)) or (
        gate_up.kernel is not qkv.kernel
    ):  # one C call multiplies all four with one storage of the weights
        return "o_proj, down_proj or gate/up is not a native product on the q/k/v product's weight storage"
    if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return f"the MLP's activation is {type(getattr(mlp, 'act_fn', None)).__name__}, not SiLU"
    norms = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
    if None in norms or norms[0][1] != norms[1][1]:
        return "the layer norms are not float32 RMSNorms of one epsilon"
    heads_dim = qkv.sizes[0]
    dim = getattr(attn, "head_dim", None)
    if not dim or heads_dim % dim or qkv.sizes[1] != qkv.sizes[2] or qkv.sizes[1] % dim or dim % 2 or dim > 512:
        return f"unsupported head sizes (q/k/v {qkv.sizes}, head dim {dim})"
    heads, kv_heads = heads_dim // dim, qkv.sizes[1] // dim
    if heads % kv_heads or gate_up.sizes[0] != gate_up.sizes[1] or down.in_features != gate_up.sizes[0]:
        return f"unsupported sizes (heads {heads}/{kv_heads}, gate/up {gate_up.sizes})"
    if o.in_features != heads_dim or o.out_features != qkv.in_features or down.out_features != qkv.in_features:
        return "the projections' sizes do not chain"
    if getattr(attn, "attention_dropout", 0.0) and attn.training:
        return "attention dropout in training mode"
    return LayerWeights(
        norms[0][0], norms[1][0], norms[0][1], qkv, o, gate_up, down, heads, gate_up.sizes[0], float(attn.scaling)
    )


@torch.inference_mode()
def forward_model(
    model: torch.nn.Module,
    layer_weights: tuple[LayerWeights, ...],  # per decoder layer (``native_layer_weights``)
    stacks: Stacks,  # the caller's stacks of bound layers, per cache (``_stack``)
    input_ids: torch.Tensor,  # [B]
    position_ids: torch.Tensor,  # [B]
    mask,  # the round's [1, 1, B, K] additive mask (``round_mask``, not tiled), or {layer type: such a mask}
    cache,  # the arena's DynamicCache of ArenaLayers, write slots set
    logit_rows: torch.Tensor,  # [L]
    spans: Sequence[tuple[int, int, int]],  # per generation: its rows, its region's first slot, the keys it reads
) -> torch.Tensor:  # [L, vocab]
    """A whole round through the native layers without transformers' model loop: the embedding, the rotary
    tables, one C call for all the layers, the final norm and the output layer on the logit rows, each the module or
    kernel the model's own forward would use, in the same order.

    Why: around the layers' C calls, transformers' model and layer code cost about 3.4 ms of Python per forward
    of the embedded model on a 2-core CPU (module calls, keyword plumbing, the mask mapping), a sixth of a
    one-row round. Only for a model ``native_layer_weights`` accepted (its checks are made once, there).

    The C call attends per generation (``native.SegmentTable``): each one's rows over its own region's keys only,
    through the round's mask cut to those keys (a view where one generation's region starts the arena)."""
    base = model.model
    cached = cache.layers
    types_ = list(getattr(model.config, "layer_types", None) or [None] * len(cached))
    by_type = {key: _segment_masks(mask if isinstance(mask, torch.Tensor) else mask[key], spans) for key in set(types_)}
    rows, bases, widths = zip(*spans, strict=True)
    table = native.SegmentTable.of(list(rows), list(bases), list(widths))
    hidden = base.embed_tokens(input_ids[None])  # [1, B, E]
    cos, sin = rotary_rows(base.rotary_emb, hidden, position_ids, cached[0].keys.shape[-2])
    h = hidden[0].contiguous()
    stack = _stack(stacks, cache, list(layer_weights))
    stack.run(h, cos, sin, cached[0].write_slots, [by_type[key] for key in types_], table)
    h = base.norm(h[None])[0]
    return model.lm_head(h.index_select(0, logit_rows))  # [L, vocab]


def _segment_masks(mask: torch.Tensor, spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """The round's [1, 1, B, K] mask as the C call reads it: each generation's rows over its own keys, flat, in
    order. One generation whose region starts the arena and whose keys end the mask is the mask itself."""
    full = mask[0, 0]  # [B, K]
    if len(spans) == 1 and spans[0][1] == 0 and spans[0][2] == full.shape[1]:
        return full.reshape(-1)
    parts, row = [], 0
    for q, first, width in spans:
        parts.append(full[row : row + q, first : first + width].reshape(-1))
        row += q
    return torch.cat(parts)


# rope types whose angles at a position depend on that position alone (the dynamic ones rescale with the length)
STATIC_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RotaryTable:
    """The model's own rotary cos and sin rows ([positions, D] float32) for positions 0, 1, ..."""

    cos: torch.Tensor
    sin: torch.Tensor


# rotary module -> its RotaryTable, or None where a round computes its own rows (see ``rotary_rows``)
_ROTARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rotary_rows(
    rotary: torch.nn.Module,
    hidden: torch.Tensor,  # [1, R, E]: the round's embeddings (their dtype and device)
    position_ids: torch.Tensor,  # [R]
    positions: int,  # how many positions the K/V holds: every position of the round is below it
) -> tuple[torch.Tensor, torch.Tensor]:  # [R, D] float32 cos, sin
    """The round's rotary cos and sin rows: rows of a table the model's own rotary module computed once for every
    position the K/V holds (made again when the K/V grows), else its own call.

    Why: the module's call is a handful of small tensor operations a round (its angles, a concatenation, a cosine
    and a sine), a few hundred microseconds on a CPU right after a forward has streamed the weights through the
    caches, where a table's rows are two index_selects. Exact: a static rope type's angle at a position is an
    elementwise function of that position, so a table row is what the call computes for it; the table is checked
    against the module's own call on several sets of positions when it is made, bit for bit, and not used
    (the module's call every round) where any differs or the rope type rescales with the length."""
    table = _ROTARY.get(rotary, False)
    if table is False or (table is not None and table.cos.shape[0] < positions):
        table = _ROTARY[rotary] = _rotary_table(rotary, hidden, positions)
    if table is None:
        return _rotary_call(rotary, hidden, position_ids)
    return table.cos.index_select(0, position_ids), table.sin.index_select(0, position_ids)


def _rotary_call(rotary, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = position_ids.shape[0]
    cos, sin = rotary(hidden, position_ids[None])
    return tuple(t.reshape(rows, t.shape[-1]).to(torch.float32).contiguous() for t in (cos, sin))


def _rotary_table(rotary, hidden: torch.Tensor, positions: int) -> RotaryTable | None:
    """The table for ``positions`` positions, or None where the rope type is not static or a probe differs."""
    if getattr(rotary, "rope_type", None) not in STATIC_ROPE:
        return None
    table = RotaryTable(*_rotary_call(rotary, hidden, torch.arange(positions)))
    last = positions - 1
    probes = (torch.tensor([last]), torch.arange(0, positions, 97)[:13], torch.arange(min(5, last), min(69, positions)))
    for ids in probes:
        cos, sin = _rotary_call(rotary, hidden, ids)
        if not (torch.equal(cos, table.cos[ids]) and torch.equal(sin, table.sin[ids])):
            return None
    return table


# cache -> (the native.LayerStack of its buffers, the LayerWeights and the K/V buffer tensors it was built on): held
# by the backend whose layers they are (``backend.CpuBackend``), not by this module
Stacks = weakref.WeakKeyDictionary


def _stack(stacks: Stacks, cache, weights: list[LayerWeights]) -> native.LayerStack:
    """The layers bound to ``cache``'s buffers: the stack built for this cache while it
    still holds these very buffer tensors and the same layers' weights, else a new one (a grown cache has new
    tensors; another model, other weights). Identity is enough: the stack keeps the tensors it was built on alive,
    so no other tensor can take their ids. Kept beside the cache, not on it (a copied cache must not inherit the
    original's addresses), and only as long as the cache lives: a finished generation's buffers are freed with it.
    """
    entry = stacks.get(cache)
    cached = cache.layers
    buffers = [t for c in cached for t in (c.keys, c.values)]
    if entry is not None:
        stack, owners, held = entry
        if all(a is b for a, b in zip(owners, weights, strict=True)) and all(
            a is b for a, b in zip(held, buffers, strict=True)
        ):
            return stack
    first = weights[0]
    keys, values = [c.keys[0] for c in cached], [c.values[0] for c in cached]
    args = [w.as_args() for w in weights]
    stack = native.LayerStack(args, keys, values, first.heads, first.intermediate, first.scale)
    stacks[cache] = (stack, list(weights), buffers)
    return stack


def native_layer_weights(model: torch.nn.Module) -> tuple[LayerWeights, ...] | str:
    """Every decoder layer's ``LayerWeights`` (what ``forward_model`` reads) when all of them can take the native
    layer (else none: a model runs one kind of layer), or why they cannot (one line).

    The model is untouched (the backend holds these, no attribute is stored on a module), so the module tree, the
    state dict and with them the weights checksum are the checkpoint's, and the model's own forward is
    transformers' for every other caller."""
    layers = _decoder_layers(model)
    if layers is None:
        return "no decoder layer list (model.model.layers)"
    if type(model).__name__ not in MODEL_CLASSES:
        return f"{type(model).__name__}'s forward is not a Llama, Mistral or Qwen2 causal LM's"
    embed = model.get_input_embeddings().weight
    if embed.dtype != torch.float32 or embed.device.type != "cpu":
        return f"the embeddings are {embed.dtype} on {embed.device.type}, not float32 on a CPU"
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types is not None and len(layer_types) != len(layers):
        return f"{len(layer_types)} layer types for {len(layers)} decoder layers"
    if native.routed().layers_segments is None:
        return "the native kernel is not loaded"
    weights, sizes = [], set()
    for layer in layers:
        found = layer_weights(layer)
        if isinstance(found, str):
            return found
        weights.append(found)
        sizes.add((found.heads, found.intermediate, found.scale, tuple(found.qkv.sizes)))
    if len(sizes) > 1:  # lp_native_llama_layers runs them all in one call, on one set of sizes
        return "the decoder layers differ in size (heads, MLP width or attention scale)"
    return tuple(weights)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None
