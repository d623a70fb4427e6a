"""GPU paged KV cache ops: allocate_kv_cache_gpu, apex::cache_append_gpu, apex::paged_attention_gpu (decode),
apex::paged_decode_append_gpu (decode fused with the append) and apex::paged_prefill_attention_gpu, against
float64 references that decode the layout of notes/CONVENTIONS.md independently of the kernels.

The "cpu" device runs the torch/C++ CPU path in a normal session and the Triton interpreter when
TRITON_INTERPRET=1 (tests/kernels/test_triton_interpreter.py runs this file that way in a subprocess).
Caches are filled with NaN before any append, so a kernel that reads an unwritten slot fails.
"""

import pytest
import torch

from apex_compile.kernels import paged_attention
from apex_compile.kernels.paged_attention import (
    allocate_kv_cache_gpu,
    DECODE_BLOCK_T,
    DECODE_BLOCK_T_SMALL_GRID,
    PROGRAMS_PER_SM,
    cache_append_launch,
    decode_chunk,
    decode_split_plan,
    paged_decode_append_launch,
    paged_decode_launch,
    reserve_decode_counters,
)
from apex_compile.kernels import prefill_attention
from apex_compile.kernels.prefill_attention import default_prefill_config, paged_prefill_launch
from apex_compile.ops import cache_append_gpu, paged_attention_gpu, paged_prefill_attention_gpu
from apex_compile.ops.gpu_attention import paged_decode_append_gpu

from tests.devices import CUDA_ONLY, DEVICES, INTERPRET, TRITON_DEVICES, not_interpreted
from tests.helpers import assert_rel_close


def tolerance(dtype, device):
    if dtype == torch.float32:
        return 1e-5
    # The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even): allow twice the error.
    return 2e-2 if device == "cpu" and INTERPRET else 1e-2


