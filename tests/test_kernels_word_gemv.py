"""pallas_kernels.word_gemv (Pallas interpreter on CPU): the few-row weight-only kernel behind
int4_matmul and int8_matmul, against its jnp reference and against the two formats'
dequantize-then-matmul references, over row counts, tilings, group sizes and odd column
counts; which kernel the two matmuls run; and its lowering for a GPU at 8B shapes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import all_eqns

from pallas_kernels.int4_matmul import Int4Tiles, int4_matmul, int4_matmul_reference
from pallas_kernels.matmul import Int8Tiles, int8_matmul, int8_matmul_reference
from pallas_kernels.word_gemv import (
    HALF2_PRODUCTS,
    WORD_ROWS,
    WordTiles,
    word_gemv,
    word_gemv_reference,
)

INT4 = dict(bits=4, offset=0, flip=0)
INT8 = dict(bits=8, offset=-128, flip=0x80)


def _int4(m, k, n, group, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    q = jnp.asarray(rng.integers(0, 256, size=(k // 2, n)), jnp.uint8)
    scale = jnp.asarray(rng.random((k // group, n)) * 0.02, jnp.float16)
    zero = jnp.asarray(-rng.random((k // group, n)) * 0.15, jnp.float16)
    return x, q, scale, zero


def _int8(m, k, n, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    q = jnp.asarray(rng.integers(-128, 128, size=(k, n)), jnp.int8)
    scale = jnp.asarray(rng.random((k // 64, n)) * 0.02, jnp.float32)
    return x, q, scale


@pytest.mark.parametrize("m, k, n, group", [(1, 256, 200, 32), (2, 512, 256, 128),
                                            (WORD_ROWS, 384, 132, 64), (3, 1024, 36, 32)])
def test_int4_word_kernel_equals_the_format_reference(m, k, n, group):
    """Every row count up to WORD_ROWS, columns that fill no block, one to 32 groups (the
    float32 kernel: float16 pairs are off here and tested below)."""
    x, q, scale, zero = _int4(m, k, n, group, seed=m + k + n)
    got = int4_matmul(x, q, scale, zero, out_dtype=jnp.float32, interpret=True,
                      tiles=Int4Tiles(word=WordTiles(half2_min_group=0)))
    want = int4_matmul_reference(x, q, scale, zero, out_dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(word_gemv_reference(x, q, scale, zero, **INT4), want,
                               rtol=1e-5, atol=1e-4)


def _runs_half2(m: int, k: int, n: int, group: int, tiles: WordTiles) -> bool:
    xs = jax.ShapeDtypeStruct((m, k), jnp.float32)
    q = jax.ShapeDtypeStruct((k // 2, n), jnp.uint8)
    s = jax.ShapeDtypeStruct((k // group, n), jnp.float16)
    text = str(jax.make_jaxpr(lambda x, q, s, z: word_gemv(x, q, s, z, interpret=True,
                                                           tiles=tiles, **INT4))(xs, q, s, s))
    assert "name=jaxinfer_word_gemv_4bit" in text
    return "name=jaxinfer_word_gemv_4bit_half2" in text


@pytest.mark.parametrize("m, k, n, group, sub_rows", [(1, 512, 256, 128, 16),
                                                      (2, 1024, 300, 128, 16),
                                                      (WORD_ROWS, 2048, 64, 256, 32)])
def test_half2_kernel_is_within_float16_rounding_of_the_reference(m, k, n, group, sub_rows):
    """int4 groups from ``half2_min_group`` to ``HALF2_PRODUCTS`` loads run the float16-pair
    kernel (every row count, columns that fill no block, several K splits): float16 products
    summed a few at a time, so within ~1e-3 of the largest output where the float32 kernel
    is within 1e-5; the float32 kernel below the threshold and for groups of more loads."""
    x, q, scale, zero = _int4(m, k, n, group, seed=m + k)
    want = word_gemv_reference(x, q, scale, zero, **INT4)
    assert _runs_half2(m, k, n, group, WordTiles(sub_rows=sub_rows))
    assert not _runs_half2(m, k, n, group, WordTiles(sub_rows=sub_rows,
                                                     half2_min_group=2 * group))
    assert not _runs_half2(m, k, n, group, WordTiles(sub_rows=group // (2 * HALF2_PRODUCTS)))
    for programs in (1, 512):
        tiles = WordTiles(target_programs=programs, sub_rows=sub_rows)
        got = word_gemv(x, q, scale, zero, interpret=True, tiles=tiles, **INT4)
        err = float(jnp.max(jnp.abs(got - want)))
        assert 0 < err <= 2e-3 * float(jnp.max(jnp.abs(want))), err
        # Loading each loop step's operands a step ahead changes when, not what: the same
        # roundings in the same order. On the GPU every float32 multiply-add is one
        # fma.rn.f32, so the bits match; the interpreter's a * b + c may be contracted
        # differently for the last step, which runs after the loop: float32 rounding.
        ahead = word_gemv(x, q, scale, zero, interpret=True,
                          tiles=dataclasses.replace(tiles, prefetch=True), **INT4)
        np.testing.assert_allclose(ahead, got, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(got))))


def _pallas_eqn(jaxpr):
    """The (one) pallas_call equation in ``jaxpr`` or the jaxprs nested in it."""
    calls = [e for e in all_eqns(jaxpr) if e.primitive.name == "pallas_call"]
    assert len(calls) == 1, calls
    return calls[0]


Shapes = tuple[tuple[tuple[int, ...], jnp.dtype], ...]


def _int4_shapes(m: int, k: int, n: int, group: int, x_dtype=jnp.float32) -> Shapes:
    """(shape, dtype) of int4 operands ``x, q, scale, zero`` (float16 scales and zeros)."""
    s = ((k // group, n), jnp.float16)
    return ((m, k), x_dtype), ((k // 2, n), jnp.uint8), s, s


def _int8_shapes(m: int, k: int, n: int, x_dtype=jnp.float32) -> Shapes:
    """(shape, dtype) of int8 operands ``x, q, scale`` (float32 scales per 64 rows)."""
    return ((m, k), x_dtype), ((k, n), jnp.int8), ((k // 64, n), jnp.float32)


def _traced_pallas_eqn(f, shapes: Shapes):
    """The pallas_call equation of ``f`` traced on operands of these (shape, dtype) pairs:
    nothing runs."""
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return _pallas_eqn(jax.make_jaxpr(f)(*structs))


def _launch_grid(f, shapes: Shapes) -> tuple[int, ...]:
    """The grid (column blocks, K splits) of the pallas_call in ``f`` traced on ``shapes``."""
    return tuple(_traced_pallas_eqn(f, shapes).params["grid_mapping"].grid)


def _grid(m: int, k: int, n: int, group: int, tiles: WordTiles) -> tuple[int, ...]:
    """word_gemv's int4 grid for these shapes."""
    return _launch_grid(lambda x, q, s, z: word_gemv(x, q, s, z, interpret=True, tiles=tiles,
                                                     **INT4), _int4_shapes(m, k, n, group))


