"""The caching-allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp and the conf parser.

Each test names the source rule it checks. Sizes are chosen so the expected numbers can be worked out by hand.
"""

from __future__ import annotations

import pickle
import random

import pytest

from autofit.errors import SpecError
from autofit.evaluators.allocator import (
    AllocatorConfig,
    AllocatorOOM,
    CachingAllocator,
    Replay,
    get_allocation_size,
    replay,
    round_size,
    roundup_power2_next_division,
)
from autofit.specs.units import GiB, MiB

EXPANDABLE = AllocatorConfig(expandable_segments=True)


# -- sizes: round_size, get_allocation_size ---------------------------------------------------------------
def test_one_byte_is_512_allocated_in_a_2mib_segment():
    # round_size: < kMinBlockSize -> 512; get_allocation_size: small -> kSmallBuffer (2 MiB)
    a = CachingAllocator()
    a.malloc(1)
    assert (a.allocated, a.reserved, a.segments, a.mallocs) == (512, 2 * MiB, 1, 1)


def test_sizes_round_up_to_512():
    # round_size: kMinBlockSize * ceil(size / kMinBlockSize)
    assert [round_size(n) for n in (0, 511, 512, 513, 1025)] == [512, 512, 512, 1024, 1536]


def test_1mib_is_small_pool_1mib_plus_1_is_large_with_a_20mib_segment():
    # get_pool: size <= kSmallSize (1 MiB) is small; get_allocation_size: < kMinLargeAlloc -> kLargeBuffer
    a = CachingAllocator()
    a.malloc(MiB)
    assert a.reserved == 2 * MiB
    a.malloc(MiB + 1)
    assert a.reserved == 2 * MiB + 20 * MiB
    assert a.allocated == MiB + MiB + 512


def test_large_requests_round_to_2mib_segments():
    # get_allocation_size: >= kMinLargeAlloc -> kRoundLarge (2 MiB) * ceil(size / 2 MiB)
    assert get_allocation_size(10 * MiB) == 10 * MiB
    assert get_allocation_size(11 * MiB + 1) == 12 * MiB
    a = CachingAllocator()
    a.malloc(10 * MiB)
    assert a.reserved == 10 * MiB
    a.malloc(11 * MiB + 1)
    assert a.reserved == 22 * MiB
    # should_split: the 1 MiB - 512 left of the 12 MiB segment is not > kSmallSize, so the whole block is
    # handed out and allocated_bytes counts all of it
    assert a.allocated == 22 * MiB


def test_two_5mib_allocations_share_one_20mib_segment():
    # alloc_found_block + should_split: the 20 MiB kLargeBuffer is split, the rest (15 MiB > kSmallSize) cached
    a = CachingAllocator()
    a.malloc(5 * MiB)
    a.malloc(5 * MiB)
    assert (a.allocated, a.reserved, a.segments, a.mallocs) == (10 * MiB, 20 * MiB, 1, 1)


def test_small_allocations_pack_into_2mib_segments():
    # should_split, small pool: split while the remainder is >= kMinBlockSize
    a = CachingAllocator()
    for _ in range(4):
        a.malloc(512 * 1024)
    assert (a.reserved, a.segments) == (2 * MiB, 1)
    a.malloc(512)
    assert (a.reserved, a.segments) == (4 * MiB, 2)


# -- caching, best fit, merging ----------------------------------------------------------------------------
def test_free_then_realloc_reuses_the_cached_block():
    # free_block caches the block; get_free_block finds it: no new cudaMalloc
    a = CachingAllocator()
    h = a.malloc(30 * MiB)
    a.free(h)
    assert (a.allocated, a.reserved) == (0, 30 * MiB)
    a.malloc(29 * MiB)
    assert (a.reserved, a.mallocs) == (30 * MiB, 1)
    assert a.allocated == 30 * MiB  # 29 MiB leaves 1 MiB: not > kSmallSize, so not split


