"""Roofline planner: memory, bytes, FLOPs and the time floor of decode and prefill.

The two numbers of every phase are the bytes it must move through device memory and the
floating-point operations it must do; over the device's bandwidth and matmul rate they give
two times, and the larger is the floor (the phase is *memory-bound* or *compute-bound*).

Formulas (``bytes`` = bytes per element of weights and cache, 2 for bf16):

* KV cache per sequence of ``S`` positions: ``S * kv_heads * layers * head_dim * 2 * bytes``
  (the 2 is K and V).
* Device memory for a batch: ``B * KV(S) + params * bytes`` (activations are small beside
  these in decode and are ignored).
* Bytes read by one decode step: every weight matrix once (the embedding table only when it
  doubles as the LM head: an untied table is gathered ``B`` rows at a time) plus the live
  part of every sequence's cache, ``B * KV(S)``. This is "weights + KV actually read", the
  numerator of MBU.
* FLOPs of one decode step: ``2 * B * matmul_params`` (every weight is one multiply-add per
  token) plus attention, ``4 * B * S * layers * heads * head_dim`` (scores and values).
* Prefill of ``T`` tokens: ``2 * B * T * layer_params`` plus causal attention
  ``2 * B * T^2 * layers * heads * head_dim`` (half of the full square) plus the LM head
  on one token per sequence; bytes: the weights once plus the K/V written.
* Quantized weights or K/V (``jaxinfer plan --quantize``, ``--kv-cache-dtype``): the plan
  counts the bytes they take as stored, scales included (``Storage``); FLOPs do not change.
* Decode latency = max(bytes / bandwidth, FLOPs / rate); throughput = ``B / latency``.
  Arithmetic intensity = FLOPs / bytes; above the device's ridge point (rate / bandwidth)
  a phase is compute-bound.

The benchmark harness (``scripts/bench.py``) uses the same functions with the *measured*
ceilings in place of the datasheet ones to report MBU and MFU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Datasheet ceilings of one accelerator (dense bf16 matmul rate, no sparsity)."""

    name: str
    bandwidth: float  # device-memory bytes per second
    flops: float  # dense bf16 FLOP per second
    memory: float  # device-memory bytes

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a phase is compute-bound on this device."""
        return self.flops / self.bandwidth


# Datasheet values (decimal units: 1 TB/s = 1e12 B/s, 1 GB = 1e9 B).
DEVICES: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec("A100 40GB SXM", 1.555e12, 312e12, 40e9),
    "a100-80gb": DeviceSpec("A100 80GB SXM", 2.039e12, 312e12, 80e9),
    "h100": DeviceSpec("H100 80GB SXM", 3.35e12, 989e12, 80e9),
    "h200": DeviceSpec("H200 141GB SXM", 4.8e12, 989e12, 141e9),
    "a10": DeviceSpec("A10 24GB", 0.6e12, 125e12, 24e9),
    "tpu-v5e": DeviceSpec("TPU v5e", 0.819e12, 197e12, 16e9),
    "tpu-v5p": DeviceSpec("TPU v5p", 2.765e12, 459e12, 95e9),
}


def device_spec(name: str, *, bandwidth: float | None = None, flops: float | None = None,
                memory: float | None = None) -> DeviceSpec:
    """A preset from ``DEVICES`` (or ``"custom"``), with any of its values overridden."""
    key = name.lower()
    if key == "custom":
        if bandwidth is None or flops is None or memory is None:
            raise InputError("device 'custom' needs --bandwidth, --flops and --memory")
        return DeviceSpec("custom", bandwidth, flops, memory)
    if key not in DEVICES:
        raise InputError(f"unknown device {name!r}; known: {', '.join(DEVICES)} or 'custom'")
    base = DEVICES[key]
    return dataclasses.replace(
        base,
        bandwidth=base.bandwidth if bandwidth is None else bandwidth,
        flops=base.flops if flops is None else flops,
        memory=base.memory if memory is None else memory,
    )


# --------------------------------------------------------------------------- model counts


def kv_bytes_per_seq(config: LlamaConfig, context: int, dtype_bytes: int = 2) -> int:
    """K and V bytes of one sequence holding ``context`` positions (all layers)."""
    c = config
    return context * c.num_kv_heads * c.num_layers * c.head_dim * 2 * dtype_bytes


def param_bytes(config: LlamaConfig, dtype_bytes: int = 2) -> int:
    """Bytes of all parameters (tied embeddings counted once)."""
    return config.num_params() * dtype_bytes


def layer_matmul_params(config: LlamaConfig) -> int:
    """Weights of the per-layer matrices (Q, K, V, O, gate, up, down), all layers."""
    c = config
    qkv = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    o = c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (qkv + o + mlp)


def weight_bytes_per_step(config: LlamaConfig, dtype_bytes: int = 2) -> int:
    """Weight bytes one decode step reads: all but an untied embedding table.

    An untied table is only gathered (B rows, negligible); a tied one is read in full as
    the LM head.
    """
    untied_embed = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return (config.num_params() - untied_embed) * dtype_bytes


DTYPE_NAMES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}
"""The dtype a plan's ``dtype_bytes`` stands for (``jaxinfer plan --dtype-bytes``)."""


