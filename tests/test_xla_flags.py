"""``jaxinfer.xla_flags``: process-wide XLA flags added to ``XLA_FLAGS`` at import."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

from jaxinfer import xla_flags

FLAG = "xla_gpu_unsupported_use_all_reduce_one_shot_kernel"


def test_adds_missing_flags_after_the_users_own():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert xla_flags.apply_defaults(env, cuda=True) == [f"--{FLAG}=false"]
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 --{FLAG}=false"
    assert xla_flags.apply_defaults(env, cuda=True) == []  # there already: not added twice
    assert env["XLA_FLAGS"].count(FLAG) == 1
    empty: dict[str, str] = {}
    xla_flags.apply_defaults(empty, cuda=True)
    assert empty == {"XLA_FLAGS": f"--{FLAG}=false"}


def test_keeps_a_value_the_user_set():
    # "--flag" alone reads as true; a value not starting with "-" names a flags file
    for given in (f"--{FLAG}=true", f"--xla_dump_to=/tmp/x --{FLAG}", "/etc/xla_flags.txt"):
        env = {"XLA_FLAGS": given}
        assert xla_flags.apply_defaults(env, cuda=True) == []
        assert env["XLA_FLAGS"] == given


def test_gpu_flags_only_where_jax_can_use_a_cuda_gpu(monkeypatch):
    env: dict[str, str] = {}
    assert xla_flags.apply_defaults(env, cuda=False) == [] and env == {}
    # JAX_PLATFORMS without cuda/gpu rules a CUDA backend out, whatever is installed.
    for platforms, allowed in (("cpu", False), ("tpu", False), ("cuda", True),
                               ("gpu,cpu", True), ("cpu, cuda", True)):
        monkeypatch.setattr(xla_flags.pkgutil, "iter_modules",
                            lambda: [types.SimpleNamespace(name="jax_cuda12_plugin")])
        assert xla_flags.cuda_possible({"JAX_PLATFORMS": platforms}) is allowed
    assert xla_flags.cuda_possible({}) is True
    monkeypatch.setattr(xla_flags.pkgutil, "iter_modules",
                        lambda: [types.SimpleNamespace(name="jaxlib")])
    assert xla_flags.cuda_possible({}) is False  # no CUDA plugin installed


def test_importing_jaxinfer_adds_them(tmp_path):
    # A fresh process where JAX could use CUDA (a stand-in plugin package, JAX_PLATFORMS
    # cuda): the flags are in the environment once jaxinfer is imported, no backend started.
    (tmp_path / "jax_cuda12_plugin").mkdir()
    (tmp_path / "jax_cuda12_plugin" / "__init__.py").write_text("")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_dump_to=/tmp/x",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    code = "import os, jaxinfer; print(os.environ['XLA_FLAGS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=root)
    assert out.stdout.strip() == f"--xla_dump_to=/tmp/x --{FLAG}=false"


def test_the_flags_parse():
    # jaxlib parses XLA_FLAGS the same way on every platform (an unknown flag would abort
    # the process), so a CPU backend starting with them shows they are well formed.
    code = "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": " ".join(f"--{k}={v}" for k, v in xla_flags.DEFAULTS.items())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "3.0"