def logical_key_cache(key_cache):
    """[num_blocks, num_kv_heads, block_size, head_dim] token-major view of the panel-transposed K cache."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    panels = key_cache.reshape(num_blocks, num_kv_heads, block_size // 16, head_dim, 16)
    return panels.transpose(3, 4).reshape(num_blocks, num_kv_heads, block_size, head_dim)


def write_sequence(key_cache, value_cache, block_table_row, key, value):
    """Stores one sequence's key/value [n, Hkv, D] at tokens 0..n-1 in the documented layout (pure torch)."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    tokens = torch.arange(key.shape[0], device=key.device)
    blocks = block_table_row[tokens // block_size].long()
    in_block = tokens % block_size
    panels = key_cache.view(num_blocks, num_kv_heads, block_size // 16, head_dim, 16)
    panels[blocks, :, in_block // 16, :, in_block % 16] = key
    value_cache[blocks, :, in_block, :] = value


class PagedBatch:
    """Random sequences written into NaN-poisoned paged caches (by `write_sequence`, independent of the
    kernels), with the logical float64 K/V of every sequence kept for references."""

    def __init__(self, context_lens, num_kv_heads, head_dim, block_size, dtype, device, spare_blocks=3,
                 extra_table_columns=1):
        self.context_lens = list(context_lens)
        blocks_per_seq = [-(-n // block_size) for n in self.context_lens]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        self.key_cache, self.value_cache = allocate_kv_cache_gpu(
            num_blocks, num_kv_heads, block_size, head_dim, dtype, device=device)
        self.key_cache.fill_(float("nan"))
        self.value_cache.fill_(float("nan"))
        width = max(blocks_per_seq) + extra_table_columns
        # Shuffled physical blocks; unused table entries point at arbitrary (never written) blocks.
        physical = torch.randperm(num_blocks).tolist()
        table = torch.randint(0, num_blocks, (len(self.context_lens), width), dtype=torch.int32)
        for seq, used in enumerate(blocks_per_seq):
            table[seq, :used] = torch.tensor([physical.pop() for _ in range(used)], dtype=torch.int32)
        self.block_tables = table.to(device)
        self.keys, self.values = [], []
        for seq, n in enumerate(self.context_lens):
            k = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=device)
            v = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=device)
            write_sequence(self.key_cache, self.value_cache, self.block_tables[seq], k, v)
            self.keys.append(k.double().cpu())
            self.values.append(v.double().cpu())
        self.context_lens_tensor = torch.tensor(self.context_lens, dtype=torch.int32, device=device)


def attention_reference(query, keys, values, positions, scale):
    """float64 attention of query [L, Hq, D] over keys/values [ctx, Hkv, D]; row i sees keys 0..positions[i]."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,thd->hlt", query.double().cpu(), k) * scale
    allowed = torch.arange(keys.shape[0])[None, :] <= torch.as_tensor(positions)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hlt,thd->lhd", probs, v)


def decode_reference(query, batch, scale):
    return torch.stack([
        attention_reference(query[s:s + 1], batch.keys[s], batch.values[s], [n - 1], scale)[0]
        for s, n in enumerate(batch.context_lens)])


def make_query(num_seqs, num_heads, head_dim, dtype, device):
    """A strided query: every other head of a wider tensor, as a slice of a fused QKV output would be."""
    return torch.randn(num_seqs, 2 * num_heads, head_dim, dtype=dtype, device=device)[:, ::2]


# ----------------------------------------------------------------------------------------------------------
# allocation and append


@pytest.mark.parametrize("device", DEVICES)
def test_allocate_kv_cache_gpu_shapes_and_validation(device):
    key_cache, value_cache = allocate_kv_cache_gpu(5, 2, 32, 64, torch.bfloat16, device=device)
    assert key_cache.shape == value_cache.shape == (5, 2, 32, 64)
    assert key_cache.dtype == torch.bfloat16 and key_cache.is_contiguous()
    assert key_cache.device.type == device
    with pytest.raises(ValueError, match="block_size"):
        allocate_kv_cache_gpu(5, 2, 24, 64, torch.float32, device=device)
    with pytest.raises(ValueError, match="head_dim"):
        allocate_kv_cache_gpu(5, 2, 16, 72, torch.float32, device=device)
    with pytest.raises(ValueError, match="dtype"):
        allocate_kv_cache_gpu(5, 2, 16, 64, torch.int8, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,num_kv_heads", [(16, 64, 3), (32, 80, 1)])
def test_cache_append_writes_the_documented_layout(device, dtype, block_size, head_dim, num_kv_heads):
    num_blocks, tokens = 4, 11
    key_cache, value_cache = allocate_kv_cache_gpu(num_blocks, num_kv_heads, block_size, head_dim, dtype, device)
    key_cache.fill_(float("nan"))
    value_cache.fill_(float("nan"))
    # Strided key/value: slices of a fused [tokens, 3 * heads, head_dim] projection output.
    qkv = torch.randn(tokens, 3 * num_kv_heads, head_dim, dtype=dtype, device=device)
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[3] = -1  # padding row: skipped
    cache_append_gpu(key, value, key_cache, value_cache, slots.to(device))

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    logical_k = logical_key_cache(key_cache.cpu()).permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)
    logical_v = value_cache.cpu().permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        assert torch.equal(logical_k[slot], key[token].cpu()), f"K of token {token} at slot {slot}"
        assert torch.equal(logical_v[slot], value[token].cpu()), f"V of token {token} at slot {slot}"
    assert torch.isnan(logical_k[~written]).all() and torch.isnan(logical_v[~written]).all()
    # Element (t, d) of K lives at ((t // 16) * head_dim + d) * 16 + t % 16 inside its slab.
    slot = int(slots[0])
    block, t = divmod(slot, block_size)
    slab = key_cache[block, num_kv_heads - 1].reshape(-1).cpu()
    d = head_dim - 1
    assert torch.equal(slab[((t // 16) * head_dim + d) * 16 + t % 16], key[0, num_kv_heads - 1, d].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_cache_append_rejects_bad_inputs(device):
    key_cache, value_cache = allocate_kv_cache_gpu(2, 1, 16, 16, torch.float32, device)
    key = torch.randn(3, 1, 16, device=device)
    with pytest.raises((ValueError, RuntimeError)):
        cache_append_gpu(key, key, key_cache, value_cache, torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises((ValueError, RuntimeError)):
        cache_append_gpu(key[:, :, :8], key[:, :, :8], key_cache, value_cache,
                         torch.zeros(3, dtype=torch.int64, device=device))
    if device == "cpu":  # on CUDA the range check would need a device sync; the kernel skips such slots
        with pytest.raises((IndexError, RuntimeError)):
            cache_append_gpu(key, key, key_cache, value_cache, torch.tensor([0, 1, 32], device=device))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("bad_id", [-1, 4, 1000])
def test_public_attention_ops_reject_out_of_range_block_ids(device, bad_id):
    """A block id a sequence reads must lie in [0, num_blocks): IndexError, never a read out of bounds; ids past
    what a sequence reads are not looked at."""
    key_cache, value_cache = allocate_kv_cache_gpu(4, 2, 16, 16, torch.float32, device)
    key_cache.zero_()
    value_cache.zero_()
    query = torch.randn(2, 4, 16, device=device)
    context_lens = torch.tensor([20, 5], dtype=torch.int32, device=device)
    good = torch.tensor([[0, 1, 2], [3, 7777, -5]], dtype=torch.int32, device=device)  # row 1 reads one block
    paged_attention_gpu(query, key_cache, value_cache, good, context_lens)
    bad = good.clone()
    bad[0, 1] = bad_id
    with pytest.raises(IndexError, match="block id"):
        paged_attention_gpu(query, key_cache, value_cache, bad, context_lens)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    with pytest.raises(IndexError, match="block id"):
        paged_prefill_attention_gpu(query, key_cache, value_cache, bad, starts, context_lens, max_query_len=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_public_attention_op_can_be_captured_in_a_cuda_graph():
    """The block-id check synchronises, so it is skipped under stream capture: the public op captures and its
    replay equals the eager call."""
    key_cache, value_cache = allocate_kv_cache_gpu(4, 2, 16, 16, torch.float32, "cuda")
    key_cache.normal_()
    value_cache.normal_()
    query = torch.randn(2, 4, 16, device="cuda")
    context_lens = torch.tensor([20, 5], dtype=torch.int32, device="cuda")
    tables = torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32, device="cuda")
    eager = paged_attention_gpu(query, key_cache, value_cache, tables, context_lens)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_gpu(query, key_cache, value_cache, tables, context_lens)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# ----------------------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 7, 8])
def test_decode_gqa_ratios(device, dtype, group):
    num_kv_heads, head_dim, block_size = 2, 32, 16
    lens = [1, 16, 45] if device == "cpu" else [1, 16, 45, 700, 2100]
    batch = PagedBatch(lens, num_kv_heads, head_dim, block_size, dtype, device)
    query = make_query(len(lens), num_kv_heads * group, head_dim, dtype, device)
    out = paged_attention_gpu(query, batch.key_cache, batch.value_cache, batch.block_tables,
                              batch.context_lens_tensor)
    assert out.shape == query.shape and out.dtype == dtype and out.device.type == device
    assert_rel_close(out, decode_reference(query, batch, head_dim ** -0.5), tolerance(dtype, device), "decode")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size,head_dim", [(32, 80), (64, 64)])
def test_decode_block_sizes_head_dims_and_scale(device, block_size, head_dim):
    lens = [block_size, block_size + 1, 3 * block_size - 5]
    batch = PagedBatch(lens, 1, head_dim, block_size, torch.float32, device)
    query = make_query(len(lens), 4, head_dim, torch.float32, device)
    out = paged_attention_gpu(query, batch.key_cache, batch.value_cache, batch.block_tables,
                              batch.context_lens_tensor, scale=0.3)
    assert_rel_close(out, decode_reference(query, batch, 0.3), 1e-5, "decode")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens_per_split", [64, 128])
def test_decode_split_k_with_empty_and_ragged_splits(device, dtype, tokens_per_split):
    lens = [1, 70, 300]  # the short rows leave most splits empty; 300 ends inside a split
    batch = PagedBatch(lens, 2, 64, 16, dtype, device)
    query = make_query(len(lens), 6, 64, dtype, device)
    out = paged_decode_launch(query, batch.key_cache, batch.value_cache, batch.block_tables,
                              batch.context_lens_tensor, tokens_per_split=tokens_per_split)
    assert_rel_close(out, decode_reference(query, batch, 64 ** -0.5), tolerance(dtype, device), "split decode")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_decode_results_do_not_depend_on_max_context_len_hint(device):
    lens = [300, 40, 513] if device == "cpu" else [3000, 40, 5130]
    batch = PagedBatch(lens, 2, 32, 32, torch.float32, device)
    query = make_query(len(lens), 4, 32, torch.float32, device)
    ref = decode_reference(query, batch, 32 ** -0.5)
    for hint in (None, 1, 64, max(lens)):
        out = paged_attention_gpu(query, batch.key_cache, batch.value_cache, batch.block_tables,
                                  batch.context_lens_tensor, max_context_len=hint)
        assert_rel_close(out, ref, 1e-5, f"decode with max_context_len={hint}")


def test_decode_split_plan():
    cpu = torch.device("cpu")
    assert decode_split_plan(64, 8, 4096, cpu) == (1, 4096)  # enough programs: one split
    splits, per_split = decode_split_plan(1, 2, 8192, cpu)
    assert splits > 1 and per_split % 64 == 0 and splits * per_split >= 8192
    assert decode_split_plan(1, 1, 100, cpu) == (1, 128)  # short contexts are not split
    # Fewer resident programs per SM: fewer, longer splits.
    assert decode_split_plan(1, 2, 8192, cpu, 128, 2)[0] < splits


def test_decode_chunk_by_grid_and_tile_size():
    cpu = torch.device("cpu")  # the interpreter assumes INTERPRETER_SM_COUNT SMs
    assert decode_chunk(1, 4, 128, 2, cpu) == (DECODE_BLOCK_T_SMALL_GRID, 2)  # 4 programs on 8 SMs
    assert decode_chunk(2, 2, 128, 2, cpu) == (DECODE_BLOCK_T_SMALL_GRID, 2)
    # more than one program per two SMs: 64-token chunks (two 128-token stages leave one program per SM)
    assert decode_chunk(1, 5, 128, 2, cpu) == (DECODE_BLOCK_T, PROGRAMS_PER_SM)
    assert decode_chunk(64, 8, 128, 2, cpu) == (DECODE_BLOCK_T, PROGRAMS_PER_SM)  # a full grid
    assert decode_chunk(1, 2, 128, 4, cpu) == (DECODE_BLOCK_T, PROGRAMS_PER_SM)  # fp32 tiles too large
    assert decode_chunk(1, 2, 256, 2, cpu) == (DECODE_BLOCK_T, PROGRAMS_PER_SM)


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 32, 128), (32, 8, 128), (28, 4, 128), (8, 1, 256)])
def test_decode_cuda_model_layouts(device, dtype, block_size, num_heads, num_kv_heads, head_dim):
    lens = [1, 17, 1000, 4099, 9000]
    batch = PagedBatch(lens, num_kv_heads, head_dim, block_size, dtype, device)
    query = make_query(len(lens), num_heads, head_dim, dtype, device)
    out = paged_attention_gpu(query, batch.key_cache, batch.value_cache, batch.block_tables,
                              batch.context_lens_tensor, max_context_len=max(lens))
    assert_rel_close(out, decode_reference(query, batch, head_dim ** -0.5), 1e-2, "decode")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_rejects_bad_inputs(device):
    batch = PagedBatch([5, 9], 2, 16, 16, torch.float32, device)
    query = torch.randn(2, 4, 16, device=device)
    args = (batch.key_cache, batch.value_cache, batch.block_tables)
    with pytest.raises((TypeError, RuntimeError)):
        paged_attention_gpu(query.double(), *args, batch.context_lens_tensor)
    with pytest.raises((ValueError, RuntimeError)):
        paged_attention_gpu(query, *args, batch.context_lens_tensor.long())
    if device == "cpu":  # data-dependent checks are made on CPU tensors only (no device sync on CUDA)
        with pytest.raises((ValueError, RuntimeError)):
            paged_attention_gpu(query, *args, torch.tensor([5, 0], dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------------
# decode fused with the append of the current token, and the in-kernel merge of splits


def slot_of(block_tables, seq, position, block_size):
    """The slot of token `position` of sequence `seq`."""
    return int(block_tables[seq, position // block_size]) * block_size + position % block_size


class AppendCase:
    """A PagedBatch whose last token per sequence is not cached yet (its slot is NaN again) but given as the
    key/value rows of a fused [rows, Hq + 2 * Hkv, D] projection output, as the engine passes them; plus
    `padding` rows of context 1 with slot -1 (their block-table rows point at block 0, which they must not
    touch). `expected_caches`: the caches after the append (every real token written, by `write_sequence`)."""

    def __init__(self, lens, num_kv_heads, group, head_dim, block_size, dtype, device, padding=0,
                 extra_table_columns=1):
        self.batch = batch = PagedBatch(lens, num_kv_heads, head_dim, block_size, dtype, device,
                                        extra_table_columns=extra_table_columns)
        self.expected_caches = batch.key_cache.clone(), batch.value_cache.clone()
        num_heads, rows = num_kv_heads * group, len(lens) + padding
        self.qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
        self.query = self.qkv[:, :num_heads]
        self.key = self.qkv[:, num_heads:num_heads + num_kv_heads]
        self.value = self.qkv[:, num_heads + num_kv_heads:]
        slots = []
        panels = batch.key_cache.view(batch.key_cache.shape[0], num_kv_heads, block_size // 16, head_dim, 16)
        for seq, n in enumerate(lens):
            self.key[seq] = batch.keys[seq][-1].to(dtype)
            self.value[seq] = batch.values[seq][-1].to(dtype)
            block, t = divmod(slot_of(batch.block_tables, seq, n - 1, block_size), block_size)
            panels[block, :, t // 16, :, t % 16] = float("nan")
            batch.value_cache[block, :, t, :] = float("nan")
            slots.append(block * block_size + t)
        self.slot_mapping = torch.tensor(slots + [-1] * padding, dtype=torch.int64, device=device)
        self.block_tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables[:padding])])
        self.context_lens = torch.tensor(list(lens) + [1] * padding, dtype=torch.int32, device=device)
        self.args = (self.query, self.key, self.value, batch.key_cache, batch.value_cache, self.slot_mapping,
                     self.block_tables, self.context_lens)

    def reference(self, scale):
        """float64 attention of every row over its whole context (padding rows: their own value rows)."""
        real = len(self.batch.context_lens)
        group = self.query.shape[1] // self.key.shape[1]
        padding = self.value[real:].double().cpu().repeat_interleave(group, dim=1)
        return torch.cat([decode_reference(self.query[:real], self.batch, scale), padding])

    def assert_caches_appended(self):
        """The caches hold every real token at its slot and nothing else changed (spare blocks stay NaN)."""
        for got, expected in zip((self.batch.key_cache, self.batch.value_cache), self.expected_caches):
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def launch_both(case, **launch):
    """(decode after a separate append, fused decode + append) on the case's inputs, by the kernel launches."""
    split_caches = case.batch.key_cache.clone(), case.batch.value_cache.clone()
    cache_append_launch(case.key, case.value, *split_caches, case.slot_mapping)
    plain = paged_decode_launch(case.query, *split_caches, case.block_tables, case.context_lens, **launch)
    fused = paged_decode_append_launch(*case.args, **launch)
    return plain, fused


def assert_counters_zero(device):
    assert not reserve_decode_counters(device, 0).any(), "a split counter was left non-zero"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_append_matches_reference_and_appends(device, dtype, group):
    """Ragged contexts (1, a block, one past it, a long one that splits) plus padding rows: the fused op equals
    the float64 reference, writes each current token at its slot and nothing else."""
    lens = [1, 16, 17, 300] if device == "cpu" else [1, 16, 17, 300, 1000, 4099]
    case = AppendCase(lens, 2, group, 32, 16, dtype, device, padding=2)
    out = paged_decode_append_gpu(*case.args)
    assert out.shape == case.query.shape and out.dtype == dtype
    assert_rel_close(out, case.reference(32 ** -0.5), tolerance(dtype, device), "fused decode")
    case.assert_caches_appended()
    assert torch.isfinite(out[len(lens):]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_decode_append_scale_and_block_size(device):
    case = AppendCase([31, 32, 33, 95], 1, 3, 80, 32, torch.float32, device)
    out = paged_decode_append_gpu(*case.args, scale=0.3)
    assert_rel_close(out, case.reference(0.3), 1e-5, "fused decode")
    case.assert_caches_appended()


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens_per_split", [64, 128])
def test_forced_splits_merge_in_kernel(device, dtype, tokens_per_split):
    """Forced split sizes: rows using one split, several, and one whose current token starts a split of its own
    (context 129 with 64 or 128 tokens per split); both ops, the in-kernel merge and the merge kernel agree with
    the reference, twice in a row, and the counters are back to zero."""
    case = AppendCase([1, 70, 129, 300], 2, 3, 64, 16, dtype, device)
    ref = case.reference(64 ** -0.5)
    for merge_kernel in (False, True):
        for attempt in range(2):
            plain, fused = launch_both(case, tokens_per_split=tokens_per_split, merge_kernel=merge_kernel)
            for name, out in (("decode", plain), ("fused decode", fused)):
                assert_rel_close(out, ref, tolerance(dtype, device),
                                 f"{name}, merge_kernel={merge_kernel}, launch {attempt}")
            assert_counters_zero(device)
    case.assert_caches_appended()


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_splits_planned_for_table_capacity(device):
    """A launch planned for a large block table (the CUDA-graph case): short rows use one split and write their
    output directly, the long one merges several; the same launch twice leaves the counters at zero."""
    lens = [1, 20, 70, 600] if device == "cpu" else [1, 20, 70, 600, 3000]
    case = AppendCase(lens, 2, 2, 32, 16, torch.float32, device, padding=1, extra_table_columns=30)
    splits, _ = decode_split_plan(len(lens) + 1, 2, case.block_tables.shape[1] * 16, case.query.device)
    assert splits > 1
    ref = case.reference(32 ** -0.5)
    for attempt in range(2):
        plain, fused = launch_both(case)
        assert_rel_close(plain[:len(lens)], ref[:len(lens)], 1e-5, f"decode, launch {attempt}")
        assert_rel_close(fused, ref, 1e-5, f"fused decode, launch {attempt}")
        assert_counters_zero(device)
    case.assert_caches_appended()


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_capture_with_too_few_counters_uses_the_merge_kernel(device, monkeypatch):
    """While a CUDA graph is being captured counters cannot grow: a launch that needs more than exist merges
    with the separate kernel (same result) and leaves the counters alone; reserving then raises."""
    case = AppendCase([40, 300], 2, 2, 32, 16, torch.float32, device)
    ref = case.reference(32 ** -0.5)
    counter_device = torch.device(device) if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    too_few = torch.zeros(1, dtype=torch.int32, device=device)
    monkeypatch.setattr(paged_attention, "_merge_counters", {counter_device: too_few})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    plain, fused = launch_both(case, tokens_per_split=128)
    assert_rel_close(plain, ref, 1e-5, "decode")
    assert_rel_close(fused, ref, 1e-5, "fused decode")
    assert paged_attention._merge_counters[counter_device] is too_few and not too_few.any()
    with pytest.raises(RuntimeError, match="captured"):
        reserve_decode_counters(device, 4)
    case.assert_caches_appended()


def test_reserve_decode_counters_grows_and_keeps_old_buffers(monkeypatch):
    monkeypatch.setattr(paged_attention, "_merge_counters", {})
    monkeypatch.setattr(paged_attention, "_retired_merge_counters", [])
    small = reserve_decode_counters("cpu", 3)
    assert small.dtype == torch.int32 and small.numel() >= 3 and not small.any()
    assert reserve_decode_counters("cpu", 2) is small
    large = reserve_decode_counters("cpu", 100)
    assert large.numel() >= 100 and not large.any()
    assert paged_attention._retired_merge_counters == [small]


@pytest.mark.parametrize("device", DEVICES)
def test_decode_append_rejects_bad_inputs(device):
    case = AppendCase([5, 20], 2, 2, 16, 16, torch.float32, device)
    query, key, value, key_cache, value_cache, slots, tables, lens = case.args
    with pytest.raises((TypeError, RuntimeError)):
        paged_decode_append_gpu(query, key.double(), value, key_cache, value_cache, slots, tables, lens)
    with pytest.raises((ValueError, RuntimeError)):
        paged_decode_append_gpu(query, key[:1], value[:1], key_cache, value_cache, slots[:1], tables, lens)
    with pytest.raises((ValueError, RuntimeError)):
        paged_decode_append_gpu(query, key, value, key_cache, value_cache, slots.int(), tables, lens)
    if device == "cpu":  # data-dependent checks are made on CPU tensors only (no device sync on CUDA)
        with pytest.raises(ValueError, match="slot of position"):
            paged_decode_append_gpu(query, key, value, key_cache, value_cache, slots + 1, tables, lens)
        with pytest.raises(ValueError, match="padding"):
            paged_decode_append_gpu(query, key, value, key_cache, value_cache, torch.tensor([slots[0], -1]),
                                    tables, lens)
        with pytest.raises(IndexError):
            paged_decode_append_gpu(query, key, value, key_cache, value_cache, slots + 10000, tables, lens)


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (32, 32, 128), (8, 1, 256)])
def test_decode_append_cuda_model_layouts(device, block_size, num_heads, num_kv_heads, head_dim):
    case = AppendCase([1, 17, 1000, 4099, 9000], num_kv_heads, num_heads // num_kv_heads, head_dim, block_size,
                      torch.bfloat16, device, padding=3)
    out = paged_decode_append_gpu(*case.args, max_context_len=9000)
    assert_rel_close(out, case.reference(head_dim ** -0.5), 1e-2, "fused decode")
    case.assert_caches_appended()
    assert_counters_zero(device)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_in_kernel_merge_under_many_concurrent_splits(device):
    """Thousands of splits finishing together, over a fresh query each launch: every in-kernel merge equals the
    merge kernel's (a partial read before its store lands would show as a stale row of the previous launch)."""
    lens = torch.randint(1000, 4000, (48,)).tolist()
    batch = PagedBatch(lens, 8, 128, 16, torch.float32, device)
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens_tensor)
    for attempt in range(20):
        query = make_query(len(lens), 32, 128, torch.float32, device)
        merged = paged_decode_launch(query, *args, tokens_per_split=64)
        separate = paged_decode_launch(query, *args, tokens_per_split=64, merge_kernel=True)
        assert_rel_close(merged, separate, 1e-5, f"launch {attempt}")
    assert_counters_zero(device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_decode_append_in_a_cuda_graph_planned_for_capacity():
    """The engine's use: captured once for the table's capacity (several splits), replayed twice over new
    tokens; every replay equals the reference and leaves the counters at zero."""
    lens = [1, 70, 600, 2000]
    case = AppendCase(lens, 8, 4, 128, 16, torch.bfloat16, "cuda", padding=2, extra_table_columns=200)
    reserve_decode_counters("cuda", len(lens) * 8 + 16)
    expected = case.reference(128 ** -0.5)
    inputs = [t.clone() for t in case.args]
    paged_decode_append_gpu(*inputs)  # warm-up (compilation) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.apex.paged_decode_append_gpu(*inputs)
    for _ in range(2):
        for buffer, source in zip(inputs, case.args):
            buffer.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, expected, 1e-2, "graph replay")
        assert_counters_zero("cuda")
        for got, want in zip(inputs[3:5], case.expected_caches):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------------------------------------
