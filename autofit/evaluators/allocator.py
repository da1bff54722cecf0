"""A model of PyTorch's CUDA caching allocator, to replay a traced allocation log into ``reserved`` bytes.

The simulated evaluator records every storage allocation and free of a training step as a log of
``(key, +bytes)`` / ``(key, -bytes)`` events. :func:`replay` feeds that log through
:class:`CachingAllocator`, a pure-Python re-implementation of ``DeviceCachingAllocator`` in
``c10/cuda/CUDACachingAllocator.cpp``, and reports the peaks of ``torch.cuda.memory_allocated`` and
``torch.cuda.memory_reserved`` that the same sequence of calls gives on a GPU -- rounding, the small and
large pools, per-stream caching, best fit, block splitting and merging, ``max_split_size``, the power-of-two
rounding, expandable segments, and the fallbacks malloc runs when the device is full (garbage collection,
freeing oversize cached blocks, ``empty_cache``) up to the out-of-memory error.

Followed (read, not copied) from pytorch/pytorch:

- ``c10/cuda/CUDACachingAllocator.cpp`` at 001074d25084fdb87a799823e395a50f5ec044d3, checked against a newer
  main-branch version (the one with ``AcceleratorAllocatorConfig::large_segment_size()``) and the templated
  ``c10/core/CachingDeviceAllocator.h``; where they differ the newer rule is used and the comment says so.
- ``c10/core/AllocatorConfig.{h,cpp}`` (``AcceleratorAllocatorConfig``, ``ConfigTokenizer``) and
  ``c10/cuda/CUDAAllocatorConfig.{h,cpp}`` for the ``PYTORCH_CUDA_ALLOC_CONF`` syntax.

What is not modelled, and why it does not matter for a traced training step:

- ``record_stream``/cross-stream uses and their CUDA events: a free here is complete at once (the log has
  no stream uses). A block allocated on one stream is still only reusable on that stream.
- CUDA graph private pools, ``MemPool``, IPC sharing, free-memory callbacks: not in a training step's log.
- Real device addresses: segments get increasing addresses, which only break ties between equal-sized
  free blocks (the ``std::set`` comparator orders by stream, size, then address).
- ``backend:cudaMallocAsync`` is a different allocator; asking for it is an error, not a silent guess.

Pure Python: no torch import. Free blocks live in sorted lists (``bisect``), one per (pool, stream), so a
malloc is a binary search, like the ``std::set::lower_bound`` in the source.
"""

from __future__ import annotations

import os
import re
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from autofit.errors import SpecError
from autofit.specs.units import GiB, MiB

# -- constants of CUDACachingAllocator.cpp (and c10/core/AllocatorConfig.h) ---------------------------------
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = MiB  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small allocations are packed in 2 MiB segments
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: requests between 1 and 10 MiB get a kLargeBuffer segment
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests are rounded up to 2 MiB
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the default large_segment_size
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one entry per power of two
MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig::pinned_max_register_threads
_NO_LIMIT = 1 << 127  # stands for SIZE_MAX (max_split_size unset)
_ADDR_BITS = 64  # free-block sort key: size << 64 | address
_DEFAULT_ADDRESS_SPACE = 1 << 48  # an expandable segment's virtual size when the device size is unknown

CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def format_size(nbytes: int) -> str:
    """Bytes as torch's ``format_size`` writes them in an OOM message (``20.00 MiB``)."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= MiB:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= GiB:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / GiB:.2f} GiB"


class AllocatorOOM(Exception):
    """The simulated ``torch.OutOfMemoryError``: malloc found no block and every fallback failed.

    Carries the numbers torch's message gives: ``alloc_size`` is what "Tried to allocate" reports
    (``get_allocation_size`` of the rounded request), ``allocated``/``reserved`` are ``allocated_bytes`` and
    ``reserved_bytes`` at the failure, ``capacity`` the device memory the process may reserve and ``allowed``
    the ``per_process_memory_fraction`` limit, if one is set.
    """

    def __init__(
        self,
        requested: int,
        size: int,
        alloc_size: int,
        allocated: int,
        reserved: int,
        capacity: int | None,
        allowed: int | None = None,
        stream: int = 0,
    ):
        self.requested, self.size, self.alloc_size = requested, size, alloc_size
        self.allocated, self.reserved, self.capacity, self.allowed = allocated, reserved, capacity, allowed
        self.stream = stream
        super().__init__(self._message())

    def __reduce__(self):
        fields = (self.requested, self.size, self.alloc_size, self.allocated, self.reserved, self.capacity)
        return type(self), (*fields, self.allowed, self.stream)

    def _message(self) -> str:
        if self.capacity is None:
            total, free = "unlimited", ""
        else:
            total = format_size(self.capacity)
            free = f" of which {format_size(max(0, self.capacity - self.reserved))} is free"
        allowed = "" if self.allowed is None else f"{format_size(self.allowed)} allowed; "
        return (
            f"CUDA out of memory (simulated). Tried to allocate {format_size(self.alloc_size)}. "
            f"The device has a capacity of {total}{free}. {allowed}"
            f"Of the allocated memory {format_size(self.allocated)} is allocated by PyTorch, "
            f"and {format_size(self.reserved - self.allocated)} is reserved by PyTorch but unallocated."
        )


# -- PYTORCH_CUDA_ALLOC_CONF ----------------------------------------------------------------------------------
_INT_RE = re.compile(r"[0-9]+")
_FLOAT_RE = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _roundup_table(value) -> tuple[int, ...]:
    """Normalise ``roundup_power2_divisions`` to torch's 16-entry table (one per power of two from 1 MiB).

    Accepts an int (every interval), 16 ints, or ``(boundary_mib | ">", divisions)`` pairs applied like
    ``AcceleratorAllocatorConfig::parseRoundUpPower2Divisions`` applies ``[256:1,512:2,>:4]``.
    """
    if isinstance(value, bool):
        raise SpecError(f"roundup_power2_divisions must be a number or a list, not {value!r}")
    if isinstance(value, int):
        if value and not _is_pow2(value):
            raise SpecError(f"roundup_power2_divisions:{value}: the divisions have to be a power of 2")
        return (value,) * ROUNDUP_INTERVALS
    items = tuple(value)
    if len(items) == ROUNDUP_INTERVALS and all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        for v in items:
            if v < 0 or (v and not _is_pow2(v)):
                raise SpecError(f"roundup_power2_divisions: {v} is not 0 or a power of 2")
        return items
    table = [0] * ROUNDUP_INTERVALS
    _apply_roundup_pairs(table, items)
    return tuple(table)


def _apply_roundup_pairs(table: list[int], pairs: Iterable) -> None:
    """``parseRoundUpPower2Divisions``, list form: the first boundary also fills every interval below it;
    ``>`` fills from the interval after the last boundary (``last_index + 1``, as in the current tree)."""
    first, last_index = True, 0
    for pair in pairs:
        try:
            boundary, divisions = pair
        except (TypeError, ValueError):
            raise SpecError(f"roundup_power2_divisions: {pair!r} is not a (boundary_mb, divisions) pair") from None
        if not isinstance(divisions, int) or divisions < 0 or (divisions and not _is_pow2(divisions)):
            raise SpecError(f"roundup_power2_divisions: {boundary}:{divisions}: divisions must be 0 or a power of 2")
        if boundary == ">":
            for i in range(last_index + 1, ROUNDUP_INTERVALS):
                table[i] = divisions
            continue
        if not isinstance(boundary, int) or not _is_pow2(boundary):
            raise SpecError(f"roundup_power2_divisions: {boundary}:{divisions}: the interval has to be a power of 2")
        index = min(boundary.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            for i in range(index):
                table[i] = divisions
            first = False
        table[index] = divisions
        last_index = index


def _describe_roundup(table: tuple[int, ...]) -> str:
    """The shortest conf text that parses back to ``table`` (``4``, or ``[256:1,512:2,>:8]``)."""
    if all(v == table[0] for v in table):
        return str(table[0])
    first_end = 0  # the first boundary also fills everything below it
    while table[first_end + 1] == table[0]:
        first_end += 1
    tail = ROUNDUP_INTERVALS - 1  # '>' fills from the interval after the last boundary
    while table[tail - 1] == table[-1]:
        tail -= 1
    parts = [f"{1 << first_end}:{table[0]}"]
    parts += [f"{1 << i}:{table[i]}" for i in range(first_end + 1, tail)]
    parts.append(f">:{table[-1]}")
    return "[" + ",".join(parts) + "]"


def _tokenize(text: str) -> list[str]:
    """``ConfigTokenizer``: split on ``, : [ ]`` (kept as tokens), drop whitespace."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _entries(text: str) -> list[tuple[str, str | list[tuple[str, str]]]]:
    """``key:value`` entries, a value being a token or a ``[a:b,c:d]`` list. Stricter than torch's tokenizer,
    which ignores a missing ``:`` or ``,``; here either is an error naming the key."""
    tokens = _tokenize(text)
    out: list[tuple[str, str | list[tuple[str, str]]]] = []
    i, n = 0, len(tokens)
    while i < n:
        key = tokens[i]
        if key in ",:[]":
            raise SpecError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: expected a key at {key!r}")
        if i + 2 >= n or tokens[i + 1] != ":":
            raise SpecError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: {key} has no value; write it as {key}:<value>")
        i += 2
        if tokens[i] == "[":
            items, i = _list_value(tokens, i + 1, key, text)
            out.append((key, items))
        else:
            if tokens[i] in ",:]":
                raise SpecError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: {key} has no value; write it as {key}:<value>")
            out.append((key, tokens[i]))
            i += 1
        if i < n:  # a trailing comma is accepted, as torch does
            if tokens[i] != ",":
                raise SpecError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: expected ',' after {key}'s value")
            i += 1
    return out


