"""Block allocator and KV manager: allocation, growth, moves between pools (contents kept), every block back."""
import pytest
import torch

from apex_compile.ops import gather_kv
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, BlockAllocator, CacheShape, KVManager


def make_manager(device_blocks=6, host_blocks=5, block_size=16, layers=2):
    shape = CacheShape(num_layers=layers, num_kv_heads=2, head_dim=16, block_size=block_size, dtype=torch.float32)
    return KVManager(shape, device_blocks, host_blocks, torch.device("cpu"))


def test_allocator_hands_out_each_block_once_and_takes_all_back():
    alloc = BlockAllocator(7)
    first = alloc.allocate(3)
    second = alloc.allocate(4)
    assert sorted(first + second) == list(range(7))
    assert alloc.num_free == 0
    with pytest.raises(RuntimeError):
        alloc.allocate(1)
    alloc.free(second)
    alloc.free(first)
    assert alloc.num_free == 7
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([0])


def test_allocator_keeps_a_request_in_one_run_after_churn():
    """Freed ids merge back into runs, and a request takes the first run that holds it whole: after requests
    of many sizes come and go in any order, a request that fits in a free run gets consecutive ids (a move
    between pools then crosses in one copy per cache). With no such run it takes the longest runs first."""
    import random

    rng = random.Random(0)
    alloc = BlockAllocator(400)
    held = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.randrange(len(held))))
        elif alloc.num_free:
            held.append(alloc.allocate(rng.randint(1, min(40, alloc.num_free))))
        in_use = sorted(b for ids in held for b in ids)
        assert len(set(in_use)) == len(in_use) and alloc.num_free == 400 - len(in_use)
        longest = max((alloc._lengths[s] for s in alloc._starts), default=0)
        if 0 < longest:
            probe = alloc.allocate(longest)
            assert probe == list(range(probe[0], probe[0] + longest))  # one run
            alloc.free(probe)
    for ids in held:
        alloc.free(ids)
    assert alloc.num_free == 400 and alloc.num_runs == 1  # every freed run merged back
    split = BlockAllocator(10)
    a, b, c, d = split.allocate(2), split.allocate(3), split.allocate(1), split.allocate(4)
    split.free(a)
    split.free(d)  # free runs: 0-1 and 6-9
    assert split.allocate(5) == [6, 7, 8, 9, 0]  # no run holds 5: the longest first
    with pytest.raises(RuntimeError, match="double free"):
        split.free([2, 2])
    split.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        split.free([3])  # already free, inside a run
    with pytest.raises(RuntimeError, match="out of range"):
        split.free([10])


def test_block_bytes_counts_k_and_v_of_every_layer():
    shape = CacheShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    assert shape.block_bytes == 2 * 30 * 3 * 16 * 64 * 2


def test_grow_allocates_only_missing_blocks_and_refuses_without_taking():
    kv = make_manager(device_blocks=4)
    assert kv.grow(1, DEVICE_POOL, 17)  # 2 blocks
    assert len(kv.tables[1].block_ids) == 2
    assert kv.grow(1, DEVICE_POOL, 32)  # still 2
    assert len(kv.tables[1].block_ids) == 2
    assert kv.grow(2, DEVICE_POOL, 20)  # 2 more: pool full
    assert kv.num_free(DEVICE_POOL) == 0
    assert not kv.grow(1, DEVICE_POOL, 33)
    assert len(kv.tables[1].block_ids) == 2
    with pytest.raises(RuntimeError, match="lives in the device pool"):
        kv.grow(1, HOST_POOL, 40)
    kv.free(1)
    kv.free(2)
    kv.free(3)  # holds nothing: no-op
    assert kv.num_used(DEVICE_POOL) == 0 and not kv.tables


@pytest.mark.parametrize("src,dst", [(DEVICE_POOL, HOST_POOL), (HOST_POOL, DEVICE_POOL)])
def test_move_copies_every_layer_and_frees_the_source(src, dst):
    kv = make_manager()
    for pool in kv.pools:
        for cache in pool.key_caches + pool.value_caches:
            cache.fill_(float("nan"))
    num_tokens = 37
    assert kv.grow(5, src, num_tokens)
    old_ids = list(kv.tables[5].block_ids)
    expected = []
    for layer in range(kv.shape.num_layers):
        for cache in (kv.pools[src].key_caches[layer], kv.pools[src].value_caches[layer]):
            cache[old_ids] = torch.randn_like(cache[old_ids])
        expected.append(gather_kv(kv.pools[src].key_caches[layer], kv.pools[src].value_caches[layer],
                                  old_ids, num_tokens))
    kv.move(5, dst)
    kv.wait_for_moves()
    assert kv.pool_of(5) == dst and kv.num_used(src) == 0 and kv.num_used(dst) == len(old_ids)
    new_ids = kv.tables[5].block_ids
    for layer in range(kv.shape.num_layers):
        k, v = gather_kv(kv.pools[dst].key_caches[layer], kv.pools[dst].value_caches[layer], new_ids, num_tokens)
        torch.testing.assert_close(k, expected[layer][0], rtol=0, atol=0)
        torch.testing.assert_close(v, expected[layer][1], rtol=0, atol=0)
    kv.free(5)
    assert kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0


