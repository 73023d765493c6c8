"""Roofline planner against hand-computed cases (numbers worked out in the comments)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import roofline
from jaxinfer.cli import main
from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError
from jaxinfer.presets import PRESETS, preset_config, resolve_config

# vocab 10, hidden 4, inter 8, 2 layers, 2 heads, 1 kv head, head_dim 2, untied.
# Per layer: qkv 4*(2+2*1)*2 = 32, o 2*2*4 = 16, mlp 3*4*8 = 96, norms 2*4 = 8 -> 152.
# Params: 2*152 + embed 40 + lm_head 40 + final norm 4 = 388.
TINY = LlamaConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=2)
UNIT = roofline.DeviceSpec("unit", bandwidth=100.0, flops=1000.0, memory=2000.0)


def test_tiny_counts():
    assert TINY.num_params() == 388
    assert roofline.param_bytes(TINY) == 776
    # KV: S * kv_heads * layers * head_dim * 2 (K,V) * 2 bytes = 3*1*2*2*2*2
    assert roofline.kv_bytes_per_seq(TINY, 3) == 48
    # the untied embedding (40 params) is gathered, not read: (388 - 40) * 2
    assert roofline.weight_bytes_per_step(TINY) == 696
    # matmul weights of the layers: 2 * (32 + 16 + 96)
    assert roofline.layer_matmul_params(TINY) == 288


def test_tiny_decode_step():
    # FLOPs: 2 * B * (288 + lm_head 40) = 1312; attention 4*L*H*D = 32 per key, B*S = 6 keys
    est = roofline.decode_step(TINY, UNIT, batch=2, context=3)
    assert est.flops == 1312 + 192
    assert est.bytes == 696 + 2 * 48
    assert est.memory_s == pytest.approx(792 / 100)
    assert est.compute_s == pytest.approx(1504 / 1000)
    assert est.bound == "memory"
    assert est.time_s == pytest.approx(7.92)
    assert est.intensity == pytest.approx(1504 / 792)


def test_tiny_prefill():
    # 2*T*288 = 2304 (T=4), causal attention (16 // 2) * 32 = 256, last-token head 2*40 = 80
    est = roofline.prefill(TINY, UNIT, batch=1, prompt_len=4)
    assert est.flops == 2640
    assert est.bytes == 696 + 4 * 16
    assert est.compute_s == pytest.approx(2.64)
    assert est.bound == "memory"  # 760 B / 100 B/s = 7.6 s > 2.64 s


def test_tiny_plan_fit_and_max_batch():
    # memory 2000 - params 776 = 1224 free; 48 bytes per sequence at S=3 -> 25 sequences
    assert roofline.max_batch(TINY, UNIT, 3) == 25
    rows = roofline.plan(TINY, UNIT, [1, 25, 26], 3)
    assert [r.fits for r in rows] == [True, True, False]
    assert rows[2].memory_bytes == 26 * 48 + 776
    assert rows[0].tokens_per_s == pytest.approx(1 / rows[0].decode.time_s)
    assert rows[1].tokens_per_s == pytest.approx(25 / rows[1].decode.time_s)


def test_llama_31_8b_on_h100():
    cfg = preset_config("llama-3.1-8b")
    assert cfg.num_params() == 8_030_261_248
    h100 = roofline.device_spec("h100")
    # KV at 8192 tokens: 8192 * 8 * 32 * 128 * 2 * 2 = 2**30 bytes exactly
    assert roofline.kv_bytes_per_seq(cfg, 8192) == 2**30
    # (80e9 - 16,060,522,496) / 2**30 = 59.55 -> 59 sequences of 8k tokens
    assert roofline.max_batch(cfg, h100, 8192) == 59
    # batch 1: (8,030,261,248 - 128256*4096) * 2 + 2**30 bytes over 3.35 TB/s = 4.801 ms
    est = roofline.decode_step(cfg, h100, 1, 8192)
    assert est.bytes == 15_009_849_344 + 2**30
    assert est.time_s == pytest.approx(16_083_591_168 / 3.35e12)
    assert est.bound == "memory"
    # prefill of 2048 tokens: ~ 2 * 2048 * 6.98e9 FLOPs -> compute-bound on an H100
    pf = roofline.prefill(cfg, h100, 1, 2048)
    assert pf.bound == "compute"
    assert pf.flops == (2 * 2048 * roofline.layer_matmul_params(cfg)
                        + 2048 * 1024 * 4 * 32 * 32 * 128 + 2 * 128256 * 4096)


def test_decode_turns_compute_bound_past_the_ridge():
    cfg = preset_config("llama-3.2-1b")
    h100 = roofline.device_spec("h100")
    assert roofline.decode_step(cfg, h100, 1, 128).bound == "memory"
    # intensity ~ batch FLOP/byte with a short context; ridge is 989/3.35 = 295
    assert roofline.decode_step(cfg, h100, 1024, 1).bound == "compute"


def test_70b_does_not_fit_one_h100():
    cfg = preset_config("llama-3.1-70b")
    # 70.55e9 params * 2 bytes = 141.1 GB: more than an H100's 80 GB and an H200's 141 GB
    assert roofline.max_batch(cfg, roofline.device_spec("h100"), 4096) == 0
    assert roofline.max_batch(cfg, roofline.device_spec("h200"), 4096) == 0
    # with 160 GB: 18.9 GB free over 4096 * 8 * 80 * 128 * 2 * 2 = 1.342 GB -> 14 sequences
    assert roofline.max_batch(cfg, roofline.device_spec("h200", memory=160e9), 4096) == 14


def test_device_overrides_and_errors():
    d = roofline.device_spec("h100", bandwidth=3.0e12)
    assert d.bandwidth == 3.0e12 and d.flops == 989e12
    assert roofline.device_spec("custom", bandwidth=1.0, flops=2.0, memory=3.0).ridge == 2.0
    with pytest.raises(InputError):
        roofline.device_spec("custom", bandwidth=1.0)
    with pytest.raises(InputError):
        roofline.device_spec("b200")
    with pytest.raises(InputError):
        preset_config("llama-9")


def test_presets_and_config_paths(tmp_path):
    for name in PRESETS:
        assert preset_config(name).num_params() > 0
    path = tmp_path / "config.json"
    path.write_text('{"vocab_size": 10, "hidden_size": 4, "intermediate_size": 8, '
                    '"num_hidden_layers": 2, "num_attention_heads": 2, '
                    '"num_key_value_heads": 1}')
    assert resolve_config(str(path)).num_params() == 388
    assert resolve_config(str(tmp_path)).num_params() == 388


def test_plan_cli(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--context", "8192", "--device", "h100",
                 "--batch", "1,59,60"]) == 0
    out = capsys.readouterr().out
    assert "largest batch that fits at context 8192: 59" in out
    assert " NO " in out  # batch 60 does not fit
    assert main(["plan", "--model", "nope"]) == 2


def test_plan_counts_quantized_weights_and_kv_as_stored(capsys):
    """``--quantize`` / ``--kv-cache-dtype``: the plan counts the bytes load_model's storage
    takes: the quantized model's (from its shapes: the same as a made one's, scales
    included; a step reads all but the untied embedding table) and a quantized page pool's
    per position, so more sequences fit; FLOPs are the bf16 plan's."""
    import jax

    from jaxinfer.benchmark import kv_bytes_per_position
    from jaxinfer.perf_cli import plan_storage
    from jaxinfer.quantize import param_bytes, random_quantized_params

    tiny = dataclasses.replace(TINY, vocab_size=64, hidden_size=64, intermediate_size=128,
                               head_dim=32, num_heads=2, num_kv_heads=1)
    made = random_quantized_params(tiny, "int4", jax.random.PRNGKey(0))
    storage = plan_storage(tiny, 2, "int4", "int8")
    assert storage.params == param_bytes(made)
    assert storage.step_weights == param_bytes(made) - param_bytes(made["embed"])
    assert storage.kv_per_position == kv_bytes_per_position(tiny, 2, "int8")
    assert storage.label == "int4 weights, int8 K/V"
    assert plan_storage(tiny, 2, None, None) == roofline.Storage.of(tiny)

    cfg = preset_config("llama-3.1-8b")
    h100 = roofline.device_spec("h100")
    q = plan_storage(cfg, 2, "int4-g128", "int8")
    bf16 = roofline.Storage.of(cfg)
    # int4 + a float16 scale and zero per 128 rows: 4.25 bits a weight, against 16
    assert 0.25 < q.params / bf16.params < 0.32
    # one byte per K/V element plus a scale per head and token, against two bytes
    assert q.kv_per_position == bf16.kv_per_position // 2 + 2 * cfg.num_layers * 8 * 2
    assert roofline.max_batch(cfg, h100, 8192, q) == int((80e9 - q.params)
                                                         // (8192 * q.kv_per_position))
    row, plain = (roofline.plan(cfg, h100, [8], 8192, s)[0] for s in (q, bf16))
    assert row.decode.bytes == q.step_weights + 8 * 8192 * q.kv_per_position
    assert row.decode.flops == plain.decode.flops and row.decode.bytes < plain.decode.bytes
    assert main(["plan", "--model", "llama-3.1-8b", "--context", "8192", "--device", "h100",
                 "--quantize", "int4-g128", "--kv-cache-dtype", "int8", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "(int4-g128 weights, int8 K/V)" in out
    assert f"fits at context 8192: {roofline.max_batch(cfg, h100, 8192, q)}" in out