def _list_value(tokens: list[str], i: int, key: str, text: str) -> tuple[list[tuple[str, str]], int]:
    items: list[tuple[str, str]] = []
    while i < len(tokens) and tokens[i] != "]":
        if i + 2 >= len(tokens) or tokens[i + 1] != ":" or tokens[i + 2] in ",:[]":
            raise SpecError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: {key}: list entries are written boundary:value")
        items.append((tokens[i], tokens[i + 2]))
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise SpecError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: {key}: missing the closing ']'")
    return items, i + 1


def _bad(key: str, value, why: str) -> SpecError:
    shown = value if isinstance(value, str) else "[" + ",".join(f"{a}:{b}" for a, b in value) + "]"
    return SpecError(f"PYTORCH_CUDA_ALLOC_CONF {key}:{shown} is invalid: {why}")


def _scalar(key: str, value) -> str:
    if not isinstance(value, str):
        raise _bad(key, value, "expected a single value, not a list")
    return value


def _as_bool(key: str, value) -> bool:
    value = _scalar(key, value)
    if value not in ("True", "False"):
        raise _bad(key, value, "expected True or False (torch accepts no other spelling)")
    return value == "True"


def _as_int(key: str, value) -> int:
    value = _scalar(key, value)
    if not _INT_RE.fullmatch(value):
        raise _bad(key, value, "expected a whole number")
    return int(value)


def _as_float(key: str, value) -> float:
    value = _scalar(key, value)
    if not _FLOAT_RE.fullmatch(value):
        raise _bad(key, value, "expected a number")
    return float(value)


def _as_mib(key: str, value, minimum_mib: int, strict: bool = False) -> int:
    mb = _as_int(key, value)
    if mb < minimum_mib or (strict and mb == minimum_mib):
        raise _bad(key, value, f"must be {'>' if strict else '>='} {minimum_mib} (MiB)")
    return mb * MiB


def _parse_roundup(key: str, value) -> tuple[int, ...]:
    if isinstance(value, str):  # the single-number form: every interval, and it must be a power of 2
        n = _as_int(key, value)
        if not _is_pow2(n):
            raise _bad(key, value, "the divisions have to be a power of 2")
        return (n,) * ROUNDUP_INTERVALS
    pairs = []
    for boundary, divisions in value:
        if boundary != ">" and not _INT_RE.fullmatch(boundary):
            raise _bad(key, value, f"interval {boundary!r} is not a number of MiB or '>'")
        pairs.append((boundary if boundary == ">" else int(boundary), _as_int(key, divisions)))
    table = [0] * ROUNDUP_INTERVALS
    try:
        _apply_roundup_pairs(table, pairs)
    except SpecError as e:
        raise _bad(key, value, str(e)) from None
    return tuple(table)


def _check_ignored(key: str, value) -> None:
    """Keys torch accepts that do not change device memory: validated like torch, then dropped."""
    if key == "pinned_num_register_threads":
        n = _as_int(key, value)
        if not _is_pow2(n) or n > MAX_REGISTER_THREADS:
            raise _bad(key, value, f"must be a power of 2 no larger than {MAX_REGISTER_THREADS}")
    elif key == "pinned_reserve_segment_size_mb":
        if _as_int(key, value) <= 0:
            raise _bad(key, value, "must be greater than 0")
    else:
        _as_bool(key, value)


_IGNORED_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb",
        "pinned_use_background_threads",
        "graph_capture_record_stream_reuse",
    }
)
_MODELLED_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "expandable_segments",
    "garbage_collection_threshold",
    "per_process_memory_fraction",
)