def test_move_without_room_raises_and_keeps_the_request():
    kv = make_manager(device_blocks=6, host_blocks=2)
    assert kv.grow(1, DEVICE_POOL, 16 * 3)
    assert not kv.can_move(1, HOST_POOL)
    with pytest.raises(RuntimeError, match="no room"):
        kv.move(1, HOST_POOL)
    assert kv.pool_of(1) == DEVICE_POOL and len(kv.tables[1].block_ids) == 3


def test_empty_pool_allocates_nothing():
    kv = make_manager(device_blocks=0, host_blocks=3)
    assert kv.pools[DEVICE_POOL].key_caches == []
    assert not kv.grow(1, DEVICE_POOL, 1)
    assert 1 not in kv.tables


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_host_pool_is_page_locked_at_its_exact_size_and_unlocked_at_close():
    """cudaHostRegister on plain memory instead of torch's pinned allocator (which rounds each layer's cache up
    to a power of two): the caches are pinned, hold exactly their blocks, and move to and from the GPU."""
    shape = CacheShape(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    kv = KVManager(shape, 4, 37, torch.device("cuda"))  # 37 blocks: no power of two
    host = kv.pools[HOST_POOL]
    assert host.registration is not None and len(host.registration.tensors) == 2 * shape.num_layers
    for cache in host.key_caches + host.value_caches:
        assert cache.is_pinned() and cache.nbytes == 37 * 2 * 16 * 64 * 2
    kv.grow(1, HOST_POOL, 20)
    filled = torch.randn(host.key_caches[0].shape, dtype=torch.bfloat16, device="cuda")
    host.key_caches[0].copy_(filled, non_blocking=True)  # device to registered host memory
    torch.cuda.synchronize()
    kv.move(1, DEVICE_POOL)  # and back, on the swap stream
    kv.wait_for_moves()
    blocks = kv.tables[1].block_ids
    torch.cuda.synchronize()
    assert torch.equal(kv.pools[DEVICE_POOL].key_caches[0][blocks].cpu(), filled[[0, 1]].cpu())
    kv.close()
    assert not host.registration.tensors and not host.key_caches


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moves_of_a_large_host_pool_leave_the_launching_thread_free():
    """Host layers of several MiB (the huge-page path) read as pinned, so a park and a resume queued behind
    GPU work return to the host at once (their copies wait on the swap stream, not on the host), and land."""
    shape = CacheShape(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    kv = KVManager(shape, 64, 200, torch.device("cuda"))  # a host layer's cache: 6.25 MiB
    host = kv.pools[HOST_POOL]
    assert all(cache.is_pinned() for cache in host.key_caches + host.value_caches)
    kv.grow(1, DEVICE_POOL, 64 * 16)
    filled = torch.randn(kv.pools[DEVICE_POOL].key_caches[0].shape, dtype=torch.bfloat16, device="cuda")
    kv.pools[DEVICE_POOL].key_caches[0].copy_(filled)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of queued GPU work ahead of the moves
    kv.move(1, HOST_POOL)
    assert not kv.landed(1)  # the host returned before the copy ran
    kv.move(1, DEVICE_POOL)
    assert torch.cuda.current_stream().query() is False
    kv.sync_moves()
    blocks = kv.tables[1].block_ids
    assert torch.equal(kv.pools[DEVICE_POOL].key_caches[0][blocks].cpu(), filled.cpu())
    kv.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_host_pool_collected_without_close_is_unregistered_by_the_next_one():
    import gc

    from apex_compile.runtime import kv_manager

    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    kv = KVManager(shape, 2, 9, torch.device("cuda"))
    del kv
    gc.collect()
    assert len(kv_manager._UNRELEASED) == 1  # no CUDA call in the collector (it may run during a capture)
    again = KVManager(shape, 2, 9, torch.device("cuda"))
    assert not kv_manager._UNRELEASED
    again.close()


def test_shrink_returns_the_blocks_past_the_tokens_kept_in_a_new_table():
    kv = make_manager(host_blocks=5)
    assert kv.grow(0, HOST_POOL, 70)  # 5 blocks
    before = kv.tables[0]
    kv.shrink(0, 33)  # 3 blocks cover 33 tokens
    assert kv.tables[0].block_ids == before.block_ids[:3] and kv.tables[0] is not before
    assert kv.num_free(HOST_POOL) == 2 and kv.tables[0].pool == HOST_POOL
    kv.shrink(0, 40)  # already within: nothing changes
    assert kv.num_free(HOST_POOL) == 2 and len(kv.tables[0].block_ids) == 3
    kv.free(0)
    assert kv.num_free(HOST_POOL) == 5


@pytest.fixture
def overlapped():
    """A CPU manager with overlapped moves over a swap stream whose copies land late (`DeferredSwap`)."""
    from tests.helpers import DeferredSwap

    kv = make_manager(device_blocks=6, host_blocks=8)
    kv._swap = DeferredSwap(delay=10 ** 6)  # lands only when waited for
    return kv


def fill(kv, request_id, pool, tokens):
    assert kv.grow(request_id, pool, tokens)
    for layer in range(kv.shape.num_layers):
        for cache in (kv.pools[pool].key_caches[layer], kv.pools[pool].value_caches[layer]):
            cache[kv.tables[request_id].block_ids] = torch.randn_like(cache[kv.tables[request_id].block_ids])
    return [gather_kv(kv.pools[pool].key_caches[layer], kv.pools[pool].value_caches[layer],
                      kv.tables[request_id].block_ids, tokens) for layer in range(kv.shape.num_layers)]


def assert_holds(kv, request_id, expected, tokens):
    table = kv.tables[request_id]
    pool = kv.pools[table.pool]
    for layer, (k_ref, v_ref) in enumerate(expected):
        k, v = gather_kv(pool.key_caches[layer], pool.value_caches[layer], table.block_ids, tokens)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_a_park_ahead_holds_its_device_blocks_until_its_copy_lands(overlapped):
    """move(hold=True): the device blocks stay out of every allocation until the copy has read them, and the
    compute stream is not ordered after it; a grow that needs them waits for the copy instead of failing."""
    kv = overlapped
    expected = fill(kv, 1, DEVICE_POOL, 40)  # 3 blocks
    old = set(kv.tables[1].block_ids)
    kv.move(1, HOST_POOL, hold=True)
    kv.wait_for_moves()
    assert kv._swap.ordered == 0 and kv.num_free(DEVICE_POOL) == 3 and kv.num_held(DEVICE_POOL) == 3
    assert kv.grow(2, DEVICE_POOL, 48) and not old & set(kv.tables[2].block_ids)  # the 3 truly free ones
    assert kv._swap.pending  # not landed yet
    assert kv.grow(3, DEVICE_POOL, 16)  # needs a held block: waits for the copy
    assert not kv._swap.pending and kv.num_held(DEVICE_POOL) == 0
    kv.host_ready(1)
    assert_holds(kv, 1, expected, 40)


def test_a_resume_orders_the_compute_and_holds_its_host_blocks(overlapped):
    """A move into the device pool: the compute stream waits for it (on the device, the host goes on); its
    source host blocks return only once the copy has read them."""
    kv = overlapped
    expected = fill(kv, 1, HOST_POOL, 40)
    old = set(kv.tables[1].block_ids)
    kv.move(1, DEVICE_POOL)
    assert kv.num_free(HOST_POOL) == 5 and kv.num_held(HOST_POOL) == 3
    assert kv.grow(2, HOST_POOL, 16 * 5) and not old & set(kv.tables[2].block_ids)
    kv.wait_for_moves()
    assert kv._swap.ordered == 1 and not kv._swap.pending
    assert_holds(kv, 1, expected, 40)
    assert kv.num_free(HOST_POOL) == 3 and kv.num_held(HOST_POOL) == 0


def test_a_park_landing_is_waited_for_by_host_readers_and_its_free(overlapped):
    """A park's destination host blocks: `host_ready` waits for the copy; freeing the request before it landed
    keeps them until it has; `sync_moves` lands everything."""
    kv = overlapped
    expected = fill(kv, 1, DEVICE_POOL, 40)
    kv.move(1, HOST_POOL)
    kv.host_ready(1)
    assert not kv._swap.pending
    assert_holds(kv, 1, expected, 40)
    fill(kv, 2, DEVICE_POOL, 40)
    kv.move(2, HOST_POOL)
    kv.free(2)
    assert kv.num_held(HOST_POOL) == 3 and kv._swap.pending
    kv.sync_moves()
    assert kv.num_held(HOST_POOL) == 0 and not kv._swap.pending
    kv.free(1)
    assert kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0


def test_landed_tells_a_parks_landing_without_waiting_for_it(overlapped):
    """`landed`: False while a park's copy is in flight (nothing waited for, nothing copied), True once it ran;
    a request with no copy in flight has landed."""
    kv = overlapped
    kv._swap.delay = 2  # the copy lands at its event's third query
    expected = fill(kv, 1, DEVICE_POOL, 40)
    kv.move(1, HOST_POOL, hold=True)
    assert not kv.landed(1) and not kv.landed(1) and kv._swap.pending  # queried, not run
    assert kv.landed(1) and not kv._swap.pending and kv.landed(1)
    assert_holds(kv, 1, expected, 40)
    assert kv.landed(7)  # no copy in flight
