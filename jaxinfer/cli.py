"""Command line: ``jaxinfer generate``, ``jaxinfer convert``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxinfer.errors import JaxinferError


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


def sampling_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The ``generate`` keyword arguments named by ``add_sampling_args`` flags."""
    return {
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty, "seed": args.seed,
        "stop": tuple(args.stop),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxinfer", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--backend", default="auto", choices=["auto", "reference", "pallas"])
    add_sampling_args(g)
    c = sub.add_parser("convert", help="convert a GGUF/HF checkpoint to a jaxinfer folder")
    c.add_argument("src")
    c.add_argument("dst")
    return p


def _generate(args: argparse.Namespace) -> None:
    from jaxinfer.generate import stream
    from jaxinfer.loading import load_model
    from jaxinfer.sampling import SamplingParams

    options = sampling_kwargs(args)
    SamplingParams.from_kwargs(**options)  # reject bad values before loading the model
    model = load_model(args.model, dtype=args.dtype, backend=args.backend)
    for piece in stream(model, args.prompt, chat=args.chat, **options):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _convert(args: argparse.Namespace) -> None:
    from jaxinfer.loading import convert

    out = convert(args.src, args.dst)
    print(f"converted {args.src} -> {out}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxinfer`` command; user errors print one line and exit 2."""
    args = _parser().parse_args(argv)
    try:
        {"generate": _generate, "convert": _convert}[args.command](args)
    except JaxinferError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
