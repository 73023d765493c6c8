"""Command line: ``jaxinfer generate``, ``chat``, ``serve``, ``convert``, ``plan``, ``bench``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from jaxinfer.errors import JaxinferError
from jaxinfer.speculative import METHODS, Speculative


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags shared by every command that generates."""
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--speculative", choices=METHODS, default=None,
                        help="speculative decoding (same output): ngram = prompt lookup, "
                        "draft = a smaller model's proposals (--draft-model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="tokens proposed per verification (with --speculative; default "
                        f"{Speculative.num_tokens})")
    parser.add_argument("--draft-model", default=None,
                        help="with --speculative draft: the draft model (a name or path, "
                        "loaded like --model; same tokenizer)")
    parser.add_argument("--draft-quantize", default=None,
                        help="quantize the draft's weights (e.g. int4: --draft-model set to "
                        "the --model itself drafts with its int4 copy)")


def sampling_kwargs(args: argparse.Namespace, draft: Any = None) -> dict[str, object]:
    """The ``generate`` keyword arguments named by ``add_sampling_args`` flags.

    ``draft`` is the loaded ``--draft-model`` (``load_draft``); ``--speculative draft``
    without it leaves ``speculative`` None, so the other flags can be checked before
    anything is loaded. Draft flags without ``--speculative draft`` are one-line errors.
    """
    from jaxinfer.errors import InputError

    if (args.speculative == "draft") != (args.draft_model is not None):
        raise InputError("--speculative draft needs --draft-model M, and --draft-model is "
                         "only for --speculative draft")
    if args.draft_quantize is not None and args.draft_model is None:
        raise InputError("--draft-quantize needs --speculative draft --draft-model M")
    speculative = None
    if args.speculative != "draft" or draft is not None:
        speculative = speculative_settings(args, draft)
    return {
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty, "seed": args.seed,
        "stop": tuple(args.stop),
        "speculative": speculative,
    }


def speculative_settings(args: argparse.Namespace, draft: Any = None) -> Speculative | None:
    """The ``Speculative`` that ``--speculative`` and ``--num-speculative-tokens`` name (with
    the loaded ``draft`` model for ``draft``), or None without ``--speculative``; a one-line
    error for ``--num-speculative-tokens`` without it."""
    from jaxinfer.errors import InputError

    num = args.num_speculative_tokens
    if not args.speculative:
        if num is not None:
            raise InputError("--num-speculative-tokens needs --speculative (it sets the "
                             "tokens proposed per verification)")
        return None
    return Speculative(method=args.speculative, draft=draft,
                       **({} if num is None else {"num_tokens": num}))


def load_draft(args: argparse.Namespace) -> Any:
    """The ``--draft-model`` of ``--speculative draft``, loaded like the target (``--dtype``,
    ``--backend``, ``--kv-cache-dtype``) and quantized with ``--draft-quantize``; None
    without one. Load it before the target's engine sizes its page pool (first use).
    A one-line error first, before anything loads, where ``--tp``/``--dp`` put the target on
    a mesh: speculation with a draft model runs on one device."""
    if args.draft_model is None:
        return None
    from jaxinfer.errors import InputError
    from jaxinfer.loading import load_model

    if getattr(args, "tp", 1) * getattr(args, "dp", 1) > 1:
        raise InputError("--speculative draft runs on one device; drop --tp/--dp, or use "
                         "--speculative ngram on a mesh")

    print(f"jaxinfer: loading the draft model {args.draft_model} …", file=sys.stderr,
          flush=True)
    return load_model(args.draft_model, dtype=args.dtype, backend=args.backend,
                      quantize=args.draft_quantize, kv_cache_dtype=args.kv_cache_dtype)


def add_quantize_arg(parser: argparse.ArgumentParser) -> None:
    """``--quantize``: the model's matmul weights quantized at load (``load_model``)."""
    parser.add_argument("--quantize", default=None,
                        help="quantize the matmul weights at load: int8, int4, int4-g64, "
                        "int4-g128, fp8, or native (a GGUF's Q8_0/Q4_0/Q4_1 blocks or an "
                        "AWQ/GPTQ folder's int4 as they are); default: as stored")


