"""Block manager: free list, refcounts, prefix hashing, copy-on-write, LRU eviction."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxinfer
from jaxinfer.errors import InputError
from jaxinfer.paged_cache import BlockManager, OutOfPages, PagePool, pages_for_budget

PS = 4


def _run(bm: BlockManager, seq: str, tokens: list[int]) -> list[tuple[int, int]]:
    """Admit ``seq`` with its prefix hits, write the rest of ``tokens``, commit; return copies."""
    hits = bm.match_prefix(seq, tokens)
    start = min(len(hits) * PS, len(tokens) - 1)
    bm.admit(seq, tokens, hits)
    copies = bm.prepare_write(seq, start, len(tokens))
    bm.commit(seq, tokens, len(tokens))
    return copies


def test_allocate_and_free_returns_every_page():
    bm = BlockManager(num_pages=8, page_size=PS, prefix_caching=False)
    _run(bm, "a", list(range(10)))  # 3 pages
    _run(bm, "b", list(range(5)))  # 2 pages
    assert bm.num_used == 5 and bm.num_free == 3
    assert len(bm.tables["a"]) == 3 and not set(bm.tables["a"]) & set(bm.tables["b"])
    bm.free("a")
    bm.free("b")
    assert bm.num_free == 8
    bm.check_all_free()


def test_prefix_pages_are_shared_and_refcounted():
    bm = BlockManager(num_pages=16, page_size=PS)
    system = list(range(100, 112))  # three full pages
    _run(bm, "a", system + [1, 2])
    assert bm.match_prefix("b", system + [3]) == bm.tables["a"][:3]
    copies = _run(bm, "b", system + [3])
    assert copies == []  # the new token starts a fresh page: nothing shared is written
    assert bm.tables["b"][:3] == bm.tables["a"][:3]
    assert all(bm.refcount(p) == 2 for p in bm.tables["a"][:3])
    assert bm.num_used == 3 + 1 + 1


def test_fully_cached_prompt_copies_the_page_it_rewrites():
    bm = BlockManager(num_pages=16, page_size=PS)
    prompt = list(range(8))  # exactly two pages
    _run(bm, "a", prompt)
    shared = bm.tables["a"][1]
    copies = _run(bm, "b", prompt)  # must recompute token 7 to get logits: writes page 1
    assert copies == [(shared, bm.tables["b"][1])] and bm.tables["b"][1] != shared
    assert bm.tables["b"][0] == bm.tables["a"][0]
    assert bm.refcount(shared) == 1


def test_released_prefix_stays_cached_until_evicted_lru():
    bm = BlockManager(num_pages=4, page_size=PS)
    _run(bm, "a", list(range(8)) + [9])  # 3 pages, 2 of them full (hashed)
    bm.free("a")
    assert bm.num_cached == 2 and bm.num_free == 4 and bm.num_used == 0
    assert len(bm.match_prefix("b", list(range(8)) + [7])) == 2  # hit after release
    _run(bm, "c", [50, 51, 52])  # takes a free page
    _run(bm, "d", [60, 61, 62, 63, 64])  # the last free page, then evicts the oldest cached
    assert bm.match_prefix("e", list(range(8)) + [7]) == []  # block 0 is gone
    assert bm.num_free == 1 and bm.num_cached == 1  # block 1 still cached, evictable
    with pytest.raises(OutOfPages):
        bm.prepare_write("d", 5, 13)  # two more pages: more than the pool has


def test_pending_block_defers_a_second_reader():
    bm = BlockManager(num_pages=16, page_size=PS)
    prompt = list(range(10))
    bm.admit("a", prompt, [])
    assert bm.waits_for_pending("b", prompt, 0)  # "a" is computing block 0 right now
    bm.prepare_write("a", 0, 10)
    bm.commit("a", prompt, 10)
    hits = bm.match_prefix("b", prompt)
    assert len(hits) == 2 and not bm.waits_for_pending("b", prompt, len(hits))


def test_pool_size_from_budget():
    cfg = jaxinfer.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                               num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8)
    per_page = PagePool.bytes_per_page(cfg, 16, jnp.float32)
    assert per_page == 2 * 2 * 1 * 16 * 8 * 4
    assert pages_for_budget(cfg, 16, jnp.float32, kv_cache_bytes=10 * per_page + 5) == 10
    with pytest.raises(InputError, match="holds no page"):
        pages_for_budget(cfg, 16, jnp.float32, kv_cache_bytes=per_page - 1)
    pool = PagePool.create(cfg, 10, 16, jnp.float32)
    assert pool.k.shape == (2, 1, 10, 16, 8) and pool.num_pages == 10 and pool.page_size == 16
    per_layer = PagePool.create(cfg, 10, 16, jnp.float32, stacked=False)
    assert [a.shape for a in per_layer.v] == [(1, 10, 16, 8)] * 2 and not per_layer.stacked
    assert per_layer.num_pages == 10 and per_layer.page_size == 16