def test_best_fit_takes_the_smallest_block_that_fits():
    # get_free_block: lower_bound over (stream, size, address) is the smallest cached block >= the request
    a = CachingAllocator()
    big, mid, small = a.malloc(40 * MiB), a.malloc(24 * MiB), a.malloc(12 * MiB)
    for h in (big, mid, small):
        a.free(h)
    h = a.malloc(20 * MiB)
    assert h == mid  # the 24 MiB segment, not the 40 MiB one
    assert a.allocated == 20 * MiB  # split: 4 MiB remain cached (> kSmallSize)
    assert a.reserved == 76 * MiB


def test_equal_sizes_tie_break_on_address():
    # BlockComparatorSize: equal sizes are ordered by address, lower first
    a = CachingAllocator()
    first, second = a.malloc(12 * MiB), a.malloc(12 * MiB)
    a.free(second)
    a.free(first)
    assert a.malloc(12 * MiB) == first


def test_adjacent_freed_blocks_merge():
    # free_block -> try_merge_blocks with prev and next: the segment is whole again
    a = CachingAllocator()
    x, y, z = a.malloc(6 * MiB), a.malloc(6 * MiB), a.malloc(6 * MiB)
    assert a.segments == 1
    a.free(x)
    a.free(z)
    a.free(y)  # merges with both neighbours
    h = a.malloc(20 * MiB)  # only fits in the whole 20 MiB segment
    assert (h, a.reserved, a.mallocs) == (x, 20 * MiB, 1)


def test_fragmentation_reserved_grows_while_allocated_does_not():
    # get_free_block finds no cached block >= the request: 12 MiB holes do not hold 14 MiB
    a = CachingAllocator()
    step1 = [a.malloc(12 * MiB) for _ in range(10)]
    for h in step1:
        a.free(h)
    for _ in range(10):
        a.malloc(14 * MiB)
    assert a.peak_allocated == 140 * MiB
    assert a.reserved == 260 * MiB  # 10 x 12 cached + 10 x 14 new


def test_expandable_segments_keep_reserved_close_to_allocated():
    # ExpandableSegment: one growing segment per stream and pool, 20 MiB pages for the large pool; freed
    # blocks merge into one range that the larger step tiles
    a = CachingAllocator(EXPANDABLE)
    step1 = [a.malloc(12 * MiB) for _ in range(10)]
    assert a.reserved == 120 * MiB  # 6 pages of 20 MiB
    for h in step1:
        a.free(h)
    for _ in range(10):
        a.malloc(14 * MiB)
    assert (a.peak_allocated, a.reserved, a.segments) == (140 * MiB, 140 * MiB, 1)


def test_expandable_small_pool_maps_2mib_pages():
    # find_expandable_block: segment_size = kSmallBuffer for the small pool
    a = CachingAllocator(EXPANDABLE)
    a.malloc(1)
    a.malloc(MiB)
    assert (a.allocated, a.reserved) == (512 + MiB, 2 * MiB)
    a.malloc(MiB)
    assert a.reserved == 4 * MiB


def test_expandable_frees_stay_mapped_until_empty_cache():
    # free_block keeps pages mapped; release_cached_blocks -> unmap_block + release_expandable_segment
    a = CachingAllocator(EXPANDABLE)
    hs = [a.malloc(30 * MiB) for _ in range(3)]
    assert a.reserved == 100 * MiB  # 90 MiB in 20 MiB pages
    a.free(hs[0])
    a.free(hs[2])
    assert a.reserved == 100 * MiB
    # layout [0,30) [30,60) [60,90) + [90,100) free; only pages wholly inside free blocks go:
    # [0,20) of the first block and [60,100) of the merged tail
    a.empty_cache()
    assert a.reserved == 40 * MiB
    a.free(hs[1])
    a.empty_cache()
    assert (a.reserved, a.segments, a.allocated) == (0, 0, 0)


