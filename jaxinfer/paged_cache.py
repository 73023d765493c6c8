"""Paged KV cache: a device pool of fixed-size pages and the host-side block manager.

The pool holds K and V for every layer (one buffer per layer, or stacked over layers, as
the weights are); per layer that is the ``[kv_heads, num_pages, page_size, head_dim]`` layout
the paged/ragged kernels in ``pallas_kernels`` read. With ``kv_cache_dtype`` ``"int8"`` or
``"fp8"`` each buffer is a ``QuantizedPages``: one-byte values in that layout plus bfloat16
scales ``[kv_heads, num_pages, page_size]`` per token and head (``pallas_kernels.kv_quant``),
so the same bytes hold about twice the tokens. Values and scales share the page index, so
everything that moves pages (block tables, prefix sharing, preemption, a new pool after an
out-of-memory error) moves both. A sequence
owns a *block table*: the list of physical pages holding its logical pages 0, 1, 2, ... so a
sequence only ever holds
``ceil(length / page_size)`` pages instead of a ``max_len`` reservation.

The ``BlockManager`` (pure host Python, no device work) keeps:

* a free list and a reference count per page;
* a block table per sequence;
* prefix sharing: every *full* page whose K/V has been computed is keyed by a hash of its
  tokens chained with the hash of everything before it, so a later sequence starting with
  the same tokens (a shared system prompt, ``n`` samples of one prompt, a preempted request
  coming back) maps those pages instead of recomputing them;
* copy-on-write: a hashed or shared page is immutable; a sequence that must write into one
  (only when it recomputes the last token of a fully cached prompt) first gets a private copy;
* an LRU prefix cache: hashed pages whose reference count drops to zero stay mapped until
  a fresh page is needed, then the least recently released one is evicted.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError
from pallas_kernels import KV_CACHE_DTYPES, SCALE_DTYPE, rotates_keys

KV_CACHE_CHOICES = tuple(KV_CACHE_DTYPES)
"""Values ``load_model(kv_cache_dtype=...)`` accepts besides None (the model's dtype)."""


def check_kv_cache_dtype(kv_cache_dtype: str | None, head_dim: int | None = None) -> None:
    """``InputError`` unless ``kv_cache_dtype`` is None or one of ``KV_CACHE_CHOICES`` (and,
    given the model's ``head_dim``, one its heads can be stored in)."""
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InputError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use "
                         f"{' or '.join(repr(c) for c in KV_CACHE_CHOICES)}, or None for the "
                         "model's dtype")
    if (kv_cache_dtype is not None and head_dim is not None and head_dim & (head_dim - 1)
            and rotates_keys(KV_CACHE_DTYPES[kv_cache_dtype])):
        raise InputError(f"kv_cache_dtype={kv_cache_dtype!r} stores keys Hadamard-rotated, "
                         f"which needs a power-of-two head_dim, not {head_dim}; use 'fp8'")


@struct.dataclass
class QuantizedPages:
    """One quantized pool buffer (K or V; ``pallas_kernels.kv_quant``): ``values [...,
    KVH, num_pages, page_size, D]`` int8 or float8_e4m3fn and ``scales [..., KVH, num_pages,
    page_size]`` bfloat16, ``...`` being the layer axis of a stacked pool.

    Indexing (``pages[layer]``) indexes both, so a layer of a stacked pool is sliced like an
    array; ``shape`` is the values' shape.
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the values (the scales drop the last axis)."""
        return self.values.shape

    def __getitem__(self, index: int | jax.Array) -> QuantizedPages:
        """Values and scales indexed alike (a layer of a stacked pool)."""
        return QuantizedPages(values=self.values[index], scales=self.scales[index])


