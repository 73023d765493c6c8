"""Save/restore the params pytree with orbax-checkpoint, and the "converted" folder format.

A converted folder (one of the inputs ``jaxinfer.load_model`` accepts) holds::

    jaxinfer_converted.json   marker + format version
    config.json               LlamaConfig.to_hf_dict()
    params/                   orbax checkpoint of the params pytree
    params.params_manifest.json   leaf shapes and dtypes (see below)
    tokenizer.json, tokenizer_config.json (or tokenizer.model)   Tokenizer.save()

We keep our own manifest of leaf shapes/dtypes instead of reading orbax's metadata because the
metadata API changed shape across orbax releases; the manifest lets us build the restore target
(``jax.ShapeDtypeStruct`` with a sharding) the same way on every version.

Quantized weights (``jaxinfer.quantize.QuantizedWeight``, ``jaxinfer convert --quantize``) are
saved as their arrays (``layers/wq/q``, ``layers/wq/scale``, ``layers/wq/zero``, a row order
``layers/wq/perm``) and a manifest entry ``layers/wq`` with their kind, group and output axes;
restoring rebuilds them, each array in the weight's sharding.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from checkpoints.hf import iter_leaves
from jaxinfer.config import LlamaConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.quantize import QuantizedWeight

if TYPE_CHECKING:
    from jaxinfer.tokenizer import Tokenizer

MANIFEST = "params_manifest.json"
MARKER = "jaxinfer_converted.json"
FORMAT_VERSION = 1


def _manifest_path(path: Path) -> Path:
    return path.parent / f"{path.name}.{MANIFEST}"


def _set_leaf(tree: dict[str, Any], name: str, value: Any) -> None:
    *parents, leaf = name.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def save_params(path: str | Path, params: dict[str, Any], overwrite: bool = False) -> None:
    """Write the params pytree (numpy or jax arrays, any dtype/sharding) as an orbax checkpoint.

    Args:
      path: checkpoint directory to create (a sibling ``<name>.params_manifest.json`` records
        every leaf's shape and dtype).
      params: nested dict of arrays and ``QuantizedWeight``.
      overwrite: replace an existing checkpoint at ``path`` instead of raising.
    """
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().resolve()
    if path.exists():
        if not overwrite:
            raise CheckpointError(f"{path} already exists; delete it or pass overwrite=True")
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {}
    arrays: dict[str, Any] = {}  # params with each quantized weight as a dict of its arrays
    for name, a in iter_leaves(params):
        if isinstance(a, QuantizedWeight):
            if a.in_last:  # model.fp8_input_last: an execution layout, not a stored one
                raise CheckpointError(f"{name} is in an execution layout (fp8 with its input "
                                      "axis last); save the params load_model read, before "
                                      "apply_layout")
            manifest[name] = {"quantized": {"kind": a.kind, "group": a.group,
                                            "out_axes": a.out_axes}}
            parts = {k: x for k, x in (("q", a.q), ("scale", a.scale), ("zero", a.zero),
                                       ("perm", a.perm)) if x is not None}
            for part, x in parts.items():
                manifest[f"{name}/{part}"] = {"shape": list(np.shape(x)), "dtype": str(x.dtype)}
                _set_leaf(arrays, f"{name}/{part}", x)
        else:
            manifest[name] = {"shape": list(np.shape(a)), "dtype": str(a.dtype)}
            _set_leaf(arrays, name, a)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(path, arrays)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    _manifest_path(path).write_text(json.dumps(manifest, indent=1))


def restore_params(path: str | Path, shardings: Any = None) -> dict[str, Any]:
    """Restore a params pytree written by ``save_params`` as ``jax.Array`` leaves.

    Args:
      path: the checkpoint directory.
      shardings: ``None`` (every leaf on this process's first device), one
        ``jax.sharding.Sharding``
        for all leaves, or a pytree of shardings with the same structure as params; each leaf is
        read straight into its sharding (no full host copy per device).

    Returns:
      The params pytree of ``jax.Array`` (and ``QuantizedWeight`` of them) with the saved
      shapes and dtypes.
    """
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().resolve()
    mpath = _manifest_path(path)
    if not path.is_dir() or not mpath.is_file():
        raise CheckpointError(f"no jaxinfer params checkpoint at {path} (needs the directory and "
                              f"{mpath.name}); run 'jaxinfer convert' again")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath} is corrupt ({e}); run 'jaxinfer convert' again") from None
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target: dict[str, Any] = {}
    for name, info in manifest.items():
        if "quantized" in info:
            continue  # its arrays have entries of their own
        if shardings is None:
            sharding = default
        elif isinstance(shardings, jax.sharding.Sharding):
            sharding = shardings
        else:
            sharding = shardings
            for part in name.split("/"):
                if isinstance(sharding, jax.sharding.Sharding):
                    break  # a quantized weight's arrays take the weight's sharding
                if not isinstance(sharding, dict) or part not in sharding:
                    raise CheckpointError(f"shardings pytree has no entry for param {name!r}; "
                                          "it must match the params structure")
                sharding = sharding[part]
        _set_leaf(target, name, jax.ShapeDtypeStruct(tuple(info["shape"]),
                                                     jnp.dtype(info["dtype"]), sharding=sharding))
    ckptr = ocp.StandardCheckpointer()
    try:
        params = ckptr.restore(path, target)
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types on bad data
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot restore params from {path} ({msg}); the checkpoint is "
                              "corrupt or incomplete, run 'jaxinfer convert' again") from None
    finally:
        ckptr.close()
    for name, info in manifest.items():
        if "quantized" in info:
            *parents, leaf = name.split("/")
            tree = params
            for p in parents:
                tree = tree[p]
            tree[leaf] = QuantizedWeight(**tree[leaf], **info["quantized"])
    return params


def save_converted(directory: str | Path, config: LlamaConfig, params: dict[str, Any],
                   tokenizer: Tokenizer, overwrite: bool = False) -> Path:
    """Write a converted model folder: config.json, orbax params, tokenizer files, marker.

    The marker is written last, so a folder interrupted mid-conversion is never taken as valid.
    Returns the folder path.
    """
    directory = Path(directory).expanduser().resolve()
    if (directory / MARKER).exists() and not overwrite:
        raise CheckpointError(f"{directory} already holds a converted model; delete it or pass "
                              "overwrite=True")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).unlink(missing_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=1))
    save_params(directory / "params", params, overwrite=True)
    tokenizer.save(directory)
    (directory / MARKER).write_text(json.dumps({"format": "jaxinfer-converted",
                                                "version": FORMAT_VERSION}))
    return directory


def is_converted_dir(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``save_converted``."""
    return (Path(path) / MARKER).is_file()


def load_converted(directory: str | Path, shardings: Any = None
                   ) -> tuple[LlamaConfig, dict[str, Any], Tokenizer]:
    """Read a folder written by ``save_converted``.

    Returns ``(config, params, tokenizer)``; params leaves are ``jax.Array`` placed on
    ``shardings`` (see ``restore_params``).
    """
    from jaxinfer.tokenizer import Tokenizer

    directory = Path(directory).expanduser().resolve()
    if not is_converted_dir(directory):
        raise CheckpointError(f"{directory} is not a converted jaxinfer model folder (no {MARKER});"
                              " create it with 'jaxinfer convert SRC DST'")
    config = LlamaConfig.from_json_file(directory / "config.json")
    params = restore_params(directory / "params", shardings)
    return config, params, Tokenizer.from_pretrained_dir(directory)