def check_load_args(args: argparse.Namespace) -> None:
    """One-line errors for ``--quantize``, ``--draft-quantize`` and ``--kv-cache-dtype``
    before anything loads: a draft model, the device, or an engine process."""
    from jaxinfer.paged_cache import check_kv_cache_dtype
    from jaxinfer.quantize import check_method

    for method in (getattr(args, "quantize", None), getattr(args, "draft_quantize", None)):
        if method is not None:
            check_method(method, native=True)
    check_kv_cache_dtype(args.kv_cache_dtype)


def add_kv_cache_arg(parser: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype``: how the engine's page pool stores K/V (``load_model``)."""
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="int8 or fp8: store K/V quantized, about twice the tokens in the "
                        "same memory (default: the model's dtype)")


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    """``--tp``/``--dp``: split the model over devices (see ``sharding.make_mesh``)."""
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel devices per model replica (default 1)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas, the batch is split over them (default 1)")


REPLICA_MODES = ("auto", "processes", "threads")


def add_replicas_arg(parser: argparse.ArgumentParser) -> None:
    """``--replicas``: how ``--dp`` replicas run (``replica_processes`` resolves it)."""
    parser.add_argument("--replicas", choices=REPLICA_MODES, default="auto",
                        help="how --dp replicas run: processes (an engine process each, pinned "
                        "to its GPUs, with its own interpreter lock; the model loads in each; "
                        "one host of CUDA GPUs) or threads of this process; auto (default): "
                        "processes for --dp 2+ on one host of CUDA GPUs without a draft "
                        "model, threads otherwise")


def targets_cuda(platforms: str | None, plugins: Sequence[str]) -> bool:
    """Whether JAX will run on CUDA GPUs, told without starting a backend: ``platforms``
    (``jax_platforms``; None or empty: JAX's choice) allows them and a CUDA plugin is among
    the installed ``jax_plugins`` modules ``plugins``."""
    allowed = not platforms or any(p.strip() in ("cuda", "gpu") for p in platforms.split(","))
    return allowed and any(name.startswith("xla_cuda") for name in plugins)


def cuda_host() -> bool:
    """``targets_cuda`` for this process's JAX configuration and installed plugins."""
    import importlib
    import pkgutil

    import jax

    try:
        plugins = importlib.import_module("jax_plugins")
    except ImportError:
        return False
    return targets_cuda(jax.config.jax_platforms,
                        [m.name for m in pkgutil.iter_modules(plugins.__path__)])


def replica_processes(args: argparse.Namespace, *, multihost: bool = False,
                      draft: bool = False, gpus: bool | None = None) -> bool:
    """Whether ``add_replicas_arg``'s ``--replicas`` runs the ``--dp`` replicas as engine
    processes: ``auto`` does so for ``--dp`` 2 or more on one host (not ``multihost``) of
    CUDA GPUs (``gpus``; None: ``cuda_host()``) without a draft model held by this process
    (``draft``). Why processes: with threads, one interpreter lock queues every replica's
    host work (4x H100, ``batch_eval --dp 4``, 1B shapes: 2.0-2.5x one GPU with threads,
    3.63-3.66x with processes; bench/NOTES.md r157-r160). Engine processes pin GPUs through
    ``CUDA_VISIBLE_DEVICES``, so elsewhere (CPU, TPU) ``auto`` keeps threads.
    """
    if args.replicas != "auto":
        return args.replicas == "processes"
    if args.dp < 2 or multihost or draft:
        return False
    return cuda_host() if gpus is None else gpus