def test_half2_programs_sets_only_the_pair_kernels_split():
    """``WordTiles.half2_programs`` is the float16-pair kernel's program target (the int4
    default runs it at ~512 programs, the float32 kernel at ~1,024); 0 keeps
    ``target_programs``. 8B qkv shape: 48 column blocks of 128, 32 groups of 128 rows."""
    k, n = 4096, 6144
    tiles = WordTiles(target_programs=1024, half2_programs=512)
    assert _grid(1, k, n, 128, tiles)[1] == 8  # pairs: largest divisor of 32 <= 512 // 48
    assert _grid(1, k, n, 128, dataclasses.replace(tiles, half2_programs=0))[1] == 16
    # float32 kernel (g32): 24 blocks of 256 columns, 32 steps of 4 groups, 1024 // 24 = 42
    assert _grid(1, k, n, 32, tiles)[1] == 32


def _kernel_eqns(jaxpr) -> list:
    """The equations of the pallas_call's kernel in ``jaxpr`` and its nested jaxprs."""
    return all_eqns(_pallas_eqn(jaxpr).params["jaxpr"])


def test_wide_tile_takes_weights_it_divides_that_make_enough_programs():
    """``WordTiles.wide_tile`` (the int4 default: 512 columns, 4 byte rows per load): a
    float16-pair weight whose columns it divides and whose groups times column blocks at that
    tile make at least ``wide_min_programs`` (256) runs it, at ``wide_programs`` (2,048) and
    with no loads ahead (70B and 8B layers); smaller weights (1B qkv, o: too few programs),
    columns it does not divide (the LM head: padding would copy the weight on every call)
    and the float32 kernel (g32) keep the default tile, and so do calls of more than
    ``wide_max_rows`` (2) rows; the tile needs ``half2_products`` of 128 / 4 = 32. With
    ``x_pairs`` (every wide-tile weight) they step 2 groups at a time, so they split K half as
    finely. The wide tile's result is within float16 rounding of the reference at every row
    count, in one step per program and in several."""
    word = Int4Tiles().word
    assert word.wide_tile == (512, 4) and word.half2_products == 32
    assert _grid(1, 4096, 6144, 128, word) == (12, 16)  # 8B qkv: 192 programs (x_pairs: 16
    # steps of 2 groups)
    assert _grid(1, 4096, 6144, 128, dataclasses.replace(word, x_pairs=False)) == (12, 32)
    assert _grid(2, 4096, 4096, 128, word) == (8, 16)  # 8B o: 128
    assert _grid(4, 4096, 4096, 128, word) == (32, 16)  # 4 rows: the narrow tile
    assert _grid(1, 4096, 28672, 128, word) == (56, 16)  # 8B gate|up: 56 x 16 <= 2,048
    assert _grid(1, 14336, 4096, 128, word) == (8, 56)  # 8B down
    assert _grid(1, 8192, 57344, 128, word) == (112, 16)  # 70B gate|up: 16 <= 2,048 / 112
    assert _grid(1, 2048, 2048, 128, word) == (16, 16)  # 1B o: 4 x 16 < 256: blocks of 128
    assert _grid(1, 4096, 128256, 128, word) == (1002, 1)  # the head: 512 does not divide
    assert _grid(1, 8192, 10240, 128, word) == (20, 32)  # 70B qkv: 64 groups, x_pairs' 32
    # steps, 32 splits
    assert _grid(1, 8192, 10240, 128, dataclasses.replace(word, x_pairs=False)) == (20, 64)
    narrow = dataclasses.replace(word, wide_tile=(0, 0))
    assert _grid(1, 4096, 6144, 128, narrow) == (48, 8)
    assert _grid(1, 4096, 6144, 128, dataclasses.replace(word, half2_products=0)) == (48, 8)
    assert not _runs_half2(1, 4096, 6144, 32, word)
    assert _grid(1, 4096, 6144, 32, word) == (24, 32)  # the float32 kernel's own tiling
    for m, k, programs, splits in ((1, 1024, 16, 8), (2, 2048, 8, 4), (WORD_ROWS, 2048, 8, 4)):
        # 2 blocks of 512 columns; one group per program, then four
        small = dataclasses.replace(word, wide_min_programs=4, wide_programs=programs,
                                    wide_max_rows=WORD_ROWS, x_pairs=False)
        x, q, scale, zero = _int4(m, k, 1024, 128, seed=20 + m)
        want = word_gemv_reference(x, q, scale, zero, **INT4)
        assert _grid(m, k, 1024, 128, small) == (2, splits)
        got = word_gemv(x, q, scale, zero, interpret=True, tiles=small, **INT4)
        err = float(jnp.max(jnp.abs(got - want)))
        assert 0 < err <= 2e-3 * float(jnp.max(jnp.abs(want))), err


