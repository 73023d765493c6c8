"""``jaxinfer.xla_flags``: process-wide XLA flags added to ``XLA_FLAGS`` at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jaxinfer import xla_flags

FLAG = "xla_gpu_unsupported_use_all_reduce_one_shot_kernel"


def test_adds_missing_flags_after_the_users_own():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert xla_flags.apply_defaults(env) == [f"--{FLAG}=false"]
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 --{FLAG}=false"
    assert xla_flags.apply_defaults(env) == []  # already there: nothing added twice
    assert env["XLA_FLAGS"].count(FLAG) == 1
    empty: dict[str, str] = {}
    xla_flags.apply_defaults(empty)
    assert empty == {"XLA_FLAGS": f"--{FLAG}=false"}


def test_keeps_a_value_the_user_set():
    for given in (f"--{FLAG}=true", f"-{FLAG}=true --xla_dump_to=/tmp/x"):
        env = {"XLA_FLAGS": given}
        assert xla_flags.apply_defaults(env) == []
        assert env["XLA_FLAGS"] == given


def test_importing_jaxinfer_sets_the_flags_before_jax_starts():
    # A fresh process: the flags are in the environment once jaxinfer is imported, and the
    # backend that starts afterwards accepts them (an unknown flag would abort XLA).
    code = ("import os, jaxinfer, jax.numpy as jnp; "
            "print(os.environ['XLA_FLAGS']); print(float(jnp.ones(3).sum()))")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    flags, total = out.stdout.split("\n")[:2]
    assert flags == f"--xla_force_host_platform_device_count=2 --{FLAG}=false"
    assert total == "3.0"
