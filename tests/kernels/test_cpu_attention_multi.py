"""The multi-cache CPU ops (every layer's rows in one call): each row appends to and attends the cache pair its
cache_index names, equal to one call per pair and to float64 attention; bad lists and indices are errors."""
import pytest
import torch

from apex_compile.ops import (
    cache_append_cpu,
    cache_append_cpu_multi,
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