@dataclasses.dataclass(frozen=True)
class Storage:
    """What a model's weights and K/V take in device memory, in bytes: what a plan's memory
    and read floors count (``Storage.of`` for weights and cache of one element size;
    ``jaxinfer plan`` measures quantized ones from their stored shapes)."""

    params: int  # every weight as stored
    step_weights: int  # what one decode step reads of them (``weight_bytes_per_step``)
    kv_per_position: int  # K and V of one cached position, all layers
    label: str = "bfloat16"  # how they are stored, for the plan's report

    @classmethod
    def of(cls, config: LlamaConfig, dtype_bytes: int = 2) -> Storage:
        """Weights and K/V at ``dtype_bytes`` bytes per element (a key of ``DTYPE_NAMES``)."""
        return cls(param_bytes(config, dtype_bytes), weight_bytes_per_step(config, dtype_bytes),
                   kv_bytes_per_seq(config, 1, dtype_bytes), DTYPE_NAMES[dtype_bytes])

    def step_bytes(self, batch: int, positions: int) -> int:
        """Bytes of a step over ``batch`` sequences of ``positions`` K/V positions each: the
        weights once plus that K/V (read by decode, written by prefill)."""
        return self.step_weights + batch * positions * self.kv_per_position


def _attention_flops_per_key(config: LlamaConfig) -> int:
    # QK^T and PV: 2 FLOPs each per (query head, key, dim), every layer.
    c = config
    return 4 * c.num_layers * c.num_heads * c.head_dim


# --------------------------------------------------------------------------- phases


@dataclasses.dataclass(frozen=True)
class PhaseEstimate:
    """The two numbers of one phase and the floor they give on a device."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def time_s(self) -> float:
        """The floor: the larger of the compute and memory times."""
        return max(self.compute_s, self.memory_s)

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte."""
        return self.flops / self.bytes

    @property
    def bound(self) -> Literal["compute", "memory"]:
        """Which ceiling sets the floor."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


def _estimate(flops: float, nbytes: float, device: DeviceSpec) -> PhaseEstimate:
    return PhaseEstimate(flops=flops, bytes=nbytes, compute_s=flops / device.flops,
                         memory_s=nbytes / device.bandwidth)


def decode_step_flops(config: LlamaConfig, batch: int, context: int) -> int:
    """FLOPs of one decode step: ``batch`` new tokens attending to ``context`` keys each."""
    c = config
    matmul = layer_matmul_params(c) + c.vocab_size * c.hidden_size  # + LM head
    return 2 * batch * matmul + batch * context * _attention_flops_per_key(c)


def decode_step_bytes(config: LlamaConfig, batch: int, context: int,
                      dtype_bytes: int = 2) -> int:
    """Bytes one decode step must read: weights once plus each sequence's live K/V."""
    return Storage.of(config, dtype_bytes).step_bytes(batch, context)


def decode_step(config: LlamaConfig, device: DeviceSpec, batch: int, context: int,
                storage: Storage | None = None) -> PhaseEstimate:
    """The floor of one decode step at ``batch`` sequences of ``context`` cached positions,
    weights and K/V as ``storage`` says (default ``Storage.of(config)``: bf16)."""
    storage = storage or Storage.of(config)
    return _estimate(decode_step_flops(config, batch, context),
                     storage.step_bytes(batch, context), device)