# -- max_split_size and rounding ---------------------------------------------------------------------------
def test_max_split_size_keeps_oversize_blocks_from_small_requests():
    # get_free_block: a request < max_split_size does not take a cached block >= max_split_size
    cfg = AllocatorConfig.parse("max_split_size_mb:20")
    a = CachingAllocator(cfg)
    a.free(a.malloc(64 * MiB))
    a.malloc(4 * MiB)
    assert a.reserved == 64 * MiB + 20 * MiB
    plain = CachingAllocator()  # without it the 64 MiB block is split
    plain.free(plain.malloc(64 * MiB))
    plain.malloc(4 * MiB)
    assert plain.reserved == 64 * MiB


def test_max_split_size_oversize_block_only_within_the_rounding_limit():
    # get_free_block: a request >= max_split_size takes an oversize block only if block < request +
    # max_non_split_rounding (default kLargeBuffer), and the block is not split (should_split)
    a = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:20"))
    a.free(a.malloc(64 * MiB))
    a.malloc(50 * MiB)  # 64 < 50 + 20: taken whole
    assert (a.allocated, a.reserved) == (64 * MiB, 64 * MiB)
    b = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:20"))
    b.free(b.malloc(64 * MiB))
    b.malloc(40 * MiB)  # 64 >= 40 + 20: refused, a new segment
    assert (b.allocated, b.reserved) == (40 * MiB, 104 * MiB)


def test_roundup_power2_divisions():
    # roundup_power2_next_division: 1200 MiB with 4 divisions -> 1280 MiB (steps of 256 MiB from 1024)
    assert roundup_power2_next_division(1200 * MiB, 4) == 1280 * MiB
    assert roundup_power2_next_division(1024 * MiB, 4) == 1024 * MiB  # a power of two stays
    a = CachingAllocator(AllocatorConfig(roundup_power2_divisions=4))
    a.malloc(1200 * MiB)
    assert a.allocated == 1280 * MiB
    # round_size: only when size > kMinBlockSize * divisions; below that the 512 rounding applies
    table = AllocatorConfig(roundup_power2_divisions=4).roundup_power2_divisions
    assert round_size(1500, table) == 1536
    assert round_size(3000, table) == 3072


def test_roundup_power2_divisions_per_interval():
    # parseRoundUpPower2Divisions: the first boundary fills below it, '>' fills after the last boundary;
    # roundup_power2_divisions(size): interval index log2(size) - 20
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert cfg.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    t = cfg.roundup_power2_divisions
    assert round_size(300 * MiB, t) == 300 * MiB  # 1 division: no power-of-two rounding
    assert round_size(600 * MiB, t) == 768 * MiB
    assert round_size(1200 * MiB, t) == 1280 * MiB
    assert round_size(3000 * MiB, t) == 3072 * MiB


# -- streams -----------------------------------------------------------------------------------------------
def test_streams_do_not_share_cached_blocks():
    # get_free_block: lower_bound is keyed by stream first; a block is reused only on its stream
    a = CachingAllocator()
    a.free(a.malloc(MiB, stream=0))
    a.malloc(MiB, stream=1)
    assert (a.reserved, a.segments) == (4 * MiB, 2)
    a.malloc(MiB, stream=0)
    assert a.reserved == 4 * MiB


def test_replay_with_streams():
    log = [("a", MiB), ("a", -MiB), ("b", MiB), ("b", -MiB), ("c", MiB)]
    assert replay(log).peak_reserved == 2 * MiB
    assert replay(log, streams={"b": 1}).peak_reserved == 4 * MiB


# -- capacity: malloc's fallbacks and the OOM --------------------------------------------------------------
def test_allocation_that_fits_only_after_empty_cache():
    # malloc: alloc_block fails -> release_cached_blocks (empty_cache) -> alloc_block(isRetry) succeeds
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(32 * MiB)
    assert (a.reserved, a.alloc_retries, a.device_frees) == (32 * MiB, 1, 1)


