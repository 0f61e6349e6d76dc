"""PageAllocator: page 0 is never handed out, allocation is all or nothing, refs are consistent."""

import numpy as np
import pytest

from meshserve.batching.pages import PageAllocator, num_pages_for


def test_page_zero_is_never_handed_out():
    allocator = PageAllocator(9)
    assert allocator.num_total == 8 and allocator.num_free == 8 and allocator.num_used == 0
    pages = allocator.allocate(8)
    assert sorted(pages) == list(range(1, 9))
    assert allocator.allocate(1) is None
    allocator.check()


def test_allocation_is_all_or_nothing():
    allocator = PageAllocator(5)
    assert allocator.allocate(3) is not None
    assert allocator.allocate(2) is None
    assert allocator.num_free == 1 and allocator.num_used == 3
    assert allocator.allocate(0) == []
    allocator.check()


def test_peak_usage_is_remembered():
    allocator = PageAllocator(9)
    allocator.free(allocator.allocate(5))
    allocator.allocate(2)
    assert allocator.num_peak_used == 5 and allocator.num_used == 2


def test_freed_pages_are_reused():
    allocator = PageAllocator(4)
    first = allocator.allocate(3)
    allocator.free(first[:2])
    assert allocator.num_free == 2
    assert sorted(allocator.allocate(2)) == sorted(first[:2])
    allocator.check()


def test_double_free_and_freeing_page_zero_fail():
    allocator = PageAllocator(4)
    (page,) = allocator.allocate(1)
    allocator.free([page])
    with pytest.raises(AssertionError, match="already free"):
        allocator.free([page])
    with pytest.raises(AssertionError, match="dummy"):
        allocator.free([0])
    with pytest.raises(AssertionError, match="already free"):
        allocator.free([3])  # never allocated


def test_shared_pages_are_free_only_after_the_last_holder():
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.share(pages)
    assert allocator.ref_count(pages[0]) == 2
    allocator.free(pages)
    assert allocator.num_used == 2
    allocator.check()
    allocator.free(pages)
    assert allocator.num_used == 0 and allocator.ref_count(pages[0]) == 0
    allocator.check()
    with pytest.raises(AssertionError, match="not in use"):
        allocator.share(pages)


def test_invariants_hold_over_random_operations():
    rng = np.random.default_rng(0)
    allocator = PageAllocator(33)
    held: list[list[int]] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            allocator.free(held.pop(int(rng.integers(len(held)))))
        elif held and rng.random() < 0.1:
            shared = held[int(rng.integers(len(held)))]
            allocator.share(shared)
            held.append(list(shared))
        else:
            before = allocator.num_free
            pages = allocator.allocate(int(rng.integers(0, 6)))
            if pages is None:
                assert allocator.num_free == before
            else:
                assert 0 not in pages
                held.append(pages)
        allocator.check()
        assert allocator.num_used == len({p for pages in held for p in pages})


def test_num_pages_for():
    assert [num_pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
