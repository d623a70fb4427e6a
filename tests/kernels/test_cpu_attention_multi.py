"""The multi-cache CPU ops (every layer's rows in one call): each row appends to and attends the cache pair its
cache_index names, equal to one call per pair and to float64 attention; bad lists and indices are errors."""
import time

import pytest
import torch

from apex_compile.ops import (
    cache_append_cpu,
    cache_append_cpu_multi,
    paged_attention_cpu,
    paged_attention_cpu_multi,
)
from tests.kernels.test_cpu_attention import DTYPES, TOLERANCE, PagedCase


def cases(dtype, count=3, seed=0):
    """`count` independent paged cases of one geometry (same block count), as the layers of a host pool."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        lens = torch.randint(1, 90, (3,), generator=gen).tolist()
        case = PagedCase(gen, lens, 8, 2, 32, 16, dtype, spare_blocks=40 - sum(-(-c // 16) for c in lens))
        out.append(case)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_attention_equals_per_cache_calls_and_float64(dtype, threads):
    torch.set_num_threads(2)
    layers = cases(dtype)
    # rows of every layer interleaved, in a shuffled order
    order = [(layer, row) for layer in range(len(layers)) for row in range(3)]
    order = [order[i] for i in torch.randperm(len(order), generator=torch.Generator().manual_seed(1)).tolist()]
    width = max(c.block_tables.shape[1] for c in layers)
    tables = torch.full((len(order), width), 10**6, dtype=torch.int32)
    for i, (layer, row) in enumerate(order):
        t = layers[layer].block_tables[row]
        tables[i, :len(t)] = t
    query = torch.stack([layers[layer].query[row] for layer, row in order])
    lens = torch.tensor([layers[layer].context_lens[row] for layer, row in order], dtype=torch.int32)
    index = torch.tensor([layer for layer, _ in order], dtype=torch.int32)
    out = paged_attention_cpu_multi(query, [c.key_cache for c in layers], [c.value_cache for c in layers], index,
                                    tables, lens, 0.2)
    tol = TOLERANCE[dtype]
    for i, (layer, row) in enumerate(order):
        single = layers[layer].run(scale=0.2)[row]
        torch.testing.assert_close(out[i].double(), single.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(out[i].double(), layers[layer].reference(0.2)[row], rtol=tol, atol=tol)


def test_multi_append_writes_each_token_to_its_pair(threads):
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(3)
    from apex_compile.ops import allocate_kv_cache_cpu

    pairs = [allocate_kv_cache_cpu(8, 2, 16, 32, torch.bfloat16) for _ in range(3)]
    singles = [allocate_kv_cache_cpu(8, 2, 16, 32, torch.bfloat16) for _ in range(3)]
    for k, v in pairs + singles:
        k.zero_()
        v.zero_()
    tokens = 300  # above the append's parallel threshold in rows
    key = torch.randn(tokens, 2, 32, generator=gen).to(torch.bfloat16)
    value = torch.randn(tokens, 2, 32, generator=gen).to(torch.bfloat16)
    index = torch.randint(0, 3, (tokens,), generator=gen, dtype=torch.int32)
    slots = torch.randperm(8 * 16 * 3, generator=gen)[:tokens] % (8 * 16)
    slots[::7] = -1  # padding rows are skipped
    # one slot per pair at most once (duplicates would leave an unspecified row)
    seen = set()
    for t in range(tokens):
        key_ = (int(index[t]), int(slots[t]))
        if slots[t] >= 0 and key_ in seen:
            slots[t] = -1
        seen.add(key_)
    cache_append_cpu_multi(key, value, [k for k, _ in pairs], [v for _, v in pairs], index, slots)
    for i, (k, v) in enumerate(singles):
        mine = index == i
        cache_append_cpu(key[mine], value[mine], k, v, slots[mine])
    for (k, v), (k1, v1) in zip(pairs, singles):
        assert torch.equal(k, k1) and torch.equal(v, v1)
    assert any(p[0].abs().sum() > 0 for p in pairs)


def test_multi_errors():
    layers = cases(torch.float32, count=2)
    keys, values = [c.key_cache for c in layers], [c.value_cache for c in layers]
    c = layers[0]
    with pytest.raises(RuntimeError, match="out of range for 2 caches"):
        paged_attention_cpu_multi(c.query, keys, values, torch.tensor([0, 2, 1], dtype=torch.int32),
                                  c.block_tables, c.lens)
    with pytest.raises(RuntimeError, match="cache_index must be int32"):
        paged_attention_cpu_multi(c.query, keys, values, torch.tensor([0, 1, 1]), c.block_tables, c.lens)
    with pytest.raises(RuntimeError, match="non-empty lists of one length"):
        paged_attention_cpu_multi(c.query, keys, values[:1], torch.zeros(3, dtype=torch.int32), c.block_tables,
                                  c.lens)
    with pytest.raises(RuntimeError, match="shape and dtype of the first"):
        paged_attention_cpu_multi(c.query, [keys[0], keys[1][:-1].contiguous()],
                                  [values[0], values[1][:-1].contiguous()], torch.zeros(3, dtype=torch.int32),
                                  c.block_tables, c.lens)
    with pytest.raises(RuntimeError, match="cache_index must be int32 \\[2\\]"):
        cache_append_cpu_multi(c.keys[:2], c.values[:2], keys, values, torch.zeros(3, dtype=torch.int32),
                               torch.zeros(2, dtype=torch.long))


def stagger_job_case(seed, layers=2, width=3, heads=4, kv_heads=2, dim=32, block=16, dtype=torch.float32):
    """A staggered turn's inputs: per layer a host cache whose rows hold the earlier tokens of `width` requests,
    the staged q/k/v of each request's current token (every row at its layer), and the rows' metadata."""
    from apex_compile.ops import allocate_kv_cache_cpu

    gen = torch.Generator().manual_seed(seed)
    blocks = 3 * width + 2
    caches = [allocate_kv_cache_cpu(blocks, kv_heads, block, dim, dtype) for _ in range(layers)]
    tables, lens, slots = [], [], []
    for key_cache, value_cache in caches:
        key_cache.fill_(float("nan"))  # only written slots may be read
        value_cache.fill_(float("nan"))
        order = torch.randperm(blocks, generator=gen).to(torch.int32)
        for row in range(width):
            context = int(torch.randint(1, 3 * block, (1,), generator=gen))
            table = order[3 * row:3 * row + 3]
            earlier = torch.arange(context - 1)
            cache_append_cpu(torch.randn(context - 1, kv_heads, dim, generator=gen).to(dtype),
                             torch.randn(context - 1, kv_heads, dim, generator=gen).to(dtype), key_cache,
                             value_cache, table[earlier // block].long() * block + earlier % block)
            tables.append(table)
            lens.append(context)
            slots.append(int(table[(context - 1) // block]) * block + (context - 1) % block)
    staged = torch.randn(layers, width, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    meta = dict(cache_index=torch.arange(layers, dtype=torch.int32).repeat_interleave(width),
                block_tables=torch.stack(tables), context_lens=torch.tensor(lens, dtype=torch.int32),
                slot_mapping=torch.tensor(slots))
    return caches, staged, meta


def run_stagger_job(caches, staged, meta, picked, heads=4, **kwargs):
    """stagger_cpu_job over the rows `picked` (None: all) into a NaN-filled output; returns it and the timings."""
    from apex_compile.ops.cpu_attention import stagger_cpu_job

    rows = None if picked is None else torch.tensor(picked)
    chosen = {k: v if rows is None else v[rows] for k, v in meta.items()}
    out = torch.full(staged.shape[:2] + (heads, staged.shape[3]), float("nan"), dtype=staged.dtype)
    seconds = stagger_cpu_job(staged, [k for k, _ in caches], [v for _, v in caches], chosen["cache_index"],
                              chosen["block_tables"], chosen["context_lens"], chosen["slot_mapping"], rows, heads,
                              0.3, out, **kwargs)
    return out, seconds


@pytest.mark.parametrize("picked", [None, [0, 2, 4, 5]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stagger_job_equals_per_layer_append_and_attention(picked, dtype, threads):
    """The staggered turn's one call: each picked row appends its K/V to its layer's cache and attends it, as
    one cache_append_cpu + paged_attention_cpu per row would; other rows of the output are left alone."""
    torch.set_num_threads(3)
    heads, kv_heads = 4, 2
    caches, staged, meta = stagger_job_case(7, dtype=dtype)
    expected_caches = [(k.clone(), v.clone()) for k, v in caches]
    out, _ = run_stagger_job(caches, staged, meta, picked)
    flat = staged.view(-1, heads + 2 * kv_heads, staged.shape[3])
    flat_out = out.view(-1, heads, staged.shape[3])
    for row in range(flat.shape[0]):
        if picked is not None and row not in picked:
            assert torch.isnan(flat_out[row]).all()
            continue
        key_cache, value_cache = expected_caches[int(meta["cache_index"][row])]
        q, k, v = flat[row:row + 1].split([heads, kv_heads, kv_heads], dim=1)
        cache_append_cpu(k, v, key_cache, value_cache, meta["slot_mapping"][row:row + 1])
        want = paged_attention_cpu(q, key_cache, value_cache, meta["block_tables"][row:row + 1],
                                   meta["context_lens"][row:row + 1], 0.3)
        torch.testing.assert_close(flat_out[row:row + 1], want, rtol=0, atol=0)
    for (k, v), (k1, v1) in zip(caches, expected_caches):
        assert torch.equal(k.nan_to_num(-7.0), k1.nan_to_num(-7.0)) and torch.equal(v.nan_to_num(-7.0),
                                                                                    v1.nan_to_num(-7.0))


def test_stagger_job_in_a_team_is_exact_on_every_call(threads):
    """The job's threads append, meet at a barrier and attend what others appended: 20 calls with a 4-thread
    team over fresh copies of one case, each equal bit for bit to a 1-thread call (a missing barrier would let
    an attention read a slot another thread has not yet written: NaN or an old value)."""
    picked = [0, 1, 3, 4, 5]
    torch.set_num_threads(1)
    caches, staged, meta = stagger_job_case(11, layers=3, width=2)
    pristine = [(k.clone(), v.clone()) for k, v in caches]
    want, _ = run_stagger_job([(k.clone(), v.clone()) for k, v in pristine], staged, meta, picked)
    torch.set_num_threads(4)
    for _ in range(20):
        got, _ = run_stagger_job([(k.clone(), v.clone()) for k, v in pristine], staged, meta, picked)
        assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))


@pytest.mark.parametrize("team", [1, 3])
def test_stagger_job_waits_for_every_ready_flag(team, threads):
    """Nothing is written before each flag reaches its value (a GPU copy raises it in the engine), whether one
    thread or a team of them (started before the wait, polling beside the thread that waits) runs the job."""
    import concurrent.futures
    import time

    torch.set_num_threads(team)
    caches, staged, meta = stagger_job_case(3)
    flags = torch.zeros(2, dtype=torch.int64)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_stagger_job, caches, staged, meta, None, ready_flags=flags, ready_values=(1, 2))
        time.sleep(0.05)
        flags[0] = 1
        flags[1] = 1  # below its value: still waiting
        time.sleep(0.05)
        assert not future.done()
        flags[1] = 5
        out, (waited, ran) = future.result(timeout=30)
    assert not torch.isnan(out).any() and waited >= 0.09 and ran >= 0


@pytest.mark.parametrize("team", [1, 3])
def test_stagger_job_times_out_with_a_clear_error_and_writes_nothing(team, threads):
    """A flag that never comes raises (from inside the job's parallel region, out to Python) and leaves the
    output and the caches untouched; the job works again afterwards."""
    torch.set_num_threads(team)
    caches, staged, meta = stagger_job_case(5)
    before = [(k.clone(), v.clone()) for k, v in caches]
    with pytest.raises(RuntimeError, match="never completed"):
        run_stagger_job(caches, staged, meta, None, ready_flags=torch.zeros(1, dtype=torch.int64),
                        ready_values=(1,), timeout_s=0.05)
    for (k, v), (k0, v0) in zip(caches, before):
        assert torch.equal(k.nan_to_num(-7.0), k0.nan_to_num(-7.0)) and torch.equal(v.nan_to_num(-7.0),
                                                                                    v0.nan_to_num(-7.0))
    out, _ = run_stagger_job(caches, staged, meta, None, ready_flags=torch.ones(1, dtype=torch.int64),
                             ready_values=(1,))
    assert not torch.isnan(out).any()


def run_layer_job(caches, staged, meta, picked, ready, done, turn, heads=4, **kwargs):
    """stagger_layer_job over the rows `picked` (None: all) into a NaN-filled output; returns it and the timings."""
    from apex_compile.ops.cpu_attention import stagger_layer_job

    rows = None if picked is None else torch.tensor(picked)
    chosen = {k: v if rows is None else v[rows] for k, v in meta.items()}
    out = torch.full(staged.shape[:2] + (heads, staged.shape[3]), float("nan"), dtype=staged.dtype)
    seconds = stagger_layer_job(staged, [k for k, _ in caches], [v for _, v in caches], chosen["cache_index"],
                                chosen["block_tables"], chosen["context_lens"], chosen["slot_mapping"], rows, heads,
                                0.3, out, ready, done, turn, **kwargs)
    return out, seconds


@pytest.mark.parametrize("picked", [None, [0, 2, 7, 8], [6, 7]])
@pytest.mark.parametrize("team", [1, 3])
def test_layer_job_equals_the_whole_job_and_raises_every_layer(picked, team, threads):
    """The one-lane job (layer by layer, each behind its ready flag) writes what the whole-turn job writes, bit
    for bit, into outputs and caches, and raises every layer's done flag to the turn (layers without rows too)."""
    torch.set_num_threads(team)
    caches, staged, meta = stagger_job_case(13, layers=3, width=3)
    pristine = [(k.clone(), v.clone()) for k, v in caches]
    want, _ = run_stagger_job([(k.clone(), v.clone()) for k, v in pristine], staged, meta, picked)
    expected_caches = [(k.clone(), v.clone()) for k, v in pristine]
    run_stagger_job(expected_caches, staged, meta, picked)
    ready = torch.full((3,), 4, dtype=torch.int64)
    done = torch.full((3,), 3, dtype=torch.int64)
    got, (waited, ran) = run_layer_job(caches, staged, meta, picked, ready, done, 4)
    assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))
    for (k, v), (k1, v1) in zip(caches, expected_caches):
        assert torch.equal(k.nan_to_num(-7.0), k1.nan_to_num(-7.0)) and torch.equal(v.nan_to_num(-7.0),
                                                                                    v1.nan_to_num(-7.0))
    assert done.tolist() == [4, 4, 4] and waited >= 0 and ran >= 0