def test_oversize_cached_block_is_released_first():
    # release_available_cached_blocks: with max_split_size set, the smallest oversize cached block that covers
    # the request is cudaFree'd before the retry; no full empty_cache needed
    a = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:20"), capacity=100 * MiB)
    a.free(a.malloc(64 * MiB))
    a.free(a.malloc(MiB))  # a small-pool cached segment that an empty_cache would also free
    a.malloc(40 * MiB)  # 64 >= 40 + 20: not reusable; 66 + 40 > 100
    assert (a.reserved, a.alloc_retries) == (42 * MiB, 0)


def test_allocation_that_cannot_fit_raises_oom():
    # malloc: every fallback failed -> OutOfMemoryError with allocated_bytes and reserved_bytes
    a = CachingAllocator(capacity=40 * MiB)
    a.malloc(30 * MiB)
    a.free(a.malloc(MiB))  # a cached small segment, freed by the retry
    with pytest.raises(AllocatorOOM) as err:
        a.malloc(12 * MiB)
    oom = err.value
    assert (oom.alloc_size, oom.allocated, oom.reserved, oom.capacity) == (12 * MiB, 30 * MiB, 30 * MiB, 40 * MiB)
    assert "Tried to allocate 12.00 MiB" in str(oom)
    assert a.ooms == 1
    assert pickle.loads(pickle.dumps(oom)).alloc_size == 12 * MiB


def test_replay_records_the_oom_and_stops():
    log = [("a", 30 * MiB), ("b", 12 * MiB), ("a", -30 * MiB)]
    r = replay(log, capacity=40 * MiB)
    assert isinstance(r.oom, AllocatorOOM)
    assert (r.events, r.peak_allocated, r.peak_reserved) == (2, 30 * MiB, 30 * MiB)
    assert replay(log).oom is None


def test_garbage_collection_frees_old_cached_blocks_before_cudamalloc():
    # garbage_collect_cached_blocks: armed by a memory fraction; above threshold x allowed it frees unsplit
    # cached blocks whose age is at least the average, although the device still has room
    cfg = AllocatorConfig.parse("garbage_collection_threshold:0.5,per_process_memory_fraction:0.99")
    a = CachingAllocator(cfg, capacity=100 * MiB, device_total=100 * MiB)
    a.free(a.malloc(24 * MiB))
    a.malloc(30 * MiB)
    a.malloc(26 * MiB)  # 24 + 30 > 49.5 MiB: the cached 24 MiB block goes first
    assert a.reserved == 56 * MiB
    unarmed = CachingAllocator(AllocatorConfig.parse("garbage_collection_threshold:0.5"), capacity=100 * MiB)
    unarmed.free(unarmed.malloc(24 * MiB))
    unarmed.malloc(30 * MiB)
    unarmed.malloc(26 * MiB)  # no fraction set: the threshold does nothing, as in torch
    assert unarmed.reserved == 80 * MiB


def test_memory_fraction_caps_reserved():
    # alloc_block: allowed_memory_maximum is checked against alloc_size before any cudaMalloc
    a = CachingAllocator(capacity=100 * MiB, memory_fraction=0.5)
    a.malloc(40 * MiB)
    with pytest.raises(AllocatorOOM) as err:
        a.malloc(12 * MiB)
    assert err.value.allowed == 50 * MiB


# -- counters ----------------------------------------------------------------------------------------------
def test_peaks_and_reset():
    # resetPeakStats: peaks restart from the current values
    a = CachingAllocator()
    h = a.malloc(12 * MiB)
    a.malloc(MiB)
    a.free(h)
    assert (a.peak_allocated, a.peak_reserved, a.reserved_at_peak_allocated) == (13 * MiB, 14 * MiB, 14 * MiB)
    a.reset_peak()
    assert (a.peak_allocated, a.peak_reserved) == (MiB, 14 * MiB)


def test_replay_summary():
    log = [(1, 5 * MiB), (2, 5 * MiB), (1, -5 * MiB), (3, 30 * MiB), (2, -5 * MiB), (3, -30 * MiB)]
    r = replay(log)
    assert r == Replay(
        peak_allocated=35 * MiB,
        peak_reserved=50 * MiB,
        reserved_at_peak_allocated=50 * MiB,
        segments=2,
        mallocs=2,
        events=6,
    )
    assert r.reserved_ratio == pytest.approx(50 / 35)