def mesh_from_args(args: argparse.Namespace) -> Any:
    """The ``(dp, tp)`` mesh named by ``add_mesh_args`` flags, or None for one device."""
    if args.tp == 1 and args.dp == 1:
        return None
    from sharding import make_mesh

    return make_mesh(data=args.dp, model=args.tp)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxinfer", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--backend", default="auto", choices=["auto", "reference", "pallas"])
    add_quantize_arg(g)
    add_kv_cache_arg(g)
    add_mesh_args(g)
    add_sampling_args(g)
    ch = sub.add_parser("chat", help="interactive multi-turn chat, replies streamed",
                        description="Chat with a model using its chat template. The whole "
                        "conversation is sent every turn. Commands: /reset clears the history, "
                        "/exit (or Ctrl-D) quits; Ctrl-C interrupts a reply.")
    ch.add_argument("--model", default="smollm2-135m-instruct")
    ch.add_argument("--system", default=None, help="system message opening the conversation")
    ch.add_argument("--dtype", default="bfloat16")
    ch.add_argument("--backend", default="auto", choices=["auto", "reference", "pallas"])
    add_quantize_arg(ch)
    add_kv_cache_arg(ch)
    add_mesh_args(ch)
    add_sampling_args(ch)
    sv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                        description="Serve /v1/completions, /v1/chat/completions, /v1/models, "
                        "/health and /metrics; Ctrl-C or SIGTERM drains and stops.")
    sv.add_argument("--model", default="smollm2-135m-instruct")
    sv.add_argument("--served-model-name", default=None,
                    help="the model id clients pass (default: --model)")
    sv.add_argument("--dtype", default="bfloat16")
    sv.add_argument("--backend", default="auto", choices=["auto", "reference", "pallas"])
    add_quantize_arg(sv)
    add_kv_cache_arg(sv)
    add_mesh_args(sv)
    add_replicas_arg(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-queue", type=int, default=1024,
                    help="requests that may wait for a slot before new ones get 429 (per "
                    "engine process when replicas are processes)")
    sv.add_argument("--shutdown-grace", type=float, default=30.0,
                    help="seconds running requests get to finish at shutdown (then cancelled)")
    sv.add_argument("--speculative", choices=["ngram"], default=None,
                    help="n-gram speculative decoding for every request (same outputs; the "
                         "engine runs it only while it is faster)")
    sv.add_argument("--num-speculative-tokens", type=int, default=None,
                    help="tokens proposed per verification (with --speculative; default "
                    f"{Speculative.num_tokens})")
    sv.add_argument("--no-warmup", action="store_true",
                    help="on an accelerator, compile the engine's step programs on first use "
                         "instead of at start (on CPU they always are)")
    from jaxinfer.perf_cli import add_parsers

    add_parsers(sub)  # plan, bench
    c = sub.add_parser("convert", help="convert a GGUF/HF checkpoint to a jaxinfer folder")
    c.add_argument("src")
    c.add_argument("dst", help="a new or empty folder, or a previous conversion with --overwrite")
    c.add_argument("--overwrite", action="store_true",
                   help="replace DST when it holds a previous jaxinfer conversion")
    c.add_argument("--quantize", default=None,
                   help="save the matmul weights quantized: int8, int4, int4-g64, int4-g128, "
                        "fp8, or native (a GGUF's Q8_0/Q4_0/Q4_1 blocks as they are)")
    return p


def _generate(args: argparse.Namespace) -> None:
    from jaxinfer.errors import InputError
    from jaxinfer.generate import stream
    from jaxinfer.loading import load_model
    from jaxinfer.sampling import SamplingParams

    if not args.prompt:
        raise InputError("--prompt is empty; give the text to continue")
    SamplingParams.from_kwargs(**sampling_kwargs(args))  # bad values: before loading
    check_load_args(args)
    options = sampling_kwargs(args, load_draft(args))
    model = load_model(args.model, dtype=args.dtype, backend=args.backend,
                       mesh=mesh_from_args(args), quantize=args.quantize,
                       kv_cache_dtype=args.kv_cache_dtype)
    for piece in stream(model, args.prompt, chat=args.chat, **options):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


CHAT_PROMPT = "you> "
CHAT_HELP = "commands: /reset clears the conversation, /exit or Ctrl-D quits"