@dataclass(frozen=True)
class AllocatorConfig:
    """What ``PYTORCH_CUDA_ALLOC_CONF`` sets that changes device memory. Sizes in bytes.

    ``max_split_size``: blocks this large or larger are never split (None: unlimited, torch's default).
    ``max_non_split_rounding``: how much larger than the request an oversize cached block may be
    (None: ``large_segment_size``, torch's default). ``large_segment_size``: the segment a 1-10 MiB request
    gets, and the page of a large-pool expandable segment (``large_segment_size_mb``; 20 MiB = kLargeBuffer).
    ``roundup_power2_divisions``: an int, 16 ints (one per power of two from 1 MiB) or ``(boundary_mib | ">",
    divisions)`` pairs; stored as the 16-entry table. ``per_process_memory_fraction``: like
    ``torch.cuda.set_per_process_memory_fraction``; below 1.0 it caps reserved memory and arms the GC.
    """

    max_split_size: int | None = None
    roundup_power2_divisions: tuple[int, ...] | int = 0
    expandable_segments: bool = False
    garbage_collection_threshold: float | None = None
    max_non_split_rounding: int | None = None
    large_segment_size: int = K_LARGE_BUFFER
    per_process_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "roundup_power2_divisions", _roundup_table(self.roundup_power2_divisions))
        large = self.large_segment_size
        if not isinstance(large, int) or large % MiB or large <= K_MIN_LARGE_ALLOC:
            raise SpecError(f"large_segment_size must be a whole number of MiB above 10 MiB, not {large!r}")
        for name in ("max_split_size", "max_non_split_rounding"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v % MiB or v < large):
                raise SpecError(f"{name} must be a whole number of MiB, at least {large // MiB} MiB, not {v!r}")
        gc = self.garbage_collection_threshold
        if gc is not None and not 0.0 < gc < 1.0:
            raise SpecError(f"garbage_collection_threshold must lie in (0.0, 1.0), not {gc!r}")
        fraction = self.per_process_memory_fraction
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise SpecError(f"per_process_memory_fraction must lie in [0.0, 1.0], not {fraction!r}")

    @property
    def non_split_rounding(self) -> int:
        """The effective ``max_non_split_rounding_size``."""
        return self.large_segment_size if self.max_non_split_rounding is None else self.max_non_split_rounding

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """Read ``PYTORCH_CUDA_ALLOC_CONF`` text, e.g. ``expandable_segments:True,max_split_size_mb:128``.

        Validates like ``AcceleratorAllocatorConfig::parseArgs`` and ``CUDAAllocatorConfig::parseArgs``: a bad
        value or an unknown key raises SpecError naming the key. Keys that do not change device memory
        (``backend:native``, ``pinned_*``, ``release_lock_on_cudamalloc``, ...) are checked and ignored.
        ``large_segment_size_mb`` is read first, as torch does, since the minima of the others depend on it.
        """
        entries = _entries(text or "")
        kw: dict = {}
        large = K_LARGE_BUFFER
        for key, value in entries:
            if key == "large_segment_size_mb":  # parseLargeSegmentSize: > kMinLargeAlloc / kMB
                large = _as_mib(key, value, K_MIN_LARGE_ALLOC // MiB, strict=True)
        if large != K_LARGE_BUFFER:
            kw["large_segment_size"] = large
        for key, value in entries:
            if key == "max_split_size_mb":  # parseMaxSplitSize: >= large_segment_size / kMB
                kw["max_split_size"] = _as_mib(key, value, large // MiB)
            elif key == "max_non_split_rounding_mb":
                kw["max_non_split_rounding"] = _as_mib(key, value, large // MiB)
            elif key == "garbage_collection_threshold":
                gc = _as_float(key, value)
                if not 0.0 < gc < 1.0:
                    raise _bad(key, value, "set it in (0.0, 1.0)")
                kw["garbage_collection_threshold"] = gc
            elif key == "roundup_power2_divisions":
                kw["roundup_power2_divisions"] = _parse_roundup(key, value)
            elif key == "expandable_segments":
                kw["expandable_segments"] = _as_bool(key, value)
            elif key == "per_process_memory_fraction":
                fraction = _as_float(key, value)
                if not 0.0 <= fraction <= 1.0:
                    raise _bad(key, value, "set it in [0.0, 1.0]")
                kw["per_process_memory_fraction"] = fraction
            elif key == "backend":
                _check_backend(value)
            elif key in _IGNORED_KEYS:
                _check_ignored(key, value)
            elif key != "large_segment_size_mb":
                known = ", ".join(sorted((*_MODELLED_KEYS, "backend", *_IGNORED_KEYS)))
                raise _bad(key, value, f"unknown key {key!r} (torch knows {known})")
        return cls(**kw)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllocatorConfig:
        """The config the process's environment gives torch.

        torch 2.9 reads ``PYTORCH_ALLOC_CONF`` first and ``PYTORCH_CUDA_ALLOC_CONF`` (deprecated) after it;
        the current tree reads ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF``, then
        ``PYTORCH_ALLOC_CONF``; older releases only ``PYTORCH_CUDA_ALLOC_CONF``. The first set one wins, so when
        two are set to different text the answer depends on the torch version: that is an error here.
        """
        env = os.environ if environ is None else environ
        found = {name: env[name] for name in CONF_VARS if name in env}
        if len(set(found.values())) > 1:
            shown = ", ".join(f"{k}={v!r}" for k, v in found.items())
            raise SpecError(
                f"{shown}: torch versions disagree on which of these wins; set only one (PYTORCH_ALLOC_CONF)"
            )
        return cls.parse(next(iter(found.values()), None))

    def describe(self) -> str:
        """The canonical ``PYTORCH_CUDA_ALLOC_CONF`` text for this config; ``""`` for torch's defaults."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.large_segment_size != K_LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_size // MiB}")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.max_non_split_rounding is not None:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MiB}")
        if any(self.roundup_power2_divisions):
            parts.append(f"roundup_power2_divisions:{_describe_roundup(self.roundup_power2_divisions)}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold!r}")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction!r}")
        return ",".join(parts)


def _check_backend(value) -> None:
    value = _scalar("backend", value)
    if value in ("cudaMallocAsync", "hipMallocAsync"):
        raise SpecError(
            f"PYTORCH_CUDA_ALLOC_CONF backend:{value} is not modelled: the CUDA driver's stream-ordered pool "
            "behaves differently from the caching allocator; use backend:native"
        )
    if value != "native":
        raise _bad("backend", value, "options are native and cudaMallocAsync")


DEFAULT_CONFIG = AllocatorConfig()


# -- rounding ----------------------------------------------------------------------------------------------
def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round up to the next of ``divisions`` equal steps between powers of
    two (1200 with 4 divisions lies in [1024, 2048), steps 1024, 1280, 1536, 1792: 1280)."""
    if _is_pow2(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)  # power2_floor >> log2(divisions)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(size: int, roundup: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS) -> int:
    """``round_size``: at least 512 bytes; a multiple of 512, or the power-of-two division when
    ``roundup_power2_divisions`` gives more than one division for the size's interval and the size exceeds
    ``512 * divisions``."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    index = min(max(size.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)  # the interval, from 1 MiB
    divisions = roundup[index]
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return (size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE


def get_allocation_size(size: int, large_segment_size: int = K_LARGE_BUFFER) -> int:
    """``get_allocation_size``: the segment a rounded request that finds no cached block gets."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


# -- the allocator -----------------------------------------------------------------------------------------
class _Pool:
    """One ``BlockPool`` (small or large) restricted to one stream: the slice of the ``std::set`` that a
    stream's ``lower_bound`` can reach. ``keys`` holds the free mapped blocks (size << 64 | address, sorted);
    ``unmapped`` the addresses of unmapped expandable-segment ranges (``BlockPool::unmapped``)."""

    __slots__ = ("small", "stream", "keys", "unmapped")

    def __init__(self, small: bool, stream: int):
        self.small, self.stream = small, stream
        self.keys: list[int] = []
        self.unmapped: list[int] = []


class _Segment:
    """An ``ExpandableSegment``: a virtual range mapped in pages of ``page`` bytes."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int):
        self.base, self.page, self.size = base, page, size


class _Block:
    __slots__ = ("addr", "size", "pool", "seg", "prev", "next", "allocated", "mapped", "key", "gc_base")

    def __init__(self, addr: int, size: int, pool: _Pool, seg: _Segment | None):
        self.addr, self.size, self.pool, self.seg = addr, size, pool, seg
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = True
        self.key = 0
        self.gc_base = 0

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        """``Block::splice``: put this block between ``before`` and ``after``."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class CachingAllocator:
    """``DeviceCachingAllocator`` for one device, driven by ``malloc``/``free`` calls.

    ``capacity``: bytes the process can get from the device (cudaMalloc and cuMemCreate fail beyond it);
    None is unlimited. ``device_total``: the device's total memory, which ``per_process_memory_fraction``
    multiplies and which sizes an expandable segment's address space; defaults to ``capacity``.
    ``memory_fraction`` overrides the config's ``per_process_memory_fraction``, like a call to
    ``torch.cuda.set_per_process_memory_fraction``.
    """

    def __init__(
        self,
        config: AllocatorConfig = DEFAULT_CONFIG,
        capacity: int | None = None,
        *,
        device_total: int | None = None,
        memory_fraction: float | None = None,
    ):
        self.config = config
        self.capacity = capacity
        total = capacity if device_total is None else device_total
        fraction = config.per_process_memory_fraction if memory_fraction is None else memory_fraction
        # setMemoryFraction (current tree): a fraction below 1 sets allowed_memory_maximum, which both caps
        # reserved memory (alloc_block) and arms garbage collection; 1.0 leaves the allocator unlimited.
        self.allowed = int(fraction * total) if fraction is not None and fraction < 1.0 and total is not None else None
        self._gc = self.allowed is not None and bool(config.garbage_collection_threshold)
        self._roundup = config.roundup_power2_divisions if any(config.roundup_power2_divisions) else None
        self._msz = _NO_LIMIT if config.max_split_size is None else config.max_split_size
        self._non_split = config.non_split_rounding
        self._large_segment = config.large_segment_size
        self._expandable = config.expandable_segments
        self._address_space = _DEFAULT_ADDRESS_SPACE if total is None else total + total // 8
        self._pools: dict[tuple[bool, int], _Pool] = {}
        self._free: dict[int, _Block] = {}  # sort key -> free mapped block
        self._unmapped: dict[int, _Block] = {}  # address -> unmapped expandable range
        self._active: dict[int, _Block] = {}  # address (the handle) -> allocated block
        self._gc_calls = [0, 0]  # BlockPool::get_free_blocks_call_count, [large, small]
        self._next_addr = 1 << 32
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = self.reserved_at_peak_allocated = 0
        self.segments = self.peak_segments = 0
        self.mallocs = 0  # num_device_alloc: cudaMalloc calls and expandable-segment maps
        self.device_frees = 0  # num_device_free: cudaFree calls and unmaps
        self.alloc_retries = 0  # num_alloc_retries: allocations that needed empty_cache first
        self.ooms = 0

    # -- public API ----------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """``DeviceCachingAllocator::malloc``: returns a handle (the block's address; 0 for 0 bytes)."""
        if nbytes <= 0:
            if nbytes == 0:
                return 0  # NativeCachingAllocator::allocate skips size 0: a null pointer
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if nbytes < K_MIN_BLOCK_SIZE:
            size = K_MIN_BLOCK_SIZE
        elif self._roundup is None:
            size = (nbytes + 511) & ~511
        else:
            size = round_size(nbytes, self._roundup)
        small = size <= K_SMALL_SIZE
        pool = self._pools.get((small, stream))
        if pool is None:
            pool = self._pools[(small, stream)] = _Pool(small, stream)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._allocate_new(pool, size, nbytes)
        remaining = block.size - size
        if small or self._expandable:  # should_split
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._msz and remaining > K_SMALL_SIZE
        if split:  # alloc_found_block: the front of the block is handed out, the rest goes back to the pool
            rest = block
            block = _Block(rest.addr, size, pool, rest.seg)
            block.splice(rest.prev, rest)
            rest.addr += size
            rest.size = remaining
            self._insert_free(rest)
        block.allocated = True
        self._active[block.addr] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
            self.reserved_at_peak_allocated = self.reserved
        return block.addr

    def free(self, handle: int) -> None:
        """``DeviceCachingAllocator::free`` and ``free_block``: merge with free neighbours, cache the block."""
        if handle == 0:
            return
        block = self._active.pop(handle, None)
        if block is None:
            raise ValueError(f"free of unknown handle {handle:#x}")
        block.allocated = False
        self.allocated -= block.size
        prev = block.prev  # try_merge_blocks(block, prev) then (block, next): free and equally mapped
        if prev is not None and not prev.allocated and prev.mapped:
            self._remove_free(prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._remove_free(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        self._insert_free(block)

    def empty_cache(self) -> None:
        """``emptyCache`` / ``release_cached_blocks``: cudaFree every unsplit cached segment; with expandable
        segments, unmap every free page and drop segments left with nothing mapped."""
        for small in (False, True):  # release_blocks(large_blocks) then release_blocks(small_blocks)
            for pool in self._pools_of(small):
                to_unmap = []
                for key in list(pool.keys):
                    block = self._free[key]
                    if block.seg is not None:
                        to_unmap.append(block)
                    elif block.prev is None and block.next is None:
                        self._release_block(block)
                for block in to_unmap:
                    self._unmap_block(block)
                    if not block.mapped and block.prev is None and block.next is None:
                        self._release_expandable_segment(block)

    def reset_peak(self) -> None:
        """``resetPeakStats``: the peaks restart from the current values."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.reserved_at_peak_allocated = self.reserved
        self.peak_segments = self.segments

    @property
    def cached(self) -> int:
        """Reserved but not allocated bytes (what ``torch.cuda.memory_reserved() - memory_allocated()`` gives)."""
        return self.reserved - self.allocated

    # -- free-block index ----------------------------------------------------------------------------------
    def _insert_free(self, block: _Block) -> None:
        """``BlockPool::insert_into_blocks``: also stamps the block's GC age base."""
        key = (block.size << _ADDR_BITS) | block.addr
        block.key = key
        block.gc_base = self._gc_calls[block.pool.small]
        insort(block.pool.keys, key)
        self._free[key] = block

    def _remove_free(self, block: _Block) -> None:
        keys = block.pool.keys
        del keys[bisect_left(keys, block.key)]
        del self._free[block.key]

    def _insert_unmapped(self, block: _Block) -> None:
        block.mapped = False
        insort(block.pool.unmapped, block.addr)
        self._unmapped[block.addr] = block

    def _remove_unmapped(self, block: _Block) -> None:
        addrs = block.pool.unmapped
        del addrs[bisect_left(addrs, block.addr)]
        del self._unmapped[block.addr]

    def _pools_of(self, small: bool) -> list[_Pool]:
        """The pools of one kind in the ``std::set`` order (by stream)."""
        return [pool for (s, _), pool in sorted(self._pools.items(), key=lambda kv: kv[0][1]) if s == small]

    # -- malloc's search and fallbacks ---------------------------------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: the smallest cached block of this stream that fits (``lower_bound``), unless the
        ``max_split_size`` rules refuse it. Only that best fit is considered, as in the source."""
        if self._gc:
            self._gc_calls[pool.small] += 1  # tracks block reuse only when GC is armed
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)
        if i == len(keys):
            return None
        block = self._free[keys[i]]
        if block.seg is not None:
            i, block = self._expandable_fit(keys, i, block)
        msz = self._msz
        if size < msz and block.size >= msz:  # do not return an oversized block for a smaller request
            return None
        if size >= msz and block.size >= size + self._non_split:  # oversized, but only within a limit
            return None
        del keys[i]
        del self._free[block.key]
        return block

    def _expandable_fit(self, keys: list[int], i: int, block: _Block) -> tuple[int, _Block]:
        """``get_free_block`` with expandable segments: a block's size for best fit is what it can grow to (its
        size plus the unmapped range after it), so walk on to larger blocks that can grow less."""

        def grows_to(b: _Block) -> int:
            n = b.next
            return b.size + (n.size if n is not None and not n.mapped else 0)

        best = grows_to(block)
        for j in range(i + 1, len(keys)):
            candidate = self._free[keys[j]]
            reach = grows_to(candidate)
            if reach >= best:
                break
            i, block, best = j, candidate, reach
        return i, block

    def _allocate_new(self, pool: _Pool, size: int, requested: int) -> _Block:
        """malloc after a failed search: GC, then ``alloc_block``, ``release_available_cached_blocks`` +
        ``alloc_block``, ``release_cached_blocks`` + ``alloc_block``; if all fail, the OOM error."""
        alloc_size = get_allocation_size(size, self._large_segment)
        if self._gc:
            self._garbage_collect()
        block = self._alloc_block(pool, size, alloc_size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self.empty_cache()  # release_cached_blocks always returns true
            self.alloc_retries += 1
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self.ooms += 1
            raise AllocatorOOM(
                requested, size, alloc_size, self.allocated, self.reserved, self.capacity, self.allowed, pool.stream
            )
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        """``alloc_block``: a new cudaMalloc'd segment of ``alloc_size``, or with expandable segments enough
        mapped pages for ``size``. The fraction limit is checked against ``alloc_size`` in both cases."""
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None  # cudaMalloc: cudaErrorMemoryAllocation
        block = _Block(self._next_addr, alloc_size, pool, None)
        self._next_addr += alloc_size
        self._grow(alloc_size)
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        return block

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.mallocs += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _release_block(self, block: _Block) -> None:
        """``release_block``: cudaFree an unsplit cached segment."""
        self._remove_free(block)
        self.reserved -= block.size
        self.segments -= 1
        self.device_frees += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size`` set, cudaFree the smallest oversize
        cached block of this stream that covers the request, else the largest oversize ones until their sizes
        add up to it. Expandable blocks are skipped (as in the current tree)."""
        msz = self._msz
        if msz == _NO_LIMIT:
            return False
        target = max(size, msz)
        keys = pool.keys
        i = bisect_left(keys, target << _ADDR_BITS)
        if i < len(keys) and self._free[keys[i]].seg is None:
            self._release_block(self._free[keys[i]])
            return True
        released = 0
        i -= 1
        while released < target and i >= 0:
            block = self._free[keys[i]]
            if block.size < msz:
                break
            i -= 1
            if block.seg is None:
                self._release_block(block)
                released += block.size
        return released >= target

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: once reserved passes threshold x allowed, free unsplit large cached
        blocks whose age (get_free_block calls since they were cached) is at least the average, pass after
        pass, until enough is reclaimed or nothing more goes."""
        threshold = int(self.config.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        calls = self._gc_calls[False]

        def candidates() -> list[_Block]:
            return [
                b
                for pool in self._pools_of(False)
                for b in (self._free[k] for k in pool.keys)
                if b.prev is None and b.next is None and b.seg is None
            ]

        blocks = candidates()
        total_age, count = sum(calls - b.gc_base for b in blocks), len(blocks)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in candidates():
                age = calls - block.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # -- expandable segments -------------------------------------------------------------------------------
    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address with room, growing the free block
        before it, until a free block of ``size`` exists."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # invariant: free -> unmapped -> ...
            nxt = candidate.next
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # map_block merged the free block before it into it
        self._remove_free(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest unmapped range of this stream (with the free block just before
        it) whose run of free and unmapped blocks holds ``size``; else a new segment."""
        for addr in pool.unmapped:
            candidate = self._unmapped[addr]
            prev = candidate.prev
            if prev is not None and not prev.allocated:
                candidate = prev
            room, b = 0, candidate
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return candidate
        page = K_SMALL_BUFFER if pool.small else self._large_segment  # 2 MiB pages small, 20 MiB large
        seg_size = -(-self._address_space // page) * page  # 1 1/8 of the device, in whole pages
        seg = _Segment(self._next_addr, page, seg_size)
        self._next_addr += seg_size
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        candidate = _Block(seg.base, seg_size, pool, seg)
        self._insert_unmapped(candidate)
        return candidate

    def _map_block(self, block: _Block, size: int) -> bool:
        """``map_block`` / ``ExpandableSegment::map``: back the first ``size`` bytes of an unmapped range with
        whole pages (all or none), keep the rest unmapped, merge with free neighbours."""
        seg, page = block.seg, block.seg.page
        offset = block.addr - seg.base
        nbytes = (-(-(offset + size) // page) - offset // page) * page
        if nbytes == 0 or (self.capacity is not None and self.reserved + nbytes > self.capacity):
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY
        self._remove_unmapped(block)
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.addr + nbytes, block.size - nbytes, block.pool, seg)
            rest.splice(block, block.next)
            self._insert_unmapped(rest)
            block.size = nbytes
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_free(block)
        self._grow(nbytes)
        return True

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block`` / ``ExpandableSegment::unmap``: return the pages wholly inside a free block."""
        seg, page = block.seg, block.seg.page
        offset = block.addr - seg.base
        first, end = -(-offset // page), (offset + block.size) // page
        if first >= end:
            return
        start, length = seg.base + first * page, (end - first) * page
        self._remove_free(block)
        before = start - block.addr
        after = block.size - before - length
        if before > 0:
            head = _Block(block.addr, before, block.pool, seg)
            head.splice(block.prev, block)
            self._insert_free(head)
        if after > 0:
            tail = _Block(start + length, after, block.pool, seg)
            tail.splice(block, block.next)
            self._insert_free(tail)
        block.addr, block.size = start, length
        block.mapped = False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_unmapped(block)
        self.reserved -= length
        self.device_frees += 1

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: absorb a free neighbour in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _release_expandable_segment(self, block: _Block) -> None:
        self._remove_unmapped(block)
        self.segments -= 1


# -- replaying a traced log ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Replay:
    """What a traced log gives through the allocator. ``segments`` is the peak number of live segments (an
    expandable segment counts once); ``mallocs`` counts device allocations (cudaMalloc calls and
    expandable-segment maps, torch's ``num_device_alloc``). On an OOM the replay stops there: ``oom`` is set
    and the other numbers are those at the failure; ``events`` is how many log entries ran."""

    peak_allocated: int
    peak_reserved: int
    reserved_at_peak_allocated: int
    segments: int
    mallocs: int
    oom: AllocatorOOM | None = field(default=None, compare=False)
    events: int = 0
    device_frees: int = 0
    alloc_retries: int = 0
    config: str = ""

    @property
    def reserved_ratio(self) -> float:
        """peak reserved / peak allocated (1.0 for an empty log)."""
        return self.peak_reserved / self.peak_allocated if self.peak_allocated else 1.0


def replay(
    log: Iterable[tuple[object, int]],
    config: AllocatorConfig = DEFAULT_CONFIG,
    capacity: int | None = None,
    streams: Mapping[object, int] | None = None,
    *,
    device_total: int | None = None,
) -> Replay:
    """Feed ``(key, +bytes)`` / ``(key, -bytes)`` events through a fresh :class:`CachingAllocator`.

    ``streams`` maps a key to the stream it was allocated on (default 0). A free of a key that is not live,
    or a second allocation of a live key, is an error in the log (ValueError).
    """
    alloc = CachingAllocator(config, capacity, device_total=device_total)
    malloc, free = alloc.malloc, alloc.free
    stream_of = streams.get if streams else None
    live: dict[object, int] = {}
    events, oom = 0, None
    try:
        for key, delta in log:
            events += 1
            if delta > 0:
                if key in live:
                    raise ValueError(f"allocation log: {key!r} allocated twice without a free")
                live[key] = malloc(delta, stream_of(key, 0) if stream_of else 0)
            elif delta < 0:
                handle = live.pop(key, None)
                if handle is None:
                    raise ValueError(f"allocation log: free of {key!r}, which is not live")
                free(handle)
    except AllocatorOOM as e:
        oom = e
    return Replay(
        peak_allocated=alloc.peak_allocated,
        peak_reserved=alloc.peak_reserved,
        reserved_at_peak_allocated=alloc.reserved_at_peak_allocated,
        segments=alloc.peak_segments,
        mallocs=alloc.mallocs,
        oom=oom,
        events=events,
        device_frees=alloc.device_frees,
        alloc_retries=alloc.alloc_retries,
        config=config.describe(),
    )


__all__ = [
    "AllocatorConfig",
    "AllocatorOOM",
    "CachingAllocator",
    "Replay",
    "DEFAULT_CONFIG",
    "format_size",
    "get_allocation_size",
    "replay",
    "round_size",
    "roundup_power2_next_division",
]