def _loads(jaxpr) -> list:
    """The load equations of the pallas_call's kernel in ``jaxpr``."""
    return [e for e in _kernel_eqns(jaxpr) if e.primitive.name in ("masked_load", "get")]


def _load_hints(jaxpr) -> list[tuple[str, str | None]]:
    """Each load of the pallas_call's kernel in ``jaxpr``: (loaded dtype, its L2
    eviction hint or None)."""
    return [(str(e.outvars[0].aval.dtype), e.params.get("eviction_policy"))
            for e in _loads(jaxpr)]


def test_evict_first_marks_only_the_weight_loads():
    """``WordTiles.evict_first`` puts the L2 evict-first hint on the float16-pair kernel's
    weight loads (uint32 words) and on nothing else; the product is the same."""
    x, q, scale, zero = _int4(2, 1024, 256, 128, seed=4)

    def loads(tiles: WordTiles) -> list[tuple[str, str | None]]:
        return _load_hints(jax.make_jaxpr(lambda x: word_gemv(x, q, scale, zero, interpret=True,
                                                              tiles=tiles, **INT4))(x))

    hinted = loads(WordTiles(evict_first=True))
    assert {p for d, p in hinted if d == "uint32"} == {"evict_first"}
    assert {p for d, p in hinted if d != "uint32"} == {None}
    assert {p for _, p in loads(WordTiles())} == {None}
    np.testing.assert_array_equal(
        word_gemv(x, q, scale, zero, interpret=True, tiles=WordTiles(evict_first=True), **INT4),
        word_gemv(x, q, scale, zero, interpret=True, tiles=WordTiles(), **INT4))


def test_int8_default_hints_its_weight_loads():
    """``Int8Tiles``' default float16-pair kernel (one row) loads its int8 weight words
    evict-first (r144-r145) and only those; the product equals the unhinted kernel's."""
    x, q, scale = _int8(1, 512, 256, seed=6)
    plain = Int8Tiles(word=dataclasses.replace(Int8Tiles().word, evict_first=False))
    hints = _load_hints(jax.make_jaxpr(lambda x: int8_matmul(x, q, scale, interpret=True))(x))
    assert {p for d, p in hints if d == "uint32"} == {"evict_first"}
    assert {p for d, p in hints if d != "uint32"} == {None}
    np.testing.assert_array_equal(int8_matmul(x, q, scale, interpret=True),
                                  int8_matmul(x, q, scale, interpret=True, tiles=plain))


def test_half2_kernel_reads_float16_scales_as_column_pairs():
    """float16 scales and zeros reach the float16-pair kernel as int32 words of two columns
    (one load for two columns); float32 ones are read per column. Both give the product."""
    m, k, n, group = 2, 1024, 200, 128
    x, q, scale, zero = _int4(m, k, n, group, seed=9)
    want = word_gemv_reference(x, q, scale, zero, **INT4)
    pairs = f"i32[{k // group},{256 // 2}]"  # 200 columns pad to two blocks of 128

    def operands(s, z) -> str:
        return str(jax.make_jaxpr(lambda x: word_gemv(x, q, s, z, interpret=True,
                                                      tiles=WordTiles(), **INT4))(x))

    assert pairs in operands(scale, zero) and "half2" in operands(scale, zero)
    wide = (scale.astype(jnp.float32), zero.astype(jnp.float32))
    assert pairs not in operands(*wide) and "half2" in operands(*wide)
    for s, z in ((scale, zero), wide):
        got = word_gemv(x, q, s, z, interpret=True, tiles=WordTiles(), **INT4)
        assert float(jnp.max(jnp.abs(got - want))) <= 2e-3 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("tiles", [  # 8 / 32 products per float16 sum
    WordTiles(), dataclasses.replace(Int4Tiles().word, wide_min_programs=1, wide_programs=8)])
