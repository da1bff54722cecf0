"""A transformer is N copies of one block: trace three, unroll to N.

The simulator's cost is one fake dispatch per op, and a step's ops are almost all inside
the decoder layers. So the step is traced on the same architecture with ``3P`` layers
(``P``: the period of the layer kinds, 2 for Gemma-2's alternating attention): a first
block of ``P`` layers, a *template* block, a last block. Layers before the repeating ones (a
hybrid stack's first dense layers: DeepSeek-V3's 3) are a *head*, traced once with the first
block (``Depth.head``). While it runs, every storage
event and phase mark is tagged with the layer it belongs to (:class:`LayerContext`):

- forward: the layer whose ``forward`` runs (module pre/post hooks);
- backward, and the checkpoint recompute inside it: the layer whose output gradient was
  produced last (a gradient hook on each layer's output fires as that layer's backward
  starts);
- optimizer step: the layer owning the tensors the op reads (a parameter, its gradient, its
  state), else the last such layer (bitsandbytes allocates a state's absmax after the
  state itself);
- a free right after a layer returns (the loop letting go of the layer's input): that layer;
- any other free outside the layers: the layer that made the storage (what a forward
  leaves to free at its end, one per layer).

:func:`unroll` then writes the event log of the ``N``-layer step: the template block's
runs of events are repeated ``N/P - 2`` times in place, in the order the trace shows (after
the first block: ascending; after the last: descending, as backward runs), and the last
block becomes layers ``N-P..N-1``. A free names the storage it frees by layer *distance*:
a layer freeing what the previous layer made frees what the previous copy made (the same
storage of another layer is found by aligning the two layers' allocations in that phase,
:class:`_Counterparts`). The result goes through the unchanged anatomy and allocator replay.

Exactness is a test, not an assumption: ``tests/evaluators/test_unroll.py`` compares the
unrolled log with the full trace, event by event (sizes, order, which storage each free
frees, phase marks), for every family in the registry and a grid of plans, and
``benchmarks/unroll_check.py`` does it at full size. :func:`unroll` checks what it writes
(every free frees a live storage, once) and raises :class:`UnrollError` otherwise, and the
simulator then traces every layer.

Imports nothing from torch at module level; the hooks are installed on a built model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Tag = int | None  # a layer index of the traced (3P-layer) model, or None: no layer


class UnrollError(RuntimeError):
    """The traced events do not repeat as the unroll needs: trace every layer instead."""


@dataclass(frozen=True)
class Depth:
    """How a model of ``total`` layers is traced: ``traced`` = ``head`` + 3 × ``period`` layers.
    ``head``: layers before the repeating ones (a hybrid stack's first dense layers), traced once
    as part of the first block."""

    total: int
    period: int
    head: int = 0

    @property
    def traced(self) -> int:
        return self.head + 3 * self.period

    @property
    def copies(self) -> int:
        """How many times the template block appears in the full model."""
        return (self.total - self.head) // self.period - 2

    @property
    def template(self) -> range:
        """The traced layers of the template block."""
        return range(self.head + self.period, self.head + 2 * self.period)

    def block(self, layer: Tag) -> int | None:
        return None if layer is None else max(0, (layer - self.head) // self.period)

    def full_layer(self, layer: int, copy: int | None = None) -> int:
        """The full model's index of traced ``layer`` (in template ``copy`` when it is one)."""
        b = self.block(layer)
        if b == 0:
            return layer
        if b == 2:
            return layer + self.total - self.traced
        return self.head + self.period * (1 + (copy or 0)) + (layer - self.head) % self.period

    def traced_layer(self, at: int) -> tuple[int, int | None]:
        """The traced layer of the full model's layer ``at``, and its template copy (None outside
        the template)."""
        p, h = self.period, self.head
        if at < h + p:
            return at, None
        if at >= self.total - p:
            return at - (self.total - self.traced), None
        return h + p + (at - h) % p, (at - h) // p - 1


def layer_period(layer_types: Sequence[Any] | None) -> int:
    """The shortest period of each layer's type (1 when all layers are alike)."""
    types = list(layer_types or ())
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return 1


def depth_for(num_layers: int, layer_types: Sequence[Any] | None, every: int = 1) -> Depth | None:
    """The unroll of a model, or None where tracing all its layers is as cheap or it does not repeat.
    ``every``: a per-layer pattern the step adds (selective checkpointing's period). Layers before
    the repeating ones (a hybrid stack's first dense layers) become a ``head``, where the step adds
    no pattern of its own (``every`` 1): the fewest layers traced wins."""
    types = list(layer_types or ())
    p = math.lcm(layer_period(types), every)
    if not num_layers % p and num_layers > 3 * p:
        return Depth(num_layers, p)
    if every != 1 or len(types) != num_layers:
        return None
    best = None
    for head in range(1, num_layers):
        p = layer_period(types[head:])
        if not (num_layers - head) % p and head + 3 * p < num_layers and (best is None or head + 3 * p < best.traced):
            best = Depth(num_layers, p, head)
    return best


def traced_spec(spec, depth: Depth):
    """The same architecture with ``depth.traced`` layers (see :func:`cut`)."""
    return cut(spec, depth.traced)


# config keys that give each decoder layer's type, one entry (or letter) per layer: cut with the
# stack. Nemotron-H's config takes its depth from its pattern's length, whatever num_hidden_layers says
PER_LAYER_KEYS = ("layer_types", "layers_block_type", "hybrid_override_pattern")


def cut(spec, layers: int):
    """The same architecture cut after ``layers`` layers: its per-layer config keys
    (:data:`PER_LAYER_KEYS`) and a hybrid stack's kinds cut to match."""
    extra = dict(spec.hf_extra)
    for key in PER_LAYER_KEYS:
        if isinstance(extra.get(key), (list, tuple, str)):
            extra[key] = extra[key][:layers] if isinstance(extra[key], str) else tuple(extra[key][:layers])
    derived = tuple((k, v[:layers] if k == "stack" else v) for k, v in spec.derived)
    return dataclasses.replace(spec, num_layers=layers, n_params=0, hf_extra=tuple(extra.items()), derived=derived)


def decoder_layers(model, class_name: str) -> list:
    """The model's decoder layers in order (the family's ``decoder_layer`` class, or a subclass of it:
    FSDP2's ``fully_shard`` swaps each wrapped layer's class for ``FSDP<class>``, ``_fully_shard.py``)."""
    return [m for m in model.modules() if any(c.__name__ == class_name for c in type(m).__mro__)]


def canonical(log: list[tuple[int, int]]) -> list[tuple]:
    """A log as sizes in order, each free naming its allocation by rank, and each run of
    frees with no allocation between as a set (sorted).

    Frees that follow one another are one moment: their order is the C++ hash order of
    autocast's weight cache when it is cleared, and neither a peak nor the caching
    allocator's state after them depends on it. Two traces of one step are the same when
    their canonical logs are equal."""
    order: dict[int, int] = {}
    out: list[tuple] = []
    run: list[tuple] = []
    for key, delta in log:
        if delta > 0:
            out += sorted(run)
            run = []
            order[key] = len(order)
            out.append(("+", delta))
        else:
            run.append(("-", delta, order[key]))
    return out + sorted(run)


# -- tagging while tracing ----------------------------------------------------------------
class LayerTags:
    """Tags for a ``memtrack.StorageTracker``: each log event, phase mark and storage with the
    decoder layer it belongs to (the rules: module docstring). Mixed in before the tracker;
    :class:`LayerContext` moves ``layer`` and ``after``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layer: Tag = None  # the decoder layer running
        self.after: Tag = None  # the layer that just returned, until the next op
        self.tags: list[Tag] = []  # per log event
        self.mark_tags: list[Tag] = []  # per phase mark
        self.owners: dict[int, Tag] = {}  # storage key -> the layer that made it
        self._taint: Tag = None  # optimizer step: the layer whose tensors were stepped last

    def here(self) -> Tag:
        return self.layer if self.layer is not None else self._taint

    @contextlib.contextmanager
    def in_phase(self, phase: str, step: int | None = None):
        self.leave_phase(phase)
        with super().in_phase(phase, step):
            yield

    def leave_phase(self, phase: str) -> None:
        if phase != "recompute":  # a recompute runs inside its layer's backward
            self.layer = self.after = self._taint = None

    def _add(self, key: int, nbytes: int) -> None:
        owner = self.here()
        self.owners[key] = owner
        self.tags.append(owner)
        super()._add(key, nbytes)

    def _free(self, cdata: int, key: int) -> None:
        rec = self.recs.get(key)
        if rec is not None:  # in a layer; just after one (its input let go); else the maker's
            here = self.layer if self.layer is not None else self.after
            if here is None and self.phase == "optimizer" and rec.phase == "optimizer":
                here = self._taint  # a step's temporary, let go when the next tensor's step rebinds it
            self.tags.append(here if here is not None else self.owners.get(key))
        super()._free(cdata, key)

    @contextlib.contextmanager
    def op_context(self, args):
        """Around one dispatched op: outside a layer it ends the moment after one; in the
        optimizer step it tags by the layer whose tensors the op steps, and not at all an op
        over several layers' lists (fused, foreach)."""
        if self.layer is None:
            self.after = None
        taint = self._taint
        if self.phase == "optimizer" and self.layer is None:
            owner, spanning = self._step_owner(args)
            if spanning:
                self._taint = None
            elif owner is not None:
                self._taint = taint = owner
        try:
            yield
        finally:
            self._taint = taint

    def _step_owner(self, args) -> tuple[Tag, bool]:
        """The layer owning the most bytes among ``args``, and whether one argument is a list
        of several layers' tensors."""
        import torch
        from torch.utils._pytree import tree_leaves

        by: dict[int, int] = {}
        spanning = False
        for a in args:
            layers = set()
            for t in tree_leaves(a):
                if isinstance(t, torch.Tensor):
                    layer = self.layer_of(t)
                    if layer is not None:
                        layers.add(layer)
                        by[layer] = by.get(layer, 0) + t.numel() * t.element_size()
            spanning |= isinstance(a, (list, tuple)) and len(layers) > 1
        return (max(by, key=by.get) if by else None), spanning

    def layer_of(self, t) -> Tag:
        """The layer that made the storage of tensor ``t`` (None: none, or not tracked)."""
        try:
            key = self._keys.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None
        return self.owners.get(key) if key is not None else None


class LayerContext:
    """Keeps ``tracker.layer`` on the decoder layer that runs, forward and backward.

    Forward: a pre-hook sets it, a post-hook clears it and puts a gradient hook on the
    layer's output, which sets it again when backward reaches the layer. The first layer's
    input (when it needs a gradient) clears it when backward leaves the stack. The
    checkpoint recompute runs inside a layer's backward, so it inherits the tag.
    """

    def __init__(self, layers: list, tracker) -> None:
        from torch.utils._pytree import tree_leaves

        self._leaves = tree_leaves
        self.tracker = tracker
        self.handles: list[Any] = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._enter(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._leave(i)))

    def _first_tensor(self, value):
        import torch

        return next((t for t in self._leaves(value) if isinstance(t, torch.Tensor)), None)

    def _set(self, layer: Tag) -> Callable:
        def hook(grad):
            self.tracker.layer = layer

        return hook

    def _enter(self, i: int) -> Callable:
        def pre_hook(module, args, kwargs):
            self.tracker.layer = i
            x = self._first_tensor(args) if args else self._first_tensor(kwargs.get("hidden_states"))
            if i == 0 and x is not None and x.requires_grad:
                x.register_hook(self._set(None))

        return pre_hook

    def _leave(self, i: int) -> Callable:
        def hook(module, args, output):
            self.tracker.layer, self.tracker.after = None, i
            y = self._first_tensor(output)
            if y is not None and y.requires_grad:
                y.register_hook(self._set(i))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# -- the unroll -----------------------------------------------------------------------------
