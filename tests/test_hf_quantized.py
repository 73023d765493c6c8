"""HF AWQ (GEMM) and GPTQ 4-bit folders load as int4 without a float copy
(``checkpoints.hf_quantized``).

AutoAWQ and auto-gptq cannot be installed here, so the folders are written by the packers
below, made from the formats' documented layouts (independently of the loader): a tiny random
Llama's linear weights are drawn as 4-bit values, zeros and float16 scales, packed, and the
float model whose weights are ``s * (q - z)`` is the oracle (HF transformers, float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import jaxinfer
from jaxinfer.errors import InputError
from jaxinfer.quantize import QuantizedWeight, param_bytes

HF_CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i <- column order[i] of 8
PROMPT = [5, 9, 2, 77, 31, 8, 100, 64, 3]
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # ours, in LINEARS' order


def _words(nibbles: np.ndarray) -> np.ndarray:
    """uint ``[..., 8]`` values 0..15 -> int32 ``[...]``, value ``i`` in bits ``4i..4i+3``."""
    word = np.zeros(nibbles.shape[:-1], np.uint32)
    for i in range(8):
        word |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return word.view(np.int32)


def pack_awq(v: np.ndarray) -> np.ndarray:
    """AWQ GEMM ``qweight`` / ``qzeros``: ``[rows, out]`` -> int32 ``[rows, out / 8]``."""
    rows, out = v.shape
    blocks = v.reshape(rows, out // 8, 8)
    return _words(np.stack([blocks[..., c] for c in AWQ_PACK_ORDER], axis=-1))


def pack_gptq_qweight(v: np.ndarray) -> np.ndarray:
    """GPTQ ``qweight``: ``[in, out]`` -> int32 ``[in / 8, out]``, input rows 8r..8r+7."""
    n_in, out = v.shape
    return _words(v.reshape(n_in // 8, 8, out).transpose(0, 2, 1))


def pack_gptq_qzeros(z: np.ndarray) -> np.ndarray:
    """GPTQ ``qzeros``: ``[groups, out]`` -> int32 ``[groups, out / 8]``, columns in order."""
    groups, out = z.shape
    return _words(z.reshape(groups, out // 8, 8))


def _act_order_groups(rng: np.random.Generator, n_in: int, group: int) -> np.ndarray:
    """GPTQ desc_act's ``g_idx``: groups of ``group`` rows along a permutation of the rows."""
    g_idx = np.empty(n_in, np.int64)
    g_idx[rng.permutation(n_in)] = np.arange(n_in) // group
    return g_idx


