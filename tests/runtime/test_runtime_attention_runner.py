"""PagedAttentionRunner against a float64 reference: decode rows, continued prompt chunks and fresh prompt chunks
in both pools in one step; the synchronous and the launch/device/wait forms agree; the runner only reads cache
slots that were written (caches start as NaN)."""
import concurrent.futures
import random
import re
import sys
import threading
import time
from typing import Optional

import pytest
import torch

from apex_compile.ops import cache_append_cpu
from apex_compile.ops.kv_layout import gather_kv
from apex_compile.runtime.attention_runner import KVExports, PagedAttentionRunner, order_chunks
from apex_compile.runtime.context import attention_runner, get_attention_runner
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, CacheShape, KVManager
from apex_compile.runtime.request import Request, SamplingParams
from apex_compile.runtime.scheduler import ScheduledChunk
from tests.devices import CUDA_ONLY, INTERPRET

HQ, HKV, D, LAYERS = 4, 2, 32, 2


def build_step(seed, specs, block_size=16):
    """specs: (pool, prior tokens, chunk tokens) per request. Returns runner, ordered chunks, history, new q/k/v."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shape = CacheShape(LAYERS, HKV, D, block_size, torch.float32)
    kv = KVManager(shape, 40, 40, torch.device("cpu"))
    for pool in kv.pools:
        for cache in pool.key_caches + pool.value_caches:
            cache.fill_(float("nan"))
    runner = PagedAttentionRunner(kv, torch.device("cpu"))
    chunks, history = [], {}
    for request_id, (pool, prior, num_new) in enumerate(specs):
        request = Request(request_id, [1] * (prior + num_new), SamplingParams())
        request.num_computed = prior
        assert kv.grow(request_id, pool, prior + num_new)
        # scatter the block ids so tables are not contiguous
        rng.shuffle(kv.tables[request_id].block_ids)
        history[request_id] = [(torch.randn(prior, HKV, D, dtype=torch.float64),
                                torch.randn(prior, HKV, D, dtype=torch.float64)) for _ in range(LAYERS)]
        chunks.append(ScheduledChunk(request, prior, num_new, pool))
    # write the prior context with the pool's own append op
    for chunk in chunks:
        if chunk.start == 0:
            continue
        one = order_chunks([ScheduledChunk(chunk.request, 0, chunk.start, chunk.pool)])
        runner.prepare(one)
        part = runner.parts[0]
        for layer in range(LAYERS):
            k, v = history[chunk.request.request_id][layer]
            cache_append_cpu(k.float(), v.float(), part.pool.key_caches[layer], part.pool.value_caches[layer],
                             part.slot_mapping)
    ordered = order_chunks(chunks)
    total = sum(c.num_tokens for c in ordered)
    new = [(torch.randn(total, HQ, D, dtype=torch.float64), torch.randn(total, HKV, D, dtype=torch.float64),
            torch.randn(total, HKV, D, dtype=torch.float64)) for _ in range(LAYERS)]
    runner.prepare(ordered)
    return runner, ordered, history, new


def reference(ordered, history, q, k, v, layer, scale):
    """float64 causal attention of every row over its request's history + chunk up to the row's token."""
    out = torch.empty_like(q)
    row = 0
    for chunk in ordered:
        hk, hv = history[chunk.request.request_id][layer]
        keys = torch.cat([hk, k[row:row + chunk.num_tokens]])
        values = torch.cat([hv, v[row:row + chunk.num_tokens]])
        keys = keys.repeat_interleave(HQ // HKV, dim=1)
        values = values.repeat_interleave(HQ // HKV, dim=1)
        for i in range(chunk.num_tokens):
            ctx = chunk.start + i + 1
            scores = torch.einsum("hd,thd->ht", q[row + i], keys[:ctx]) * scale
            out[row + i] = torch.einsum("ht,thd->hd", scores.softmax(-1), values[:ctx])
        row += chunk.num_tokens
    return out


MIXES = {
    "decode_device": [(DEVICE_POOL, 5, 1), (DEVICE_POOL, 33, 1), (DEVICE_POOL, 16, 1)],
    "decode_host": [(HOST_POOL, 7, 1), (HOST_POOL, 48, 1)],
    "fresh_only": [(DEVICE_POOL, 0, 12), (HOST_POOL, 0, 1), (HOST_POOL, 0, 20)],
    "everything": [(HOST_POOL, 0, 9), (DEVICE_POOL, 21, 1), (HOST_POOL, 30, 1), (DEVICE_POOL, 0, 17),
                   (DEVICE_POOL, 17, 9), (HOST_POOL, 3, 14), (DEVICE_POOL, 40, 1)],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_matches_float64_reference(mix, block_size):
    runner, ordered, history, new = build_step(len(mix) * block_size, MIXES[mix], block_size)
    scale = D ** -0.5
    for layer in range(LAYERS):
        q, k, v = new[layer]
        out = runner.attention(layer, q.float(), k.float(), v.float(), scale)
        assert out.shape == (q.shape[0], HQ, D) and not out.isnan().any()
        expected = reference(ordered, history, q, k, v, layer, scale)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        # into a given output (a piecewise graph's buffer); the append again writes the same K/V
        given = torch.full_like(out, float("nan"))
        assert runner.attention(layer, q.float(), k.float(), v.float(), scale, out=given) is given
        torch.testing.assert_close(given.double(), expected, rtol=1e-5, atol=1e-5)


class DelayedCopies(KVExports):
    """KVExports on a background lander whose copies (of CPU tensors) take `seconds` each, one after another, as
    on a busy CUDA stream: an export lands only once its copy flag is up. Exports numbered above `held_after`
    are copied only once `release` is set."""

    def __init__(self, seconds: float):
        super().__init__(cache_append_cpu, background=True)
        self.seconds = seconds
        self.held_after: Optional[int] = None
        self.release = threading.Event()
        self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def _copied_now(self, index: int) -> None:
        held = self.held_after is not None and index > self.held_after

        def copy():
            time.sleep(self.seconds)
            if held:
                self.release.wait()
            self._copied[0] = index
        self._copier.submit(copy)


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("mix", ["fresh_only", "everything"])
def test_host_rows_from_the_model_device_match_reference_and_fill_the_cache(mix, background):
    """The path of host-pool rows whose q/k/v sit on the GPU (run here on CPU tensors: the same code, the
    copies to the host are no-ops): outputs equal the float64 reference and the host cache holds the chunk's
    K/V as the pool's own path writes them (fresh chunks' K/V exported by the lander when `background`, as on
    CUDA, their copies slowed down so that reading the cache before `exports.wait` would find it unwritten)."""
    runner, ordered, history, new = build_step(11, MIXES[mix])
    if background:
        runner.exports = DelayedCopies(0.05)
    twin, *_ = build_step(11, MIXES[mix])
    scale = D ** -0.5
    for layer in range(LAYERS):
        q, k, v = (t.float() for t in new[layer])
        expected = reference(ordered, history, *new[layer], layer, scale)
        for part, twin_part in zip(runner.parts, twin.parts):
            if part.pool.index != HOST_POOL:
                continue
            rows = slice(part.start, part.end)
            out = runner._host_rows_from_device(part, layer, q[rows], k[rows], v[rows], scale)
            torch.testing.assert_close(out.double(), expected[rows], rtol=1e-5, atol=1e-5)
            twin._run_part(twin_part, layer, q[rows], k[rows], v[rows], scale)
    runner.exports.wait()
    host, twin_host = runner.kv.pools[HOST_POOL], twin.kv.pools[HOST_POOL]
    for mine, theirs in zip(host.key_caches + host.value_caches, twin_host.key_caches + twin_host.value_caches):
        assert torch.equal(mine.nan_to_num(7.0), theirs.nan_to_num(7.0))


def test_a_continued_host_chunk_does_not_take_the_fresh_chunks_of_its_step_to_the_cpu():
    """A host part holding paged rows (a continued chunk, decode rows) and fresh chunks: only the paged rows go
    through the CPU path (their q/k/v across, the output back); the fresh chunks attend on the model's device
    and only their K/V are exported. Outputs equal the float64 reference."""
    runner, ordered, history, new = build_step(13, [(HOST_POOL, 20, 5), (HOST_POOL, 33, 1), (HOST_POOL, 0, 9),
                                                    (HOST_POOL, 0, 4)])
    part = runner.host_part
    num_paged = part.paged_end - part.start
    assert num_paged == 6 and part.end - part.start == 19  # paged rows first, then the two fresh chunks
    to_cpu, exported = [], []
    host_work, submit = runner._host_work, runner.exports.submit
    runner._host_work = lambda p, layer, q, k, v, scale: (to_cpu.append((p.end - p.start, q.shape[0], k.shape[0])),
                                                          host_work(p, layer, q, k, v, scale))[1]
    runner.exports.submit = lambda k, v, kc, vc, slots: (exported.append((k.shape[0], slots.tolist())),
                                                         submit(k, v, kc, vc, slots))[1]
    for layer in range(LAYERS):
        q, k, v = (t.float() for t in new[layer])
        out = runner._host_rows_from_device(part, layer, q, k, v, 0.2)
        torch.testing.assert_close(out.double(), reference(ordered, history, *new[layer], layer, 0.2),
                                   rtol=1e-5, atol=1e-5)
    assert to_cpu == [(num_paged, num_paged, num_paged)] * LAYERS
    assert exported == [(13, part.slot_mapping[num_paged:].tolist())] * LAYERS


def test_paged_host_rows_read_the_cache_only_after_pending_exports():
    """A continued prompt chunk reads the host cache that an earlier fresh chunk's export fills: with the
    prior context still on its way (a slow background export), the paged rows wait for it (without the wait
    they would read the NaN the caches start with), and only for it: a later export into a block they do not
    hold, whose copy is held back, does not hold them."""
    runner, ordered, history, new = build_step(13, [(HOST_POOL, 20, 5), (HOST_POOL, 33, 1)])
    kv, host = runner.kv, runner.kv.pools[HOST_POOL]
    for cache in host.key_caches + host.value_caches:
        cache.fill_(float("nan"))
    runner.exports = DelayedCopies(0.1)
    bs = kv.block_size
    for chunk in ordered:
        blocks = kv.tables[chunk.request.request_id].block_ids
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(chunk.start)])
        for layer in range(LAYERS):
            k, v = history[chunk.request.request_id][layer]
            runner.exports.submit(k.float(), v.float(), host.key_caches[layer], host.value_caches[layer], slots)
    runner.exports.held_after = runner.exports.submitted
    blocks = host.key_caches[0].shape[0]
    spare = [torch.zeros(blocks + 1, *host.key_caches[0].shape[1:]) for _ in range(2)]
    past = blocks * bs  # a slot in a block past the pool: no table holds it
    runner.exports.submit(torch.ones(1, HKV, D), torch.ones(1, HKV, D), *spare, torch.tensor([past]))
    assert runner.exports.queued()
    part = runner.host_part
    for layer in range(LAYERS):
        q, k, v = (t.float() for t in new[layer])
        out = runner._host_rows_from_device(part, layer, q, k, v, 0.2)
        torch.testing.assert_close(out.double(), reference(ordered, history, *new[layer], layer, 0.2),
                                   rtol=1e-5, atol=1e-5)
    assert runner.exports.queued() == 1  # the held export only
    runner.exports.release.set()
    runner.exports.wait()
    assert not runner.exports.queued() and torch.equal(spare[1][-1, :, 0], torch.ones(HKV, D))


def test_exports_keep_their_order_and_report_errors():
    shape = (3, HKV, D)
    cache = torch.zeros(4, HKV, 16, D), torch.zeros(4, HKV, 16, D)
    exports = DelayedCopies(0.02)
    slots = torch.tensor([0, 1, 2])
    first, second = torch.ones(shape), torch.full(shape, 2.0)
    exports.submit(first, first, *cache, slots)
    exports.submit(second, second, *cache, slots)  # the same slots: the later export must win
    slots.fill_(5)  # the caller's slot buffer is reused at once: the export keeps what it was given
    second.fill_(9.0)
    exports.wait()
    written = KVExports(cache_append_cpu, background=False)
    expected = torch.zeros(4, HKV, 16, D), torch.zeros(4, HKV, 16, D)
    written.submit(torch.full(shape, 2.0), torch.full(shape, 2.0), *expected, torch.tensor([0, 1, 2]))
    assert torch.equal(cache[0], expected[0]) and torch.equal(cache[1], expected[1])
    exports.submit(first, first, *cache, torch.tensor([0, 1, 99999]))  # a slot past the cache
    with pytest.raises(Exception):
        exports.wait()
    assert not exports.queued()


@pytest.mark.parametrize("background", [False, True])
def test_the_exports_gate_counts_every_export_landed_in_order(background):
    """gate() = (counter, value): the counter reaches the value once every export submitted so far is in the
    cache (the C++ runner's jobs wait on it without the GIL), a failed export counted too (its error is raised
    by `wait`); an export still on its way keeps the counter below."""
    shape = (3, HKV, D)
    cache = torch.zeros(4, HKV, 16, D), torch.zeros(4, HKV, 16, D)
    exports = DelayedCopies(0.2) if background else KVExports(cache_append_cpu, background=False)
    counter, value = exports.gate()
    assert value == 0 and int(counter[0]) == 0
    exports.submit(torch.ones(shape), torch.ones(shape), *cache, torch.tensor([0, 1, 2]))
    exports.submit(torch.ones(shape), torch.ones(shape), *cache, torch.tensor([3, 4, 5]))
    counter, value = exports.gate()
    assert value == 2
    if background:
        assert int(counter[0]) < 2 and not torch.equal(cache[1][0, :, 5], torch.ones(HKV, D))
        exports.wait()
    assert int(counter[0]) == 2 and torch.equal(cache[1][0, :, 5], torch.ones(HKV, D))
    with pytest.raises(Exception):
        exports.submit(torch.ones(shape), torch.ones(shape), *cache, torch.tensor([0, 1, 99999]))
        exports.wait()
    assert exports.gate() == (counter, 3) and int(counter[0]) == 3
    exports.close()


def test_a_gate_over_block_tables_waits_only_for_the_exports_into_those_blocks():
    """gate(tables, context_lens): the last export that wrote a block the rows hold (their first ceil(context /
    block size) table entries; padding and blocks no export wrote count 0); wait(tables, context_lens) returns
    once those landed, while a later export into other blocks is still on its way."""
    shape = (3, HKV, D)
    cache = torch.full((8, HKV, 16, D), float("nan")), torch.full((8, HKV, 16, D), float("nan"))
    exports = DelayedCopies(0.4)
    ones = torch.ones(shape)
    exports.submit(ones, ones, *cache, torch.tensor([32, 33, 34]))  # 1: block 2
    exports.submit(ones, ones, *cache, torch.tensor([15, 16, 17]))  # 2: blocks 0 and 1
    exports.submit(ones, ones, *cache, torch.tensor([64, 65, 66]))  # 3: block 4
    tables = torch.tensor([[2, 5, 0], [3, -1, -1], [1, 4, 0]], dtype=torch.int32)

    def gate(rows, contexts):
        counter, value = exports.gate(tables[rows], torch.tensor(contexts, dtype=torch.int32))
        assert counter is exports.landed
        return value

    assert gate([0], [16]) == 1  # block 2 only: the table's 5 and 0 lie past the context
    assert gate([0], [40]) == 2  # blocks 2, 5 and 0
    assert gate([1], [30]) == 0  # block 3: nothing exported into it; -1 padding ignored
    assert gate([2], [17]) == 3 and gate([0, 1, 2], [16, 30, 5]) == 2
    assert exports.gate() == (exports.landed, 3)
    exports.wait(tables[[0]], torch.tensor([16], dtype=torch.int32))
    assert int(exports.landed[0]) >= 1 and exports.queued() >= 1  # export 3 (block 4) still on its way
    assert torch.equal(cache[1][2, :, :3], torch.ones(HKV, 3, D)) and cache[1][4].isnan().all()
    exports.wait()
    assert not exports.queued()
    exports.close()


@pytest.mark.parametrize("then", ["free", "move"])
def test_host_blocks_wait_for_their_exports_before_a_move_reads_them_or_they_are_freed(then):
    """An export still on its way into a request's host blocks (its copy held back, released by another thread)
    lands before the KV manager moves those blocks (the move carries the exported K/V) or frees them (a later
    owner's writes are never overwritten by it): `KVManager.settle_host` -> `KVExports.settle`."""
    shape = CacheShape(LAYERS, HKV, D, 16, torch.float32)
    kv = KVManager(shape, 8, 8, torch.device("cpu"))
    runner = PagedAttentionRunner(kv, torch.device("cpu"))
    runner.exports = exports = DelayedCopies(0.0)
    exports.held_after = 0
    assert kv.grow(7, HOST_POOL, 20)
    blocks = kv.tables[7].block_ids
    host = kv.pools[HOST_POOL]
    k = torch.randn(20, HKV, D)
    slots = torch.tensor([blocks[p // 16] * 16 + p % 16 for p in range(20)])
    for layer in range(LAYERS):
        exports.submit(k, k, host.key_caches[layer], host.value_caches[layer], slots)
    threading.Timer(0.3, exports.release.set).start()
    if then == "free":
        # an export into these blocks that fails (K/V of another head size) does not raise inside the KV
        # manager's free: the next wait does
        bad = torch.ones(1, HKV, 2 * D)
        exports.submit(bad, bad, host.key_caches[0], host.value_caches[0], torch.tensor([blocks[0] * 16]))
        kv.free(7)
        assert not exports.queued()
        with pytest.raises(RuntimeError):
            exports.wait()
        return
    kv.move(7, DEVICE_POOL)
    assert not exports.queued()
    device = kv.pools[DEVICE_POOL]
    for layer in range(LAYERS):
        moved = gather_kv(device.key_caches[layer], device.value_caches[layer], kv.tables[7].block_ids, 20)
        assert torch.equal(moved[0], k) and torch.equal(moved[1], k)


def test_a_runner_let_go_without_close_is_freed_at_once():
    """The KV manager's settle hook is the exports' own method, so neither it nor a replaced exports object ties
    the runner in a cycle: dropping the last reference frees it without the cyclic collector (its threads and
    pools with it; a cycle kept an unclosed engine's worker thread alive into later tests)."""
    import gc
    import weakref

    shape = CacheShape(LAYERS, HKV, D, 16, torch.float32)
    kv = KVManager(shape, 4, 4, torch.device("cpu"))
    runner = PagedAttentionRunner(kv, torch.device("cpu"))
    runner.exports = KVExports(cache_append_cpu, background=False)
    assert kv.settle_host == runner.exports.settle
    gone = weakref.ref(runner)
    gc.disable()
    try:
        del runner
        assert gone() is None
    finally:
        gc.enable()


def test_launch_device_wait_equals_attention():
    runner, ordered, history, new = build_step(7, MIXES["everything"])
    scale = 0.1
    for layer in range(LAYERS):
        q, k, v = (t.float() for t in new[layer])
        token = runner.offload_launch(layer, q, k, v, scale)
        assert token.shape == (1,) and token.dtype == q.dtype
        device_out = runner.device_attention(layer, q, k, v, scale, token)
        split = runner.offload_wait(layer, token, device_out)
        # appending the same K/V again at the same slots changes nothing
        whole = runner.attention(layer, q, k, v, scale)
        torch.testing.assert_close(split, whole, rtol=0, atol=0)
        torch.testing.assert_close(split.double(), reference(ordered, history, new[layer][0], new[layer][1],
                                                             new[layer][2], layer, scale), rtol=1e-5, atol=1e-5)


def test_only_device_rows_returns_without_host_part():
    runner, ordered, history, new = build_step(3, MIXES["decode_device"])
    q, k, v = (t.float() for t in new[0])
    token = runner.offload_launch(0, q, k, v, 0.2)
    out = runner.offload_wait(0, token, runner.device_attention(0, q, k, v, 0.2, token))
    torch.testing.assert_close(out.double(), reference(ordered, history, *new[0], 0, 0.2), rtol=1e-5, atol=1e-5)


def test_context_installs_and_restores_the_runner():
    runner, *_ = build_step(1, MIXES["decode_host"])
    with pytest.raises(RuntimeError, match="outside an engine step"):
        get_attention_runner()
    with attention_runner(runner):
        assert get_attention_runner() is runner
    with pytest.raises(RuntimeError):
        get_attention_runner()


@pytest.mark.skipif(not INTERPRET, reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 "
                    "(test_triton_interpreter.py runs this file so)")
def test_warm_up_compiles_every_decode_variant_and_writes_nothing(monkeypatch):
    """compile_decode_variants launches the device pool's decode kernel in each variant a step may meet (fused
    append or not x 64/128-token chunks x one split or several), reading block 0 and writing no cache slot."""
    import apex_compile.kernels.paged_attention as kernels
    from apex_compile.runtime.kv_manager import CacheShape

    kv = KVManager(CacheShape(2, 2, 32, 16, torch.float32), 8, 0, torch.device("cpu"))
    runner = PagedAttentionRunner(kv, torch.device("cpu"))
    pool = kv.pools[DEVICE_POOL]
    for cache in pool.key_caches + pool.value_caches:
        cache.normal_()
    before = [c.clone() for c in pool.key_caches + pool.value_caches]
    monkeypatch.setattr(runner, "_device_is_cpu", False)
    monkeypatch.setattr(pool, "device", torch.device("cuda"))  # a CUDA pool as far as the runner can tell
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    launched = set()
    for name in ("paged_decode_launch", "paged_decode_append_launch"):
        original = getattr(kernels, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            table = args[6] if _name == "paged_decode_append_launch" else args[3]
            splits = 1 if kwargs["tokens_per_split"] is None else -(-table.shape[1] * 16 // kwargs["tokens_per_split"])
            launched.add((_name, kwargs["block_t"], splits > 1))
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, recording)
    import apex_compile.runtime.attention_runner as runner_module
    monkeypatch.setattr(runner_module, "paged_decode_append_launch", kernels.paged_decode_append_launch)
    runner.compile_decode_variants(num_heads=4)
    assert launched == {(name, block_t, multi) for name in ("paged_decode_launch", "paged_decode_append_launch")
                        for block_t in (kernels.DECODE_BLOCK_T, kernels.DECODE_BLOCK_T_SMALL_GRID)
                        for multi in (False, True)}
    assert all(torch.equal(b, c) for b, c in zip(before, pool.key_caches + pool.value_caches))


MIXED_STEPS = {  # device-pool steps that a whole mixed graph of 48 rows serves
    "decode_and_chunks": [(DEVICE_POOL, 21, 1), (DEVICE_POOL, 0, 17), (DEVICE_POOL, 17, 9), (DEVICE_POOL, 40, 1),
                          (DEVICE_POOL, 5, 1)],
    "chunks_only": [(DEVICE_POOL, 0, 12), (DEVICE_POOL, 3, 14), (DEVICE_POOL, 0, 1)],
    "decode_only": [(DEVICE_POOL, 5, 1), (DEVICE_POOL, 33, 1)],
}
MIXED_ROWS = 48


def mixed_fill(runner, ordered):
    """Fills a step in the fixed layout of a 48-row mixed graph (rows past the step's: padding)."""
    from apex_compile.runtime.step_buffers import StepBuffers

    buffers = getattr(runner, "_test_buffers", None) or StepBuffers(runner.kv, 64, 256, torch.device("cpu"))
    runner._test_buffers = buffers
    parts, rows = buffers.fill(ordered, [0], mixed_rows=MIXED_ROWS)
    buffers.copy_to_device()
    runner.set_parts(parts, rows)


def padded_qkv(qkv, total):
    return [torch.cat([t, torch.randn(MIXED_ROWS - total, *t.shape[1:], dtype=t.dtype)]).float() for t in qkv]


@pytest.mark.skipif(not INTERPRET, reason="the fixed layout runs the GPU pool's Triton kernels: TRITON_INTERPRET=1 "
                    "(test_triton_interpreter.py runs this file so)")
@pytest.mark.parametrize("mix", sorted(MIXED_STEPS))
def test_mixed_layout_matches_float64_reference(mix):
    """A mixed step's fixed layout (decode kernel over every row, prefill kernel over padded chunks) gives every
    real row its causal attention; padding rows write no cache slot (caches start NaN, read slots must not)."""
    runner, ordered, history, new = build_step(11, MIXED_STEPS[mix])
    mixed_fill(runner, ordered)
    total = sum(c.num_tokens for c in ordered)
    scale = D ** -0.5
    for layer in range(LAYERS):
        q, k, v = new[layer]
        padded = padded_qkv((q, k, v), total)
        out = runner.attention(layer, *padded, scale, out=torch.full_like(padded[0], float("nan")))
        assert out.shape == (MIXED_ROWS, HQ, D) and not out[:total].isnan().any()
        torch.testing.assert_close(out[:total].double(), reference(ordered, history, q, k, v, layer, scale),
                                   rtol=1e-5, atol=1e-5)
    # the slots written are the requests' tokens (history and this step's), none for padding rows
    value_cache = runner.kv.pools[DEVICE_POOL].value_caches[0]  # [blocks, kv heads, block size, head dim]
    assert int((~value_cache.isnan()).any(dim=3).any(dim=1).sum()) == sum(c.start + c.num_tokens for c in ordered)


@pytest.mark.skipif(not INTERPRET, reason="the fixed layout runs the GPU pool's Triton kernels: TRITON_INTERPRET=1")
def test_mixed_layout_launches_do_not_depend_on_the_step():
    """What a CUDA graph bakes in (tensor shapes, metadata addresses, scalar arguments) is the same for two
    different steps of the same row count: one captured graph replays both."""
    steps = [MIXED_STEPS["decode_and_chunks"], MIXED_STEPS["chunks_only"]]
    runner, ordered, *_ = build_step(5, steps[0] + steps[1])
    launches = []
    for name in ("_decode_append_unchecked", "_prefill_gpu"):
        original = getattr(runner, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            launches.append((_name, [(tuple(a.shape), a.data_ptr() if a.dtype != torch.float32 else None)
                                     if isinstance(a, torch.Tensor) else a for a in args],
                             {k: v for k, v in kwargs.items() if k != "out"}))
            return _original(*args, **kwargs)

        setattr(runner, name, recording)
    ids = {c.request.request_id: c for c in ordered}
    seen = []
    for first, count in ((0, len(steps[0])), (len(steps[0]), len(steps[1]))):
        chunks = order_chunks([ids[i] for i in range(first, first + count)])
        mixed_fill(runner, chunks)
        launches.clear()
        q, k, v = (torch.randn(MIXED_ROWS, heads, D) for heads in (HQ, HKV, HKV))
        runner.attention(0, q, k, v, 0.1, out=torch.empty_like(q))
        seen.append(list(launches))
    assert [name for name, _, _ in seen[0]] == ["_decode_append_unchecked", "_prefill_gpu"]
    assert all(any(isinstance(a, tuple) and a[1] is not None for a in args) for _, args, _ in seen[0])
    assert seen[0] == seen[1]


def test_mixed_layout_refuses_what_it_cannot_hold():
    from apex_compile.runtime.step_buffers import MIXED_CHUNKS, StepBuffers

    runner, ordered, *_ = build_step(2, [(DEVICE_POOL, 0, 2)] * (MIXED_CHUNKS + 1), block_size=16)
    assert not StepBuffers.mixed_fits(ordered)
    buffers = StepBuffers(runner.kv, 64, 256, torch.device("cpu"), per_chunk=True)
    with pytest.raises(ValueError, match="at most"):
        buffers.fill(ordered, [0], mixed_rows=32)
    runner, ordered, *_ = build_step(2, MIXES["everything"])
    assert not StepBuffers.mixed_fits(ordered)  # host-pool rows
    assert StepBuffers.mixed_fits([c for c in ordered if c.pool == DEVICE_POOL])


def test_the_exports_state_tells_where_they_stand():
    """A timed-out device wait behind a job gated on exports names where they stand: how many were submitted,
    copied (the flag a GPU raises behind each copy) and landed, and when the last ones were queued."""
    shape = (3, HKV, D)
    cache = torch.zeros(4, HKV, 16, D), torch.zeros(4, HKV, 16, D)
    exports = DelayedCopies(0.4)
    ones = torch.ones(shape)
    exports.submit(ones, ones, *cache, torch.tensor([0, 1, 2]))
    state = exports.state()
    assert re.fullmatch(r"exports: 1 submitted, 0 copied, 0 landed; export 1 queued 0\.\d s ago", state), state
    exports.wait()
    assert exports.state().startswith("exports: 1 submitted, 1 copied, 1 landed")
    exports.close()


def test_exports_land_without_the_gil():
    """The lander needs no Python: with the GIL held by this thread (a C++ wait of its own would release it; a
    busy Python loop holds it but for the interpreter's switches) exports whose copies are done land, and so the
    GPU's wait for a job gated on them cannot hang behind a launching thread stuck holding the GIL."""
    shape = (3, HKV, D)
    cache = torch.zeros(4, HKV, 16, D), torch.zeros(4, HKV, 16, D)
    exports = KVExports(cache_append_cpu, background=True)
    exports.submit(torch.zeros(shape), torch.zeros(shape), *cache, torch.tensor([0, 1, 2]))  # its thread exists
    exports.wait()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no other Python thread runs while this one loops
    try:
        exports.submit(torch.ones(shape), torch.ones(shape), *cache, torch.tensor([0, 1, 2]))
        deadline = time.perf_counter() + 5.0
        while exports._landed[0] < 2 and time.perf_counter() < deadline:  # (numpy: never releases the GIL)
            pass
        landed = int(exports._landed[0])
    finally:
        sys.setswitchinterval(interval)
    assert landed == 2 and torch.equal(cache[1][0, :, :3], torch.ones(HKV, 3, D))
    exports.close()


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_exports_of_gpu_tensors_land_behind_their_copy_without_the_gil(device):
    """On a GPU the copy flag is raised by the stream behind the export's copy: an export queued behind a busy
    stream lands only once the GPU got there, and lands while this thread holds the GIL (a device wait for a job
    gated on it must not depend on the launching thread)."""
    shape = (5, HKV, D)
    cache = torch.zeros(4, HKV, 16, D), torch.zeros(4, HKV, 16, D)
    exports = KVExports(cache_append_cpu, background=True)
    key, value = torch.randn(shape, device=device), torch.randn(shape, device=device)
    exports.submit(key, value, *cache, torch.tensor([0, 1, 2, 3, 20]))  # (the flag kernel compiled, buffers made)
    exports.wait()
    key, value = torch.randn(shape, device=device), torch.randn(shape, device=device)
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time before the copy
    exports.submit(key, value, *cache, torch.tensor([0, 1, 2, 3, 20]))
    assert exports._landed[0] == 1 and exports.queued() == 1
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        deadline = time.perf_counter() + 10.0
        while exports._landed[0] < 2 and time.perf_counter() < deadline:
            pass
        landed = int(exports._landed[0])
    finally:
        sys.setswitchinterval(interval)
    assert landed == 2
    expected = torch.zeros(4, HKV, 16, D), torch.zeros(4, HKV, 16, D)
    cache_append_cpu(key.cpu(), value.cpu(), *expected, torch.tensor([0, 1, 2, 3, 20]))
    exports.wait()
    assert torch.equal(cache[0], expected[0]) and torch.equal(cache[1], expected[1])
    exports.close()
