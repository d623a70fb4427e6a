"""CPU paged decode attention, KV-cache append and the KV layout helpers, against float64 references."""
import math
import os
import random
import sys

import pytest
import torch

from apex_compile.ops import (
    allocate_kv_cache_cpu,
    cache_append_cpu,
    copy_blocks,
    copy_blocks_layers,
    cpu_attention_work_split,
    cpu_isa,
    gather_kv,
    paged_attention_cpu,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _supported_isas():
    previous = os.environ.get("APEX_CPU_ISA")
    supported = []
    try:
        for name in ("avx512", "avx2", "scalar"):
            os.environ["APEX_CPU_ISA"] = name
            try:
                supported.append(cpu_isa())
            except RuntimeError:
                pass
    finally:
        if previous is None:
            os.environ.pop("APEX_CPU_ISA", None)
        else:
            os.environ["APEX_CPU_ISA"] = previous
    return supported


ISAS = _supported_isas()


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Forces each kernel path this CPU supports in turn."""
    monkeypatch.setenv("APEX_CPU_ISA", request.param)
    return request.param


class PagedCase:
    """Random K/V appended into NaN-poisoned caches through shuffled block tables, plus a random query."""

    def __init__(self, gen, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3,
                 spare_columns=1):
        self.context_lens = list(context_lens)
        self.dtype = dtype
        needed = [-(-c // block_size) for c in self.context_lens]
        self.num_blocks = sum(needed) + spare_blocks
        self.key_cache, self.value_cache = allocate_kv_cache_cpu(
            self.num_blocks, num_kv_heads, block_size, head_dim, dtype
        )
        self.key_cache.fill_(float("nan"))
        self.value_cache.fill_(float("nan"))
        order = torch.randperm(self.num_blocks, generator=gen).to(torch.int32)
        num_seqs = len(self.context_lens)
        # Unused columns hold garbage ids: the kernel must only read the blocks the context needs.
        self.block_tables = torch.full((num_seqs, max(needed, default=0) + spare_columns), 10**6, dtype=torch.int32)
        slots, start = [], 0
        for s, (context, count) in enumerate(zip(self.context_lens, needed)):
            self.block_tables[s, :count] = order[start : start + count]
            start += count
            tokens = torch.arange(context)
            slots.append(self.block_tables[s, tokens // block_size].long() * block_size + tokens % block_size)
        total = sum(self.context_lens)
        self.keys = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.values = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
        cache_append_cpu(self.keys, self.values, self.key_cache, self.value_cache, self.slot_mapping)
        self.query = (2 * torch.randn(num_seqs, num_heads, head_dim, generator=gen)).to(dtype)
        self.lens = torch.tensor(self.context_lens, dtype=torch.int32)

    def run(self, query=None, scale=None):
        """The op's output for this case."""
        return paged_attention_cpu(
            self.query if query is None else query, self.key_cache, self.value_cache, self.block_tables, self.lens,
            scale,
        )

    def reference(self, scale=None):
        """float64 attention over the cache contents in logical order."""
        num_seqs, num_heads, head_dim = self.query.shape
        group = num_heads // self.key_cache.shape[1]
        scale = head_dim**-0.5 if scale is None else scale
        outputs = []
        for s in range(num_seqs):
            k, v = gather_kv(self.key_cache, self.value_cache, self.block_tables[s], self.context_lens[s])
            k = k.double().repeat_interleave(group, dim=1)
            v = v.double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,thd->ht", self.query[s].double(), k) * scale
            outputs.append(torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v))
        return torch.stack(outputs) if outputs else torch.zeros(0, num_heads, head_dim, dtype=torch.float64)


def assert_matches(out, case, scale=None):
    assert out.dtype == case.dtype
    assert out.shape == case.query.shape
    tol = TOLERANCE[case.dtype]
    torch.testing.assert_close(out.double(), case.reference(scale), rtol=tol, atol=tol)