def test_layer_job_in_a_team_is_exact_on_every_call(threads):
    """The layered job's team claims items across layers, each row appended by the item holding its last token:
    20 calls with a 4-thread team, each equal bit for bit to a 1-thread call (a misplaced append lets an
    attention read a slot not yet appended, or a done flag rise before its layer's rows are written)."""
    picked = [0, 1, 3, 4, 5, 7]
    caches, staged, meta = stagger_job_case(29, layers=4, width=2)
    pristine = [(k.clone(), v.clone()) for k, v in caches]
    flags = lambda: (torch.ones(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))  # noqa: E731
    torch.set_num_threads(1)
    want, _ = run_layer_job([(k.clone(), v.clone()) for k, v in pristine], staged, meta, picked, *flags(), 1)
    torch.set_num_threads(4)
    for _ in range(20):
        got, _ = run_layer_job([(k.clone(), v.clone()) for k, v in pristine], staged, meta, picked, *flags(), 1)
        assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))


def test_layer_job_times_its_items(threads):
    """timings of 5: the last is the team's thread-seconds inside work items (more than 0, at most the running
    time over the team); other sizes are refused."""
    torch.set_num_threads(3)
    caches, staged, meta = stagger_job_case(31, layers=3, width=2)
    args = (staged, [k for k, _ in caches], [v for _, v in caches], meta["cache_index"], meta["block_tables"],
            meta["context_lens"], meta["slot_mapping"], None, 4, 0.3, torch.empty(3, 2, 4, staged.shape[3],
                                                                                   dtype=staged.dtype))
    timings = torch.zeros(5, dtype=torch.float64)
    torch.ops.apex.stagger_layer_job(*args, torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 1,
                                     10.0, timings)
    waited, ran, _, _, busy = timings.tolist()
    assert 0 < busy <= ran * 3 + 1e-4
    # 6: the whole call last, its checks, plans and frees included (at least its waits and running time), within
    # the caller's wall time; the Python wrapper returns it after the busy thread-seconds
    from apex_compile.ops.cpu_attention import stagger_layer_job

    timings = torch.zeros(6, dtype=torch.float64)
    begin = time.perf_counter()
    torch.ops.apex.stagger_layer_job(*args, torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 1,
                                     10.0, timings)
    wall = time.perf_counter() - begin
    waited, ran, call = timings[0].item(), timings[1].item(), timings[5].item()
    assert waited + ran <= call <= wall
    values = stagger_layer_job(*args, torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 1,
                               with_busy=True, with_call=True)
    assert len(values) == 4 and values[0] + values[1] <= values[3]
    with pytest.raises(RuntimeError, match="2, 4, 5 or 6 elements"):
        torch.ops.apex.stagger_layer_job(*args, torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                                         1, 10.0, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("team", [1, 3])
def test_layer_job_runs_each_layer_behind_its_flag(team, threads):
    """Layer l is written only after ready_flags[l] reaches the turn, and its done flag rises right after it,
    before later layers are staged (the GPU's next step waits for it per layer, not for the whole job)."""
    import concurrent.futures
    import time

    torch.set_num_threads(team)
    caches, staged, meta = stagger_job_case(17, layers=3, width=2)
    ready = torch.zeros(3, dtype=torch.int64)
    done = torch.zeros(3, dtype=torch.int64)
    turn = 2
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_layer_job, caches, staged, meta, None, ready, done, turn)
        time.sleep(0.05)
        assert done.tolist() == [0, 0, 0]
        ready[0] = turn
        for _ in range(2000):
            if done[0] == turn:
                break
            time.sleep(0.001)
        assert done.tolist() == [turn, 0, 0] and not future.done()
        ready[1] = turn - 1  # the turn before: still waiting
        time.sleep(0.05)
        assert done.tolist() == [turn, 0, 0]
        ready[1:] = turn
        out, (waited, _) = future.result(timeout=30)
    assert done.tolist() == [turn] * 3 and not torch.isnan(out).any() and waited >= 0.09


