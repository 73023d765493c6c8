"""Weight-only quantization (``jaxinfer.quantize``): the quantizers' error bounds and bytes,
the int4 packing, the quantized forward pass equal to the dequantized model's through the
engine on every layout, convert --quantize, and the default model's perplexity
against its float weights (int8 within 1%, int4 within 8%, fp8 within 3%)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import all_eqns

import jaxinfer
from jaxinfer.errors import InputError
from jaxinfer.model import apply_layout, init_params
from jaxinfer.quantize import (
    QuantizedWeight,
    pack_int4,
    quantize_params,
)

CFG = jaxinfer.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=112, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                           tie_word_embeddings=False)


def _dequantized(params):
    return jax.tree.map(lambda w: w.dequantize() if isinstance(w, QuantizedWeight) else w,
                        params, is_leaf=lambda w: isinstance(w, QuantizedWeight))


@pytest.mark.parametrize("layout", ["stacked", "fast"])
def test_int8_weights_bound_their_error_and_halve_the_bytes(layout):
    params = apply_layout(init_params(CFG, jax.random.PRNGKey(0), jnp.bfloat16), layout)
    q = quantize_params(params, "int8")
    weights = [w for w in jax.tree.leaves(q, is_leaf=lambda w: isinstance(w, QuantizedWeight))
               if isinstance(w, QuantizedWeight)]
    # Every matmul weight (fast: wqkv, wo, w_gate_up, w_down per layer; stacked: the seven
    # stacked ones) and the untied output head.
    assert len(weights) == (4 * CFG.num_layers if layout == "fast" else 7) + 1
    for name in ("embed", "final_norm"):
        assert not isinstance(q[name], QuantizedWeight)
    assert isinstance(q["lm_head"], QuantizedWeight)
    w, qw = params["lm_head"].astype(jnp.float32), q["lm_head"]
    err = jnp.abs(qw.dequantize() - w)  # at most half a step of the row's group
    bound = jnp.repeat(qw.scale, qw.group, axis=0) / 2
    assert qw.scale.shape == (CFG.hidden_size // qw.group, CFG.vocab_size)
    assert bool(jnp.all(err <= bound + 1e-6))
    before = jaxinfer.Model(CFG, params, None, jnp.bfloat16).param_bytes
    after = jaxinfer.Model(CFG, q, None, jnp.bfloat16).param_bytes
    assert after < 0.6 * before


@pytest.mark.parametrize("method, layout", [("int8", "stacked"), ("int8", "fast"),
                                            ("int4", "fast")])
def test_quantized_model_equals_its_dequantized_weights_through_the_engine(method, layout):
    # fast: fused QKV / gate|up per layer; fp8 quality: the default model's perplexity below
    params = apply_layout(init_params(CFG, jax.random.PRNGKey(1), jnp.float32), layout)
    q = quantize_params(params, method)
    quant = jaxinfer.Model(CFG, q, None, jnp.float32, backend="reference")
    plain = jaxinfer.Model(CFG, _dequantized(q), None, jnp.float32, backend="reference")
    prompt = list(range(5, 30))
    np.testing.assert_allclose(jaxinfer.compute_logits(quant, prompt),
                               jaxinfer.compute_logits(plain, prompt), atol=2e-4, rtol=1e-4)
    prompts = [list(range(3, 3 + n)) for n in (4, 17)]
    got = jaxinfer.generate(quant, prompts, max_new_tokens=6, ignore_eos=True)
    want = jaxinfer.generate(plain, prompts, max_new_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


@pytest.mark.parametrize("method, group", [("int4", 32), ("int4-g128", 128)])
def test_int4_weights_bound_their_error_and_count_packed_bytes(method, group):
    w = jax.random.normal(jax.random.PRNGKey(2), (256, 3, 40), jnp.float32)  # fused [in, s, out]
    qw = quantize_params({"wqkv": w}, method)["wqkv"]
    assert (qw.kind, qw.group, qw.out_axes, qw.shape) == ("int4", group, 2, w.shape)
    assert qw.q.shape == (128, 3, 40) and qw.q.dtype == jnp.uint8
    assert qw.scale.shape == qw.zero.shape == (256 // group, 3, 40)
    err = jnp.abs(qw.dequantize() - w)  # half a step, plus float16 rounding of scale and zero
    bound = jnp.repeat(qw.scale.astype(jnp.float32), group, axis=0) * 0.51 + 1e-3
    assert bool(jnp.all(err <= bound))
    # Two weights per byte plus a float16 scale and zero per group and column.
    assert jaxinfer.quantize.param_bytes(qw) == w.size // 2 + 2 * 2 * w.size // group


def test_int4_packing_keeps_every_value_in_its_row():
    v = np.random.default_rng(0).integers(0, 16, size=(2, 128, 5))  # [layers, in, out]
    packed = pack_int4(v, 64, axis=1)
    assert packed.shape == (2, 64, 5) and packed.dtype == np.uint8
    # Byte j of a group: row j in the low nibble, row j + 32 in the high one (GGUF's order).
    np.testing.assert_array_equal(packed[:, 3] & 15, v[:, 3])
    np.testing.assert_array_equal(packed[:, 3] >> 4, v[:, 35])
    np.testing.assert_array_equal(packed[:, 40] >> 4, v[:, 64 + 8 + 32])
    ones = np.ones((2, 2, 5), np.float16)
    qw = QuantizedWeight(q=jnp.asarray(packed), scale=jnp.asarray(ones), zero=jnp.asarray(0 * ones),
                         group=64, kind="int4")
    np.testing.assert_array_equal(qw.dequantize(), v)


def test_fp8_weights_multiply_unrounded_activations_plain_and_fused():
    from jaxinfer.model import _dense, _dense_fused

    kx, kw = jax.random.split(jax.random.PRNGKey(4))
    x = jax.random.normal(kx, (2, 5, 128), jnp.float32)
    w = quantize_params({"wo": jax.random.normal(kw, (128, 48), jnp.float32)}, "fp8")["wo"]
    assert w.scale.shape == (1, 48) and w.q.dtype == jnp.float8_e4m3fn
    want = x @ w.dequantize()
    # The weight's e4m3 values times the activations as they are (an fp8 x fp8 GEMM would
    # round x to 3 mantissa bits too: a few percent of the output).
    np.testing.assert_allclose(_dense(x, w), want, rtol=1e-5, atol=1e-5)
    # Scaled after the matmul: no weight-sized product (a dequantized copy XLA cannot fuse
    # into its GEMM) and no activation converted to fp8, on any backend.
    eqns = jax.make_jaxpr(_dense)(x.astype(jnp.bfloat16), w).eqns
    assert not [e for e in eqns if e.primitive.name == "mul"
                and e.outvars[0].aval.size >= w.q.size]
    assert not [e for e in eqns if e.primitive.name == "convert_element_type"
                and e.params["new_dtype"] == jnp.float8_e4m3fn]
    # One scale per column and group of rows, as a weight split on its rows over a mesh
    # holds it (each device scales its own rows).
    rows = jax.random.normal(kw, (2, 64, 48), jnp.float32)  # [groups, rows, out]
    scale = jnp.max(jnp.abs(rows), axis=1) / 448
    grouped = QuantizedWeight(q=(rows / scale[:, None]).astype(jnp.float8_e4m3fn)
                              .reshape(128, 48), scale=scale, group=64, kind="fp8")
    np.testing.assert_allclose(_dense(x, grouped), x @ grouped.dequantize(), rtol=1e-5,
                               atol=1e-5)
    # A fused [in, shards, out / shards] weight, as a tensor-parallel mesh holds it.
    fused = quantize_params({"w_gate_up": jax.random.normal(kw, (128, 2, 24), jnp.float32)},
                            "fp8")["w_gate_up"]
    got = _dense_fused(x, fused)
    np.testing.assert_allclose(got, jnp.einsum("btd,dsf->btsf", x, fused.dequantize()),
                               rtol=1e-5, atol=1e-5)


def test_bad_quantize_options_are_one_line_errors():
    with pytest.raises(InputError, match="quantize='int3' must be one of int8"):
        jaxinfer.load_model("unused", quantize="int3")
    with pytest.raises(InputError, match="deterministic=True"):
        jaxinfer.load_model("unused", quantize="int8", deterministic=True)
    with pytest.raises(InputError, match="packs two input rows per byte, but wq has 63"):
        quantize_params({"wq": jnp.zeros((63, 8))}, "int4")


def test_convert_saves_quantized_weights_that_load_as_they_are(tmp_path):
    from checkpoints.orbax_io import restore_params
    from jaxinfer.cli import main
    from jaxinfer.loading import convert
    from sharding.testing import write_tiny_model

    src = write_tiny_model(tmp_path / "src")
    dst = convert(src, tmp_path / "int4", quantize="int4")
    model = jaxinfer.load_model(dst, dtype="float32", backend="reference", layout="stacked")
    wq = model.params["layers"]["wq"]
    assert (wq.kind, wq.group, wq.q.dtype) == ("int4", 32, jnp.uint8)
    plain = jaxinfer.load_model(src, dtype="float32", backend="reference", layout="stacked")
    want = dataclasses.replace(plain, params=quantize_params(plain.params, "int4"))
    prompt = [5, 9, 2, 77, 31, 8]
    np.testing.assert_array_equal(jaxinfer.compute_logits(model, prompt),
                                  jaxinfer.compute_logits(want, prompt))
    with pytest.raises(InputError, match="holds quantized weights"):
        jaxinfer.load_model(dst, quantize="int8")
    assert main(["convert", str(src), str(tmp_path / "int8"), "--quantize", "int8"]) == 0
    assert restore_params(tmp_path / "int8" / "params")["lm_head"].kind == "int8"
    assert main(["convert", str(src), str(tmp_path / "x"), "--quantize", "int2"]) == 2


def test_cli_quantize_flag_quantizes_the_model_at_load(tmp_path, capsys, monkeypatch):
    """``--quantize`` on ``generate``, ``chat`` and ``serve`` reaches ``load_model`` (serve:
    the engine process's ``EngineSpec``): ``generate --quantize int8`` prints what the model
    loaded with ``quantize="int8"`` generates; an unknown method is one line on stderr and
    exit 2, before a draft model, the model or an engine process loads (``load_model`` and
    ``create_app`` are stand-ins by then that would say so)."""
    import jaxinfer.cli
    import jaxinfer.loading
    import jaxinfer.server
    from jaxinfer.cli import main
    from jaxinfer.generate import stream
    from sharding.testing import write_tiny_model

    src = str(write_tiny_model(tmp_path / "src"))
    flags = ["--model", src, "--dtype", "float32", "--backend", "reference"]
    want = jaxinfer.load_model(src, dtype="float32", backend="reference", quantize="int8")
    assert want.params["lm_head"].kind == "int8"
    text = "".join(stream(want, "hello", max_new_tokens=6))
    capsys.readouterr()
    assert main(["generate", *flags, "--quantize", "int8", "--prompt", "hello",
                 "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == text + "\n"

    class Stop(Exception):
        """Raised in place of loading the model or starting the server."""

    seen = []

    def fake_load(name, **kw):
        seen.append(kw["quantize"])
        raise Stop

    def fake_create_app(spec, **_):
        seen.append(spec.quantize)
        raise Stop

    monkeypatch.setattr(jaxinfer.loading, "load_model", fake_load)
    monkeypatch.setattr(jaxinfer.server, "create_app", fake_create_app)
    for command in (["generate", *flags, "--quantize", "int4", "--prompt", "hi"],
                    ["chat", *flags, "--quantize", "int4-g64"],
                    ["serve", *flags, "--quantize", "fp8"]):
        with pytest.raises(Stop):
            main(command)
    assert seen == ["int4", "int4-g64", "fp8"]
    capsys.readouterr()
    seen.clear()
    for command in ("generate", "chat", "serve"):  # before a draft model or the model loads
        argv = [command, "--model", "no-such-model", "--quantize", "int2"]
        if command != "serve":
            argv += ["--speculative", "draft", "--draft-model", src]
        assert main([*argv, "--prompt", "hi"] if command == "generate" else argv) == 2
        err = capsys.readouterr().err
        assert err == "jaxinfer: error: quantize='int2' must be one of int8, int4, int4-g64, " \
                      "int4-g128, fp8, native or None\n", err
    assert seen == []


def test_decode_weight_bytes_count_what_a_step_reads():
    """``decode_weight_bytes``: every stored array of quantized params (packed values, scales,
    norms, the LM head) but an untied embedding table, of which a step gathers a few rows;
    a tied table is the LM head and counts; unquantized params give None (the config's
    ``roofline.weight_bytes_per_step`` applies)."""
    from jaxinfer.quantize import decode_weight_bytes

    params = quantize_params(apply_layout(init_params(CFG, jax.random.PRNGKey(0), jnp.float32),
                                          "stacked"), "int8")
    stored = [x for name, v in params.items() if name != "embed"
              for x in jax.tree.leaves(v)]
    assert decode_weight_bytes(params, False) == sum(x.nbytes for x in stored)
    assert decode_weight_bytes(params, True) == (sum(x.nbytes for x in stored)
                                                 + params["embed"].nbytes)
    assert params["lm_head"].q.dtype == jnp.int8  # the head counted as stored, int8
    assert decode_weight_bytes(_dequantized(params), False) is None


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
        "those used to make wine. Books became cheaper, literacy spread across Europe, and "
        "ideas travelled faster than ever before. Within fifty years, presses were running in "
        "more than two hundred cities, and millions of volumes had been printed. Printers "
        "standardised spelling and grammar, scholars compared identical copies of the same "
        "text for the first time, and pamphlets carried news and arguments to readers who "
        "had never owned a book. Historians still debate how much the press changed the "
        "way people thought, but few doubt that it changed what they could read.")


@pytest.mark.slow
def test_default_model_perplexity_int8_int4_fp8(default_gguf):
    base = jaxinfer.load_model(str(default_gguf), dtype="float32")
    ids = base.tokenizer.encode(TEXT)

    def perplexity(model: jaxinfer.Model) -> float:
        logp = jax.nn.log_softmax(jnp.asarray(jaxinfer.compute_logits(model, ids)), axis=-1)
        return float(np.exp(-np.mean(np.asarray(logp)[np.arange(len(ids) - 1), ids[1:]])))

    ppl = perplexity(base)
    for method, limit in (("int8", 0.01), ("int4", 0.08), ("fp8", 0.03)):
        quant = dataclasses.replace(base, params=quantize_params(base.params, method))
        assert abs(perplexity(quant) / ppl - 1) < limit, (method, perplexity(quant), ppl)
    # fp8 as Hopper runs it: the prompt's matmuls fp8 x fp8 (activations in e4m3 too).
    from jaxinfer.model import fp8_input_last, prepare_params
    from jaxinfer.runner import FP8_ACTIVATION_ROWS

    assert len(ids) >= FP8_ACTIVATION_ROWS
    last = fp8_input_last(prepare_params(quant.params, fuse=True, unstack=True))
    fp8_act = perplexity(dataclasses.replace(quant, params=last))
    assert abs(fp8_act / ppl - 1) < 0.03, (fp8_act, ppl)


def test_fp8_input_last_layout_runs_prefill_fp8_x_fp8():
    """``fp8_input_last`` lays each layer's fp8 weights out as ``q [out, in]``. Its matmuls
    are weight-only, unless ``with_fp8_activations`` sets them to scale their activations
    into e4m3 per row (the fp8 x fp8 GEMM of Hopper prefill), within a few percent of the
    float product. Such a layout is not a checkpoint."""
    from checkpoints.orbax_io import save_params
    from jaxinfer.errors import CheckpointError
    from jaxinfer.model import _dense, fp8_input_last, prepare_params, with_fp8_activations
    from jaxinfer.runner import FP8_ACTIVATION_ROWS

    h, inter = CFG.hidden_size, CFG.intermediate_size
    params = quantize_params(init_params(CFG, jax.random.PRNGKey(0), jnp.float32), "fp8")
    fast = prepare_params(params, fuse=True, unstack=True)
    last = fp8_input_last(prepare_params(params, fuse=True, unstack=True))
    for lp, lq in zip(fast["layers"], last["layers"], strict=True):
        w, wl = lp["w_gate_up"].first_shard(), lq["w_gate_up"]
        assert wl.in_last and wl.q.shape == (2 * inter, h) and wl.shape == w.shape == (h, 2 * inter)
        np.testing.assert_array_equal(wl.dequantize(), w.dequantize())
    w, wl = fast["layers"][0]["wo"], last["layers"][0]["wo"]
    x = jax.random.normal(jax.random.PRNGKey(1), (FP8_ACTIVATION_ROWS, h), jnp.float32)
    want = x @ w.dequantize()
    np.testing.assert_allclose(_dense(x, wl), _dense(x, w), rtol=1e-5, atol=1e-5)
    w8 = with_fp8_activations({"wo": wl}, True)["wo"]
    assert w8.fp8_activations and not wl.fp8_activations
    assert not with_fp8_activations({"wo": w8}, False)["wo"].fp8_activations
    got = _dense(x, w8)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.05
    assert float(jnp.linalg.norm(_dense(x, w) - want) / jnp.linalg.norm(want)) < 1e-5

    def e4m3_activations(weight) -> bool:
        return any(e.primitive.name == "convert_element_type"
                   and e.params["new_dtype"] == jnp.float8_e4m3fn
                   for e in jax.make_jaxpr(_dense)(x[:1], weight).eqns)

    assert e4m3_activations(w8) and not e4m3_activations(wl)  # one row too: per program
    # The whole model: random weights compound each matmul's ~2.5% through the layers; a
    # wrong layout would be off by ~100% (quality: the default model's perplexity below).
    model = jaxinfer.Model(CFG, fast, None, dtype=jnp.float32, backend="reference")
    ids = [3 + i % 60 for i in range(FP8_ACTIVATION_ROWS + 6)]
    ref = jaxinfer.compute_logits(model, ids)
    got = jaxinfer.compute_logits(dataclasses.replace(model, params=last), ids)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.15
    with pytest.raises(ValueError, match="one device"):
        fp8_input_last(prepare_params(params, fuse=True))
    with pytest.raises(CheckpointError, match="execution layout"):
        save_params("/nonexistent/never-written", {"wo": wl})


def test_step_programs_choose_fp8_matmuls_and_cublas_for_the_whole_program():
    """A ``runner.StepProgram`` over ``fp8_input_last`` params runs every fp8 matmul of a
    program of ``FP8_ACTIVATION_ROWS`` rows or more fp8 x fp8 (activations rounded to e4m3)
    and compiles it with ``CUBLAS_GEMMS``; fewer rows, or params without that layout, get
    XLA's GEMMs and weight-only matmuls, whatever the row count of each matmul inside
    (here a 2-row matmul beside the step's rows). Target and draft params count alike."""
    import types

    from jaxinfer import runner
    from jaxinfer.model import _dense, fp8_input_last, prepare_params
    from jaxinfer.runner import FP8_ACTIVATION_ROWS

    params = quantize_params(init_params(CFG, jax.random.PRNGKey(0), jnp.float32), "fp8")
    fast = prepare_params(params, fuse=True, unstack=True)
    last = fp8_input_last(prepare_params(params, fuse=True, unstack=True))
    h = CFG.hidden_size

    def fn(target, draft, x):  # the step's rows, and a 2-row matmul of the draft's
        return _dense(x, target["layers"][0]["wo"]), _dense(x[:2], draft["layers"][0]["wo"])

    program = runner.StepProgram(fn, lambda x, **_: x.shape[0], num_models=2)
    e4m3 = "xf8E4M3FN>"
    for rows in (FP8_ACTIVATION_ROWS - 1, FP8_ACTIVATION_ROWS):
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, h), jnp.float32)
        big = rows >= FP8_ACTIVATION_ROWS
        for target, draft, fp8 in ((last, fast, big), (fast, last, big), (fast, fast, False)):
            assert program.options(target, draft, x) == (runner.CUBLAS_GEMMS if fp8 else None)
            text = program.lower(target, draft, x).as_text()
            # activations rounded to e4m3: [rows, h] for the target, [2, h] for the draft
            assert (f"tensor<{rows}x{h}{e4m3}" in text) == (fp8 and target is last)
            assert (f"tensor<2x{h}{e4m3}" in text) == (fp8 and draft is last)
            a, b = program(target, draft, x)
            want = x @ fast["layers"][0]["wo"].dequantize()
            for got, ref in ((a, want), (b, want[:2])):
                err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                assert err < (0.05 if fp8 else 1e-5), (rows, err)
    # 127 rows: three param layouts, default options; 128: two cuBLAS programs, one default
    assert program.compiled() == {"default": 4, "cublas": 2}
    # The engine's step programs count their rows as their bodies do.
    tokens = types.SimpleNamespace(tokens=np.zeros(FP8_ACTIVATION_ROWS, np.int32))
    spec = types.SimpleNamespace(decode=types.SimpleNamespace(tokens=np.zeros(32, np.int32)))
    # the decode loop's options at 128 rows (split-K off from 64), kept beside cuBLAS's
    loop = {**runner.DEVICE_LOOP_GRAPHS, **runner.UNSPLIT_K}
    assert runner.decode_steps.options(last, None, None, tokens) == {**loop,
                                                                      **runner.CUBLAS_GEMMS}
    assert runner.decode_steps.options(fast, None, None, tokens) == loop
    for options, fp8 in (
            (runner.mixed_step.options(last, None, None, tokens), True),
            (runner.verify_step.options(last, None, None, tokens, None, None), True),
            (runner.draft_step.options(last, None, tokens, None), True),
            (runner.ngram_steps.options(last, None, None, spec, width=3), True),  # 32 x 4
            (runner.ngram_steps.options(last, None, None, spec, width=2), False),  # 32 x 3
            (runner.draft_steps.options(fast, last, None, None, None, spec, width=3), True),
            (runner.draft_steps.options(fast, fast, None, None, None, spec, width=3), False)):
        assert options == (runner.CUBLAS_GEMMS if fp8 else None)
    assert runner.gemm_options([fast, last], FP8_ACTIVATION_ROWS) == runner.CUBLAS_GEMMS
    assert runner.gemm_options(fast, 10 * FP8_ACTIVATION_ROWS) is None


