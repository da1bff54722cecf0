"""Activation offloading: tensors saved for backward go to host memory in forward and come
back in backward, one by one as autograd unpacks them.

:class:`ActivationOffload` is a ``torch.autograd.graph.saved_tensors_hooks`` entered around
the forward (the backward's checkpoint recompute runs outside it and keeps its tensors on
the device). It follows the rules of torchtune's ``OffloadActivations``
(torchtune/training/_activation_offloading.py), which TRL copies as
``trl.models.activation_offloading`` (``SFTConfig.activation_offloading``):

- a saved tensor is offloaded when it lives on the compute device, holds at least
  :data:`MIN_BYTES` and is not a parameter or a buffer (their storage stays anyway);
- the output head and the loss are left out (:meth:`ActivationOffload.stop` from the
  head's forward on): torchtune computes the loss outside the offloading context and
  keeps the head under a ``NoOpManager``, because their tensors come back at once in
  backward (TRL, which computes the loss inside, leaves out the head only);
- the copy is made on the compute stream with ``non_blocking`` into pinned memory, and the
  device tensor is released when autograd drops it (torchtune's single-stream path,
  ``use_streams=False``): transfers are not overlapped with compute, and the time model
  prices them as exposed host-link traffic (``costs.transfer_work``);
- a tensor saved twice (one input of q, k and v) is copied once and shares its host copy.

The simulated evaluator and the CPU measurement run the same hooks with a
``memtrack.StorageTracker``: the host copies are made under ``tracker.on_host()`` (host
memory, outside the device's log) and what comes back is counted as ``activations``.

Imports torch at module level; nothing from autofit.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

MIN_BYTES = 1024  # torchtune / TRL ``min_offload_size``


class ActivationOffload(saved_tensors_hooks):
    """Offload saved activations of ``model``'s forward to host memory (see the module doc).

    ``device``: the device type whose tensors are offloaded ("cuda"; "cpu" where a CPU
    target stands in for a GPU, with a ``tracker`` saying which bytes are host memory).
    """

    def __init__(self, model: torch.nn.Module, device: str = "cuda", tracker: Any = None, pin_memory: bool = True):
        self.device = device
        self.tracker = tracker
        self.pin = pin_memory and device == "cuda"
        self.offloaded_bytes = 0  # host bytes copied so far
        self._params = {_storage(t) for t in (*model.parameters(), *model.buffers())}
        self._active = True
        # (storage, offset, size, stride, dtype) -> (the tensor first saved, its host copy)
        self._seen: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc):
        # the forward is over: only autograd's saved tensors hold the host copies now, so
        # each is freed when backward has used it
        self._seen.clear()
        return super().__exit__(*exc)

    def stop(self) -> None:
        """Keep what the rest of this forward saves on the device (the head and the loss)."""
        self._active = False

    def stop_at(self, module: torch.nn.Module):
        """Stop when ``module`` (the output head) starts its forward; returns the hook's handle."""
        return module.register_forward_pre_hook(lambda *_: self.stop())

    def _offloads(self, t: torch.Tensor) -> bool:
        return (
            self._active
            and t.device.type == self.device
            and t.numel() * t.element_size() >= MIN_BYTES
            and not isinstance(t, torch.nn.Parameter)
            and _storage(t) not in self._params
        )

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._offloads(t):
            return t
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.size()), t.stride(), t.dtype)
        seen = self._seen.get(key)
        first = seen[0]() if seen is not None else None
        if first is not None and first.untyped_storage()._cdata == key[0]:
            host = seen[1]
        else:
            with self._on_host():
                host = torch.empty_like(t, device="cpu", pin_memory=self.pin)
                host.copy_(t, non_blocking=True)
            self.offloaded_bytes += host.numel() * host.element_size()
            self._seen[key] = (weakref.ref(t), host)
        return host, t.device

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, device = packed
        region = self.tracker.in_region("activations") if self.tracker is not None else contextlib.nullcontext()
        with region:
            # a new device tensor even where the "host" is the same device (a CPU target)
            return host.to(device, non_blocking=True, copy=True)

    def _on_host(self):
        return self.tracker.on_host() if self.tracker is not None else contextlib.nullcontext()


def _storage(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (None where it has none: FSDP2's sharded DTensors)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None