@struct.dataclass
class PagePool:
    """K/V pages of every layer, in one of two layouts matching the weights':

    * per layer (``stacked=False``): ``k``, ``v`` are tuples of one ``[KVH, num_pages,
      page_size, D]`` buffer per layer, so each layer's attention kernel reads its pool in
      place (slicing layer i out of a stacked pool for a custom call copies it);
    * stacked: ``k``, ``v`` are ``[L, KVH, num_pages, page_size, D]``, for the layer scan
      over stacked weights (compile time flat in depth).

    A quantized pool (``kv_cache_dtype``) holds ``QuantizedPages`` where these hold arrays.
    """

    k: jax.Array | QuantizedPages | tuple[jax.Array | QuantizedPages, ...]
    v: jax.Array | QuantizedPages | tuple[jax.Array | QuantizedPages, ...]

    @property
    def stacked(self) -> bool:
        """Whether the layers are stacked on a leading axis of one buffer."""
        return not isinstance(self.k, tuple)

    @property
    def num_pages(self) -> int:
        """Physical pages in the pool."""
        return (self.k if self.stacked else self.k[0]).shape[-3]

    @property
    def page_size(self) -> int:
        """Token positions per page."""
        return (self.k if self.stacked else self.k[0]).shape[-2]

    @classmethod
    def create(cls, config: LlamaConfig, num_pages: int, page_size: int,
               dtype: jnp.dtype = jnp.bfloat16, sharding: jax.sharding.Sharding | None = None,
               stacked: bool = True, kv_cache_dtype: str | None = None) -> PagePool:
        """Allocate a zeroed pool, directly in shards when ``sharding`` is given (a mesh).

        ``sharding`` is that of one buffer (``sharding.rules.engine_pool_sharding``; its spec
        splits the K/V head axis only, so it fits the scales too). ``kv_cache_dtype``
        (``"int8"``/``"fp8"``) makes ``QuantizedPages`` buffers; None stores ``dtype``.
        """
        check_kv_cache_dtype(kv_cache_dtype, config.head_dim)
        shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
        n = config.num_layers
        if stacked:
            shape = (n, *shape)

        def zeros() -> jax.Array | QuantizedPages:
            if kv_cache_dtype is None:
                return jnp.zeros(shape, dtype)
            return QuantizedPages(values=jnp.zeros(shape, KV_CACHE_DTYPES[kv_cache_dtype]),
                                  scales=jnp.zeros(shape[:-1], SCALE_DTYPE))

        make = jax.jit(zeros, out_shardings=sharding)
        if stacked:
            return cls(k=make(), v=make())
        return cls(k=tuple(make() for _ in range(n)), v=tuple(make() for _ in range(n)))

    @staticmethod
    def bytes_per_page(config: LlamaConfig, page_size: int, dtype: jnp.dtype = jnp.bfloat16,
                       kv_cache_dtype: str | None = None) -> int:
        """Device bytes one page takes across all layers, K and V (values and, for a
        quantized ``kv_cache_dtype``, their scales)."""
        per = config.num_layers * config.num_kv_heads * page_size
        if kv_cache_dtype is None:
            return 2 * per * config.head_dim * jnp.dtype(dtype).itemsize
        check_kv_cache_dtype(kv_cache_dtype)
        value = KV_CACHE_DTYPES[kv_cache_dtype].itemsize
        return 2 * per * (config.head_dim * value + SCALE_DTYPE.itemsize)


def pages_for_budget(
    config: LlamaConfig,
    page_size: int,
    dtype: jnp.dtype,
    kv_cache_bytes: int | None = None,
    memory_fraction: float = 0.9,
    model_shards: int = 1,
    reserve_bytes: int = 0,
    device: jax.Device | None = None,
    kv_cache_dtype: str | None = None,
) -> int:
    """How many pages fit ``kv_cache_bytes``, or ``memory_fraction`` of the free device memory
    left after ``reserve_bytes`` (the steps' activations and workspace).

    Pages are counted in ``dtype``, or in a quantized ``kv_cache_dtype`` (one-byte values
    plus their scales: ``PagePool.bytes_per_page``), so a quantized pool holds about twice
    the pages for the same bytes.

    With ``model_shards`` > 1 (a mesh's model size) each device holds that fraction of every
    page's K/V heads, and ``kv_cache_bytes`` is per device. ``device``: the device whose free
    memory counts (default the first local one).

    Raises ``InputError`` when no budget is given and the device reports no memory statistics
    (CPU), or when the budget holds less than one page.
    """
    per_page = PagePool.bytes_per_page(config, page_size, dtype, kv_cache_dtype) // model_shards
    if kv_cache_bytes is None:
        stats = (device or jax.local_devices()[0]).memory_stats() or {}
        if "bytes_limit" not in stats:
            raise InputError("this device reports no free memory; pass kv_cache_bytes=... "
                             "or num_pages=... to size the KV cache")
        if not 0 < memory_fraction <= 1:
            raise InputError(f"memory_fraction={memory_fraction} must be in (0, 1]")
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - reserve_bytes
        kv_cache_bytes = max(0, int(free * memory_fraction))
    pages = int(kv_cache_bytes) // per_page
    if pages < 1:
        raise InputError(f"kv_cache_bytes={kv_cache_bytes} holds no page of {per_page} bytes; "
                         "raise the budget or lower page_size")
    return pages


