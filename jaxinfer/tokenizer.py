"""Tokenizers: HF ``tokenizer.json``, sentencepiece ``tokenizer.model``, or a GGUF's vocabulary.

Every source is turned into one ``tokenizers.Tokenizer`` (the Rust fast tokenizer), so encode,
decode, streaming and ``save`` behave the same whatever the model came from:

* ``tokenizer.json`` is used as is.
* A sentencepiece BPE ``tokenizer.model`` (Llama 1/2, TinyLlama) and a GGUF ``"llama"`` vocabulary
  become a byte-fallback BPE whose merges are derived from the piece scores (what transformers'
  converter does); the tests check it against sentencepiece itself.
* A GGUF ``"gpt2"`` vocabulary (SmolLM2, Llama 3, Qwen2) becomes a byte-level BPE with the file's
  merges and the pre-tokenizer named by ``tokenizer.ggml.pre`` (llama.cpp's names).

Chat templates are rendered with jinja2 in a sandbox, configured like transformers'
``apply_chat_template`` so the rendered prompt is identical.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _FastTokenizer

from jaxinfer.errors import CheckpointError, InputError

# llama.cpp token types (GGUF ``tokenizer.ggml.token_type`` / sentencepiece piece types).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre(kind: str) -> Any:
    if kind == "digits":
        # llama.cpp splits on \p{N} first, then applies the GPT-2 regex: exactly HF's
        # Digits(individual) followed by ByteLevel(use_regex=True), as in SmolLM2's tokenizer.json.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[kind]
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


# ``tokenizer.ggml.pre`` value (llama.cpp) -> pre-tokenizer family.
_GGUF_PRE = {
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "smaug-bpe": "llama3",
    "dbrx": "llama3", "falcon3": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
}


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a piece into two pieces,
    best score first (same order as transformers' ``generate_merges``)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                       add_space_prefix: bool) -> _FastTokenizer:
    """Byte-fallback BPE equivalent to a sentencepiece BPE model (Llama style).

    The dummy-prefix space is added by ``Tokenizer.encode`` (``space_prefix``), not here:
    ``Metaspace(prepend_scheme="first")`` skips the prefix when the text already starts with a
    space, which sentencepiece does not (``"  hi"`` must become three U+2581).
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # Control/byte/unused pieces never take part in merges; only normal and user pieces do.
    mergeable = {tok: float(s) for tok, s, t in zip(tokens, scores, types, strict=True)
                 if t in (_NORMAL, _USER_DEFINED)}
    unk = next((tok for tok, t in zip(tokens, types, strict=True) if t == _UNKNOWN), None)
    tok = _FastTokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(vocab, mergeable),
                                    unk_token=unk, fuse_unk=True, byte_fallback=True,
                                    dropout=None))
    # Sentencepiece replaces spaces by U+2581 and adds one in front of the text (dummy prefix).
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    _add_special(tok, tokens, types)
    return tok


