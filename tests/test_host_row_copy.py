"""A state clone's row copies on the CPU (engine/kv/host_copy.py): DeviceCache.copy_page and
copy_slot copy exactly the row a torch copy does, leave every other byte alone, refuse rows
outside the pool, and keep torch copies where those are the better ones."""

from __future__ import annotations

import pytest
import torch

from engine.kv.device_cache import CacheGeometry, DeviceCache, StateShape
from engine.kv.host_copy import MAX_BYTES, host_row_copier

CPU = torch.device("cpu")
HYBRID = StateShape((3,), 2, 16, linear_layers=(0, 1, 2), linear_value_heads=2, linear_key_dim=16,
                    linear_value_dim=16, conv_dim=96, conv_kernel=4)


def filled(shape: StateShape, dtype: torch.dtype = torch.float32, pages: int = 6, slots: int = 4) -> DeviceCache:
    cache = DeviceCache(shape, CacheGeometry(8, pages, slots, dtype), CPU)
    g = torch.Generator().manual_seed(0)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    cache.state_rows.copy_(torch.randint(0, 256, cache.state_rows.shape, generator=g, dtype=torch.uint8))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_page_and_a_slot_copy_as_torch_copies_them(dtype: torch.dtype) -> None:
    cache = filled(HYBRID, dtype)
    assert cache._page_copy is not None and cache._slot_copy is not None  # small rows: by address
    kv, rows = cache.kv.clone(), cache.state_rows.clone()
    cache.copy_page(4, 1)
    cache.copy_slot(0, 3)
    kv[1].copy_(kv[4])
    rows[3].copy_(rows[0])
    assert torch.equal(cache.kv, kv) and torch.equal(cache.state_rows, rows)  # the rows, and nothing else


def test_rows_outside_the_pool_are_refused_and_nothing_moves() -> None:
    cache = filled(HYBRID)
    kv, rows = cache.kv.clone(), cache.state_rows.clone()
    for src, dst in ((0, 6), (6, 0), (-1, 2), (2, -1)):
        with pytest.raises(IndexError, match="outside a pool of 6 rows"):
            cache.copy_page(src, dst)
    with pytest.raises(IndexError, match="outside a pool of 4 rows"):
        cache.copy_slot(1, 4)
    cache.copy_page(2, 2)  # onto itself: a no-op
    assert torch.equal(cache.kv, kv) and torch.equal(cache.state_rows, rows)


def test_large_rows_and_non_cpu_pools_keep_torch_copies() -> None:
    big = torch.zeros(2, MAX_BYTES // 4 + 1)
    assert host_row_copier(big) is None
    assert host_row_copier(torch.zeros(2, MAX_BYTES // 4)) is not None
    assert host_row_copier(torch.zeros(4, 4)[:, ::2]) is None  # not contiguous
    assert host_row_copier(torch.zeros(0, 4)) is None
    assert host_row_copier(torch.zeros(2, 4, device="meta")) is None
    dense = filled(StateShape((0, 1), 2, 16), slots=0)  # no slots: no slot rows to copy
    assert dense._slot_copy is None and dense._page_copy is not None


def test_a_large_slot_row_still_copies_through_torch() -> None:
    """A hybrid model with a big recurrent state (13 MB a slot in the bench) keeps torch's threaded copy."""
    shape = StateShape((3,), 2, 16, linear_layers=(0, 1, 2), linear_value_heads=16, linear_key_dim=128,
                       linear_value_dim=128, conv_dim=96, conv_kernel=4)
    cache = filled(shape, slots=2)
    assert cache.state_rows[0].numel() > MAX_BYTES and cache._slot_copy is None
    cache.copy_slot(0, 1)
    assert torch.equal(cache.state_rows[1], cache.state_rows[0])


def test_a_row_copy_kernel_given_is_the_one_used() -> None:
    """A cache given a row-copy kernel (Triton's, which tests run on the CPU interpreted) copies with it,
    not by address, so those tests check that kernel."""
    calls: list[tuple[int, int]] = []

    def copy_rows(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        calls.append((int(src), int(dst)))
        pool[dst] = pool[src]

    cache = DeviceCache(HYBRID, CacheGeometry(8, 6, 4, torch.float32), CPU, copy_rows=copy_rows)
    assert cache._page_copy is None and cache._slot_copy is None
    cache.copy_page(4, 1)
    cache.copy_slot(0, 3)
    assert calls == [(4, 1), (0, 3)]
