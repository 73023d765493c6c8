"""Tokenizers against their references: transformers' GGUF tokenizer and sentencepiece."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxinfer.errors import CheckpointError, InputError
from jaxinfer.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n\n\n",
    "digits 0 12 345 6789 3.14159 1e-10 2024-01-01 x=1234567",
    "emoji 😀👍🏽🇫🇷 and 🧑‍🤝‍🧑 done",
    "中文字符测试，日本語のテキスト。한국어 문장",
    "   leading, inner    runs, trailing   ",
    "tabs\t\tand\r\nnewlines\n\n\nend",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they're fine, we'll see; it's John's",
    "ünïcödé ÀÉÎ Ωμέγα ÄÖÜß",
    "a<|endoftext|>b<repo_name>c",
    "",
    " ",
    "\n",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
]


@pytest.fixture(scope="module")
def gguf_tokenizers(default_gguf: Path, hf_smollm2_tokenizer):
    """(ours from the GGUF metadata, transformers' AutoTokenizer from the same GGUF)."""
    from checkpoints.gguf import read_gguf_metadata

    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_gguf))
    return ours, hf_smollm2_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_decode_parity(gguf_tokenizers, text):
    ours, ref = gguf_tokenizers
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_gguf_special_ids(gguf_tokenizers):
    ours, ref = gguf_tokenizers
    assert ours.bos_id == ref.bos_token_id == 1
    assert ours.eos_ids == (ref.eos_token_id,) == (2,)
    assert ours.vocab_size == len(ref) == 49152
    assert not ours.add_bos
    assert ours.encode("hi", add_bos=True)[0] == 1
    # Individual digits, as llama.cpp's "smollm" pre-tokenizer and SmolLM2's tokenizer.json do.
    assert ours.encode(" 2024") == [ours.backend.token_to_id(t) for t in ["Ġ", "2", "0", "2", "4"]]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_parity(gguf_tokenizers, messages):
    ours, ref = gguf_tokenizers
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    prompt = ours.apply_chat_template(messages)
    assert ours.encode(prompt) == ref.apply_chat_template(messages, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)


def test_incremental_decoder_matches_full_decode(gguf_tokenizers):
    ours, _ = gguf_tokenizers
    for text in TEXTS + ["💩🤖 中文 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓"]:
        ids = ours.encode(text)
        dec = ours.incremental_decoder(skip_special_tokens=False)
        pieces = [dec.add(i) for i in ids]
        assert "".join(pieces) + dec.flush() == ours.decode(ids, skip_special_tokens=False)
        assert all("\ufffd" not in p for p in pieces), pieces
        # Groups of ids (one decode per group when it ends on a whole character) agree.
        for group in (2, 3, 7):
            dec = ours.incremental_decoder(skip_special_tokens=False)
            pieces = [dec.add_many(ids[k: k + group]) for k in range(0, len(ids), group)]
            assert "".join(pieces) + dec.flush() == ours.decode(ids, skip_special_tokens=False)
            assert all("\ufffd" not in p for p in pieces), pieces
    # A 4-byte emoji spans several byte-level tokens: nothing is emitted until it is complete.
    ids = ours.encode("😀")
    assert len(ids) > 1
    dec = ours.incremental_decoder()
    assert [dec.add(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_save_and_reload(gguf_tokenizers, tmp_path):
    ours, _ = gguf_tokenizers
    ours.save(tmp_path)
    again = Tokenizer.from_pretrained_dir(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
    assert (again.bos_id, again.eos_ids, again.add_bos) == (ours.bos_id, ours.eos_ids,
                                                             ours.add_bos)
    assert again.apply_chat_template(CHATS[0]) == ours.apply_chat_template(CHATS[0])


def test_hf_dir_with_jinja_file_and_generation_config(gguf_tokenizers, tmp_path):
    """A transformers-5 style folder: chat_template.jinja, eos list in generation_config.json."""
    import json

    ours, _ = gguf_tokenizers
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text(ours.chat_template)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.bos_id == 1 and tok.eos_ids == (2, 0) and not tok.add_bos
    assert tok.apply_chat_template(CHATS[1]) == ours.apply_chat_template(CHATS[1])


def test_chat_template_helpers_and_errors(gguf_tokenizers):
    ours, ref = gguf_tokenizers
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m.role) }}{% endif %}\n"
        "  {% if m.role == 'user' %}{{ m.role }}: {{ m.content | tojson }}{% endif %}\n"
        "{{ eos_token }}\n{% endfor %}")
    tok = Tokenizer(ours.backend, bos_id=1, eos_ids=[2], chat_template=template)
    messages = [{"role": "user", "content": "é <b>"}]
    out = tok.apply_chat_template(messages)
    # trim_blocks/lstrip_blocks and the non-escaping tojson, exactly as transformers renders.
    assert out == ref.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert out.startswith('<|im_start|>user: "é <b>"')
    # The template already writes BOS: encode() must not add a second one.
    tok.add_bos = True
    assert tok.encode(out)[:2] == [1, tok.backend.token_to_id("user")]
    with pytest.raises(InputError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(InputError, match="no chat template"):
        Tokenizer(ours.backend, bos_id=1, eos_ids=[2]).apply_chat_template(CHATS[0])


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_pretrained_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be parsed"):
        Tokenizer.from_pretrained_dir(tmp_path)
    with pytest.raises(CheckpointError, match="not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert",
                                      "tokenizer.ggml.tokens": ["a"]})


# ---------------------------------------------------------------------------------- sentencepiece
SP_TEXTS = [
    "Hello world, this is a test.",
    "  two leading spaces and  double  inner",
    "numbers 12345 and 3.14",
    "unseen glyphs: 😀 中文 ß",
    "newline\nand\ttab",
    "",
]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    """A tiny Llama-style sentencepiece BPE model (byte fallback, no normalization)."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("sp")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join([
        "Hello world, this is a test of the tokenizer.",
        "The quick brown fox jumps over the lazy dog 0123456789 times.",
        "Sentencepiece models split text into pieces with scores.",
        "Tests are good; testing tokenizers is better. Hello again!",
    ] * 40))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "m"), vocab_size=320, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, character_coverage=1.0,
        user_defined_symbols=["<tool>"], minloglevel=2)
    return folder / "m.model"


def test_sentencepiece_model_parity(sp_model, tmp_path):
    import shutil

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    shutil.copy(sp_model, tmp_path / "tokenizer.model")
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.bos_id is None or tok.bos_id == sp.bos_id()
    assert tok.vocab_size == sp.get_piece_size()
    for text in SP_TEXTS + ["a <tool> b"]:
        assert tok.encode(text, add_bos=False) == sp.encode(text), text
        assert tok.decode(tok.encode(text, add_bos=False)) == sp.decode(sp.encode(text))
    ids = tok.encode("😀 中文 Hello", add_bos=False)
    dec = tok.incremental_decoder()
    assert "".join(dec.add(i) for i in ids) + dec.flush() == "😀 中文 Hello"
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_pretrained_dir(tmp_path / "saved")
    assert again.encode(SP_TEXTS[0]) == tok.encode(SP_TEXTS[0])


def test_gguf_llama_vocab_parity(sp_model):
    """A GGUF "llama" vocabulary (pieces, scores, types as llama.cpp writes them)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) == "<tool>" else 1

    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
    }
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.add_bos and tok.eos_ids == (sp.eos_id(),)
    for text in SP_TEXTS:
        assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))