def test_half2_kernel_scales_activations_so_nothing_overflows(tiles):
    """Activations whose float16 products would overflow unscaled (3e4 and 1e5, x 15 per
    product) and an all-zero row: the kernel scales activations by 2^-8 before rounding to
    float16, so the result stays finite and close, and zeros give zeros (also in the int4
    default's wide tile, 32 products per float16 sum: 8 programs of one group)."""
    x, q, scale, zero = _int4(2, 1024, 128, 128, seed=5)
    if tiles.wide_tile != (0, 0):  # 4 byte rows of 32 words per load: the wide tile
        jaxpr = jax.make_jaxpr(lambda x: word_gemv(x, q, scale, zero, interpret=True,
                                                   tiles=tiles, **INT4))(x)
        assert {e.outvars[0].aval.shape for e in _loads(jaxpr)
                if e.outvars[0].aval.dtype == jnp.uint32} == {(4, 32)}
    x = x.at[0, 3].set(3e4).at[0, 700].set(-1e5).at[1].set(0.0)
    got = word_gemv(x, q, scale, zero, interpret=True, tiles=tiles, **INT4)
    want = word_gemv_reference(x, q, scale, zero, **INT4)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert float(jnp.max(jnp.abs(got[0] - want[0]))) <= 1e-3 * float(jnp.max(jnp.abs(want[0])))
    np.testing.assert_array_equal(got[1], np.zeros(128, np.float32))


@pytest.mark.parametrize("m", [1, 2, WORD_ROWS])
def test_int8_word_kernel_equals_the_format_reference(m):
    """The float32 kernel (``int8_half2`` off; the float16 pairs are tested below)."""
    x, q, scale = _int8(m, 512, 260, seed=m)
    got = word_gemv(x, q, scale, None, interpret=True, tiles=WordTiles(int8_half2=False),
                    **INT8)
    want = int8_matmul_reference(x, q, scale, out_dtype=jnp.float32)
    # float32 sums of values up to ~127 * 0.02 over 512 rows: a few ulps of ~40.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-4)
    np.testing.assert_allclose(word_gemv_reference(x, q, scale, None, **INT8), want,
                               rtol=1e-5, atol=2e-4)


def _kernel_names(f, *args) -> set[str]:
    """The pallas_call names in ``f``'s jaxpr (on shapes: nothing runs)."""
    text = str(jax.make_jaxpr(f)(*args))
    return {w.split("name=")[1] for w in text.split() if w.startswith("name=jaxinfer_")}