@dataclass
class Unrolled:
    log: list[tuple[int, int]]
    kinds: dict[int, str]
    marks: list[tuple[int, str, int]]
    tags: list[Tag]  # each event's layer in the full model


def unroll(
    depth: Depth,
    log: list[tuple[int, int]],
    tags: list[Tag],
    owners: dict[int, Tag],
    kinds: dict[int, str],
    marks: list[tuple[int, str, int]],
    mark_tags: list[Tag],
) -> Unrolled:
    """The ``depth.total``-layer log from the tagged ``depth.traced``-layer one (module docstring)."""
    if len(tags) != len(log) or len(mark_tags) != len(marks):
        raise UnrollError("the trace's layer tags do not cover its events")
    items = _items(log, tags, marks, mark_tags)
    counterparts = _Counterparts(items, log, marks, owners, kinds)
    out_log: list[tuple[int, int]] = []
    out_kinds: dict[int, str] = {}
    out_marks: list[tuple[int, str, int]] = []
    out_tags: list[Tag] = []
    new_key: dict[tuple[int, int | None], int] = {}
    live: dict[int, int] = {}

    def target(key: int, tag: Tag, copy: int | None) -> tuple[int, int | None]:
        """The (traced key, copy) a free at ``tag`` (in template ``copy``) frees."""
        owner = owners.get(key)
        if owner is None or (copy is None and depth.block(owner) != 1):
            return key, None  # neither side repeats: the storage itself
        if tag is None:
            raise UnrollError(f"an event outside the layers frees storage {key} of layer {owner}")
        at = depth.full_layer(tag, copy) + owner - tag  # the full model's layer that made it
        if at < 0 or at >= depth.total:
            raise UnrollError(f"a free in layer {tag} reaches layer {at}, outside the model")
        layer, at_copy = depth.traced_layer(at)
        if layer != owner:  # the same storage of another layer
            other = counterparts.of(key, owner, layer)
            if other is None:
                raise UnrollError(f"storage {key} of layer {owner} has no counterpart in layer {layer}")
            key = other
        return key, at_copy

    def emit(item: tuple[str, int, Tag], copy: int | None) -> None:
        what, i, tag = item
        if what == "m":
            _, phase, step = marks[i]
            out_marks.append((len(out_log), phase, step))
            return
        key, delta = log[i]
        out_tags.append(None if tag is None else depth.full_layer(tag, copy))
        if delta > 0:
            k = new_key[(key, copy)] = len(new_key)
            out_kinds[k] = kinds[key]
            live[k] = delta
            out_log.append((k, delta))
            return
        k = new_key.get(target(key, tag, copy))
        if k is None or k not in live:
            raise UnrollError(f"event {i}: the unrolled free of storage {key} frees nothing alive")
        out_log.append((k, -live.pop(k)))

    n = len(items)
    i = 0
    while i < n:
        if depth.block(items[i][2]) != 1:
            emit(items[i], None)
            i += 1
            continue
        j = i
        while j < n and depth.block(items[j][2]) == 1:
            j += 1
        order = range(depth.copies)
        if _descending(items, i, j, depth):
            order = reversed(order)
        for c in order:
            for item in items[i:j]:
                emit(item, c)
        i = j
    return Unrolled(out_log, out_kinds, out_marks, out_tags)