def _add_special(tok: _FastTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control tokens are matched whole in text and skipped when decoding with
    ``skip_special_tokens``; user-defined tokens are matched whole but decoded as text."""
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int],
                    pre: str) -> _FastTokenizer:
    """Byte-level BPE (GGUF ``tokenizer.ggml.model == "gpt2"``)."""
    if pre not in _GGUF_PRE:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.pre={pre!r} is not supported; supported: "
            f"{', '.join(sorted(_GGUF_PRE))}; use the model's HF tokenizer.json instead"
        )
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    # Tokens outside the byte alphabet (rare, e.g. a raw "\n" control token) get byte spelling so
    # the BPE model can reach them; control tokens are still matched whole by the added tokens.
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = _FastTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None,
                                    continuing_subword_prefix="", end_of_word_suffix="",
                                    fuse_unk=False))
    tok.normalizer = None
    tok.pre_tokenizer = _byte_level_pre(_GGUF_PRE[pre])
    tok.decoder = decoders.ByteLevel()
    _add_special(tok, tokens, [ty if ty != _CONTROL or set(t) <= alphabet else _NORMAL
                               for t, ty in zip(tokens, types, strict=True)])
    return tok


def _token_content(value: Any) -> str | None:
    """``tokenizer_config.json`` stores special tokens as a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download it") from None
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model.

    Build with ``from_pretrained_dir`` or ``from_gguf_metadata``; ``save`` writes a folder that
    ``from_pretrained_dir`` reads back identically.
    """

    def __init__(self, backend: _FastTokenizer, *, bos_id: int | None,
                 eos_ids: Iterable[int], chat_template: str | None = None,
                 add_bos: bool = False, sp_model: bytes | None = None,
                 space_prefix: bool = False):
        """Args:
          backend: the ``tokenizers.Tokenizer`` doing the work (its own post-processor is not
            used; BOS is added here according to ``add_bos``).
          bos_id: beginning-of-sequence id, or None.
          eos_ids: every id that ends generation (e.g. ``<|eot_id|>`` and ``<|end_of_text|>``).
          chat_template: jinja2 chat template source, or None.
          add_bos: whether ``encode`` prepends ``bos_id`` by default.
          sp_model: serialized sentencepiece model this tokenizer was built from (kept so that
            ``save`` also writes ``tokenizer.model``).
          space_prefix: ``encode`` puts one space before non-empty text (sentencepiece's
            ``add_dummy_prefix``, for tokenizers built from sentencepiece vocabularies).
        """
        self._tok = backend
        self._bos_id = bos_id
        self._eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.chat_template = chat_template
        self.add_bos = bool(add_bos and bos_id is not None)
        self._sp_model = sp_model
        self._space_prefix = space_prefix

    # ----------------------------------------------------------------------------- builders
    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """Read an HF-style tokenizer folder.

        Uses ``tokenizer.json`` if present, else a sentencepiece BPE ``tokenizer.model``.
        Special tokens, ``add_bos_token`` and the chat template come from
        ``tokenizer_config.json`` (chat template also from ``chat_template.jinja`` /
        ``chat_template.json``); extra EOS ids from ``generation_config.json`` and
        ``config.json`` of the same folder.
        """
        folder = Path(path)
        cfg = _read_json(folder / "tokenizer_config.json")
        sp_bytes = None
        space_prefix = bool(cfg.get("jaxinfer_space_prefix", False))
        if (folder / "tokenizer.json").is_file():
            try:
                backend = _FastTokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as e:  # noqa: BLE001 - the Rust parser raises a generic Exception
                raise CheckpointError(f"{folder / 'tokenizer.json'} cannot be parsed ({e}); "
                                      "re-download it") from None
        elif (folder / "tokenizer.model").is_file():
            sp_bytes = (folder / "tokenizer.model").read_bytes()
            backend, space_prefix = _from_sentencepiece(sp_bytes, folder / "tokenizer.model")
        else:
            raise CheckpointError(f"{folder} has no tokenizer.json or tokenizer.model; copy the "
                                  "model's tokenizer files there")

        def token_id(name: str) -> int | None:
            content = _token_content(cfg.get(name))
            return backend.token_to_id(content) if content is not None else None

        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        bos = token_id("bos_token")
        if bos is None:
            bos = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
        eos: list[int] = _as_id_list(cfg.get("jaxinfer_eos_token_ids"))
        eos_tok = token_id("eos_token")
        if eos_tok is not None:
            eos.append(eos_tok)
        eos += _as_id_list(gen_cfg.get("eos_token_id"))
        if not eos:
            eos = _as_id_list(model_cfg.get("eos_token_id"))
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        elif bos is not None:
            # No explicit flag: follow what the tokenizer.json post-processor does.
            add_bos = backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
        else:
            add_bos = False
        return cls(backend, bos_id=bos, eos_ids=eos, chat_template=_chat_template(folder, cfg),
                   add_bos=add_bos, sp_model=sp_bytes, space_prefix=space_prefix)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build from the vocabulary embedded in a GGUF (``checkpoints.gguf.load_gguf`` metadata).

        Supports ``tokenizer.ggml.model`` ``"gpt2"`` (byte-level BPE with merges, pre-tokenizer
        from ``tokenizer.ggml.pre``) and ``"llama"`` (sentencepiece-style pieces with scores).
        """
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise CheckpointError("the GGUF has no embedded vocabulary (tokenizer.ggml.tokens); "
                                  "load the model from an HF folder with tokenizer.json instead")
        types = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if kind == "gpt2":
            merges = metadata.get("tokenizer.ggml.merges")
            if not merges:
                raise CheckpointError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges; the "
                                      "file is incomplete")
            backend = _byte_level_bpe(tokens, merges, types,
                                      metadata.get("tokenizer.ggml.pre", "default"))
            default_add_bos, space_prefix = False, False
        elif kind == "llama":
            scores = metadata.get("tokenizer.ggml.scores")
            if not scores:
                raise CheckpointError("GGUF llama tokenizer has no tokenizer.ggml.scores; the "
                                      "file is incomplete")
            space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            backend = _sentencepiece_bpe(tokens, scores, types, space_prefix)
            default_add_bos = True  # llama.cpp's default for sentencepiece vocabularies
        else:
            raise CheckpointError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (only "
                                  "'gpt2' and 'llama'); use the model's HF tokenizer.json")
        eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if k in metadata]
        return cls(backend, bos_id=metadata.get("tokenizer.ggml.bos_token_id"), eos_ids=eos,
                   chat_template=metadata.get("tokenizer.chat_template"),
                   add_bos=metadata.get("tokenizer.ggml.add_bos_token", default_add_bos),
                   space_prefix=space_prefix)

    # ----------------------------------------------------------------------------- persistence
    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``tokenizer.model`` when built
        from one) so that ``Tokenizer.from_pretrained_dir(directory)`` reproduces this one."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / "tokenizer.json"))
        if self._sp_model is not None:
            (folder / "tokenizer.model").write_bytes(self._sp_model)
        cfg: dict[str, Any] = {
            "add_bos_token": self.add_bos,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            # HF has one eos_token; models such as Llama 3 stop on several ids.
            "jaxinfer_eos_token_ids": list(self._eos_ids),
            "jaxinfer_space_prefix": self._space_prefix,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1,
                                                                 ensure_ascii=False))

    # ----------------------------------------------------------------------------- properties
    @property
    def backend(self) -> _FastTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence token id (None if the model has none)."""
        return self._bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every token id that ends generation."""
        return self._eos_ids

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token (as chat templates use it)."""
        return self._tok.id_to_token(self._bos_id) if self._bos_id is not None else None

    @property
    def eos_token(self) -> str | None:
        """Text of the first EOS token."""
        return self._tok.id_to_token(self._eos_ids[0]) if self._eos_ids else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    # ----------------------------------------------------------------------------- encode/decode
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in the text (e.g. ``<|im_start|>``) map
        to their ids.

        Args:
          add_bos: prepend ``bos_id``; ``None`` uses the tokenizer's default, and then skips it
            when the text already starts with the BOS string (chat templates often write it).
        """
        if not isinstance(text, str):
            raise InputError(f"encode expects a string, got {type(text).__name__}")
        if self._space_prefix and text:
            text = " " + text
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos and not (ids[:1] == [self._bos_id])
        if add_bos:
            if self._bos_id is None:
                raise InputError("add_bos=True but this tokenizer has no BOS token")
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary (padding rows of a larger embedding)
        are dropped. Incomplete UTF-8 at the end decodes to U+FFFD."""
        n = self.vocab_size
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < n],
                                skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh streaming decoder for one sequence."""
        return IncrementalDecoder(self, skip_special_tokens)

    # ----------------------------------------------------------------------------- chat
    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        Same output as transformers' ``apply_chat_template(..., tokenize=False)``. Extra keyword
        arguments (e.g. ``tools``) are passed to the template. Encode the result with
        ``encode(text)``: the default BOS handling avoids a double BOS.
        """
        if not self.chat_template:
            raise InputError("this model's tokenizer has no chat template; pass plain prompts "
                             "(chat=False)")
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        import jinja2

        try:
            return _compile_template(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as e:
            raise InputError(f"chat template failed: {e}") from None


class IncrementalDecoder:
    """Streaming detokenizer: feed ids one at a time, get back only text that is final.

    A byte-level BPE token can hold part of a UTF-8 character, and sentencepiece pieces change
    their leading space depending on context, so text is produced by decoding a short window
    (the previous emitted token(s) plus the new ones) and emitting the difference once it no
    longer ends in an incomplete character. Concatenating all returned pieces plus ``flush()``
    equals ``Tokenizer.decode`` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: context whose text was already emitted
        self._read = 0  # ids before this index have been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one id; return the newly final text (possibly ``""``)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text):]
        return ""

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Append several ids; return the newly final text.

        One decode of the window for all of them when they end on a complete character
        (a streaming server's usual case: tokens arrive in groups), else id by id.
        """
        ids = [int(t) for t in token_ids]
        if not ids:
            return ""
        start = len(self._ids)
        self._ids += ids
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text):]
        del self._ids[start:]
        return "".join(self.add(t) for t in ids)

    def flush(self) -> str:
        """Text still held back (e.g. a trailing incomplete character, as U+FFFD) at the end."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]


@cache
def _compile_template(source: str) -> Any:
    """Compile a chat template like transformers does (sandboxed, trim/lstrip blocks)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"the model's chat template is not valid jinja2 ({e})") from None


def _chat_template(folder: Path, cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _from_sentencepiece(data: bytes, path: Path) -> tuple[_FastTokenizer, bool]:
    """Convert a sentencepiece BPE model (bytes of ``tokenizer.model``) to a fast tokenizer;
    also return whether it adds the dummy-prefix space."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    try:
        proto.ParseFromString(data)
        spm.SentencePieceProcessor(model_proto=data)
    except Exception as e:  # noqa: BLE001 - protobuf/sentencepiece raise assorted errors
        raise CheckpointError(f"{path} is not a valid sentencepiece model ({e}); re-download "
                              "it") from None
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:
        kind = pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
        raise CheckpointError(f"{path} is a sentencepiece {kind} model; only BPE models (Llama "
                              "family) are supported")
    tokens = [p.piece for p in proto.pieces]
    scores = [p.score for p in proto.pieces]
    # sentencepiece piece types: NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4, BYTE=6,
    # UNUSED=5: the same numbering GGUF uses.
    types = [int(p.type) for p in proto.pieces]
    prefix = bool(proto.normalizer_spec.add_dummy_prefix)
    return _sentencepiece_bpe(tokens, scores, types, prefix), prefix