def _f16_pair_bound(x: jax.Array, q: jax.Array, scale: jax.Array, products: int) -> jax.Array:
    """What the int8 float16-pair kernel may differ from the float32 reference by, per output:
    each activation is rounded to float16 once and each of a float16 sum's ``products``
    multiply-adds once, each off by at most 2^-11 of a value no larger than the group's
    sum of ``|x q|`` (float32 after that: negligible), so at most ``(products + 1) 2^-11
    (|x| @ |w|)``; plus 1e-4 for activations and sums in float16's subnormal range, which
    round to absolute steps (``_HALF2_X_SCALE``)."""
    w = jnp.abs(q.astype(jnp.float32)) * jnp.repeat(scale, q.shape[0] // scale.shape[0], 0)
    total = jnp.dot(jnp.abs(x), w, precision=jax.lax.Precision.HIGHEST)
    return (products + 1) * 2.0**-11 * total + 1e-4


@pytest.mark.parametrize("m, k, n, tiles", [
    (1, 512, 260, WordTiles()),  # 4 products per float16 sum, columns that fill no block
    (2, 1024, 300, WordTiles(target_programs=1)),  # K in one program
    (3, 256, 64, WordTiles(sub_rows=8, block_n=64)),  # HALF2_PRODUCTS (8) products per sum
    (WORD_ROWS, 2048, 36, WordTiles(step_rows=256, num_warps=8)),  # 4 groups per loop step
    (2, 2048, 100, WordTiles(target_programs=1, prefetch=True)),  # 16 steps, loaded ahead
    # ``Int8Tiles``' wide tile: 512 columns x 8 rows, 8 products; and 256 x 8
    (1, 1024, 512, dataclasses.replace(Int8Tiles().word, wide_min_programs=4, wide_programs=8)),
    (2, 1024, 512, WordTiles(wide_tile=(256, 8), wide_min_programs=4, wide_programs=8)),
])
def test_int8_pairs_are_within_float16_rounding_of_the_reference(m, k, n, tiles):
    """int8_matmul up to WORD_ROWS rows: word_gemv's float16-pair kernel (each int8 value
    made exact in float16 by a lop3 and a sub, fma.rn.f16x2 with the activations), within
    the bound of its float16 roundings of both references; errors are not 0 (the float32
    kernel would be within 1e-5)."""
    x, q, scale = _int8(m, k, n, seed=m + k + n)
    itiles = Int8Tiles(word_rows=WORD_ROWS, word=tiles)
    assert _kernel_names(lambda x: int8_matmul(x, q, scale, interpret=True, tiles=itiles),
                         x) == {"jaxinfer_word_gemv_8bit_half2"}
    got = int8_matmul(x, q, scale, out_dtype=jnp.float32, interpret=True, tiles=itiles)
    want = word_gemv_reference(x, q, scale, None, **INT8)
    np.testing.assert_allclose(int8_matmul_reference(x, q, scale, out_dtype=jnp.float32),
                               want, rtol=1e-5, atol=2e-4)
    err = jnp.abs(got - want)
    sub = tiles.wide_tile[1] or tiles.sub_rows  # a case with a wide tile has a weight it takes
    products = 64 // min(sub, 64)
    assert bool(jnp.all(err <= _f16_pair_bound(x, q, scale, products)))
    assert 0 < float(jnp.max(err)) <= 2e-3 * float(jnp.max(jnp.abs(want)))


PAIRS = Int8Tiles(word_rows=WORD_ROWS)  # the float16-pair kernel up to WORD_ROWS rows


def _int8_grid(m: int, k: int, n: int, tiles: Int8Tiles) -> tuple[int, ...]:
    """``int8_matmul``'s few-row grid for these shapes."""
    return _launch_grid(lambda x, q, s: int8_matmul(x, q, s, interpret=True, tiles=tiles),
                        _int8_shapes(m, k, n))


def test_int8_default_takes_the_wide_tile_on_8b_layers():
    """``Int8Tiles``' default runs the wide tile (512 columns, 8 byte rows per load, ~1,024
    programs, r235-r236; with x_pairs two groups per loop step) on every 8B layer weight at
    one row; a weight of too few programs at it (1B o) keeps the narrow tile (256 columns for
    64-row groups, ~512 programs)."""
    tiles = Int8Tiles()
    assert tiles.word.wide_tile == (512, 8) and tiles.word.wide_programs == 1024
    assert _int8_grid(1, 4096, 6144, tiles) == (12, 32)  # 8B qkv: 64 groups, 2 per step
    assert _int8_grid(1, 4096, 28672, tiles) == (56, 16)  # 8B gate|up
    assert _int8_grid(1, 14336, 4096, tiles) == (8, 112)  # 8B down: 224 groups
    assert _int8_grid(1, 2048, 2048, tiles) == (8, 32)  # 1B o: 4 x 32 < 256 at 512


@pytest.mark.parametrize("tiles, rows, bound", [
    # the narrow tile (16 rows per load: 4 products per float16 sum), below 65504 * 256 / 512
    (PAIRS, (5, 21, 37, 53), 32752.0),
    # the wide tile (8 rows per load: 8 products), below 65504 * 256 / 1024
    (Int8Tiles(word_rows=WORD_ROWS, word=dataclasses.replace(
        Int8Tiles().word, wide_min_programs=1, wide_max_rows=WORD_ROWS, x_pairs=False)),
     (5, 13, 21, 29, 37, 45, 53, 61), 16376.0),
    # the same with the activations as pairs made by XLA (``x_pairs``)
    (Int8Tiles(word_rows=WORD_ROWS, word=dataclasses.replace(
        Int8Tiles().word, wide_min_programs=1, wide_max_rows=WORD_ROWS)),
     (5, 13, 21, 29, 37, 45, 53, 61), 16376.0)])
def test_int8_pairs_overflow_only_past_the_documented_bound(tiles, rows, bound):
    """``_HALF2_X_SCALE``: the products of ``|q| = 128`` and ``|x| * 2^-8`` that one float16
    sum takes (a 64-row group's rows ``5 + sub_rows * t``) stay finite below ``|x| = 65504 *
    256 / (128 * products)``. Column 0 gets ``q = -128`` on those rows and every other column
    random values; row 0 puts 0.98 of the bound on them (finite, and as accurate as
    anywhere), row 1 1.02 of it (float16 infinity, so the bound is the real one), row 2 an
    activation of 3e4 elsewhere in the group."""
    x, q, scale = _int8(3, 256, 512, seed=11)
    hot = jnp.asarray(rows) + 64
    q = q.at[hot, 0].set(-128)
    x = x.at[0, hot].set(0.98 * bound).at[1, hot].set(1.02 * bound).at[2, 70].set(3e4)
    got = int8_matmul(x, q, scale, out_dtype=jnp.float32, interpret=True, tiles=tiles)
    want = word_gemv_reference(x, q, scale, None, **INT8)
    bound = _f16_pair_bound(x, q, scale, len(rows))
    assert bool(jnp.all(jnp.isfinite(got[0]))) and bool(jnp.all(jnp.isfinite(got[2])))
    assert bool(jnp.all(jnp.abs(got - want)[jnp.asarray([0, 2])] <= bound[jnp.asarray([0, 2])]))
    assert float(got[1, 0]) == -np.inf and bool(jnp.all(jnp.isfinite(got[1, 1:])))


def test_int8_pairs_give_zeros_for_zero_weights_or_activations():
    """Zero weights (any activations) and zero activations (any weights): exact zeros, with
    a row of ordinary activations beside them."""
    x, q, scale = _int8(3, 512, 132, seed=2)
    x = x.at[1].set(0.0)
    zeros = int8_matmul(x, jnp.zeros_like(q), scale, out_dtype=jnp.float32, interpret=True,
                        tiles=PAIRS)
    np.testing.assert_array_equal(zeros, np.zeros((3, 132), np.float32))
    got = int8_matmul(x, q, scale, out_dtype=jnp.float32, interpret=True, tiles=PAIRS)
    np.testing.assert_array_equal(got[1], np.zeros(132, np.float32))
    assert float(jnp.min(jnp.abs(got[0]))) > 0


def test_int8_matmul_routes_few_rows_to_the_pairs():
    """One row (``Int8Tiles.word_rows``; up to WORD_ROWS if asked): the float16-pair kernel;
    more rows, or ``word_rows=0``: the tensor-core kernel; ``int8_half2=False``: word_gemv's
    float32 kernel. All agree."""
    x, q, scale = _int8(WORD_ROWS + 1, 256, 64, seed=4)

    def kernels(m: int, tiles: Int8Tiles) -> set[str]:
        return _kernel_names(lambda x: int8_matmul(x, q, scale, interpret=True, tiles=tiles),
                             x[:m])

    pairs, dot, word = ({"jaxinfer_word_gemv_8bit_half2"}, {"jaxinfer_int8_matmul"},
                        {"jaxinfer_word_gemv_8bit"})
    four = PAIRS
    off = Int8Tiles(word_rows=0)
    f32 = Int8Tiles(word_rows=WORD_ROWS, word=WordTiles(int8_half2=False))
    assert [kernels(1, Int8Tiles()), kernels(2, Int8Tiles()), kernels(WORD_ROWS, four),
            kernels(WORD_ROWS + 1, four), kernels(2, off), kernels(2, f32)] == [
        pairs, dot, pairs, dot, dot, word]
    want = int8_matmul_reference(x, q, scale, out_dtype=jnp.float32)
    for tiles in (four, off, f32):
        got = int8_matmul(x[:2], q, scale, out_dtype=jnp.float32, interpret=True, tiles=tiles)
        np.testing.assert_allclose(got, want[:2], rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("tiles", [
    WordTiles(),  # the default: 256 columns for groups of 64 rows
    WordTiles(block_n=64, sub_rows=8, step_rows=32, target_programs=4096, num_warps=2),
    WordTiles(block_n=512, sub_rows=32, step_rows=512, target_programs=8, num_warps=8,
              num_stages=4),
])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_word_tilings_equal_the_reference(tiles, fmt):
    """The tilings ``scripts/bench_int4.py`` times: narrow and wide column blocks, loads of a
    part of a group or several groups per loop step, many or few K splits."""
    if fmt == "int4":
        x, q, scale, zero = _int4(2, 1024, 300, 64, seed=7)
        kw = INT4
    else:  # the float32 kernel (float16 pairs: test_int8_pairs_...)
        (x, q, scale), zero, kw = _int8(2, 1024, 300, seed=7), None, INT8
        tiles = dataclasses.replace(tiles, int8_half2=False)
    got = word_gemv(x, q, scale, zero, interpret=True, tiles=tiles, **kw)
    np.testing.assert_allclose(got, word_gemv_reference(x, q, scale, zero, **kw),
                               rtol=1e-5, atol=2e-4)


def test_a_tiling_that_splits_a_group_unevenly_is_refused():
    x, q, scale, zero = _int4(1, 256, 64, 128, seed=0)
    with pytest.raises(ValueError, match="must divide"):
        word_gemv(x, q, scale, zero, interpret=True, tiles=WordTiles(sub_rows=24), **INT4)


@pytest.mark.parametrize("programs", [1, 512])  # K whole in one program, or split
def test_word_kernel_writes_the_output_dtype(programs):
    """Unsplit, the kernel writes the result in its dtype (no XLA op after it); split, the
    float32 partials are summed and cast."""
    x, q, scale, zero = _int4(2, 512, 64, 32, seed=3)
    got = word_gemv(x.astype(jnp.bfloat16), q, scale, zero, interpret=True,
                    tiles=WordTiles(target_programs=programs), out_dtype=jnp.bfloat16, **INT4)
    want = word_gemv_reference(x.astype(jnp.bfloat16), q, scale, zero, **INT4)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=1e-2, atol=1e-2)


def test_more_rows_take_the_tensor_core_kernel():
    """Past WORD_ROWS (and with word_rows=0) int4_matmul runs its dot kernel: same product.
    Groups of 32 take the word kernel for one row only."""
    x, q, scale, zero = _int4(WORD_ROWS + 1, 256, 64, 32, seed=1)
    want = int4_matmul_reference(x, q, scale, zero, out_dtype=jnp.float32)
    for tiles in (Int4Tiles(), Int4Tiles(word_rows=0)):
        got = int4_matmul(x[:2], q, scale, zero, out_dtype=jnp.float32, interpret=True,
                          tiles=tiles)
        np.testing.assert_allclose(got, want[:2], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(int4_matmul(x, q, scale, zero, out_dtype=jnp.float32,
                                           interpret=True), want, rtol=1e-5, atol=1e-4)

    def kernels(m, group):
        xs = jax.ShapeDtypeStruct((m, 256), jnp.float32)
        s = jax.ShapeDtypeStruct((256 // group, 64), jnp.float16)
        text = str(jax.make_jaxpr(lambda x, s, z: int4_matmul(x, q, s, z, interpret=True))(
            xs, s, s))
        return "word" if "name=word_gemv" in text else "dot"

    assert [kernels(1, 32), kernels(2, 32), kernels(2, 64), kernels(WORD_ROWS + 1, 64)] == [
        "word", "dot", "word", "dot"]


def test_word_kernel_lowers_to_triton_for_cuda_at_8b_shapes():
    """Lowering for a GPU (through jax.export on this CPU machine) runs every Pallas Triton
    rule the kernels need: the uint32 reinterpretation, shifts, float bitcasts, strided loads
    of the scales, strided stores of the result and (float16 pairs) the inline asm."""
    from jax import export

    no_check = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for m, k, n, group in ((2, 4096, 6144, 128), (1, 14336, 4096, 32)):
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        q = jax.ShapeDtypeStruct((k // 2, n), jnp.uint8)
        s = jax.ShapeDtypeStruct((k // group, n), jnp.float16)
        exported = export.export(jax.jit(int4_matmul), platforms=["cuda"],
                                 disabled_checks=no_check)(x, q, s, s)
        # g128: the float16-pair kernel (its inline PTX in the Triton module); g32: float32.
        name = "jaxinfer_word_gemv_4bit" + ("_half2" if group >= 128 else "")
        assert name in exported.mlir_module()
        assert ("fma.rn.f16x2" in exported.mlir_module()) == (group >= 128)
    # The float16-pair kernel with its loads a loop step ahead (a loop-carried load set):
    # K = 4096 runs several steps per program, K = 256 one (no loop).
    ahead = Int4Tiles(word=WordTiles(prefetch=True))
    for k in (4096, 256):
        args = (jax.ShapeDtypeStruct((1, k), jnp.bfloat16),
                jax.ShapeDtypeStruct((k // 2, 4096), jnp.uint8),
                jax.ShapeDtypeStruct((k // 128, 4096), jnp.float16))
        exported = export.export(
            jax.jit(lambda x, q, s: int4_matmul(x, q, s, s, tiles=ahead)),
            platforms=["cuda"], disabled_checks=no_check)(*args)
        assert "jaxinfer_word_gemv_4bit_half2" in exported.mlir_module()
    q8 = jax.ShapeDtypeStruct((4096, 6144), jnp.int8)
    s8 = jax.ShapeDtypeStruct((64, 6144), jnp.float32)
    x = jax.ShapeDtypeStruct((2, 4096), jnp.bfloat16)
    f = jax.jit(lambda x, q, s: word_gemv(x, q, s, None, interpret=False,
                                          tiles=WordTiles(int8_half2=False), **INT8))
    exported = export.export(f, platforms=["cuda"], disabled_checks=no_check)(x, q8, s8)
    assert "jaxinfer_word_gemv_8bit" in exported.mlir_module()
    # int8_matmul at one row: the int8 float16 pairs (lop3 with the int8 bias, fma.rn.f16x2).
    x1 = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    text = export.export(jax.jit(int8_matmul), platforms=["cuda"],
                         disabled_checks=no_check)(x1, q8, s8).mlir_module()
    assert "jaxinfer_word_gemv_8bit_half2" in text
    assert "0x64806480" in text and "fma.rn.f16x2" in text


def _kernel_x_dtype(f, *args) -> str:
    """The dtype of the activations operand of the pallas_call in ``f``'s jaxpr."""
    return str(_pallas_eqn(jax.make_jaxpr(f)(*args)).invars[0].aval.dtype)


@pytest.mark.parametrize("m, step_rows", [(1, 256), (2, 256), (1, 128)])
def test_x_pairs_give_the_wide_tiles_result(m, step_rows):
    """``WordTiles.x_pairs``: the wide tile's activations reach the kernel as int32 float16
    pairs made by XLA (and, for int4, group sums), where they were converted in the loop; the
    products are the same float16 arithmetic, so the result differs from the kernel's without
    them only in the float32 order of its sums (``x_pairs_step_rows``: 1 or 2 groups per loop
    step, so other K splits; int4 at 2: 2 steps per split). The narrow tile ignores the
    flag."""
    wide = dataclasses.replace(Int4Tiles().word, wide_min_programs=4, wide_programs=8,
                               x_pairs=False, x_pair_sums=False)
    pairs = dataclasses.replace(wide, x_pairs=True, x_pairs_step_rows=step_rows)
    x, q, scale, zero = _int4(m, 2048, 1024, 128, seed=30 + m)  # 2 x 16 groups, 4 per program
    got, plain = (word_gemv(x, q, scale, zero, interpret=True, tiles=t, **INT4)
                  for t in (pairs, wide))
    want = word_gemv_reference(x, q, scale, zero, **INT4)
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    assert float(jnp.max(jnp.abs(got - want))) <= 2e-3 * float(jnp.max(jnp.abs(want)))

    def x_dtype(tiles):
        return _kernel_x_dtype(lambda x: word_gemv(x, q, scale, zero, interpret=True,
                                                   tiles=tiles, **INT4), x)
    assert x_dtype(pairs) == "int32"
    assert x_dtype(dataclasses.replace(pairs, wide_min_programs=10_000)) == "float32"  # narrow
    x8, q8, s8 = _int8(m, 1024, 512, seed=40 + m)
    i8 = dataclasses.replace(Int8Tiles().word, wide_min_programs=4, wide_programs=8,
                             x_pairs_step_rows=step_rows // 2)
    t8 = [Int8Tiles(word_rows=WORD_ROWS, word=dataclasses.replace(i8, x_pairs=on))
          for on in (True, False)]
    assert _kernel_x_dtype(lambda x: int8_matmul(x, q8, s8, interpret=True, tiles=t8[0]),
                           x8) == "int32"
    got8, plain8 = (int8_matmul(x8, q8, s8, out_dtype=jnp.float32, interpret=True, tiles=t)
                    for t in t8)
    np.testing.assert_allclose(got8, plain8, rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(plain8))))


def test_default_x_pairs_take_the_weights_the_defaults_name():
    """``Int4Tiles`` gives ``x_pairs`` with ``x_pair_sums`` to every wide-tile weight (every
    70B and 8B layer weight: XLA only makes the pairs, elementwise; r247), with no group-sum
    operand; ``Int8Tiles`` gives ``x_pairs`` to every wide-tile weight too (every 8B layer
    weight: the junction kernels make the pairs; r263-r264). Traced only: nothing runs."""
    def int4_x(k, n):
        eqn = _traced_pallas_eqn(lambda x, q, s, z: int4_matmul(x, q, s, z, interpret=True),
                                 _int4_shapes(1, k, n, 128, jnp.bfloat16))
        assert len(eqn.invars) == 4  # pairs, q, scale, zero: no group sums from XLA
        return str(eqn.invars[0].aval.dtype)

    def int8_x(k, n):
        eqn = _traced_pallas_eqn(lambda x, q, s: int8_matmul(x, q, s, interpret=True),
                                 _int8_shapes(1, k, n, jnp.bfloat16))
        return str(eqn.invars[0].aval.dtype)
    seventy_b = [(8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192)]
    assert [int4_x(k, n) for k, n in seventy_b] == ["int32"] * 4
    eight_b = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # qkv, o, gate|up, down
    assert [int4_x(k, n) for k, n in eight_b] == ["int32"] * 4
    assert [int8_x(k, n) for k, n in eight_b] == ["int32"] * 4


@pytest.mark.parametrize("m", [1, 2])
def test_x_pair_sums_make_the_group_sums_in_the_kernel(m):
    """``WordTiles.x_pair_sums``: with x_pairs, each program sums its groups' activations
    from the pairs (float32 sums of their float16 values) instead of reading XLA's sums, so
    the pallas_call takes no sums operand; the result is within float16 rounding of the
    reference and close to the kernel with XLA's sums (they sum the unrounded activations)."""
    base = dataclasses.replace(Int4Tiles().word, wide_min_programs=4, wide_programs=8)
    x, q, scale, zero = _int4(m, 2048, 1024, 128, seed=50 + m)
    got, xla = (word_gemv(x, q, scale, zero, interpret=True, tiles=dataclasses.replace(
        base, x_pair_sums=on), **INT4) for on in (True, False))
    want = word_gemv_reference(x, q, scale, zero, **INT4)
    peak = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) <= 2e-3 * peak
    assert float(jnp.max(jnp.abs(got - xla))) <= 1e-3 * peak

    def inputs(tiles):
        jaxpr = jax.make_jaxpr(lambda x: word_gemv(x, q, scale, zero, interpret=True,
                                                   tiles=tiles, **INT4))(x)
        return len(_pallas_eqn(jaxpr).invars)
    assert inputs(dataclasses.replace(base, x_pair_sums=True)) == 4  # pairs, q, scale, zero
    assert inputs(dataclasses.replace(base, x_pair_sums=False)) == 5  # and XLA's sums