def test_bad_logs_and_handles_are_errors():
    with pytest.raises(ValueError, match="not live"):
        replay([("a", -512)])
    with pytest.raises(ValueError, match="twice"):
        replay([("a", 512), ("a", 512)])
    with pytest.raises(ValueError):
        CachingAllocator().free(12345)


def _check_books(a: CachingAllocator) -> None:
    """The allocator's invariants: every segment is a gap-free chain of blocks; no two free neighbours in the
    same mapped state (free_block/try_merge_blocks always merge them); reserved is the mapped bytes and
    allocated the allocated blocks; the sorted free lists hold exactly the free mapped blocks."""
    blocks = set(a._free.values()) | set(a._unmapped.values()) | set(a._active.values())
    seen, mapped = set(), 0
    for head in (b for b in blocks if b.prev is None):
        b, addr = head, head.addr
        while b is not None:
            assert b.addr == addr and b not in seen
            seen.add(b)
            mapped += b.size if b.mapped else 0
            n = b.next
            if n is not None:
                assert n.prev is b
                assert b.allocated or n.allocated or b.mapped != n.mapped
            addr, b = addr + b.size, n
    assert seen == blocks
    assert (mapped, sum(b.size for b in a._active.values())) == (a.reserved, a.allocated)
    assert all(b.key == k and b.mapped and not b.allocated for k, b in a._free.items())
    for pool in a._pools.values():
        assert pool.keys == sorted(pool.keys) and pool.unmapped == sorted(pool.unmapped)
    assert len(a._free) == sum(len(p.keys) for p in a._pools.values())


@pytest.mark.parametrize(
    "conf",
    [
        "",
        "expandable_segments:True",
        "max_split_size_mb:64",
        "expandable_segments:True,max_split_size_mb:40,roundup_power2_divisions:[1:2,>:4]",
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9,max_split_size_mb:30",
    ],
)
@pytest.mark.parametrize("capacity", [None, 600 * MiB])
def test_random_mallocs_and_frees_keep_the_books(conf, capacity):
    # invariants of the block lists under random sizes, two streams, empty_cache calls and OOMs; at the end
    # everything freed and empty_cache drop every segment
    rng = random.Random(len(conf) + (capacity or 0))
    a = CachingAllocator(AllocatorConfig.parse(conf), capacity)
    live = []
    for step in range(1500):
        r = rng.random()
        if r < 0.01:
            a.empty_cache()
        elif live and r < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randrange(1, MiB), rng.randrange(MiB, 12 * MiB), rng.randrange(1, 100 * MiB)])
            try:
                live.append(a.malloc(size, stream=rng.randrange(2)))
            except AllocatorOOM:
                pass
        if step % 5 == 0:
            _check_books(a)
        assert a.allocated <= a.reserved <= (capacity or a.reserved)
    for h in live:
        a.free(h)
    a.empty_cache()
    _check_books(a)
    assert (a.allocated, a.reserved, a.segments) == (0, 0, 0)


def test_replay_benchmark_200k_events():
    # not timed: 2 x 10^5 events of a training-step-like mix must simply replay
    rng = random.Random(0)
    log, live = [], []
    for key in range(100_000):
        size = rng.choice([512 * rng.randrange(1, 2048), 512 * rng.randrange(2048, 100_000)])
        log.append((key, size))
        live.append((key, size))
        if len(live) > 300 or rng.random() < 0.3:
            k, s = live.pop(rng.randrange(len(live)))
            log.append((k, -s))
    log += [(k, -s) for k, s in live]
    r = replay(log[:200_000])
    assert r.oom is None and r.peak_reserved >= r.peak_allocated > 0