def test_step_program_compiles_both_programs_with_its_base_options():
    """``StepProgram(base=...)`` hands its base options to XLA in the default and the cuBLAS
    program alike (``runner.decode_steps`` runs its loop as one CUDA graph this way): a
    value XLA rejects fails the compile of each, a valid one (the decode loop's) compiles."""
    import jaxlib

    from jaxinfer import runner
    from jaxinfer.model import _dense, fp8_input_last, prepare_params

    params = quantize_params(init_params(CFG, jax.random.PRNGKey(0), jnp.float32), "fp8")
    last = fp8_input_last(prepare_params(params, fuse=True, unstack=True))

    def fn(target, x):
        return _dense(x, target["layers"][0]["wo"])

    for rows in (1, runner.FP8_ACTIVATION_ROWS):  # the default program, then cuBLAS's
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, CFG.hidden_size), jnp.float32)
        bad = runner.StepProgram(fn, lambda x, **_: x.shape[0],
                                 base=lambda _: {"xla_gpu_enable_command_buffer": "NOT_A_COMMAND"})
        with pytest.raises(jaxlib.xla_client.XlaRuntimeError, match="NOT_A_COMMAND"):
            bad(last, x)
        good = runner.StepProgram(fn, lambda x, **_: x.shape[0], base=runner.decode_options)
        assert good(last, x).shape == (rows, CFG.hidden_size)
        cublas = runner.CUBLAS_GEMMS if rows > 1 else {}
        assert good.options(last, x) == {**runner.decode_options(rows), **cublas}


