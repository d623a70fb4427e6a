"""StepBuffers: a step's inputs written in place (ids, positions, slots, block tables, context lengths, logits
indices), block-table rows updated when requests gain blocks or change rows, padding rows of a captured size."""
import torch

from apex_compile.runtime.attention_runner import order_chunks
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, CacheShape, KVManager
from apex_compile.runtime.request import Request, SamplingParams
from apex_compile.runtime.scheduler import ScheduledChunk
from apex_compile.runtime.step_buffers import StepBuffers

BS = 16


def setup(max_tokens=32, max_model_len=256, per_chunk=False):
    kv = KVManager(CacheShape(2, 2, 16, BS, torch.float32), 64, 64, torch.device("cpu"))
    return kv, StepBuffers(kv, max_tokens, max_model_len, torch.device("cpu"), per_chunk=per_chunk)


def decode_request(kv, request_id, prompt_len, generated, pool=DEVICE_POOL):
    request = Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams())
    request.output_token_ids = list(range(500, 500 + generated))
    request.num_computed = request.num_tokens - 1
    assert kv.grow(request_id, pool, request.num_tokens)
    return request


def device_pool_mix(kv):
    """A decoding request, one whose prompt continues after 16 cached tokens, and a fresh 10-token prompt."""
    decode = decode_request(kv, 0, 12, 4)
    continuing = Request(1, list(range(200, 240)), SamplingParams())
    continuing.num_computed = 16
    assert kv.grow(1, DEVICE_POOL, 30)
    fresh = Request(2, list(range(300, 310)), SamplingParams())
    assert kv.grow(2, DEVICE_POOL, 10)
    return decode, continuing, fresh


def mix_chunks(decode, continuing, fresh):
    """One step's chunks of `device_pool_mix`: the fresh prompt, a decode token, 14 tokens of the continuation."""
    return [ScheduledChunk(fresh, 0, 10, DEVICE_POOL), ScheduledChunk(decode, decode.num_computed, 1, DEVICE_POOL),
            ScheduledChunk(continuing, 16, 14, DEVICE_POOL)]


def expected_rows(kv, chunks):
    """(ids, positions, slots, tables, ctx) a step of `chunks` must hold, computed from the requests."""
    ids, positions, slots, tables, ctx = [], [], [], [], []
    for c in chunks:
        tokens = c.request.prompt_token_ids + c.request.output_token_ids
        blocks = kv.tables[c.request.request_id].block_ids
        for p in range(c.start, c.start + c.num_tokens):
            ids.append(tokens[p])
            positions.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
            if c.start:
                tables.append(list(blocks))
                ctx.append(p + 1)
    return ids, positions, slots, tables, ctx


def check_step(kv, buffers, chunks, logit_rows):
    parts, rows = buffers.fill(chunks, logit_rows)
    ids, positions, slots, tables, ctx = expected_rows(kv, chunks)
    input_ids, position_ids, indices = buffers.inputs(rows, len(logit_rows))
    assert input_ids[0].tolist() == ids and position_ids[0].tolist() == positions
    assert indices.tolist() == logit_rows
    part = parts[0]
    assert part.slot_mapping.tolist() == slots
    assert part.context_lens.tolist() == ctx
    for row, table in enumerate(tables):
        assert part.block_tables[row, :len(table)].tolist() == table
    return parts


def test_decode_step_and_block_growth_update_rows_in_place():
    kv, buffers = setup()
    requests = [decode_request(kv, i, 10 + 7 * i, 3) for i in range(3)]
    chunks = [ScheduledChunk(r, r.num_computed, 1, DEVICE_POOL) for r in requests]
    check_step(kv, buffers, chunks, [0, 1, 2])
    rows = buffers.rows[DEVICE_POOL]
    # request 0 crosses into a new block: only its new entry is written
    r0 = requests[0]
    r0.output_token_ids += list(range(600, 600 + BS))
    r0.num_computed = r0.num_tokens - 1
    assert kv.grow(0, DEVICE_POOL, r0.num_tokens)
    rows.tables[0, :len(kv.tables[0].block_ids) - 1] = -7  # untouched entries stay as they are
    buffers.fill([ScheduledChunk(r, r.num_computed, 1, DEVICE_POOL) for r in requests], [0, 1, 2])
    blocks = kv.tables[0].block_ids
    assert rows.tables[0, len(blocks) - 1] == blocks[-1]
    assert (rows.tables[0, :len(blocks) - 1] == -7).all()


def test_rows_rewritten_when_requests_finish_and_others_shift():
    kv, buffers = setup()
    requests = [decode_request(kv, i, 20 + 9 * i, 2) for i in range(4)]
    check_step(kv, buffers, [ScheduledChunk(r, r.num_computed, 1, DEVICE_POOL) for r in requests], [0, 1, 2, 3])
    kv.free(1)  # request 1 finished; 2 and 3 move up a row, a new request takes the last row
    new = decode_request(kv, 7, 40, 1)
    rest = [requests[0], requests[2], requests[3], new]
    check_step(kv, buffers, [ScheduledChunk(r, r.num_computed, 1, DEVICE_POOL) for r in rest], [0, 1, 2, 3])