# --- correctness --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(24))
def test_fuzzed_shapes_match_reference(seed, isa):
    """Random GQA ratio, head_dim, block size, dtype, ragged batch of contexts (partial and exact blocks)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    group = rng.choice([1, 2, 3, 4, 5, 7, 8, 12, 16, 64])
    num_kv_heads = rng.choice([1, 2, 3]) if group < 16 else 1
    head_dim = rng.choice([64, 80, 96, 112, 128, 256])
    block_size = rng.choice([16, 32, 64, 128, 256])
    dtype = rng.choice(DTYPES)
    contexts = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.25:
            contexts.append(block_size * rng.randint(1, 3))  # exact multiple
        elif kind < 0.4:
            contexts.append(rng.randint(1, 15))  # inside the first panel
        else:
            contexts.append(rng.randint(1, 600))
    case = PagedCase(gen, contexts, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype)
    assert_matches(case.run(), case)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 64])
def test_every_gqa_ratio(group, isa):
    """Every head-tile remainder of the score and value kernels."""
    gen = torch.Generator().manual_seed(group)
    case = PagedCase(gen, [37, 130], 2 * group, 2, 64, 32, torch.float32)
    assert_matches(case.run(), case)


@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 80, 96, 112, 128, 144, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_head_dim(head_dim, dtype, isa):
    """Every column-tile remainder of the value kernel (head_dim / 16 = 1..16)."""
    gen = torch.Generator().manual_seed(head_dim)
    case = PagedCase(gen, [70, 16], 8, 2, head_dim, 16, dtype)
    assert_matches(case.run(), case)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_block_sizes_partial_and_exact(block_size, isa):
    gen = torch.Generator().manual_seed(block_size)
    contexts = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 5]
    case = PagedCase(gen, contexts, 4, 2, 64, block_size, torch.bfloat16)
    assert_matches(case.run(), case)


@pytest.mark.parametrize("dtype, num_threads", [(torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 7)])
def test_long_contexts_split_k(dtype, num_threads, isa, threads):
    """One long request is cut into pieces merged by log-sum-exp; results agree for any thread count."""
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(num_threads)
    case = PagedCase(gen, [20000, 3], 8, 1, 64, 64, dtype)
    assert_matches(case.run(), case)


def test_split_k_with_many_small_pieces(threads):
    """Many threads over a ragged batch: pieces start mid-block and counts per sequence differ."""
    torch.set_num_threads(32)
    gen = torch.Generator().manual_seed(5)
    case = PagedCase(gen, [5000, 2900, 17, 1200], 12, 3, 128, 256, torch.float32)
    assert_matches(case.run(), case)


@pytest.fixture
def restore_work_split():
    """Restores the work-split parameters a test changes."""
    saved = cpu_attention_work_split()
    yield
    cpu_attention_work_split(**saved)


@pytest.mark.parametrize("items_per_thread", [1, 3, 16])
def test_work_split_granularity(items_per_thread, threads, restore_work_split):
    """Guided pieces, coarse to fine, over a ragged batch on 6 threads: the cut never changes the result beyond
    the reference tolerance, whatever sizes the pieces take."""
    torch.set_num_threads(6)
    cpu_attention_work_split(items_per_thread=items_per_thread, min_item_bytes=4096, min_thread_bytes=1)
    gen = torch.Generator().manual_seed(17 + items_per_thread)
    case = PagedCase(gen, [3000, 1, 700, 4100, 45], 8, 2, 64, 32, torch.bfloat16)
    assert_matches(case.run(), case)


@pytest.fixture
def finest_split():
    """Splits every call as finely as the planner allows (one panel per item, every thread), then restores."""
    saved = cpu_attention_work_split()
    cpu_attention_work_split(items_per_thread=1 << 20, min_item_bytes=1, min_thread_bytes=1)
    yield
    cpu_attention_work_split(**saved)


@pytest.mark.parametrize("num_threads", [2, 5])
def test_finest_split_small_calls(num_threads, isa, threads, finest_split):
    """Small calls cut into 16-token items over several threads: each merge is done by whichever thread
    finishes its last piece, and results match the reference."""
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(11 + num_threads)
    for contexts, group, kv_heads, head_dim, block_size, dtype in [
        ([1, 17, 33, 160, 47], 3, 2, 64, 16, torch.bfloat16),
        ([300, 1, 64], 7, 1, 80, 32, torch.float32),
        ([129, 513], 1, 4, 128, 128, torch.float16),
    ]:
        case = PagedCase(gen, contexts, group * kv_heads, kv_heads, head_dim, block_size, dtype)
        assert_matches(case.run(), case)


def test_work_split_parameters_round_trip(finest_split):
    params = cpu_attention_work_split()
    assert params == {"items_per_thread": 1 << 20, "min_item_bytes": 1, "min_thread_bytes": 1}
    assert cpu_attention_work_split(min_item_bytes=4096)["min_item_bytes"] == 4096
    assert cpu_attention_work_split(items_per_thread=-3)["items_per_thread"] == 1 << 20  # <= 0 keeps


def test_longest_context(threads):
    """A 131072-token context (the contract's maximum) with split-K over 2 threads."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(9)
    case = PagedCase(gen, [131072], 2, 1, 32, 256, torch.bfloat16, spare_blocks=0)
    assert_matches(case.run(), case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_rounding_matches_torch(dtype, isa):
    """Two tokens with equal keys: the output is exactly (v1 + v2) / 2 rounded to the dtype, so the kernel's
    fp32 -> bf16/fp16 conversion must match torch's bit for bit, subnormals and large values included."""
    gen = torch.Generator().manual_seed(10)
    num_blocks, head_dim = 1, 256
    key_cache, value_cache = allocate_kv_cache_cpu(num_blocks, 1, 16, head_dim, dtype)
    finite_limit = 0x7C00 if dtype == torch.float16 else 0x7F80
    bits = torch.randint(0, finite_limit, (2, 1, head_dim), generator=gen, dtype=torch.int32)
    bits |= torch.randint(0, 2, bits.shape, generator=gen, dtype=torch.int32) << 15
    values = bits.to(torch.int16).view(dtype)
    cache_append_cpu(torch.zeros_like(values), values, key_cache, value_cache, torch.tensor([0, 1]))
    query = torch.zeros(1, 1, head_dim, dtype=dtype)
    out = paged_attention_cpu(query, key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32),
                              torch.tensor([2], dtype=torch.int32))
    expected = ((values[0].float() + values[1].float()) * 0.5).to(dtype)
    assert torch.equal(out.view(torch.int16), expected.view(1, 1, head_dim).view(torch.int16))


def test_strided_query_from_fused_qkv(isa):
    """The query may be a slice of a fused QKV projection output (non-contiguous heads and rows)."""
    gen = torch.Generator().manual_seed(3)
    case = PagedCase(gen, [45, 300, 1], 8, 2, 64, 16, torch.bfloat16)
    num_seqs, num_heads, head_dim = case.query.shape
    fused = torch.randn(num_seqs, (num_heads + 4) * head_dim + 16, generator=gen).to(case.dtype)
    query = fused[:, 16 : 16 + num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    query.copy_(case.query)
    assert not query.is_contiguous()
    assert_matches(case.run(query=query), case)
    transposed = case.query.transpose(1, 2).contiguous().transpose(1, 2)  # last dim not contiguous
    assert_matches(case.run(query=transposed), case)


def test_explicit_scale():
    gen = torch.Generator().manual_seed(4)
    case = PagedCase(gen, [100], 4, 4, 64, 16, torch.float32)
    assert_matches(case.run(scale=0.3), case, scale=0.3)


def test_every_isa_path_agrees():
    gen = torch.Generator().manual_seed(6)
    case = PagedCase(gen, [300, 33], 12, 4, 128, 32, torch.float16)
    outputs = []
    for name in ISAS:
        os.environ["APEX_CPU_ISA"] = name
        try:
            assert cpu_isa() == name
            outputs.append(case.run())
        finally:
            del os.environ["APEX_CPU_ISA"]
    for out in outputs:
        assert_matches(out, case)


def test_default_isa_is_best_supported(monkeypatch):
    monkeypatch.delenv("APEX_CPU_ISA", raising=False)
    assert cpu_isa() == ISAS[0]
    monkeypatch.setenv("APEX_CPU_ISA", "auto")
    assert cpu_isa() == ISAS[0]
    assert "scalar" in ISAS


def test_unknown_or_unsupported_isa_is_an_error(monkeypatch):
    monkeypatch.setenv("APEX_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="APEX_CPU_ISA"):
        cpu_isa()
    gen = torch.Generator().manual_seed(0)
    case = PagedCase(gen, [5], 2, 1, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="APEX_CPU_ISA"):
        case.run()
    for name in ("avx512", "avx2"):
        if name not in ISAS:
            monkeypatch.setenv("APEX_CPU_ISA", name)
            with pytest.raises(RuntimeError, match="does not support|does not include"):
                cpu_isa()


def test_empty_batch():
    key_cache, value_cache = allocate_kv_cache_cpu(2, 1, 16, 64, torch.float32)
    out = paged_attention_cpu(
        torch.randn(0, 2, 64), key_cache, value_cache, torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
    )
    assert out.shape == (0, 2, 64)


def test_output_is_fully_written():
    """The output is freshly allocated; with NaN in memory beforehand, no NaN survives."""
    gen = torch.Generator().manual_seed(8)
    case = PagedCase(gen, [40, 9], 6, 3, 96, 16, torch.float16)
    for _ in range(3):
        torch.full((4096,), float("nan"))  # leave NaN in recently freed allocator memory
        assert torch.isfinite(case.run()).all()


# --- cache append and layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
def test_cache_append_round_trip(dtype, block_size):
    """Rows appended in a random order to random slots (strided inputs) come back from gather_kv, and K sits at
    the contract's transposed panel offset."""
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 6, 3, 80
    key_cache, value_cache = allocate_kv_cache_cpu(num_blocks, num_kv_heads, block_size, head_dim, dtype)
    key_cache.fill_(float("nan"))
    value_cache.fill_(float("nan"))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:300 % (num_blocks * block_size)]
    fused = torch.randn(len(slots), 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 1 : 1 + num_kv_heads], fused[:, 1 + num_kv_heads :]
    cache_append_cpu(key, value, key_cache, value_cache, slots)

    flat_k = key_cache.view(num_blocks, num_kv_heads, -1)
    for i in torch.randint(len(slots), (20,), generator=gen).tolist():
        block, offset = divmod(int(slots[i]), block_size)
        for h in range(num_kv_heads):
            d = i % head_dim
            position = ((offset // 16) * head_dim + d) * 16 + offset % 16
            assert flat_k[block, h, position].item() == key[i, h, d].item()
            assert torch.equal(value_cache[block, h, offset], value[i, h])

    table = torch.arange(num_blocks, dtype=torch.int32)
    k_all, v_all = gather_kv(key_cache, value_cache, table, num_blocks * block_size)
    assert torch.equal(k_all[slots], key)
    assert torch.equal(v_all[slots], value)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(k_all[untouched].float()).all() and torch.isnan(v_all[untouched].float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_cache_append_of_prompt_runs_equals_the_layout(dtype, block_size, num_threads, threads):
    """Prompt chunks append runs of consecutive slots (written a panel tile at a time): runs starting mid-panel,
    crossing panels and ending a block, a run broken by a skipped slot, padding tokens and single rows among them;
    strided key/value. Every token reads back at its slot (gather_kv) and nothing else is written."""
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(block_size + num_threads)
    num_blocks, num_kv_heads, head_dim = 8, 4, 48
    key_cache, value_cache = allocate_kv_cache_cpu(num_blocks, num_kv_heads, block_size, head_dim, dtype)
    key_cache.fill_(float("nan"))
    value_cache.fill_(float("nan"))
    b = torch.randperm(num_blocks, generator=gen).tolist()
    pieces = [torch.arange(b[0] * block_size + 5, (b[0] + 1) * block_size),  # mid-panel to the block's end
              torch.arange(b[1] * block_size, b[1] * block_size + block_size // 2 + 3),
              torch.full((3,), -1),  # padding
              torch.tensor([b[2] * block_size + 9, b[2] * block_size + 10, b[2] * block_size + 12]),  # broken
              torch.tensor([b[3] * block_size + 1]),
              torch.arange(b[4] * block_size, (b[4] + 1) * block_size).flip(0)[:block_size // 2]]  # descending
    pieces += [torch.arange(i * block_size, (i + 1) * block_size) for i in b[5:]]  # whole blocks: >= 256 rows,
    slots = torch.cat(pieces)                                                    # the threads share them out
    assert len(slots) * num_kv_heads >= 256
    fused = torch.randn(len(slots), 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 1:1 + num_kv_heads], fused[:, 1 + num_kv_heads:]
    cache_append_cpu(key, value, key_cache, value_cache, slots)
    k_all, v_all = gather_kv(key_cache, value_cache, torch.arange(num_blocks, dtype=torch.int32),
                             num_blocks * block_size)
    kept = slots >= 0
    assert torch.equal(k_all[slots[kept]], key[kept]) and torch.equal(v_all[slots[kept]], value[kept])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.isnan(k_all[untouched].float()).all() and torch.isnan(v_all[untouched].float()).all()


def test_cache_append_skips_negative_slots_and_handles_many_rows(threads):
    torch.set_num_threads(2)
    key_cache, value_cache = allocate_kv_cache_cpu(64, 2, 16, 64, torch.float32)
    key_cache.zero_()
    value_cache.zero_()
    slots = torch.arange(1000)
    slots[::3] = -1  # padding rows
    key, value = torch.randn(1000, 2, 64), torch.randn(1000, 2, 64)
    cache_append_cpu(key, value, key_cache, value_cache, slots)
    k_all, v_all = gather_kv(key_cache, value_cache, torch.arange(64, dtype=torch.int32), 1024)
    kept = slots >= 0
    assert torch.equal(k_all[slots[kept]], key[kept]) and torch.equal(v_all[slots[kept]], value[kept])
    skipped = torch.arange(0, 1000, 3)
    assert (k_all[skipped] == 0).all() and (v_all[skipped] == 0).all()


def test_gather_kv_logical_order():
    key_cache, value_cache = allocate_kv_cache_cpu(3, 1, 32, 16, torch.float32)
    key = torch.arange(40 * 16, dtype=torch.float32).view(40, 1, 16)
    table = torch.tensor([2, 0], dtype=torch.int32)
    slots = torch.cat([2 * 32 + torch.arange(32), torch.arange(8)])
    cache_append_cpu(key, -key, key_cache, value_cache, slots)
    k, v = gather_kv(key_cache, value_cache, table, 40)
    assert torch.equal(k, key) and torch.equal(v, -key)


def test_copy_blocks_cpu():
    src_k, _ = allocate_kv_cache_cpu(8, 2, 16, 32, torch.bfloat16)
    dst_k, _ = allocate_kv_cache_cpu(5, 2, 16, 32, torch.bfloat16)
    src_k.copy_(torch.randn(src_k.shape))
    dst_k.zero_()
    copy_blocks(src_k, dst_k, [7, 1, 2, 3], torch.tensor([4, 0, 1, 2]))
    assert torch.equal(dst_k[4], src_k[7]) and torch.equal(dst_k[:3], src_k[1:4])
    assert (dst_k[3] == 0).all()
    before = src_k[:2].clone()
    copy_blocks(src_k, src_k, [0, 1], [1, 0])  # swap within one pool
    assert torch.equal(src_k[0], before[1]) and torch.equal(src_k[1], before[0])
    with pytest.raises(ValueError, match="differ"):
        copy_blocks(src_k, dst_k, [0], [0, 1])
    with pytest.raises(IndexError):
        copy_blocks(src_k, dst_k, [8], [0])
    with pytest.raises(ValueError, match="dtypes"):
        copy_blocks(src_k, dst_k.float(), [0], [0])


@pytest.mark.parametrize("host_is_dst", [True, False])
def test_blocks_cross_in_one_gather_and_a_copy_per_host_run(host_is_dst, monkeypatch):
    """The host <-> accelerator path of copy_blocks_layers, run with both sides on the CPU: blocks scattered over
    the accelerator's pool, host ids in three runs; every layer's K and V arrive, with one copy per run and
    cache (not one per block)."""
    from apex_compile.ops import kv_layout

    gen = torch.Generator().manual_seed(3)
    accel = [torch.randn(12, 2, 16, 8, generator=gen) for _ in range(4)]
    host = [torch.randn(10, 2, 16, 8, generator=gen) for _ in range(4)]
    device_ids, host_ids = [9, 2, 7, 0, 11, 5], [3, 4, 5, 0, 8, 9]
    src, dst = (accel, host) if host_is_dst else (host, accel)
    src_ids, dst_ids = (device_ids, host_ids) if host_is_dst else (host_ids, device_ids)
    want = [d.clone() for d in dst]
    for s_, w in zip(src, want):
        for i, j in zip(src_ids, dst_ids):
            w[j] = s_[i]
    copies = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, other, **kw: copies.append(1) or copy(self, other, **kw))
    kv_layout._copy_across(src, dst, src_ids, dst_ids, host_is_dst=host_is_dst)
    assert all(torch.equal(d, w) for d, w in zip(dst, want))
    assert len(copies) == 3 * len(src)
    assert kv_layout.id_runs([3, 4, 5, 0, 8, 9, 1]) == [(0, 3, 3), (3, 0, 1), (4, 8, 2), (6, 1, 1)]


def test_copy_blocks_layers_checks_every_pair():
    a, b = torch.zeros(4, 2, 16, 8), torch.zeros(4, 2, 16, 8)
    with pytest.raises(ValueError, match="dtypes"):
        copy_blocks_layers([a, a], [b, b.double()], [0], [1])
    with pytest.raises(IndexError):
        copy_blocks_layers([a, a], [b, b[:2]], [0], [3])
    with pytest.raises(ValueError, match="caches"):
        copy_blocks_layers([a], [b, b], [0], [1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_blocks_across_devices_and_cuda_inputs_rejected():
    host_k, _ = allocate_kv_cache_cpu(8, 2, 16, 32, torch.float16, pin_memory=True)
    host_k.copy_(torch.randn(host_k.shape))
    device_k = torch.zeros(6, 2, 16, 32, dtype=torch.float16, device="cuda")
    copy_blocks(host_k, device_k, [3, 4, 5, 0], [0, 1, 2, 5])
    torch.cuda.synchronize()
    assert torch.equal(device_k[:3].cpu(), host_k[3:6]) and torch.equal(device_k[5].cpu(), host_k[0])
    back = torch.zeros_like(host_k).pin_memory()
    copy_blocks(device_k, back, [5, 0], [1, 2])
    torch.cuda.synchronize()
    assert torch.equal(back[1], host_k[0]) and torch.equal(back[2], host_k[3])
    gen = torch.Generator().manual_seed(0)
    case = PagedCase(gen, [20], 2, 1, 64, 16, torch.float32)
    with pytest.raises(RuntimeError):
        paged_attention_cpu(case.query.cuda(), case.key_cache, case.value_cache, case.block_tables, case.lens)


# --- errors -------------------------------------------------------------------------------------------------


def _error_case():
    gen = torch.Generator().manual_seed(11)
    return PagedCase(gen, [20, 33], 4, 2, 64, 16, torch.float32)


def _call(case, **changes):
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, context_lens=case.lens)
    args.update(changes)
    return paged_attention_cpu(**args)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: dict(query=c.query.bfloat16()), "query dtype"),
        (lambda c: dict(query=c.query[0]), r"query must be \[num_seqs"),
        (lambda c: dict(query=c.query[:, :, :32]), "head_dim"),
        (lambda c: dict(query=c.query[:, :3]), "multiple of num_kv_heads"),
        (lambda c: dict(query=c.query[:1]), "block_tables must be"),
        (lambda c: dict(key_cache=c.key_cache.double(), value_cache=c.value_cache.double(),
                        query=c.query.double()), "float32, bfloat16 and float16"),
        (lambda c: dict(value_cache=c.value_cache.half()), "value_cache dtype"),
        (lambda c: dict(value_cache=c.value_cache[:-1]), "value_cache shape"),
        (lambda c: dict(key_cache=c.key_cache.transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        (lambda c: dict(key_cache=c.key_cache[0]), r"key_cache must be \[num_blocks"),
        (lambda c: dict(block_tables=c.block_tables.long()), "block_tables must be int32"),
        (lambda c: dict(block_tables=c.block_tables[:, :1]), "needs 2 blocks of 16 tokens but block_tables has 1"),
        (lambda c: dict(context_lens=c.lens.long()), "context_lens must be int32"),
        (lambda c: dict(context_lens=c.lens[:1]), "context_lens must be int32"),
        (lambda c: dict(context_lens=torch.tensor([20, 0], dtype=torch.int32)), "zero-length"),
        (lambda c: dict(context_lens=torch.tensor([-3, 1], dtype=torch.int32)), "at least"),
        (lambda c: dict(block_tables=_set(c.block_tables, 1, 2, c.num_blocks)), "out of range"),
        (lambda c: dict(block_tables=_set(c.block_tables, 0, 0, -1)), "out of range"),
        (lambda c: dict(query=c.query.to("meta")), "CPU tensor"),
        (lambda c: dict(block_tables=c.block_tables.to("meta")), "CPU tensor"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message):
    case = _error_case()
    with pytest.raises(RuntimeError, match=message):
        _call(case, **change(case))


def _set(table, row, column, value):
    table = table.clone()
    table[row, column] = value
    return table


@pytest.mark.parametrize(
    "shape, message",
    [((4, 2, 24, 64), "power of two"), ((4, 2, 8, 64), "power of two"), ((4, 2, 512, 64), "power of two"),
     ((4, 2, 16, 72), "multiple of 16"), ((4, 2, 16, 272), "multiple of 16")],
)
def test_bad_cache_geometry(shape, message):
    key_cache = torch.zeros(shape)
    value_cache = torch.zeros(shape)
    query = torch.zeros(1, 2, shape[3])
    with pytest.raises(RuntimeError, match=message):
        paged_attention_cpu(query, key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=message):
        cache_append_cpu(torch.zeros(1, 2, shape[3]), torch.zeros(1, 2, shape[3]), key_cache, value_cache,
                         torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match=message):
        allocate_kv_cache_cpu(*shape, torch.float32)


def test_allocate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        allocate_kv_cache_cpu(4, 2, 16, 64, torch.int8)
    with pytest.raises(ValueError, match=">= 1"):
        allocate_kv_cache_cpu(0, 2, 16, 64, torch.float32)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: dict(slot_mapping=torch.tensor([0, 4 * 16])), "out of range"),
        (lambda a: dict(slot_mapping=torch.tensor([0, 1], dtype=torch.int32)), "slot_mapping must be int64"),
        (lambda a: dict(slot_mapping=torch.tensor([0])), "slot_mapping must be int64"),
        (lambda a: dict(key=a["key"].half(), value=a["value"].half()), "must equal the cache dtype"),
        (lambda a: dict(value=a["value"][:, :1]), "value shape"),
        (lambda a: dict(key=a["key"][:, :, :32], value=a["value"][:, :, :32]), "key must be"),
        (lambda a: dict(key=a["key"].to("meta")), "CPU tensor"),
    ],
)
def test_cache_append_bad_arguments(change, message):
    key_cache, value_cache = allocate_kv_cache_cpu(4, 2, 16, 64, torch.float32)
    args = dict(key=torch.randn(2, 2, 64), value=torch.randn(2, 2, 64), key_cache=key_cache,
                value_cache=value_cache, slot_mapping=torch.tensor([0, 5]))
    args.update(change(args))
    with pytest.raises(RuntimeError, match=message):
        cache_append_cpu(**args)


# --- torch.compile ------------------------------------------------------------------------------------------


def test_opcheck():
    """Schema, fake implementation and dispatch registrations are consistent (torch.library.opcheck)."""
    gen = torch.Generator().manual_seed(12)
    case = PagedCase(gen, [30, 17], 4, 2, 64, 16, torch.float32)
    torch.library.opcheck(
        torch.ops.apex.paged_attention_cpu.default,
        (case.query, case.key_cache, case.value_cache, case.block_tables, case.lens, None),
    )
    key, value = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    torch.library.opcheck(
        torch.ops.apex.cache_append_cpu.default,
        (key, value, case.key_cache, case.value_cache, torch.tensor([3, -1])),
    )


def test_decode_step_under_torch_compile_fullgraph():
    """Append + attend traced with fullgraph=True: the fake implementations carry shapes, the append's
    mutation of the caches is kept, and results equal eager."""
    gen = torch.Generator().manual_seed(13)
    case = PagedCase(gen, [50, 20], 6, 3, 64, 16, torch.float32, spare_blocks=4)

    def decode_step(qkv, key_cache, value_cache, slot_mapping, block_tables, context_lens):
        query, key, value = qkv.split([6, 3, 3], dim=1)
        cache_append_cpu(key, value, key_cache, value_cache, slot_mapping)
        return paged_attention_cpu(query * 1.0, key_cache, value_cache, block_tables, context_lens) * 2.0

    new_lens = case.lens + 1
    slots = torch.tensor(
        [int(case.block_tables[s, c // 16]) * 16 + c % 16 for s, c in enumerate(case.context_lens)]
    )
    qkv = torch.randn(2, 12, 64, generator=gen)
    expected_k, expected_v = case.key_cache.clone(), case.value_cache.clone()
    expected = decode_step(qkv, expected_k, expected_v, slots, case.block_tables, new_lens)
    compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    out = compiled(qkv, case.key_cache, case.value_cache, slots, case.block_tables, new_lens)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(case.key_cache.nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(case.value_cache.nan_to_num(7.0), expected_v.nan_to_num(7.0))
    assert not math.isnan(out.sum().item())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge-page alignment is a Linux allocation")
def test_large_caches_start_on_a_huge_page_boundary(monkeypatch):
    """HUGE_PAGE_SHIFT_PAGES = 0: a layer's cache of 4 MiB or more starts on a 2 MiB boundary (all its memory can
    be backed by transparent huge pages, none lost to 4 KiB pages at its ends); K and V are separate, contiguous,
    of the asked shape."""
    from apex_compile.ops import cpu_attention

    monkeypatch.setattr(cpu_attention, "HUGE_PAGE_SHIFT_PAGES", 0)
    for num_blocks in (257, 1000):  # 4 MiB + one block, ~15.6 MiB of fp32 per cache
        key_cache, value_cache = allocate_kv_cache_cpu(num_blocks, 2, 16, 128, torch.float32)
        for cache in (key_cache, value_cache):
            assert cache.shape == (num_blocks, 2, 16, 128) and cache.dtype == torch.float32
            assert cache.is_contiguous() and cache.data_ptr() % (2 << 20) == 0
        assert key_cache.untyped_storage().data_ptr() != value_cache.untyped_storage().data_ptr()
        key_cache.fill_(1.0)
        value_cache.fill_(2.0)  # the two do not overlap
        assert bool((key_cache == 1.0).all()) and bool((value_cache == 2.0).all())


@pytest.mark.parametrize("shift_pages", [0, 1])
def test_a_large_cache_is_its_storage(monkeypatch, shift_pages):
    """A cache's storage starts at its first element and ends at its last: torch's `is_pinned` looks at the
    storage's first byte, so a cache inside a larger allocation would read as unpinned once the host pool
    page-locks the cache's own range, and every swap copy would block the launching thread."""
    from apex_compile.ops import cpu_attention

    monkeypatch.setattr(cpu_attention, "HUGE_PAGE_SHIFT_PAGES", shift_pages)
    for num_blocks in (3, 257):  # below and above the huge-page path's 4 MiB
        for cache in allocate_kv_cache_cpu(num_blocks, 2, 16, 128, torch.float32):
            storage = cache.untyped_storage()
            assert storage.data_ptr() == cache.data_ptr() and storage.nbytes() == cache.nbytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge-page alignment is a Linux allocation")
def test_shifted_caches_start_a_page_apart_within_their_advised_huge_pages(monkeypatch):
    """HUGE_PAGE_SHIFT_PAGES = 1: each large cache starts one 4 KiB page after the one allocated before it (mod
    2 MiB), inside memory advised for huge pages from the boundary below its start; the caches do not overlap."""
    from apex_compile.ops import cpu_attention

    advised = []
    real_advise = cpu_attention._advise_huge_pages
    monkeypatch.setattr(cpu_attention, "HUGE_PAGE_SHIFT_PAGES", 1)
    monkeypatch.setattr(cpu_attention, "_advise_huge_pages",
                        lambda t: (advised.append((t.data_ptr(), t.nbytes)), real_advise(t)))
    caches = [c for _ in range(3) for c in allocate_kv_cache_cpu(257, 2, 16, 128, torch.float32)]
    offsets = [c.data_ptr() % (2 << 20) for c in caches]
    assert all((b - a) % (2 << 20) == 4096 for a, b in zip(offsets, offsets[1:]))
    for cache, (start, nbytes) in zip(caches, advised):
        assert start % (2 << 20) == 0 and nbytes % (2 << 20) == 0
        assert start <= cache.data_ptr() and cache.data_ptr() + cache.nbytes <= start + nbytes
    for i, cache in enumerate(caches):
        cache.fill_(float(i))
    assert all(bool((cache == i).all()) for i, cache in enumerate(caches))
