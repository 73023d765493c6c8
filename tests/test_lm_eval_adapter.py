"""jaxinfer.lm_eval_adapter: lm-evaluation-harness on a tiny local task, offline.

The tasks (multiple choice, rolling perplexity, generation) are YAML + JSONL files written in
the test's folder; the harness's log-likelihoods must equal ``jaxinfer.score``'s and its
generations ``jaxinfer.generate``'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import jaxinfer
from jaxinfer.engine import Engine

lm_eval = pytest.importorskip("lm_eval")

SIZES = dict(num_pages=96, page_size=8, max_batch=8, max_tokens_per_step=16, verbose=False)
DOCS = [{"question": "Is the sea wet?", "choices": ["yes", "no"], "answer": 0},
        {"question": "Two plus two?", "choices": ["four", "five", "six"], "answer": 0},
        {"question": "Colour of snow?", "choices": ["white", "black"], "answer": 1}]
TEXTS = [{"text": "The cat sat on the mat. " * 3}, {"text": "Hello world"}]


def write_tasks(folder: Path) -> None:
    """Three tasks over local JSONL files (no downloads)."""
    (folder / "qa.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "texts.jsonl").write_text("".join(json.dumps(d) + "\n" for d in TEXTS))
    common = "dataset_path: json\ntest_split: train\n"
    (folder / "tiny_choice.yaml").write_text(
        "task: tiny_choice\n" + common
        + f"dataset_kwargs:\n  data_files: {folder / 'qa.jsonl'}\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n" + common
        + f"dataset_kwargs:\n  data_files: {folder / 'texts.jsonl'}\n"
        "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\n"
        "doc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common
        + f"dataset_kwargs:\n  data_files: {folder / 'qa.jsonl'}\n"
        "output_type: generate_until\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\n"
        "doc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: [\"\\n\", \"Q:\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from sharding.testing import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("lm_eval") / "model")
    m = jaxinfer.load_model(folder, dtype="float32", backend="reference")
    m.engine = Engine(m, **SIZES)  # small: few step programs to compile
    return m


@pytest.mark.slow  # importing lm_eval and compiling the step programs: ~20-35 s on CPU
def test_harness_results_equal_jaxinfer(model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    import jaxinfer.lm_eval_adapter  # noqa: F401 - registers "jaxinfer"

    write_tasks(tmp_path)
    out = lm_eval.simple_evaluate(
        model="jaxinfer", model_args={"pretrained": model},
        tasks=["tiny_choice", "tiny_ppl", "tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True)
    samples = out["samples"]

    # Multiple choice: each choice's (log-likelihood, greedy) is jaxinfer.score's.
    for s in samples["tiny_choice"]:
        doc = s["doc"]
        context = f"Q: {doc['question']}\nA:"
        want = jaxinfer.score(model, [(context, " " + c) for c in doc["choices"]])
        got = [r[0] for r in s["resps"]]
        assert [g[0] for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
        assert [g[1] for g in got] == [w.greedy for w in want]
    assert len(samples["tiny_choice"]) == len(DOCS)

    # Rolling log-likelihood: score_rolling of BOS + the text.
    tok = model.tokenizer
    for s in samples["tiny_ppl"]:
        ids = [tok.bos_id, *tok.encode(s["doc"]["text"], add_bos=False)]
        assert s["resps"][0][0] == pytest.approx(jaxinfer.score_rolling(model, ids).logprob,
                                                 abs=1e-4)

    # Generation stops at the task's `until` strings, as generate with those stop strings.
    for s in samples["tiny_gen"]:
        context = f"Q: {s['doc']['question']}\nA:"
        (want,) = jaxinfer.generate(model, context, max_new_tokens=8, stop=["\n", "Q:"])
        assert s["resps"][0][0] == want.text
    assert "acc,none" in out["results"]["tiny_choice"]


def test_command_line_registers_the_model(model, tmp_path, monkeypatch):
    """``python -m jaxinfer.lm_eval_adapter --model jaxinfer --model_args pretrained=...``:
    lm_eval's CLI with the model registered (load_model replaced by the loaded model)."""
    from jaxinfer import lm_eval_adapter

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path)
    loaded = []

    def fake_load(path, **kwargs):
        loaded.append((path, kwargs))
        return model

    monkeypatch.setattr(lm_eval_adapter, "load_model", fake_load)

    class LocalTasksOnly(lm_eval.tasks.TaskManager):
        """The CLI's task index without lm_eval's ~26k built-in task files (~30 s)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasksOnly)
    monkeypatch.setattr(sys, "argv", [
        "lm_eval", "--model", "jaxinfer", "--model_args",
        "pretrained=some/folder,dtype=float32,backend=reference", "--tasks", "tiny_choice",
        "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out")])
    lm_eval_adapter.main()
    assert loaded == [("some/folder", dict(dtype="float32", backend="reference",
                                           quantize=None, mesh=None))]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    assert "tiny_choice" in json.loads(result.read_text())["results"]


def test_unsupported_generation_options_are_refused(model):
    from jaxinfer.errors import InputError
    from jaxinfer.lm_eval_adapter import JaxinferLM

    lm = JaxinferLM(pretrained=model)

    class Req:
        args = ("Q: x\nA:", {"until": ["\n"], "num_beams": 4})

    with pytest.raises(InputError, match="num_beams"):
        lm.generate_until([Req()])