# prefill


def prefill_case(query_lens, context_lens, num_kv_heads, group, head_dim, block_size, dtype, device):
    batch = PagedBatch(context_lens, num_kv_heads, head_dim, block_size, dtype, device)
    query = make_query(sum(query_lens), num_kv_heads * group, head_dim, dtype, device)
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    refs, begin = [], 0
    for q_len, n, keys, values in zip(query_lens, context_lens, batch.keys, batch.values):
        positions = list(range(n - q_len, n))
        refs.append(attention_reference(query[begin:begin + q_len], keys, values, positions, head_dim ** -0.5))
        begin += q_len
    return batch, query, starts, torch.cat(refs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 7, 8])
def test_prefill_whole_prompts_and_chunks(device, dtype, group):
    # A whole prompt, a chunk after a cached prefix, a decode-like row, and a prompt ending mid-block.
    query_lens, context_lens = [19, 5, 1, 16], [19, 40, 7, 16]
    if device == "cuda":
        query_lens, context_lens = [300, 77, 1, 1024], [300, 500, 7, 1500]
    batch, query, starts, ref = prefill_case(query_lens, context_lens, 1, group, 32, 16, dtype, device)
    out = paged_prefill_attention_gpu(query, batch.key_cache, batch.value_cache, batch.block_tables, starts,
                                      batch.context_lens_tensor)
    assert out.shape == query.shape and out.dtype == dtype
    assert_rel_close(out, ref, tolerance(dtype, device), "prefill")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_prefill_writes_every_row_with_several_query_blocks(device):
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    batch, query, starts, ref = prefill_case([40, 3], [40, 50], 2, 2, 80, 32, torch.float32, device)
    out = paged_prefill_launch(query, batch.key_cache, batch.value_cache, batch.block_tables, starts,
                               batch.context_lens_tensor, max_query_len=40, config=config)
    assert_rel_close(out, ref, 1e-5, "prefill")


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (8, 1, 256)])
def test_prefill_cuda_model_layouts(device, block_size, num_heads, num_kv_heads, head_dim):
    query_lens, context_lens = [1000, 129, 1], [1000, 700, 3000]
    batch, query, starts, ref = prefill_case(query_lens, context_lens, num_kv_heads, num_heads // num_kv_heads,
                                             head_dim, block_size, torch.bfloat16, device)
    out = paged_prefill_attention_gpu(query, batch.key_cache, batch.value_cache, batch.block_tables, starts,
                                      batch.context_lens_tensor, max_query_len=max(query_lens))
    assert_rel_close(out, ref, 1e-2, "prefill")


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_rejects_bad_inputs(device):
    batch, query, starts, _ = prefill_case([4, 2], [4, 6], 1, 2, 16, 16, torch.float32, device)
    args = (batch.key_cache, batch.value_cache, batch.block_tables)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention_gpu(query, *args, starts[:-1], batch.context_lens_tensor)
    if device == "cpu":
        with pytest.raises(ValueError, match="more query tokens"):
            paged_prefill_attention_gpu(query, *args, starts, torch.tensor([3, 6], dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------------
# op registration


@not_interpreted
def test_attention_op_registration():
    batch = PagedBatch([5, 20], 2, 16, 16, torch.float32, "cpu")
    query = torch.randn(2, 4, 16)
    torch.library.opcheck(torch.ops.apex.paged_attention_gpu.default,
                          (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens_tensor))
    starts = torch.tensor([0, 3, 7], dtype=torch.int32)
    torch.library.opcheck(torch.ops.apex.paged_prefill_attention_gpu.default,
                          (torch.randn(7, 4, 16), batch.key_cache, batch.value_cache, batch.block_tables, starts,
                           batch.context_lens_tensor))
    key_cache, value_cache = torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16)
    torch.library.opcheck(torch.ops.apex.cache_append_gpu.default,
                          (torch.randn(3, 2, 16), torch.randn(3, 2, 16), key_cache, value_cache,
                           torch.tensor([0, 5, 17])))


def test_prefill_tiles_follow_the_grid(monkeypatch):
    """A launch of fewer than two 128-row programs per SM (a prompt chunk beside decode rows) takes 64-row tiles;
    a long prompt keeps 128-row ones; the interpreter its small tiles."""
    monkeypatch.setattr(prefill_attention, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert default_prefill_config(128, cuda, 32 * 2 * 1)["BLOCK_M"] == 64  # 32 heads, one 256-token chunk
    assert default_prefill_config(128, cuda, 32 * 32 * 1)["BLOCK_M"] == 128  # one 4096-token prompt
    assert default_prefill_config(128, cuda)["BLOCK_M"] == 128
    assert default_prefill_config(128, torch.device("cpu"), 1)["BLOCK_M"] == 32


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_unchecked_launches_equal_checked_ones(device):
    """check=False (the engine's runner on CUDA: inputs it built, launched per layer from Python) skips only the
    validation: every launcher writes what its checked call writes, caches included."""
    from apex_compile.kernels.paged_attention import (cache_append_launch, paged_decode_append_launch,
                                                      paged_decode_launch)
    from apex_compile.runtime.attention_runner import PagedAttentionRunner

    results = []
    for check in (True, False):
        torch.manual_seed(5)
        case = AppendCase([1, 16, 17, 60], 2, 4, 32, 16, torch.float32, device, padding=1)
        fused = paged_decode_append_launch(*case.args, check=check)
        query, _, _, key_cache, value_cache, slots, tables, lens = case.args[:8]
        decode = paged_decode_launch(query, key_cache, value_cache, tables, lens, check=check)
        cache_append_launch(case.key, case.value, key_cache, value_cache, slots, check=check)
        batch, prefill_query, starts, _ = prefill_case([5, 1, 16], [40, 7, 16], 1, 3, 32, 16, torch.float32, device)
        prefill = paged_prefill_launch(prefill_query, batch.key_cache, batch.value_cache, batch.block_tables, starts,
                                       batch.context_lens_tensor, check=check)
        results.append([fused, decode, key_cache, value_cache, prefill])
    for checked, unchecked in zip(*results):
        torch.testing.assert_close(unchecked, checked, rtol=0, atol=0, equal_nan=True)
    from apex_compile.runtime.kv_manager import CacheShape, KVManager

    kv = KVManager(CacheShape(1, 1, 32, 16, torch.float32), 4, 0, torch.device("cpu"))
    runner = PagedAttentionRunner(kv, torch.device("cpu"))  # not CUDA: its launches keep their checks
    assert runner._paged_gpu.keywords == {"check": True} and runner._prefill_gpu.keywords == {"check": True}