def chat_session(
    model: Any,
    options: dict[str, Any],
    read_line: Callable[[str], str],
    out: TextIO,
    system: str | None = None,
) -> None:
    """Run the chat loop until ``/exit`` or end of input.

    Args:
      model: a loaded ``jaxinfer.Model`` with a chat template.
      options: sampling keywords for ``stream``; a ``seed`` is offset by the turn number so
        that a seeded chat is reproducible without repeating the same random draws each turn.
      read_line: ``input``-like; raises ``EOFError`` at the end of input.
      out: where replies stream to.
      system: optional system message kept at the head of the conversation.
    """
    from jaxinfer.errors import JaxinferError
    from jaxinfer.generate import stream
    from jaxinfer.sampling import offset_seed

    opening = [{"role": "system", "content": system}] if system else []
    history: list[dict[str, str]] = list(opening)
    turn = 0
    while True:
        try:
            line = read_line(CHAT_PROMPT).strip()
        except EOFError:
            out.write("\n")
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = list(opening)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]!r}; {CHAT_HELP}", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        turn_options = dict(options)
        if turn_options.get("seed") is not None:
            turn_options["seed"] = offset_seed(int(turn_options["seed"]), turn)
        pieces: list[str] = []
        try:
            for piece in stream(model, history, **turn_options):
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            # Keep the history consistent: a half-written reply is not part of the chat.
            history.pop()
            out.write("\n")
            print("(reply interrupted; that turn is discarded)", file=sys.stderr)
            continue
        except JaxinferError as e:
            history.pop()
            print(f"jaxinfer: error: {e}; /reset starts a new conversation", file=sys.stderr)
            continue
        out.write("\n")
        history.append({"role": "assistant", "content": "".join(pieces)})
        turn += 1


def _chat(args: argparse.Namespace) -> None:
    from jaxinfer.loading import load_model
    from jaxinfer.sampling import SamplingParams

    SamplingParams.from_kwargs(**sampling_kwargs(args))  # bad values: before loading
    check_load_args(args)
    options = sampling_kwargs(args, load_draft(args))
    print(f"jaxinfer: loading {args.model} …", file=sys.stderr, flush=True)
    model = load_model(args.model, dtype=args.dtype, backend=args.backend,
                       mesh=mesh_from_args(args), quantize=args.quantize,
                       kv_cache_dtype=args.kv_cache_dtype)
    if model.tokenizer is None or not model.tokenizer.chat_template:
        from jaxinfer.errors import InputError

        raise InputError(f"{args.model} has no chat template; use 'jaxinfer generate' instead")
    read_line = input
    if sys.stdin.isatty():
        try:  # line editing and history for the prompt in a real terminal
            import readline  # noqa: F401
        except ImportError:
            pass
    print(f"chatting with {args.model}; {CHAT_HELP}", file=sys.stderr, flush=True)
    chat_session(model, options, read_line, sys.stdout, system=args.system)


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from jaxinfer.engine_process import EngineSpec
    from jaxinfer.errors import InputError
    from jaxinfer.server import create_app

    if args.max_queue < 0:
        raise InputError(f"--max-queue={args.max_queue} must be >= 0")
    if not 0 < args.port < 65536:
        raise InputError(f"--port={args.port} must be in [1, 65535]")
    if not (math.isfinite(args.shutdown_grace) and args.shutdown_grace >= 0):
        raise InputError(f"--shutdown-grace={args.shutdown_grace} must be a number of "
                         "seconds >= 0")
    check_load_args(args)
    speculative = speculative_settings(args)
    # The model loads in the engine process (create_app starts it); this one serves HTTP.
    spec = EngineSpec(args.model, dtype=args.dtype, backend=args.backend,
                      quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
                      tp=args.tp, dp=args.dp,
                      warmup=not args.no_warmup, speculative=speculative,
                      replica_processes=replica_processes(args))
    app = create_app(spec, name=args.served_model_name or args.model,
                     max_queue=args.max_queue, shutdown_grace_s=args.shutdown_grace)
    # uvicorn stops on SIGINT/SIGTERM: it closes the listening socket, lets open responses
    # finish for the grace period, then the app's shutdown cancels what is left.
    uvicorn.run(app, host=args.host, port=args.port,
                timeout_graceful_shutdown=args.shutdown_grace)


def _convert(args: argparse.Namespace) -> None:
    from jaxinfer.loading import convert

    out = convert(args.src, args.dst, overwrite=args.overwrite, quantize=args.quantize)
    print(f"converted {args.src} -> {out}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxinfer`` command; user errors print one line and exit 2."""
    args = _parser().parse_args(argv)
    try:
        if hasattr(args, "perf_handler"):
            args.perf_handler(args)
            return 0
        {"generate": _generate, "chat": _chat, "convert": _convert,
         "serve": _serve}[args.command](args)
    except JaxinferError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
