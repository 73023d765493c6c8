"""``jaxinfer chat``: the loop's history handling (fake model) and a real session in a pty."""

from __future__ import annotations

import importlib
import io
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jaxinfer.cli import CHAT_PROMPT, chat_session
from jaxinfer.errors import InputError


class _FakeStream:
    """Stands in for ``jaxinfer.stream``: records each call's messages, replies in two pieces."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict[str, str]], dict[str, Any]]] = []

    def __call__(self, model: Any, messages: Any, **options: Any) -> Iterator[str]:
        self.calls.append(([dict(m) for m in messages], options))
        last = messages[-1]["content"]
        if last == "boom":
            raise InputError("prompt too long")
        yield "echo: "
        yield last


def _run(lines: list[str], monkeypatch: pytest.MonkeyPatch, **kwargs: Any
         ) -> tuple[_FakeStream, str]:
    fake = _FakeStream()
    # jaxinfer.generate (the attribute) is the function; patch the module itself.
    monkeypatch.setattr(importlib.import_module("jaxinfer.generate"), "stream", fake)
    feed = iter(lines)

    def read_line(prompt: str) -> str:
        assert prompt == CHAT_PROMPT
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    chat_session(object(), {"max_new_tokens": 4, "seed": 7}, read_line, out, **kwargs)
    return fake, out.getvalue()


def test_history_reset_commands_and_errors(monkeypatch, capsys):
    fake, out = _run(["hi", "", "again", "/nope", "boom", "/reset", "fresh", "/exit", "never"],
                     monkeypatch, system="be brief")
    sent = [msgs for msgs, _ in fake.calls]
    assert sent[0] == [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "hi"}]
    assert sent[1][1:] == [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "echo: hi"},
                           {"role": "user", "content": "again"}]
    # The failed turn is dropped, so /reset leaves only the system message before "fresh".
    assert sent[3] == [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "fresh"}]
    assert len(sent) == 4  # nothing after /exit
    # A seed is offset per successful turn so replies do not reuse the same random draws.
    assert [opts["seed"] for _, opts in fake.calls] == [7, 8, 9, 9]
    assert out.splitlines() == ["echo: hi", "echo: again", "echo: fresh"]
    err = capsys.readouterr().err
    assert "unknown command '/nope'" in err and "prompt too long" in err and "cleared" in err


def test_end_of_input_leaves_cleanly(monkeypatch):
    fake, out = _run(["hello"], monkeypatch)
    assert len(fake.calls) == 1 and out == "echo: hello\n\n"


def _read_until(fd: int, buf: bytearray, needle: bytes, count: int, timeout: float) -> str:
    """Read from ``fd`` into ``buf`` until ``needle`` occurs ``count`` times."""
    deadline = time.monotonic() + timeout
    while buf.count(needle) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {needle!r} #{count}; got {bytes(buf)!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"chat exited early; output: {bytes(buf)!r}")
            buf.extend(chunk)
    return buf.decode("utf-8", "replace")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")
def test_chat_in_a_terminal_remembers_the_conversation(tmp_path):
    """Two turns with the default model in a pseudo-terminal; turn 2 needs turn 1's name."""
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, JAX_PLATFORMS="cpu", TERM="dumb")
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxinfer.cli", "chat", "--max-new-tokens", "16",
             "--dtype", "float32"],
            stdin=slave, stdout=slave, stderr=err, env=env, close_fds=True)
    os.close(slave)
    buf = bytearray()
    prompt = CHAT_PROMPT.encode()
    try:
        _read_until(master, buf, prompt, 1, 300)
        os.write(master, b"Hi! My name is Zorblax. Please remember it.\n")
        _read_until(master, buf, prompt, 2, 300)
        os.write(master, b"What is my name?\n")
        text = _read_until(master, buf, prompt, 3, 300)
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0, err_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    second_reply = text.split("What is my name?", 1)[1].rsplit(CHAT_PROMPT, 1)[0]
    assert "Zorblax" in second_reply, text
