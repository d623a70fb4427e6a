"""The prompt K/V exports' C++ lander (`ExportLander`, ops kv_export_*): each export lands once its copy flag is
up, in submission order, without Python; a failed export (or one whose flag never comes) still counts as landed
and its error is raised once."""
import time

import pytest
import torch

from apex_compile.ops import ExportLander, cache_append_cpu

HKV, D, BLOCK = 2, 16, 16


def caches():
    return torch.zeros(4, HKV, BLOCK, D), torch.zeros(4, HKV, BLOCK, D)


def wait_until(predicate, seconds=5.0):
    deadline = time.perf_counter() + seconds
    while not predicate():
        assert time.perf_counter() < deadline, "timed out"
        time.sleep(0.001)


def test_exports_land_in_order_once_their_copy_flag_is_up_as_cache_append_would_write():
    copied, landed = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    lander = ExportLander(copied, landed, threads=2)
    mine, expected = caches(), caches()
    exports = [(torch.randn(3, HKV, D), torch.randn(3, HKV, D), torch.tensor([0, 1, 17])),
               (torch.randn(2, HKV, D), torch.randn(2, HKV, D), torch.tensor([1, 40]))]  # slot 1 again: the later wins
    try:
        for index, (k, v, slots) in enumerate(exports, start=1):
            lander.submit(index, k, v, *mine, slots)
            cache_append_cpu(k, v, *expected, slots)
        time.sleep(0.05)
        assert int(landed[0]) == 0 and not mine[1].any()  # no copy flag yet: nothing lands
        copied[0] = 1
        wait_until(lambda: int(landed[0]) == 1)
        time.sleep(0.05)
        assert int(landed[0]) == 1  # the second waits for its own flag
        copied[0] = 2
        wait_until(lambda: int(landed[0]) == 2)
        lander.poll()
        assert torch.equal(mine[0], expected[0]) and torch.equal(mine[1], expected[1])
    finally:
        lander.close()


def test_a_failed_export_still_lands_and_its_error_is_raised_once():
    copied, landed = torch.full((1,), 9, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    lander = ExportLander(copied, landed, threads=1)
    cache = caches()
    ones = torch.ones(1, HKV, D)
    try:
        lander.submit(1, ones, ones, *cache, torch.tensor([4 * BLOCK]))  # a slot past the cache
        lander.submit(2, ones, ones, *cache, torch.tensor([3]))
        wait_until(lambda: int(landed[0]) == 2)
        with pytest.raises(RuntimeError, match="K/V export 1 into the host cache failed"):
            lander.poll()
        lander.poll()  # raised once
        assert torch.equal(cache[1][0, :, 3], torch.ones(HKV, D))  # the export after it landed
    finally:
        lander.close()
    lander.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        lander.submit(3, ones, ones, *cache, torch.tensor([3]))


def test_an_export_whose_copy_flag_never_comes_times_out_landed_the_later_ones_at_once_and_close_raises():
    copied, landed = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    lander = ExportLander(copied, landed, threads=1, timeout_s=0.2)
    ones = torch.ones(1, HKV, D)
    start = time.perf_counter()
    for index in range(1, 6):
        lander.submit(index, ones, ones, *caches(), torch.tensor([0]))
    wait_until(lambda: int(landed[0]) == 5)
    assert time.perf_counter() - start < 0.6  # the later exports are not waited for once one flag never came
    with pytest.raises(RuntimeError, match="export 1 .* failed"):
        lander.close()