def test_layer_job_checks_its_rows_and_times_out_clearly(threads):
    """Rows out of layer order or a cache_index that is not each row's layer are refused before any wait; a
    layer never staged raises after the timeout, the done flags of the layers before it raised, none after."""
    torch.set_num_threads(2)
    caches, staged, meta = stagger_job_case(19, layers=2, width=2)
    ready = torch.ones(2, dtype=torch.int64)
    done = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="sorted by layer"):
        run_layer_job(caches, staged, meta, [2, 0], ready, done, 1)
    swapped = dict(meta, cache_index=meta["cache_index"].flip(0))
    with pytest.raises(RuntimeError, match="sorted by layer"):
        run_layer_job(caches, staged, swapped, None, ready, done, 1)
    with pytest.raises(RuntimeError, match="ready_flags and done_flags"):
        run_layer_job(caches, staged, meta, None, torch.ones(3, dtype=torch.int64), done, 1)
    assert done.tolist() == [0, 0]
    ready[1] = 0
    with pytest.raises(RuntimeError, match="layer 1 of turn 1"):
        run_layer_job(caches, staged, meta, None, ready, done, 1, timeout_s=0.05)
    assert done.tolist() == [1, 0]


def test_layer_job_planned_by_the_team_raises_the_first_layers_error(threads):
    """The layers are checked and planned by the job's team, a layer per thread at a time: with bad rows in two
    layers the error raised is the first layer's, as a serial loop over the layers would raise it, and no done
    flag rises."""
    torch.set_num_threads(3)
    caches, staged, meta = stagger_job_case(37, layers=4, width=2)
    bad = dict(meta, block_tables=meta["block_tables"].clone(), slot_mapping=meta["slot_mapping"].clone())
    bad["block_tables"][2 * 1, 0] = 10 ** 6  # layer 1: a block out of range
    bad["slot_mapping"][2 * 3] = 10 ** 9  # layer 3: a slot out of range
    for _ in range(5):  # the layers are planned in whatever order the team takes them
        done = torch.zeros(4, dtype=torch.int64)
        with pytest.raises(RuntimeError, match="block_tables.* out of range"):
            run_layer_job([(k.clone(), v.clone()) for k, v in caches], staged, bad, None,
                          torch.ones(4, dtype=torch.int64), done, 1)
        assert done.tolist() == [0] * 4