def test_load_model_lays_fp8_weights_out_for_fp8_tensor_cores(tmp_path, monkeypatch):
    """``load_model(quantize="fp8")`` and a converted fp8 folder keep each layer's fp8
    weights ``[in, out]`` where there are no fp8 tensor cores (here: CPU), with the same
    greedy tokens; on one GPU that has them (faked here) they are laid out ``[in, out]`` ->
    ``[out, in]`` (``fp8_input_last``), and the programs of ``FP8_ACTIVATION_ROWS`` rows or
    more over them run fp8 x fp8 and leave their GEMMs to cuBLAS (``runner.gemm_options``):
    prompts of that many tokens run there."""
    import types

    from jaxinfer import model as model_module
    from jaxinfer import runner
    from jaxinfer.loading import convert
    from jaxinfer.model import fp8_gemms, fp8_tensor_cores
    from jaxinfer.runner import FP8_ACTIVATION_ROWS
    from sharding.testing import write_tiny_model

    src = write_tiny_model(tmp_path / "src")
    kw = dict(dtype="float32", backend="reference", layout="fast")
    dst = convert(src, tmp_path / "fp8", quantize="fp8")
    quantized, converted = (jaxinfer.load_model(src, quantize="fp8", **kw),
                            jaxinfer.load_model(dst, **kw))
    for model in (quantized, converted):
        layer = model.params["layers"][0]
        assert layer["wo"].kind == "fp8" and not layer["wo"].in_last
        assert not layer["w_gate_up"].in_last and not fp8_gemms(model.params)
        assert runner.gemm_options(model.params, 4096) is None
    prompt = [[5, 9, 2, 77, 31, 8]]
    got, want = (jaxinfer.generate(m, prompt, max_new_tokens=5, ignore_eos=True)
                 for m in (converted, quantized))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]

    monkeypatch.setattr(model_module, "fp8_tensor_cores", lambda device: True)
    for source, q in ((src, "fp8"), (dst, None)):
        last = jaxinfer.load_model(source, quantize=q, **kw)
        assert all(w.in_last for lp in last.params["layers"] for w in lp.values()
                   if isinstance(w, QuantizedWeight))
        assert last.params["lm_head"].in_last  # an untied head: fp8 x fp8 in cuBLAS programs
        assert fp8_gemms(last.params)
        assert runner.gemm_options(last.params, FP8_ACTIVATION_ROWS) == runner.CUBLAS_GEMMS
        assert runner.gemm_options(last.params, FP8_ACTIVATION_ROWS - 1) is None
        ids = [3 + i % 60 for i in range(FP8_ACTIVATION_ROWS + 6)]
        ref = jaxinfer.compute_logits(quantized, ids)
        logits = jaxinfer.compute_logits(last, ids)  # the cuBLAS program (accepted on CPU)
        assert np.linalg.norm(logits - ref) / np.linalg.norm(ref) < 0.15
        assert 0 < np.linalg.norm(logits - ref)  # fp8 activations: not the weight-only model
        short = ids[:40]  # padded to a 64-row program: weight-only
        np.testing.assert_allclose(jaxinfer.compute_logits(last, short),
                                   jaxinfer.compute_logits(quantized, short),
                                   rtol=1e-5, atol=1e-5)
        before = runner.mixed_step.compiled()["cublas"]
        long = jaxinfer.generate(last, [ids], max_new_tokens=3, ignore_eos=True)[0]
        assert len(long.token_ids) == 3
        if source == src:  # the prompt's step compiled in cuBLAS (the folder's reuses it)
            assert runner.mixed_step.compiled()["cublas"] > before
    assert not fp8_gemms(jaxinfer.load_model(src, quantize="int8", **kw).params)
    gpu = types.SimpleNamespace(platform="gpu")
    assert [fp8_tensor_cores(types.SimpleNamespace(platform="gpu", compute_capability=c))
            for c in ("8.0", "8.6", "8.9", "9.0", "10.0")] == [False, False, True, True, True]
    assert not fp8_tensor_cores(gpu) and not fp8_tensor_cores(jax.devices()[0])


