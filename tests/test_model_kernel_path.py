"""The model's decode path through the int4 / int8 Pallas kernels, run in the Pallas
interpreter on CPU (``backend="pallas"``, ``model.gemv_kernels``): against the XLA path of the
same weights, with and without the junctions (``_add_norm``: ``add_norm_pairs`` joining each
matmul's split partials to the next matmul's input)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import all_eqns

import jaxinfer
from jaxinfer import model
from jaxinfer.model import apply_layout, forward_ragged, init_params
from jaxinfer.quantize import QuantizedWeight, quantize_params

CFG = jaxinfer.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                           max_position_embeddings=256, tie_word_embeddings=False)


def _decode_step(backend, rows=1):
    """A decode step for each of ``rows`` sequences (``max_q_len`` 1: sequence ``i`` at
    position ``3 + i``, its earlier keys in pages ``16 i`` on) through ``forward_ragged``:
    ``(step(params, *args) -> hidden [rows, hidden], args)``."""
    kvh, d = CFG.num_kv_heads, CFG.head_dim
    key = jax.random.PRNGKey(7)
    # 16 pages of 16 keys per sequence: two blocks of 128, so the paged kernel splits them
    # and its combine kernel runs
    pool = [jax.random.normal(jax.random.fold_in(key, i), (kvh, 16 * rows, 16, d), jnp.float32)
            for i in range(CFG.num_layers)]
    pos = jnp.arange(3, 3 + rows, dtype=jnp.int32)
    pages = jnp.arange(16 * rows, dtype=jnp.int32).reshape(rows, 16)
    args = (jnp.arange(5, 5 + rows, dtype=jnp.int32), pos, pool, pool, pages[:, 0], pos, pages,
            pos + 1, jnp.arange(rows + 1, dtype=jnp.int32))

    def step(p, *a):
        return forward_ragged(p, CFG, *a, backend=backend, dtype=jnp.float32, max_q_len=1)[0]
    return step, args


def _decode_one(params, backend, rows=1):
    """``_decode_step`` run: the final hidden states ``[rows, hidden]`` and the jaxpr's
    pallas_call names."""
    step, args = _decode_step(backend, rows)
    names = [e.params["name"] for e in all_eqns(jax.make_jaxpr(step)(params, *args))
             if e.primitive.name == "pallas_call"]
    return jax.jit(step)(params, *args), names


def _force_junctions(monkeypatch):
    """Every quantized kernel weight treated as reading ``ScaledPairs`` (the default tiles only
    read them for weights far larger than a CPU test's): the junction kernel then runs, and
    the GEMV rebuilds the activations from the pairs (``ScaledPairs.values``)."""
    monkeypatch.setattr(model, "_reads_pairs", lambda w, rows, kernels, norm=True: kernels and (
        isinstance(w, QuantizedWeight)))


@pytest.mark.parametrize("method, rows", [("int4", 1), ("int8", 1), ("int4", 2)])
def test_kernel_decode_path_equals_the_xla_path(method, rows, monkeypatch):
    """One decode step of one or two rows: the Pallas kernels (interpreted) give the XLA
    path's hidden states, with ``add_norm_pairs`` twice and ``silu_mul_pairs`` and
    ``sum_rope`` once per layer when junctions apply, and none of them otherwise."""
    params = quantize_params(apply_layout(init_params(CFG, jax.random.PRNGKey(1), jnp.float32),
                                          "fast"), method)
    want, names = _decode_one(params, "reference", rows)
    gemvs = ("word_gemv", "int4_matmul", "int8_matmul")  # int4 g32 at 2 rows: the dot kernel
    assert not any(g in n for n in names for g in gemvs + ("add_norm_pairs",))
    got, names = _decode_one(params, "pallas", rows)
    assert any(g in n for n in names for g in gemvs)
    assert not any(n in names for n in ("jaxinfer_add_norm_pairs", "jaxinfer_silu_mul_pairs",
                                        "jaxinfer_sum_rope"))
    # int8 sums its products in float16 pairs (word_gemv): ~1e-3 of the largest output
    np.testing.assert_allclose(got, want, atol=2e-3 * float(jnp.max(jnp.abs(want))))
    _force_junctions(monkeypatch)
    joined, names = _decode_one(params, "pallas", rows)
    assert names.count("jaxinfer_add_norm_pairs") == 2 * CFG.num_layers
    assert names.count("jaxinfer_silu_mul_pairs") == CFG.num_layers
    assert names.count("jaxinfer_sum_rope") == CFG.num_layers
    # float16 pairs of the normalized activations: float16 rounding, not float32's
    np.testing.assert_allclose(joined, want, atol=1e-2 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("rows", [1, 2])
def test_the_paged_kernel_reads_sum_ropes_output_uncopied(rows, monkeypatch):
    """``sum_rope`` writes q|k|v packed as the paged kernel reads them, and ``_qkv`` slices
    them by heads, so the compiled step has no concatenate packing them again (column slices
    left XLA a copy kernel per layer: H200 r255 / r257)."""
    _force_junctions(monkeypatch)
    params = quantize_params(apply_layout(init_params(CFG, jax.random.PRNGKey(1), jnp.float32),
                                          "fast"), "int4")
    step, args = _decode_step("pallas", rows)
    hlo = jax.jit(step).lower(params, *args).compile().as_text()
    packed = f"f32[{rows},{CFG.num_heads + 2 * CFG.num_kv_heads},{CFG.head_dim}]"  # [T, H, D]
    copies = [line for line in hlo.splitlines()
              if f"= {packed}" in line and " concatenate(" in line]
    assert "sum_rope" in hlo and not copies, copies[:1]


def test_junctions_need_the_kernels_and_leave_other_weights_alone():
    """``_reads_pairs`` is False for plain weights, without the kernels (reference backend, a
    mesh, a TPU), for act-order weights and for prefill-sized steps, so no junction runs
    there (shapes where the kernel's launch would read pairs: the 8B qkv)."""
    assert _decides("int4", 4096, 6144, 1, True)
    assert not _decides("int4", 4096, 6144, 1, True, kernels=False)
    assert not _decides("int4", 4096, 6144, 64, True)
    assert not _decides("int4", 4096, 6144, 1, True, perm=True)
    assert not model._reads_pairs(jnp.zeros((8, 8)), 1, True)
    plain = apply_layout(init_params(CFG, jax.random.PRNGKey(2), jnp.float32), "fast")
    for params, backend in ((plain, "pallas"), (quantize_params(plain, "int4"), "reference")):
        _, names = _decode_one(params, backend)
        assert not any(n.endswith(("add_norm_pairs", "silu_mul_pairs", "sum_rope"))
                       for n in names)


def _weight_shapes(kind, k, n, fused=True, perm=False):
    """A ``kind`` weight ``[k, (1,) n]`` of ``jax.ShapeDtypeStruct`` leaves (``perm``: stored
    rows in another order, as act-order GPTQ)."""
    u8, f16 = jnp.uint8, jnp.float16
    mid = (1,) if fused else ()
    rows_q, dtype = (k // 2, u8) if kind == "int4" else (k, jnp.int8)
    groups = k // (128 if kind == "int4" else 64)
    return QuantizedWeight(
        q=jax.ShapeDtypeStruct((rows_q, *mid, n), dtype),
        scale=jax.ShapeDtypeStruct((groups, *mid, n), f16 if kind == "int4" else jnp.float32),
        zero=jax.ShapeDtypeStruct((groups, *mid, n), f16) if kind == "int4" else None,
        perm=jax.ShapeDtypeStruct((k,), jnp.int32) if perm else None,
        out_axes=2 if fused else 1, group=128 if kind == "int4" else 64, kind=kind)


def _decides(kind, k, n, rows, norm, fused=True, kernels=True, perm=False):
    """``model._reads_pairs`` for a ``kind`` weight ``[k, (1,) n]`` (shapes only: traced;
    ``perm`` as in ``_weight_shapes``)."""
    w = _weight_shapes(kind, k, n, fused, perm)
    out = []
    jax.eval_shape(lambda w: out.append(model._reads_pairs(w, rows, kernels, norm)) or 0, w)
    return out[0]


def test_default_tiles_give_junctions_to_the_8b_and_70b_layers():
    """With the default tiles, one and two decode rows: int4 qkv and gate|up read RMSNorm'd
    pairs and down reads silu pairs (8B and 70B, whose down has 224 groups); so do int8's
    (8B); four rows take the narrow tile: no junction."""
    for k, qkv, gu, i in ((4096, 6144, 28672, 14336), (8192, 10240, 57344, 28672)):
        for rows in (1, 2):
            assert _decides("int4", k, qkv, rows, True) and _decides("int4", k, gu, rows, True)
            assert _decides("int4", i, k, rows, False, fused=False)
        assert not _decides("int4", k, gu, 4, True)
    assert not _decides("int4", 28672, 8192, 1, True, fused=False)  # 224 groups: no norm
    assert _decides("int8", 4096, 6144, 1, True) and _decides("int8", 4096, 28672, 1, True)
    assert _decides("int8", 14336, 4096, 1, False, fused=False)


def test_attention_hands_the_o_matmul_scaled_pairs(monkeypatch):
    """Where o's kernel reads pairs (forced here: at default tiles, int8 and int4-g128 at
    one row) and its groups are one head or a part of one (int4-g64, and int4's 32 rows;
    head_dim 64), the decode step's attention returns ``ScaledPairs`` (``out_pairs``, one
    scale per head) and o reads them: the hidden state still matches the XLA path; with
    groups of 128, more than a head, it gets the plain output."""
    import pallas_kernels

    _force_junctions(monkeypatch)
    asked = []
    write = pallas_kernels.paged_attention_write

    def spy(*a, **kw):
        asked.append(kw.get("out_pairs"))
        return write(*a, **kw)
    monkeypatch.setattr(pallas_kernels, "paged_attention_write", spy)
    plain = apply_layout(init_params(CFG, jax.random.PRNGKey(3), jnp.float32), "fast")
    for method, pairs in (("int4-g64", True), ("int4", True), ("int4-g128", False)):
        params = quantize_params(plain, method)
        asked.clear()
        got, names = _decode_one(params, "pallas")
        assert asked and all(a is pairs for a in asked)
        assert "jaxinfer_combine_splits" in names  # the kernel that writes the pairs
        want, _ = _decode_one(params, "reference")
        np.testing.assert_allclose(got, want, atol=1e-2 * float(jnp.max(jnp.abs(want))))


def test_qkv_junction_needs_a_power_of_two_head_size():
    """``sum_rope`` reads half-head blocks (a Triton block side is a power of two): with head
    size 48 the QKV product of ``ScaledPairs`` runs the fused matmul and XLA's RoPE instead,
    and gives the same Q, K, V as from the plain activations (XLA's matmuls here: the routing
    is what is tested)."""
    import pallas_kernels

    cfg = jaxinfer.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256,
                               num_layers=1, num_heads=2, num_kv_heads=1, head_dim=48,
                               max_position_embeddings=64)
    lp = quantize_params(apply_layout(init_params(cfg, jax.random.PRNGKey(4), jnp.float32),
                                      "fast"), "int4")["layers"][0]
    h = jax.random.normal(jax.random.PRNGKey(5), (1, 128), jnp.float32)
    _, sp = pallas_kernels.add_norm_pairs_reference(None, h, lp["attn_norm"], group=32,
                                                    eps=cfg.rms_norm_eps)
    pos = jnp.asarray([[7]], jnp.int32)
    text = str(jax.make_jaxpr(lambda s: model._qkv(s, lp, cfg, pos))(sp))
    assert "sum_rope" not in text
    got = model._qkv(sp, lp, cfg, pos)
    want = model._qkv(sp.values()[None], lp, cfg, pos)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_one_device_layout_pads_a_kernel_head_to_the_wide_tile(monkeypatch):
    """On a GPU an int4 / int8 LM head whose columns 512 does not divide (Llama 3's 128,256:
    the narrow tile) is padded once, at load, to a multiple of it (the wide tile). Its
    logits (``lm_head``, XLA's path on CPU) are the unpadded head's, one per vocabulary
    entry, and the kernel's padded columns are 0. Off a GPU, with columns that divide
    already, or where even the padded head would not run the wide tile, nothing changes."""
    import dataclasses
    from types import SimpleNamespace

    import pallas_kernels

    assert pallas_kernels.WIDE_BLOCK_N == 512
    gpu = SimpleNamespace(platform="gpu", compute_capability="9.0")
    for kind in ("int4", "int8"):  # Llama 3 8B's head, shapes only
        assert not _decides(kind, 4096, 128256, 1, False, fused=False)
        assert _decides(kind, 4096, 128512, 1, False, fused=False)
        params = {"embed": jax.ShapeDtypeStruct((128256, 4096), jnp.bfloat16), "layers": [{}],
                  "lm_head": _weight_shapes(kind, 4096, 128256, fused=False)}
        laid = jax.eval_shape(lambda p: model.one_device_layout(p, gpu), params)
        assert laid["lm_head"].shape == (4096, 128512)
    with pytest.raises(ValueError, match="one device's"):  # a fused [in, 1, out] weight
        jax.eval_shape(lambda w: model.pad_columns(w, 512), _weight_shapes("int4", 256, 200))
    # What the wide tile would not run is not padded: too few programs (under 256), or
    # columns that 512 divides already
    for vocab in (200, 16384):
        params = {"embed": jax.ShapeDtypeStruct((vocab, 4096), jnp.float32), "layers": [{}],
                  "lm_head": _weight_shapes("int4", 4096, vocab, fused=False)}
        assert model.one_device_layout(params, gpu) is params
    # This CPU test's head is far too small for the wide tile: as if it were not
    monkeypatch.setattr(model, "_reads_pairs", lambda w, rows, kernels, norm=True: True)
    cfg = dataclasses.replace(CFG, vocab_size=200)
    plain = apply_layout(init_params(cfg, jax.random.PRNGKey(8), jnp.float32), "fast")
    h = jax.random.normal(jax.random.PRNGKey(9), (3, CFG.hidden_size), jnp.float32)
    for method in ("int4", "int8"):
        params = quantize_params(plain, method)
        assert model.one_device_layout(params, jax.devices("cpu")[0]) is params
        padded = model.one_device_layout(params, gpu)
        assert padded["lm_head"].shape == (CFG.hidden_size, 512)
        assert padded["layers"] is params["layers"]
        want = model.lm_head(params, h)  # [3, 200]
        np.testing.assert_allclose(model.lm_head(padded, h), want, rtol=1e-6, atol=1e-6)
        got = model._dense_quantized(h[:1], padded["lm_head"], jnp.float32, True)  # [1, 512]
        np.testing.assert_allclose(got[:, :200], want[:1], atol=2e-3 * float(jnp.max(want)))
        np.testing.assert_array_equal(got[:, 200:], 0.0)