# -- PYTORCH_CUDA_ALLOC_CONF -------------------------------------------------------------------------------
def test_parse_good_values():
    # AcceleratorAllocatorConfig::parseArgs / CUDAAllocatorConfig::parseArgs
    cfg = AllocatorConfig.parse(
        "expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:4,backend:native,pinned_use_cuda_host_register:True,"
        "release_lock_on_cudamalloc:False,pinned_num_register_threads:8,"
    )
    assert cfg.expandable_segments and cfg.max_split_size == 128 * MiB
    assert cfg.garbage_collection_threshold == 0.6
    assert cfg.roundup_power2_divisions == (4,) * 16
    assert AllocatorConfig.parse("") == AllocatorConfig.parse(None) == AllocatorConfig()
    big = AllocatorConfig.parse("large_segment_size_mb:64,max_split_size_mb:64")
    assert (big.large_segment_size, big.non_split_rounding) == (64 * MiB, 64 * MiB)
    assert get_allocation_size(5 * MiB, big.large_segment_size) == 64 * MiB


@pytest.mark.parametrize(
    "text, key",
    [
        ("max_split_size_mb:19", "max_split_size_mb"),  # parseMaxSplitSize: >= kLargeBuffer / kMB
        ("max_split_size_mb:lots", "max_split_size_mb"),
        ("expandable_segments:true", "expandable_segments"),  # toBool: only True / False
        ("garbage_collection_threshold:1.0", "garbage_collection_threshold"),  # in (0.0, 1.0)
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),  # a power of 2
        ("roundup_power2_divisions:[100:2]", "roundup_power2_divisions"),  # intervals powers of 2
        ("large_segment_size_mb:10", "large_segment_size_mb"),  # > kMinLargeAlloc / kMB
        ("max_split_size_mb:20,large_segment_size_mb:32", "max_split_size_mb"),  # >= large_segment_size
        ("per_process_memory_fraction:1.5", "per_process_memory_fraction"),
        ("pinned_num_register_threads:256", "pinned_num_register_threads"),
        ("backend:magic", "backend"),
        ("max_split_size:128", "max_split_size"),  # unknown key
        ("expandable_segments", "expandable_segments"),  # no value
    ],
)
def test_parse_bad_values_name_the_key(text, key):
    with pytest.raises(SpecError, match=key):
        AllocatorConfig.parse(text)


def test_cuda_malloc_async_is_not_modelled():
    with pytest.raises(SpecError, match="not modelled"):
        AllocatorConfig.parse("backend:cudaMallocAsync")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "expandable_segments:True",
        "max_split_size_mb:128,garbage_collection_threshold:0.8",
        "roundup_power2_divisions:[64:8,256:4,1024:4,>:1]",
        "roundup_power2_divisions:[1:2,>:16]",
        "large_segment_size_mb:32,max_non_split_rounding_mb:64,per_process_memory_fraction:0.9",
    ],
)
def test_describe_round_trips_through_parse(text):
    cfg = AllocatorConfig.parse(text)
    assert AllocatorConfig.parse(cfg.describe()) == cfg
    assert AllocatorConfig.parse("expandable_segments:False").describe() == ""


def test_config_from_env():
    # AcceleratorAllocatorConfig::instance: PYTORCH_ALLOC_CONF is the new name of PYTORCH_CUDA_ALLOC_CONF
    assert AllocatorConfig.from_env({}) == AllocatorConfig()
    assert AllocatorConfig.from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == EXPANDABLE
    assert AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == EXPANDABLE
    same = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert AllocatorConfig.from_env(same) == EXPANDABLE
    with pytest.raises(SpecError, match="PYTORCH_CUDA_ALLOC_CONF"):
        AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": ""})


def test_config_constructor_validates():
    with pytest.raises(SpecError, match="max_split_size"):
        AllocatorConfig(max_split_size=5 * MiB)
    with pytest.raises(SpecError, match="roundup_power2_divisions"):
        AllocatorConfig(roundup_power2_divisions=3)
    assert AllocatorConfig(roundup_power2_divisions=((256, 1), (512, 2), (1024, 4), (">", 8))) == AllocatorConfig.parse(
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    )
    assert AllocatorConfig(max_split_size=GiB).describe() == "max_split_size_mb:1024"
