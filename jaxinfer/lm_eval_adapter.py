"""An lm-evaluation-harness model: ``--model jaxinfer`` (needs ``pip install lm-eval``).

Importing this module registers ``JaxinferLM`` under the name ``jaxinfer`` in lm_eval's
model registry. The ``lm_eval`` command itself loads no plugins, so run the harness through
this module, which registers the model and then hands its arguments to lm_eval's CLI::

    python -m jaxinfer.lm_eval_adapter --model jaxinfer \\
        --model_args pretrained=smollm2-135m-instruct,dtype=float32 --tasks hellaswag

or from Python: ``import jaxinfer.lm_eval_adapter`` then
``lm_eval.simple_evaluate(model="jaxinfer", model_args=...)``.

The three request types run through the engine: ``loglikelihood`` through ``jaxinfer.score``
(one batch; contexts shared by several continuations are computed once),
``loglikelihood_rolling`` through ``jaxinfer.score_rolling`` and ``generate_until`` through
``jaxinfer.generate`` with the task's ``until`` strings as stop strings.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from jaxinfer.errors import InputError
from jaxinfer.generate import generate, score, score_rolling
from jaxinfer.loading import load_model
from jaxinfer.requests import Model
from jaxinfer.sampling import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256
"""``max_gen_toks`` of a ``generate_until`` request that does not set it (lm_eval's)."""


@register_model("jaxinfer")
class JaxinferLM(LM):
    """lm_eval's ``LM`` interface over a jaxinfer model and its engine.

    Model arguments (``--model_args key=value,...``):
      pretrained: a model name, checkpoint or converted folder (``load_model``), or a loaded
        ``jaxinfer.Model`` (``simple_evaluate(model_args={"pretrained": model})``).
      dtype, backend, quantize, kv_cache_dtype: passed to ``load_model`` (default
        bfloat16, auto, none, none).
      tp, dp: tensor- and data-parallel devices (``sharding.make_mesh``), default 1.

    lm_eval's ``batch_size``, ``max_batch_size`` and ``device`` are accepted and have no
    effect: the engine batches all of a call's requests itself, on JAX's devices.
    """

    def __init__(self, pretrained: str | Model, dtype: str = "bfloat16",
                 backend: str = "auto", quantize: str | None = None,
                 kv_cache_dtype: str | None = None, tp: int = 1, dp: int = 1,
                 batch_size: Any = None, max_batch_size: Any = None, device: Any = None
                 ) -> None:
        super().__init__()
        if isinstance(pretrained, Model):
            self.model = pretrained
        else:
            mesh = None
            if tp != 1 or dp != 1:
                from sharding import make_mesh

                mesh = make_mesh(data=dp, model=tp)
            self.model = load_model(str(pretrained), dtype=dtype, backend=backend,
                                    quantize=quantize, kv_cache_dtype=kv_cache_dtype,
                                    mesh=mesh)
        tok = self.model.tokenizer
        if tok is None:
            raise InputError("lm_eval passes text; the model needs a tokenizer")
        # What an empty context and a rolling window's first token are conditioned on.
        self.prefix_id = tok.bos_id if tok.bos_id is not None else tok.eos_ids[0]

    @property
    def tokenizer_name(self) -> str:
        """A name for lm_eval's request cache."""
        return (self.model.name or "jaxinfer").replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The model's chat template over lm_eval's messages (``--apply_chat_template``)."""
        return self.model.tokenizer.apply_chat_template(
            chat_history, add_generation_prompt=add_generation_prompt)

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy)`` per ``(context, continuation)``.

        Trailing spaces of a context move to the front of its continuation (how lm_eval's
        own models split the text); an empty context is the BOS token (or EOS without one).
        """
        pairs: list[tuple[Any, str]] = []
        for r in requests:
            context, continuation = r.args
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            pairs.append((context if context else [self.prefix_id], continuation))
        if not pairs:
            return []
        out = []
        for r, result in zip(requests, score(self.model, pairs), strict=True):
            if result.error is not None:
                raise RuntimeError(f"scoring failed: {result.error}")
            out.append((result.logprob, result.greedy))
            self.cache_hook.add_partial("loglikelihood", r.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        """Log-likelihood of each whole text, conditioned on the BOS token (or EOS),
        through ``score_rolling``'s overlapping windows of the model's context."""
        out = []
        for r in requests:
            (text,) = r.args
            ids = [self.prefix_id, *self.model.tokenizer.encode(text, add_bos=False)]
            result = score_rolling(self.model, ids)
            out.append(result.logprob)
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, result.logprob)
        return out

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """One completion per ``(context, gen_kwargs)``, all in one ``generate`` batch.

        ``gen_kwargs``: ``until`` (stop strings), ``max_gen_toks`` (default 256),
        ``do_sample`` / ``temperature`` / ``top_p`` / ``top_k`` / ``seed``; other keys are
        refused. A context too long for ``max_gen_toks`` more tokens loses its oldest tokens
        (lm_eval's convention), which is reported on stderr.
        """
        if not requests:
            return []
        tok = self.model.tokenizer
        context_len = self.model.config.max_position_embeddings
        prompts, sampling, cut = [], [], 0
        for r in requests:
            context, kwargs = r.args
            sp = self._sampling(dict(kwargs))
            ids = tok.encode(context)
            room = context_len - sp.max_new_tokens
            if room < 1:
                raise InputError(f"max_gen_toks={sp.max_new_tokens} leaves no room for a "
                                 f"prompt in the model's context of {context_len}")
            if len(ids) > room:
                ids, cut = ids[-room:], cut + 1
            prompts.append(ids)
            sampling.append(sp)
        if cut:
            print(f"jaxinfer lm_eval: {cut} of {len(requests)} contexts kept only their last "
                  "tokens to leave room for max_gen_toks", file=sys.stderr)
        out = []
        for r, c in zip(requests, generate(self.model, prompts, sampling=sampling),
                        strict=True):
            if c.error is not None:
                raise RuntimeError(f"generation failed: {c.error}")
            out.append(c.text)
            self.cache_hook.add_partial("generate_until", r.args, c.text)
        return out

    @staticmethod
    def _sampling(kwargs: dict[str, Any]) -> SamplingParams:
        """``SamplingParams`` from lm_eval's ``gen_kwargs`` (greedy unless ``do_sample``)."""
        until = kwargs.pop("until", None) or ()
        stop = (until,) if isinstance(until, str) else tuple(until)
        max_new = kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS)
        do_sample = kwargs.pop("do_sample", False)
        temperature = kwargs.pop("temperature", 1.0 if do_sample else 0.0)
        options: dict[str, Any] = dict(max_new_tokens=max_new, stop=stop,
                                       temperature=temperature if do_sample else 0.0)
        for name in ("top_p", "top_k", "seed"):
            if name in kwargs:
                options[name] = kwargs.pop(name)
        if kwargs:
            raise InputError(f"generation options {sorted(kwargs)} are not supported by the "
                             "jaxinfer lm_eval model")
        return SamplingParams(**options)


def main() -> None:
    """``python -m jaxinfer.lm_eval_adapter ARGS``: lm_eval's CLI with ``jaxinfer``
    registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