@pytest.mark.parametrize("layout", ["stacked", "fast"])
def test_an_all_int4_model_decodes_a_lone_request_in_one_row(layout):
    """On a GPU, with every matmul an int4 or int8 weight its few-row kernel takes (layers
    and the untied head; int4 groups of 32-128, int8's 64), the engine's smallest decode
    calls are 1, 2 and 4 rows, since the kernels compute padding rows too; a tied head, plain
    weights, fp8, groups the kernel does not take, or another platform keep two rows (XLA's
    GEMM needs them). A one-row engine's greedy tokens equal the same model run at two rows."""
    from jaxinfer.model import one_row_decode_weights

    cfg = dataclasses.replace(CFG, intermediate_size=128)  # every input a multiple of 32
    params = apply_layout(init_params(cfg, jax.random.PRNGKey(4), jnp.float32), layout)
    q4 = quantize_params(params, "int4")
    assert one_row_decode_weights(q4, "gpu") and not one_row_decode_weights(q4, "cpu")
    assert one_row_decode_weights(quantize_params(params, "int8"), "gpu")
    assert not one_row_decode_weights(quantize_params(params, "fp8"), "gpu")
    assert not one_row_decode_weights(params, "gpu")
    assert not one_row_decode_weights({k: v for k, v in q4.items() if k != "lm_head"}, "gpu")
    odd = apply_layout(init_params(CFG, jax.random.PRNGKey(4), jnp.float32), layout)
    assert not one_row_decode_weights(quantize_params(odd, "int4"), "gpu")  # w_down: 112 rows
    m = jaxinfer.Model(cfg, q4, None, jnp.float32, backend="reference")
    two = jaxinfer.Engine(m, max_batch=4)
    assert two.row_buckets == (2, 4)  # this CPU: XLA's matmuls, two rows
    one = jaxinfer.Engine(m, max_batch=4)
    one.row_buckets = (1, 2, 4)
    prompt = list(range(3, 12))
    got, want = (e.run([e.submit(prompt, max_new_tokens=8, ignore_eos=True)])[0].token_ids
                 for e in (one, two))
    assert got == want and len(got) == 8


