"""A storage tracker: every byte a training step allocates, and who owns it at the peak.

:class:`StorageTracker` is a ``TorchDispatchMode`` that sees each op's outputs, notes
every new storage (with a weakref finalizer to notice its free) and appends
``(+bytes)`` / ``(-bytes)`` events to a log. It works the same on real CPU tensors and
on fake tensors, which is what lets the simulator be checked against real runs.

Attribution is done *after* the step, from the log, with knowledge the step only has at
its end: which storages became a parameter's ``.grad``, which are optimizer state. The
live set at the peak event is replayed and each storage is given one DESIGN.md
component by the phase and region it was created in:

- ``weights``: parameters and buffers (registered up front) and dtype casts of them
  (autocast's cached 16-bit copies)
- ``gradients``: storages that ended up as a parameter's ``.grad``
- ``optimizer``: storages held by the optimizer's state after the step
- ``logits``: anything created inside the ``logits`` region (lm_head + loss, forward or
  backward)
- ``activations``: created in the forward phase, or recomputed by activation
  checkpointing in backward, or brought back by activation offloading (the
  ``activations`` region), and alive at the peak
- ``temporary``: everything else (backward intermediates, buckets, optimizer temporaries)

torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` gives a similar
breakdown and the same peak, but took 24.5 s per fake Mistral-7B step (seq 4096) against
2.1 s for this tracker and 1.6 s for the bare step
(benchmarks/results/2026-12-02-simulated-speed.md), so we keep our own.

Imports torch at module level (import it lazily from modules that must load without
torch) and, from autofit, only the component names of ``autofit.results``. How the
simulator and measured runs use it: docs/EVALUATORS.md.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from autofit.results import TENSOR_COMPONENTS

_TO_COPY = torch.ops.aten._to_copy.default


# The CUDA caching allocator hands out blocks in multiples of 512 bytes; what
# torch.cuda.max_memory_allocated counts is the rounded size.
BLOCK = 512


def round_block(nbytes: int) -> int:
    return max(BLOCK, -(-nbytes // BLOCK) * BLOCK) if nbytes else 0


@dataclass
class _Rec:
    nbytes: int
    phase: str
    region: str
    step: int
    op: str = ""  # the op that made it, when the tracker records ops (debugging)


@dataclass
class Snapshot:
    """The breakdown at the peak moment, in bytes (rounded to allocator blocks)."""

    components: dict[str, int]
    peak: int
    peak_event: int
    peak_phase: str
    peak_step: int
    sizes: list[int] = field(default_factory=list)  # live storage sizes at the peak

    @property
    def total(self) -> int:
        return sum(self.components.values())


def _plain_tensors(items: Iterable) -> Iterator[torch.Tensor]:
    """The tensors that own memory: wrapper subclasses (FSDP2's DTensor parameters and
    gradients) are replaced by their inner tensors, whose storages are the real ones (the
    wrapper reports a storage of the *global* size)."""
    for t in items:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            yield from _plain_tensors(getattr(t, a) for a in attrs)
        else:
            yield t


class StorageTracker(TorchDispatchMode):
    """Log every storage an op creates, and when it dies."""

    def __init__(
        self,
        record_ops: bool = False,
        budget: int | None = None,
        skip_meta: bool = False,
        decompositions: dict | None = None,
    ) -> None:
        super().__init__()
        self.record_ops = record_ops
        # measured runs build models on the meta device (no memory); fake tensors keep
        # meta storages too, so the simulator leaves this off
        self.skip_meta = skip_meta
        # measured runs on the CPU: bytes this rank may hold at once (see _exceeded)
        self.budget = budget
        self.budget_hit: dict | None = None
        # {op: (when(*args, **kwargs) -> bool, impl)}: ops whose kernels allocate
        # temporaries of their own; when ``when`` says so, ``impl`` (the kernel's own Python
        # implementation) runs under the tracker instead, so those temporaries are seen
        # (see runtime.bnb_decompositions)
        self.decompositions = decompositions or {}
        self._op = ""
        self.log: list[tuple[int, int]] = []  # (storage key, +/- rounded bytes)
        self.recs: dict[int, _Rec] = {}
        self.live = 0
        self.peak = 0
        self.peak_event = -1
        self.peak_phase = ""
        self.peak_step = 0
        self.phase = "setup"
        self.region = ""
        self.step = 0
        self._next_key = 0
        self._keys: dict[int, int] = {}  # storage _cdata -> key of the live record
        self.weight_keys: set[int] = set()
        self.grad_keys: set[int] = set()
        self.optimizer_keys: set[int] = set()
        # host memory (offloaded activations, ``on_host``): outside the log and the peak
        self.host = False
        self.host_live = 0
        self.host_peak = 0
        self.host_allocs: list[tuple[int, int, object]] = []  # (step, bytes, here())
        self._host_cdata: set[int] = set()
        self._entered = 0  # how deep the tracker is entered (its own re-entries included)

    # -- context -----------------------------------------------------------------------
    def __enter__(self):
        self._entered += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._entered -= 1
        return super().__exit__(*exc)

    def again(self):
        """The tracker, for the ops a tensor subclass runs inside one op's dispatch, while the tracker
        is entered (else nothing). A dispatch mode is off while its handler runs the op, so what DTensor's
        handlers allocate beneath it goes unseen: the ring attention's buffers (``evaluators/ring.py``)."""
        return self if self._entered else contextlib.nullcontext()

    @contextlib.contextmanager
    def in_phase(self, phase: str, step: int | None = None) -> Iterator[None]:
        prev = self.phase
        self.phase = phase
        if step is not None:
            self.step = step
        try:
            yield
        finally:
            self.phase = prev

    @contextlib.contextmanager
    def in_region(self, region: str) -> Iterator[None]:
        prev = self.region
        self.region = region
        try:
            yield
        finally:
            self.region = prev

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        """Storages created inside are host memory (an activation offload's copies): counted in
        ``host_live``/``host_peak`` and ``host_allocs``, not in the device's log."""
        prev = self.host
        self.host = True
        try:
            yield
        finally:
            self.host = prev

    def here(self) -> object:
        """What :attr:`host_allocs` records beside each allocation (the simulator's layer tag)."""
        return None

    def _host_storage(self, st) -> None:
        nbytes = st.nbytes()
        self._host_cdata.add(st._cdata)
        self.host_live += nbytes
        self.host_peak = max(self.host_peak, self.host_live)
        self.host_allocs.append((self.step, nbytes, self.here()))
        weakref.finalize(st, self._host_free, st._cdata, nbytes)

    def _host_free(self, cdata: int, nbytes: int) -> None:
        self._host_cdata.discard(cdata)
        self.host_live -= nbytes

    # -- registration ------------------------------------------------------------------
    def _key_of(self, t: torch.Tensor, create: bool) -> int | None:
        st = t.untyped_storage()
        if self.host:
            if create and st._cdata not in self._host_cdata:
                self._host_storage(st)
            return None
        if self.skip_meta and st.device.type == "meta":
            return None
        cdata = st._cdata
        key = self._keys.get(cdata)
        if key is not None or not create:
            return key
        nbytes = round_block(st.nbytes())
        if nbytes == 0:
            return None
        key = self._next_key
        self._next_key += 1
        self._keys[cdata] = key
        self.recs[key] = _Rec(nbytes, self.phase, self.region, self.step, self._op)
        weakref.finalize(st, self._free, cdata, key)  # before _add, which may raise (budget)
        self._add(key, nbytes)
        return key

    def _add(self, key: int, nbytes: int) -> None:
        self.log.append((key, nbytes))
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.peak_event = len(self.log) - 1
            self.peak_phase = self.phase
            self.peak_step = self.step
        if self.budget is not None and self.live > self.budget and self.budget_hit is None:
            self._exceeded(nbytes)

    def _free(self, cdata: int, key: int) -> None:
        if self._keys.get(cdata) == key:
            del self._keys[cdata]
        rec = self.recs.get(key)
        if rec is not None:
            self.log.append((key, -rec.nbytes))
            self.live -= rec.nbytes

    def track(self, tensors: Iterable[torch.Tensor], kind: str | None = None) -> None:
        """Register tensors that exist already (parameters, buffers, states)."""
        for t in _plain_tensors(tensors):
            key = self._key_of(t, create=True)
            if key is None:
                continue
            if kind == "weights":
                self.weight_keys.add(key)
            elif kind == "gradients":
                self.grad_keys.add(key)
            elif kind == "optimizer":
                self.optimizer_keys.add(key)

    def mark(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Say what already-tracked tensors turned out to be (grads, optimizer state)."""
        self.track(tensors, kind)

    # -- dispatch ----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dec = self.decompositions.get(func)
        if dec is not None and dec[0](*args, **(kwargs or {})):
            with self:
                return dec[1](*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self.record_ops:
            self._op = f"{func.__name__}{[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]}"
        # a dtype cast of a weight (autocast's cached 16-bit copy) is a weight too
        weight_copy = (
            func is _TO_COPY
            and isinstance(args[0], torch.Tensor)
            and self._key_of(args[0], create=False) in self.weight_keys
        )
        for t in _plain_tensors(tree_leaves(out)):
            key = self._key_of(t, create=True)
            if weight_copy and key is not None:
                self.weight_keys.add(key)
        return out

    # -- the CPU memory budget (measured runs) ------------------------------------------
    def _exceeded(self, nbytes: int) -> None:
        """Raise ``torch.OutOfMemoryError`` at the allocation that crosses the budget.

        The op has already run (a dispatch mode sees outputs), but its caller never gets
        the result: the error surfaces from the same op, forward or backward, as CUDA's
        allocator raises it. Only the first crossing raises; the state is kept in
        ``budget_hit`` for the result file.
        """
        self.budget_hit = {
            "requested": nbytes,
            "live_before": self.live - nbytes,
            "budget": self.budget,
            "phase": self.phase,
            "step": self.step,
            "event": len(self.log) - 1,
        }
        mib = 2**20
        raise torch.OutOfMemoryError(
            f"CPU out of memory under the autofit budget: tried to allocate {nbytes / mib:.2f} MiB with "
            f"{(self.live - nbytes) / mib:.2f} MiB allocated; the budget is {self.budget / mib:.2f} MiB "
            f"(phase {self.phase}, step {self.step})"
        )

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (``torch.cuda.reset_peak_memory_stats``)."""
        self.peak = self.live
        self.peak_event = len(self.log) - 1
        self.peak_phase = self.phase
        self.peak_step = self.step

    # -- results -----------------------------------------------------------------------
    def snapshot(self, event: int | None = None) -> Snapshot:
        """Replay the log up to ``event`` (default: the peak) and attribute each live storage."""
        event = self.peak_event if event is None else event
        live = self.live_at(event)
        comps = dict.fromkeys(TENSOR_COMPONENTS, 0)
        for key, nbytes in live.items():
            comps[self.classify(key)] += nbytes
        return Snapshot(
            components=comps,
            peak=sum(live.values()),
            peak_event=event,
            peak_phase=self.peak_phase,
            peak_step=self.peak_step,
            sizes=sorted(live.values(), reverse=True),
        )

    def live_at(self, event: int | None = None) -> dict[int, int]:
        event = self.peak_event if event is None else event
        live: dict[int, int] = {}
        for key, delta in self.log[: event + 1]:
            if delta > 0:
                live[key] = delta
            else:
                live.pop(key, None)
        return live

    def classify(self, key: int) -> str:
        if key in self.weight_keys:
            return "weights"
        if key in self.grad_keys:
            return "gradients"
        if key in self.optimizer_keys:
            return "optimizer"
        rec = self.recs[key]
        if rec.region in ("logits", "weights", "activations"):
            return rec.region
        if rec.phase in ("forward", "recompute"):
            return "activations"
        return "temporary"