@pytest.mark.parametrize("team", [1, 4])
def test_layer_job_with_split_items_equals_the_whole_job(team, threads):
    """Items cut into several pieces of one (row, kv head), merged by the thread writing the last partial: the
    layered job writes the whole job's caches bit for bit and its outputs to rounding (the pieces depend on the
    team) and the same bits on every call (only the piece holding a row's last token appends it, and later
    layers' items run beside it)."""
    from apex_compile.ops import cpu_attention_work_split

    saved = cpu_attention_work_split()
    cpu_attention_work_split(items_per_thread=1 << 20, min_item_bytes=1, min_thread_bytes=1)
    try:
        torch.set_num_threads(team)
        caches, staged, meta = stagger_job_case(31, layers=4, width=3)
        pristine = [(k.clone(), v.clone()) for k, v in caches]
        picked = [0, 1, 2, 4, 6, 7, 9, 10, 11]
        want_caches = [(k.clone(), v.clone()) for k, v in pristine]
        want, _ = run_stagger_job(want_caches, staged, meta, picked)

        def layered():
            got_caches = [(k.clone(), v.clone()) for k, v in pristine]
            done = torch.zeros(4, dtype=torch.int64)
            got, _ = run_layer_job(got_caches, staged, meta, picked, torch.ones(4, dtype=torch.int64), done, 1)
            assert done.tolist() == [1] * 4
            for (k, v), (k1, v1) in zip(got_caches, want_caches):
                assert torch.equal(k.nan_to_num(-7.0), k1.nan_to_num(-7.0))
                assert torch.equal(v.nan_to_num(-7.0), v1.nan_to_num(-7.0))
            return got.nan_to_num(-7.0)

        first = layered()
        torch.testing.assert_close(first, want.nan_to_num(-7.0), rtol=1e-5, atol=1e-6)
        for _ in range(10):
            assert torch.equal(layered(), first)
    finally:
        cpu_attention_work_split(**saved)