def _qkv_barriers(params, cfg) -> int:
    """How many optimization barriers in one decode token's forward pass (traced on shapes,
    per-layer pools) take exactly the fused QKV product ``[1, 1, 1, (H + 2 KVH) D]``."""
    from jaxinfer.model import forward_ragged

    pool = [jax.ShapeDtypeStruct((cfg.num_kv_heads, 4, 16, cfg.head_dim), jnp.float32)
            for _ in range(cfg.num_layers)]
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda p, *a: forward_ragged(p, cfg, *a, dtype=jnp.float32))(
        params, i32(1), i32(1), pool, pool, i32(1), i32(1), i32(1, 4), i32(1), i32(2))
    qkv = (1, 1, 1, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    return sum(e.primitive.name == "optimization_barrier" and [v.aval.shape for v in e.invars]
               == [qkv] for e in all_eqns(jaxpr))


def test_a_quantized_qkv_product_is_summed_apart_from_rope():
    """A quantized fused QKV weight puts an optimization barrier on the QKV product, one per
    layer, so XLA sums the few-row kernels' K-split partials in a reduction of their own
    instead of inside the RoPE concatenate (H200 r228: 6.7 us per 70B layer; r234-r235);
    float weights get none."""
    params = apply_layout(init_params(CFG, jax.random.PRNGKey(5), jnp.float32), "fast")
    assert _qkv_barriers(quantize_params(params, "int4"), CFG) == CFG.num_layers
    assert _qkv_barriers(quantize_params(params, "int8"), CFG) == CFG.num_layers
    assert _qkv_barriers(params, CFG) == 0