class OutOfPages(RuntimeError):
    """The pool has no free or evictable page; the scheduler preempts and retries."""


class BlockManager:
    """Host bookkeeping of the page pool: free list, block tables, refcounts, prefix cache.

    Sequence ids are any hashable values chosen by the caller. Nothing here touches the
    device; page copies needed for copy-on-write are returned as ``(src, dst)`` pairs for
    the caller to apply before the step that writes.
    """

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise InputError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._refcount = np.zeros(num_pages, np.int32)
        self._page_hash: dict[int, bytes] = {}  # hashed (immutable) page -> its block hash
        self._cached: dict[bytes, int] = {}  # block hash -> page holding that block
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self._pending: dict[bytes, object] = {}  # block hash -> sequence computing it now
        self.tables: dict[object, list[int]] = {}
        self._hashes: dict[object, list[bytes]] = {}
        self._committed: dict[object, int] = {}  # full pages already passed to commit

    # ---------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        """Pages a new allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one live sequence."""
        return int(np.count_nonzero(self._refcount))

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept only for the prefix cache (evictable)."""
        return len(self._evictable)

    def refcount(self, page: int) -> int:
        """Live sequences mapping ``page``."""
        return int(self._refcount[page])

    # ---------------------------------------------------------------- hashing
    def block_hashes(self, seq: object, tokens: Sequence[int]) -> list[bytes]:
        """Chained hashes of every full page of ``tokens`` (cached per sequence, extended).

        Block j's hash covers tokens ``[0, (j + 1) * page_size)``: equal hashes mean equal
        prefixes, so equal K/V (positions start at 0 for every sequence).
        """
        hashes = self._hashes.setdefault(seq, [])
        ps = self.page_size
        for j in range(len(hashes), len(tokens) // ps):
            h = hashlib.blake2b(digest_size=16)
            if j:
                h.update(hashes[j - 1])
            h.update(np.asarray(tokens[j * ps:(j + 1) * ps], np.int64).tobytes())
            hashes.append(h.digest())
        return hashes[: len(tokens) // ps]

    def match_prefix(self, seq: object, tokens: Sequence[int]) -> list[int]:
        """Cached pages holding the longest computed prefix of ``tokens`` (full pages only)."""
        if not self.prefix_caching:
            return []
        pages = []
        for h in self.block_hashes(seq, tokens):
            page = self._cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def waits_for_pending(self, seq: object, tokens: Sequence[int], num_hit_pages: int) -> bool:
        """True if another running sequence is computing the block right after the hits.

        The scheduler then admits ``seq`` a step later to share that block instead of
        computing it twice (``n`` samples of one prompt arriving together).
        """
        if not self.prefix_caching:
            return False
        hashes = self.block_hashes(seq, tokens)
        if num_hit_pages >= len(hashes):
            return False
        owner = self._pending.get(hashes[num_hit_pages], seq)
        return owner != seq

    # ---------------------------------------------------------------- allocation
    def pages_needed(self, seq: object, start: int, end: int, hits: Sequence[int] = ()) -> int:
        """Free pages that writing positions ``[start, end)`` of ``seq`` would consume.

        ``hits`` are prefix pages about to be mapped by ``admit`` (for a new sequence); any
        that sit in the evictable LRU stop being available once mapped, so they count too.
        """
        table = self.tables.get(seq, list(hits))
        need = max(0, math.ceil(end / self.page_size) - len(table))
        first = start // self.page_size
        if start < end and first < len(table) and self._immutable(table[first]):
            need += 1  # copy-on-write
        need += sum(1 for p in hits if self._refcount[p] == 0)
        return need

    def admit(self, seq: object, tokens: Sequence[int], hits: Sequence[int]) -> None:
        """Start a block table for ``seq`` mapping the prefix-cache ``hits``.

        The prompt's remaining full blocks are marked pending (being computed by ``seq``).
        """
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} already has a block table")
        for page in hits:
            self._incref(page)
        self.tables[seq] = list(hits)
        if self.prefix_caching:
            for h in self.block_hashes(seq, tokens)[len(hits):]:
                if h not in self._cached:
                    self._pending.setdefault(h, seq)

    def prepare_write(self, seq: object, start: int, end: int) -> list[tuple[int, int]]:
        """Map pages so that ``seq`` can write positions ``[start, end)``.

        Returns the ``(src, dst)`` page copies to apply on the device before writing
        (copy-on-write of an immutable page). Raises ``OutOfPages`` if the pool is exhausted;
        callers check ``pages_needed`` first so this happens only on misuse.
        """
        if self.pages_needed(seq, start, end) > self.num_free:
            raise OutOfPages(f"sequence {seq!r} needs pages the pool does not have")
        table = self.tables[seq]
        copies = []
        first = start // self.page_size
        if start < end and first < len(table) and self._immutable(table[first]):
            src = table[first]
            dst = self._allocate()
            self._decref(src)
            table[first] = dst
            copies.append((src, dst))
        while len(table) * self.page_size < end:
            table.append(self._allocate())
        return copies

    def commit(self, seq: object, tokens: Sequence[int], num_computed: int) -> None:
        """Record that the K/V of ``tokens[:num_computed]`` are written (or will be, by a
        step already launched: the device runs steps in order): hash full pages.

        A newly full page becomes immutable and findable by later sequences; if an equal
        block is already cached (computed concurrently), the sequence keeps its private copy.
        """
        if not self.prefix_caching:
            return
        table = self.tables[seq]
        hashes = self.block_hashes(seq, tokens[:num_computed])
        done = self._committed.get(seq, 0)
        self._committed[seq] = max(done, len(hashes))
        for j in range(done, len(hashes)):
            h, page = hashes[j], table[j]
            if page in self._page_hash or h in self._cached:
                if self._pending.get(h) == seq:
                    del self._pending[h]
                continue
            self._cached[h] = page
            self._page_hash[page] = h
            if self._pending.get(h) == seq:
                del self._pending[h]

    def free(self, seq: object) -> None:
        """Release every page of ``seq`` (hashed ones stay in the prefix cache)."""
        for page in self.tables.pop(seq, []):
            self._decref(page)
        self._hashes.pop(seq, None)
        self._committed.pop(seq, None)
        for h in [h for h, owner in self._pending.items() if owner == seq]:
            del self._pending[h]

    def check_all_free(self) -> None:
        """Assert no page is referenced (every sequence released); used by tests."""
        if self.num_used or self.tables or self._pending:
            raise AssertionError(f"{self.num_used} pages still referenced by {list(self.tables)}")

    # ---------------------------------------------------------------- internals
    def _immutable(self, page: int) -> bool:
        return self._refcount[page] > 1 or page in self._page_hash

    def _allocate(self) -> int:
        if self._free:
            page = self._free.popleft()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)  # least recently released
            del self._cached[self._page_hash.pop(page)]
        else:
            raise OutOfPages("the KV page pool is exhausted")
        self._refcount[page] = 1
        return page

    def _incref(self, page: int) -> None:
        if self._refcount[page] == 0:
            self._evictable.pop(page, None)
        self._refcount[page] += 1

    def _decref(self, page: int) -> None:
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            if page in self._page_hash:
                self._evictable[page] = None
            else:
                self._free.append(page)