def test_mixed_step_with_prefill_chunks_and_host_rows():
    kv, buffers = setup(max_tokens=64)
    decode, continuing, fresh = device_pool_mix(kv)
    host = decode_request(kv, 3, 25, 2, pool=HOST_POOL)
    host_chunk = ScheduledChunk(host, host.num_computed, 1, HOST_POOL)
    chunks = order_chunks(mix_chunks(decode, continuing, fresh) + [host_chunk])
    parts, rows = buffers.fill(chunks, [0, 25])
    assert rows == 26
    device, host_part = parts
    assert (device.start, device.paged_end, device.end, device.fresh) == (0, 15, 25, [(15, 25)])
    assert (host_part.start, host_part.end, host_part.paged_end) == (25, 26, 26)
    assert device.max_context_len == 30
    ids, positions, slots, tables, ctx = expected_rows(kv, chunks[:3])
    assert buffers.inputs(rows, 2)[0][0, :25].tolist() == ids
    assert device.slot_mapping.tolist() == slots and device.context_lens.tolist() == ctx
    _, _, host_slots, host_tables, host_ctx = expected_rows(kv, chunks[3:])
    assert host_part.slot_mapping.tolist() == host_slots and host_part.context_lens.tolist() == host_ctx
    assert host_part.block_tables[0, :len(host_tables[0])].tolist() == host_tables[0]


def test_padding_rows_of_a_captured_size():
    kv, buffers = setup()
    requests = [decode_request(kv, i, 5 + i, 1) for i in range(3)]
    parts, rows = buffers.fill([ScheduledChunk(r, r.num_computed, 1, DEVICE_POOL) for r in requests], [0, 1, 2],
                               pad_to=8)
    assert rows == 8
    part = parts[0]
    assert part.slot_mapping[3:].tolist() == [-1] * 5 and part.context_lens[3:].tolist() == [1] * 5
    assert buffers.inputs(8, 8)[0][0, 3:].tolist() == [0] * 5
    assert buffers.inputs(8, 8)[2].tolist() == list(range(8))
    assert part.max_context_len is None  # split-K planned for the table's capacity
    assert 0 <= int(part.block_tables.min()) and int(part.block_tables.max()) < kv.pools[0].num_blocks


def test_gpu_layout_has_one_table_row_per_chunk_and_query_starts():
    """The device pool's GPU kernels take one table row per chunk (a prompt's first chunk too: they attend it from
    the cache) and its full context length; the decode rows come first (the decode kernel's), then the chunks
    with their first rows counted from the first chunk's (query_start_loc, the prefill kernel's); decode-only
    steps keep one row per token and no query starts."""
    kv, buffers = setup(max_tokens=64, per_chunk=True)
    decode, continuing, fresh = device_pool_mix(kv)
    chunks = order_chunks(mix_chunks(decode, continuing, fresh))
    assert [c.request for c in chunks] == [decode, continuing, fresh]
    [part], rows = buffers.fill(chunks, [0])
    assert rows == 25 and (part.paged_end, part.fresh, part.num_decode) == (25, [], 1)
    assert part.context_lens.tolist() == [decode.num_tokens, 30, 10] and part.max_context_len == 30
    assert part.query_start_loc.tolist() == [0, 14, 24] and part.max_query_len == 14
    for row, request_id in enumerate((0, 1, 2)):
        blocks = kv.tables[request_id].block_ids
        assert part.block_tables[row, :len(blocks)].tolist() == blocks
    [part], _ = buffers.fill([ScheduledChunk(decode, decode.num_computed, 1, DEVICE_POOL)], [0])
    assert part.query_start_loc is None and part.context_lens.tolist() == [decode.num_tokens]


def test_tail_padding_rows_of_a_piecewise_step_belong_to_no_pool():
    """total_rows pads any step (here a mixed device + host step) with rows after the last part: id 0,
    position 0, and no part's slots, tables or rows cover them."""
    kv, buffers = setup()
    decode, continuing, fresh = device_pool_mix(kv)
    host = decode_request(kv, 3, 7, 2, pool=HOST_POOL)
    chunks = order_chunks(mix_chunks(decode, continuing, fresh) + [ScheduledChunk(host, host.num_computed, 1,
                                                                                   HOST_POOL)])
    parts, rows = buffers.fill(chunks, [0, 1], total_rows=32)
    assert rows == 32 and parts[-1].end == 26
    assert [p.end - p.start for p in parts] == [25, 1]
    ids, positions, _ = buffers.inputs(rows, 2)
    assert ids[0, 26:].tolist() == [0] * 6 and positions[0, 26:].tolist() == [0] * 6
    unpadded, _ = buffers.fill(chunks, [0, 1])
    assert [p.slot_mapping.tolist() for p in unpadded] == [p.slot_mapping.tolist() for p in parts]


def test_ids_already_on_the_device_fill_their_rows_by_runs_or_one_indexed_copy():
    """A step queued ahead: the sampled ids land in their rows over the host's placeholders (rows and sources in
    runs: a copy per run; scattered: one indexed copy), the other rows keep what the host wrote."""
    from apex_compile.runtime.step_buffers import MAX_ID_RUNS, DeviceIds

    _, buffers = setup()
    tokens = torch.tensor([70, 71, 72, 73, 74, 75])
    cases = [([0, 1, 4, 5, 6], [0, 1, 2, 3, 4]),  # two runs
             ([0, 2, 4, 6, 8, 10], [5, 4, 3, 2, 1, 0])]  # six runs
    assert len(DeviceIds(tokens, *cases[0]).runs()) == 2 <= MAX_ID_RUNS < len(DeviceIds(tokens, *cases[1]).runs())
    for rows, sources in cases:
        buffers.ids[:12] = range(1, 13)
        buffers.copy_to_device(DeviceIds(tokens, rows, sources))
        expected = list(range(1, 13))
        for row, source in zip(rows, sources):
            expected[row] = int(tokens[source])
        assert buffers.dev_ids[:12].tolist() == expected