def written_while_python_holds_the_gil(job, out, flags, window=1.0):
    """Starts job() on a worker thread (it waits for flags[0] >= 1), then raises the flag and runs pure Python
    for up to `window` seconds with forced GIL switches pushed out to 30 s, polling out's first element through
    raw memory; returns whether the job wrote it inside that window (the job is joined after it)."""
    import concurrent.futures
    import ctypes
    import sys
    import time

    interval = sys.getswitchinterval()
    first = ctypes.c_float.from_address(out.data_ptr())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(job)
        time.sleep(0.1)  # the worker now waits for its flag (the GIL released)
        sys.setswitchinterval(30.0)
        try:
            ctypes.c_int64.from_address(flags.data_ptr()).value = 1  # no op call: the GIL stays here
            start = time.perf_counter()
            written = False
            while not written and time.perf_counter() - start < window:
                written = first.value == first.value  # NaN until the job writes it
        finally:
            sys.setswitchinterval(interval)
        future.result(timeout=60)
    return written


def test_stagger_job_runs_while_another_thread_holds_the_gil(threads):
    """From its flags to its end the job needs no GIL: it finishes while the launching thread runs pure Python
    without a pause, as the engine's main thread does between two steps. A job that goes back to Python after
    its wait (as the staggered job did before it was one call) does not."""
    from apex_compile.ops.cpu_attention import stagger_cpu_job, wait_host_flags

    torch.set_num_threads(1)
    caches, staged, meta = stagger_job_case(4)
    keys, values = [k for k, _ in caches], [v for _, v in caches]

    def fresh():
        return torch.full(staged.shape[:2] + (4, staged.shape[3]), float("nan")), torch.zeros(1, dtype=torch.int64)

    out, flags = fresh()

    def one_call():
        stagger_cpu_job(staged, keys, values, *meta.values(), None, 4, 0.3, out, flags, (1,))

    assert written_while_python_holds_the_gil(one_call, out, flags)
    assert not torch.isnan(out).any()
    caches, staged, meta = stagger_job_case(4)
    keys, values = [k for k, _ in caches], [v for _, v in caches]
    out, flags = fresh()

    def back_in_python():
        wait_host_flags(flags, (1,))
        stagger_cpu_job(staged, keys, values, *meta.values(), None, 4, 0.3, out)

    assert not written_while_python_holds_the_gil(back_in_python, out, flags)