def _quantized_linear(rng: np.random.Generator, out: int, n_in: int, group: int, method: str,
                      g_idx: np.ndarray, v1: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the packed tensors of one linear layer, the float64 weight ``[out, in]`` they mean)."""
    v1 = v1 and method == "gptq"  # GPTQ v1 stores z - 1: z runs 1..16
    q = rng.integers(0, 16, (n_in, out))
    z = rng.integers(1 if v1 else 0, 17 if v1 else 16, (n_in // group, out))
    s = rng.uniform(0.005, 0.03, (n_in // group, out)).astype(np.float16)
    w = s.astype(np.float64)[g_idx] * (q - z[g_idx])  # [in, out]
    if method == "awq":
        tensors = {"qweight": pack_awq(q), "qzeros": pack_awq(z)}
    else:
        tensors = {"qweight": pack_gptq_qweight(q),
                   "qzeros": pack_gptq_qzeros((z - 1) & 15 if v1 else z),
                   "g_idx": g_idx.astype(np.int32)}
    return {**tensors, "scales": s}, w.T


def write_packed_folder(path: Path, method: str, group: int = 32, act_order: bool = False,
                        v1: bool = True, quantized_head: bool = False, seed: int = 0,
                        shared_orders: bool = True):
    """An AWQ / GPTQ folder of a tiny random Llama at ``path``; returns the float32 torch
    model whose weights are the ones the packed tensors mean (the oracle). With
    ``act_order``, layers that read one input share its row order, as GPTQ's (one Hessian)
    do, unless not ``shared_orders``."""
    import torch
    from safetensors.numpy import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG)).eval()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    names = [f"model.layers.{i}.{m}" for i in range(HF_CONFIG["num_hidden_layers"])
             for m in LINEARS] + (["lm_head"] if quantized_head else [])
    orders: dict[str, np.ndarray] = {}  # act-order g_idx by the layer whose input it orders
    for name in names:
        out, n_in = state.pop(f"{name}.weight").shape
        g_idx = np.arange(n_in) // group
        if act_order:
            parent, _, module = name.rpartition(".")
            source = f"{parent}.{SHARED_INPUT.get(module, module)}" if shared_orders else name
            if source not in orders:
                orders[source] = _act_order_groups(rng, n_in, group)
            g_idx = orders[source]
        tensors, w = _quantized_linear(rng, out, n_in, group, method, g_idx, v1)
        state.update({f"{name}.{k}": v for k, v in tensors.items()})
        with torch.no_grad():
            model.get_submodule(name).weight.copy_(torch.from_numpy(w.astype(np.float32)))
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
              "sym": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    (path / "config.json").write_text(json.dumps({**HF_CONFIG, "model_type": "llama",
                                                  "quantization_config": qc}))
    return model


def loaded_linears(params: dict) -> dict[str, np.ndarray]:
    """The int4 weights of loaded params, dequantized, by HF module name (``[out, in]``)."""
    out = {}
    for key, module in zip(KEYS, LINEARS, strict=True):
        for i, w in enumerate(np.asarray(params["layers"][key].dequantize())):
            out[f"model.layers.{i}.{module}"] = np.array(w.T)
    if isinstance(params.get("lm_head"), QuantizedWeight):
        out["lm_head"] = np.array(np.asarray(params["lm_head"].dequantize()).T)
    return out


def torch_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


CASES = {  # name: (method, group, act_order, v1, quantized lm_head)
    "awq-g32": ("awq", 32, False, False, False),
    "gptq-v1-g64-head": ("gptq", 64, False, True, True),
    "gptq-v2-g32-act-order": ("gptq", 32, True, False, False),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if CASES[c][2] else c
                                  for c in sorted(CASES)])  # act-order: also the engine
def test_packed_folders_load_as_the_weights_they_encode(case, tmp_path):
    import torch

    from checkpoints.hf import load_hf_checkpoint
    from checkpoints.orbax_io import restore_params, save_params

    method, group, act_order, v1, head = CASES[case]
    oracle = write_packed_folder(tmp_path, method, group, act_order, v1, head)
    _, params = load_hf_checkpoint(tmp_path)  # what load_model places
    layers = params["layers"]  # [L, ...] weights
    # (a) every weight is int4 with the checkpoint's group, 4-bit values and float16 scales,
    # and dequantizes to s * (q - z) up to the float16 rounding of its zero -s * z: at most
    # half a float16 ulp of s * z <= 16 * 0.03 (2**-13). The oracle then takes the loaded
    # weights, so (b) compares the forward passes alone.
    for qw in [layers[k] for k in KEYS] + ([params["lm_head"]] if head else []):
        assert (qw.kind, qw.group, qw.q.dtype.name, qw.scale.dtype.name) == (
            "int4", group, "uint8", "float16")
        assert (qw.perm is not None) == act_order
    loaded = loaded_linears(params)
    assert len(loaded) == len(LINEARS) * HF_CONFIG["num_hidden_layers"] + head
    for name, got in loaded.items():
        linear = oracle.get_submodule(name)
        assert np.abs(got - linear.weight.detach().numpy()).max() <= 2.0 ** -13, name
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(got))
    # The bytes: half a byte a weight, a float16 scale and zero per group and column (and an
    # int32 row order per input row), besides two float32 norms per layer.
    shapes = [oracle.get_submodule(f"model.layers.0.{m}").weight.shape for m in LINEARS]
    per_layer = sum(o * i // 2 + 2 * 2 * (i // group) * o + 4 * i * act_order
                    for o, i in shapes) + 2 * 4 * 64
    assert param_bytes(layers) == HF_CONFIG["num_hidden_layers"] * per_layer
    # (b) the logits of the HF float32 model holding those weights; act-order (c) in the
    # fused, per-layer layout (one row order per fused weight), and greedy decoding by the
    # engine gives HF's tokens and log-probabilities.
    model = jaxinfer.load_model(tmp_path, dtype="float32", backend="reference",
                                layout="fast" if act_order else "stacked")
    assert isinstance(model.params.get("lm_head"), QuantizedWeight) == head
    if not act_order:
        assert model.param_bytes == param_bytes(params)
    want = torch_logits(oracle, PROMPT)
    np.testing.assert_allclose(jaxinfer.compute_logits(model, PROMPT), want, atol=1e-4)
    if act_order:
        ids, logprobs = list(PROMPT), []
        for _ in range(4):
            logits = torch_logits(oracle, ids)[-1].astype(np.float64)
            ids.append(int(logits.argmax()))
            logprobs.append(-np.log(np.exp(logits - logits.max()).sum()))  # the argmax's
        [got] = jaxinfer.generate(model, [PROMPT], max_new_tokens=4, ignore_eos=True,
                                  temperature=0.0, logprobs=True)
        assert got.token_ids == ids[len(PROMPT):]
        np.testing.assert_allclose(got.logprobs, logprobs, atol=1e-4)
        # jaxinfer convert saves the row order with the packed arrays.
        save_params(tmp_path / "saved", {"wq": layers["wq"]})
        saved = restore_params(tmp_path / "saved")["wq"]
        np.testing.assert_array_equal(saved.perm, layers["wq"].perm)
        np.testing.assert_array_equal(saved.dequantize(), layers["wq"].dequantize())


def test_act_order_weights_that_share_an_input_must_share_their_order(tmp_path):
    from jaxinfer.errors import CheckpointError

    write_packed_folder(tmp_path, "gptq", 32, act_order=True, shared_orders=False)
    with pytest.raises(CheckpointError, match="wq, wk, wv order their input rows differently"):
        jaxinfer.load_model(tmp_path)


BAD = [  # (quantization_config changes, error)
    ({"bits": 8}, "GPTQ bits=8 is not supported"),
    ({"group_size": -1}, "group_size=-1 is not supported"),
    ({"group_size": 256}, "groups of 32, 64 or 128"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({"pack_dtype": "int8"}, "pack_dtype='int8' is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version='gemv'"),
    ({"quant_method": "awq", "version": "exllama"}, "AWQ version='exllama'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
]


@pytest.mark.parametrize("change, error", BAD)
def test_unsupported_variants_are_one_line_errors_before_reading_tensors(change, error,
                                                                         tmp_path):
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, **change}
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "quantization_config": qc}))
    with pytest.raises(InputError, match=error) as e:  # no safetensors: none were read
        jaxinfer.load_model(tmp_path)
    assert "\n" not in str(e.value)


def test_quantize_options_on_a_packed_folder(tmp_path):
    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "quantization_config": qc}))
    with pytest.raises(InputError, match="quantized already; load it without quantize='int8'"):
        jaxinfer.load_model(tmp_path, quantize="int8")
    with pytest.raises(InputError, match="deterministic=True"):
        jaxinfer.load_model(tmp_path, deterministic=True)
    with pytest.raises(InputError, match="quantized already"):
        jaxinfer.loading.convert(tmp_path, tmp_path / "out", quantize="int4")