def _items(log, tags, marks, mark_tags) -> list[tuple[str, int, Tag]]:
    """Events and phase marks in one sequence, each with its layer tag (a mark at event
    index ``e`` comes before event ``e``, in the order the marks were made)."""
    items: list[tuple[str, int, Tag]] = []
    mi = 0
    for ev in range(len(log)):
        while mi < len(marks) and marks[mi][0] <= ev:
            items.append(("m", mi, mark_tags[mi]))
            mi += 1
        items.append(("e", ev, tags[ev]))
    items += [("m", m, mark_tags[m]) for m in range(mi, len(marks))]
    return items


class _Counterparts:
    """The same storage in another layer: the layers' allocations in each phase segment
    (a stretch of one phase; a recompute inside backward does not start one) aligned by
    size and component (``difflib``), so a first layer that makes one tensor more (its
    input needs no gradient) still pairs the rest."""

    def __init__(self, items, log, marks, owners, kinds) -> None:
        self.made: dict[tuple[int, Tag], list[int]] = {}
        self.where: dict[int, tuple[int, int]] = {}
        self.sizes = {key: delta for key, delta in log if delta > 0}
        self.kinds = kinds
        self._pairs: dict[tuple[int, Tag, Tag], dict[int, int]] = {}
        segment, outer = 0, ""
        for what, i, _ in items:
            if what == "m":
                phase = marks[i][1]
                if phase != "recompute" and phase != outer:
                    segment, outer = segment + 1, phase
                continue
            key, delta = log[i]
            if delta > 0:
                made = self.made.setdefault((segment, owners.get(key)), [])
                self.where[key] = (segment, len(made))
                made.append(key)

    def of(self, key: int, owner: Tag, layer: int) -> int | None:
        segment, rank = self.where[key]
        pairs = self._pairs.get((segment, owner, layer))
        if pairs is None:
            a = self.made.get((segment, owner), [])
            b = self.made.get((segment, layer), [])
            sm = difflib.SequenceMatcher(None, self._tokens(a), self._tokens(b), autojunk=False)
            pairs = {i + n: j + n for i, j, size in sm.get_matching_blocks() for n in range(size)}
            pairs = self._pairs[(segment, owner, layer)] = {i: b[j] for i, j in pairs.items()}
        return pairs.get(rank)

    def _tokens(self, keys: list[int]) -> list[tuple[int, str]]:
        return [(self.sizes[k], self.kinds[k]) for k in keys]


def _descending(items, start: int, end: int, depth: Depth) -> bool:
    """Whether the template run ``items[start:end]`` runs from the last block toward the
    first (backward): the layered items around it say which block comes before it."""
    before = next((depth.block(t) for _, _, t in reversed(items[:start]) if depth.block(t) in (0, 2)), None)
    after = next((depth.block(t) for _, _, t in items[end:] if depth.block(t) in (0, 2)), None)
    return before == 2 or (before is None and after == 0)