def test_wait_host_flags_times_out_with_a_clear_error():
    from apex_compile.ops.cpu_attention import wait_host_flags

    with pytest.raises(RuntimeError, match="never completed"):
        wait_host_flags(torch.zeros(1, dtype=torch.int64), [1], timeout_s=0.05)
    assert wait_host_flags(torch.tensor([4, 9]), [4, 2]) >= 0.0


def test_a_soft_flag_is_waited_for_a_bounded_time():
    """A negative value is a soft wait (a hint when to start): it returns once the flag is raised, or after
    ~30 ms without it, and never raises; the hard flags beside it are still waited for."""
    import threading

    from apex_compile.ops.cpu_attention import wait_host_flags

    flags = torch.zeros(2, dtype=torch.int64)
    waited = wait_host_flags(flags, [0, -1], timeout_s=0.01)  # never raised: gives up after ~30 ms
    assert 0.02 <= waited < 1.0
    flags[1] = 1
    assert wait_host_flags(flags, [0, -1], timeout_s=0.01) < 0.02  # raised: no wait
    raise_later = threading.Timer(0.1, lambda: flags.__setitem__(0, 3))
    raise_later.start()
    assert wait_host_flags(flags, [3, -5], timeout_s=5.0) >= 0.09  # the hard flag still holds it
    raise_later.join()