def prefill_flops(config: LlamaConfig, batch: int, prompt_len: int) -> int:
    """FLOPs to prefill ``batch`` prompts of ``prompt_len`` tokens (causal attention)."""
    c = config
    t = prompt_len
    layers = 2 * batch * t * layer_matmul_params(c)
    attention = batch * (t * t // 2) * _attention_flops_per_key(c)  # half the square
    head = 2 * batch * c.vocab_size * c.hidden_size  # logits of the last token only
    return layers + attention + head


def prefill_bytes(config: LlamaConfig, batch: int, prompt_len: int, dtype_bytes: int = 2) -> int:
    """Bytes prefill must move: weights read once plus the K/V it writes."""
    return Storage.of(config, dtype_bytes).step_bytes(batch, prompt_len)


def prefill(config: LlamaConfig, device: DeviceSpec, batch: int, prompt_len: int,
            storage: Storage | None = None) -> PhaseEstimate:
    """The floor of prefilling ``batch`` prompts of ``prompt_len`` tokens (the TTFT floor),
    weights and K/V as ``storage`` says (default ``Storage.of(config)``: bf16)."""
    storage = storage or Storage.of(config)
    return _estimate(prefill_flops(config, batch, prompt_len),
                     storage.step_bytes(batch, prompt_len), device)


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One batch size of a plan."""

    batch: int
    context: int
    kv_bytes: int  # whole batch
    memory_bytes: int  # kv_bytes + params
    fits: bool
    decode: PhaseEstimate
    prefill: PhaseEstimate

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput at the floor: ``batch`` tokens per step."""
        return self.batch / self.decode.time_s


def max_batch(config: LlamaConfig, device: DeviceSpec, context: int,
              storage: Storage | None = None) -> int:
    """Largest batch whose weights plus KV cache fit in device memory (0 if none);
    ``storage`` default: ``Storage.of(config)`` (bf16)."""
    storage = storage or Storage.of(config)
    free = device.memory - storage.params
    if free <= 0:
        return 0
    return int(free // (context * storage.kv_per_position))


def plan(config: LlamaConfig, device: DeviceSpec, batches: Sequence[int], context: int,
         storage: Storage | None = None) -> list[PlanRow]:
    """Memory, decode and prefill floors for each batch size at ``context`` positions, with
    weights and K/V as ``storage`` says (default ``Storage.of(config)``: bf16)."""
    if context < 1:
        raise InputError(f"context={context} must be >= 1")
    storage = storage or Storage.of(config)
    rows = []
    for b in batches:
        if b < 1:
            raise InputError(f"batch={b} must be >= 1")
        kv = b * context * storage.kv_per_position
        mem = kv + storage.params
        rows.append(PlanRow(batch=b, context=context, kv_bytes=kv, memory_bytes=mem,
                            fits=mem <= device.memory,
                            decode=decode_step(config, device, b, context, storage),
                            prefill=prefill(config, device, b, context, storage)))
    return rows


def default_batches(limit: int) -> list[int]:
    """Powers of two from 1 to just past ``limit`` (so the table shows where memory ends)."""
    out = [1]
    while out[-1] <= max(limit, 1) and out[-1] < 4096:
        out.append(out[-1] * 2)
    return out


def format_plan(name: str, config: LlamaConfig, device: DeviceSpec, rows: list[PlanRow],
                storage: Storage | None = None) -> str:
    """The plan as a short text report (what ``jaxinfer plan`` prints); ``storage`` as the
    rows were planned with (default ``Storage.of(config)``)."""
    storage = storage or Storage.of(config)
    context = rows[0].context
    kv1 = context * storage.kv_per_position
    best = max_batch(config, device, context, storage)
    lines = [
        f"model {name} ({storage.label}): {config.num_params() / 1e9:.3f} B params = "
        f"{storage.params / 1e9:.2f} GB; KV cache "
        f"{storage.kv_per_position / 1e3:.1f} kB/token, "
        f"{kv1 / 1e9:.3f} GB per sequence of {context} tokens",
        f"device {device.name}: {device.bandwidth / 1e12:.2f} TB/s, "
        f"{device.flops / 1e12:.0f} TFLOP/s, {device.memory / 1e9:.0f} GB; ridge "
        f"{device.ridge:.0f} FLOP/byte",
        "",
        f"{'batch':>6} {'KV GB':>8} {'mem GB':>8} {'fits':>5} {'step GB':>8} {'step ms':>8} "
        f"{'tok/s':>9} {'FLOP/B':>7} {'decode':>7} {'TTFT ms':>9} {'prefill':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.batch:>6} {r.kv_bytes / 1e9:>8.2f} {r.memory_bytes / 1e9:>8.2f} "
            f"{'yes' if r.fits else 'NO':>5} {r.decode.bytes / 1e9:>8.2f} "
            f"{r.decode.time_s * 1e3:>8.3f} {r.tokens_per_s:>9.0f} {r.decode.intensity:>7.1f} "
            f"{r.decode.bound:>7} {r.prefill.time_s * 1e3:>9.1f} {r.prefill.bound:>8}")
    lines.append("")
    if best == 0:
        lines.append(f"the weights alone do not fit in {device.memory / 1e9:.0f} GB")
    else:
        lines.append(f"largest batch that fits at context {context}: {best}")
    lines.append("step = one decode step reading weights + live KV; TTFT = prefill of "
                 f"batch x {context}-token prompts; floors, not measurements")
    return "\n".join(lines)
