"""Check and time the pallas_kernels attention kernels on a GPU (run on the device machine).

Correctness first (each kernel against its float32 jnp reference on fresh random inputs,
masked cache slots / unused pages filled with NaN), then timings:

* flash attention, causal, bf16: ours (several tile configs) vs cuDNN
  (`jax.nn.dot_product_attention(implementation="cudnn")`), plain XLA and JAX's shipped
  Pallas Triton kernel (`jax.experimental.pallas.ops.gpu.attention.mha`), in TFLOP/s;
* decode attention (contiguous cache) and paged attention, bf16, 32 q / 8 kv heads,
  head_dim 128: achieved K/V bytes/s (each valid K/V byte counted once) vs JAX's
  `decode_attention.gqa` / `paged_attention.paged_attention` and a device-copy ceiling;
* paged attention with its combine against the split count (``splits``): batch 1 and 64,
  the head layouts of 8B and 70B at tp 1-4, short and long contexts, narrow and wide block
  tables;
* paged attention at batch 64 against its launch settings (``configs``): splits, pipeline
  stages and keys per block, on rows of one length and on the engine's mix of lengths;
* ragged paged attention (the engine's kernel), bf16, 32 q / 8 kv heads, head_dim 128
  and 64, page_size 16: (a) 256 decode sequences with ~1024 keys each (max_q_len 1), in
  achieved K/V bytes/s; (b) 64 decode sequences plus 2 prefill chunks of 1024 tokens on
  1024 cached keys (2112 tokens, max_q_len 1024 as the engine passes a bucket), in
  TFLOP/s of the causal work actually needed.

Timing: flash: jit, warm up, `reps` back-to-back calls, one `block_until_ready`, median
over `trials` batches. Decode/paged (microsecond kernels): 16 calls inside one jitted
program rotating over several input sets (so small caches do not sit in L2), timed as the
device kernels' own time from a profiler trace (not wall time, which adds the program's
dispatch), divided by 16. Ragged (hundreds of microseconds and up, and one input set, which
16 identical calls in one program would risk XLA merging): like flash. Results go to JSON
(`--out`) and a table on stdout.

Usage: PYTHONPATH=. python3 scripts/bench_kernels.py --out $OUT/bench.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmark import traced_kernels
from pallas_kernels import (
    decode_attention,
    decode_attention_reference,
    flash_attention,
    flash_attention_reference,
    paged_attention,
    paged_attention_reference,
    paged_decode_launch,
    ragged_attention,
    ragged_attention_reference,
)

RESULTS: dict[str, Any] = {"jax": jax.__version__, "device": str(jax.devices()[0])}


def log(msg: str) -> None:
    """Print a progress line now (the device run's log is read as it goes)."""
    print(msg, flush=True)


def rand(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Standard-normal values of ``shape``, drawn in float32 and cast to ``dtype``."""
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def time_fn(fn: Callable[..., Any], arg_sets: list[tuple], reps: int = 10,
            trials: int = 7) -> float:
    """Median seconds per call: `reps` async launches over rotating inputs, one sync."""
    out = fn(*arg_sets[0])
    jax.block_until_ready(out)
    for a in arg_sets:
        jax.block_until_ready(fn(*a))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for i in range(reps):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def time_in_jit(fn: Callable[..., Any], arg_sets: list[tuple], calls: int = 16,
                trials: int = 5) -> float:
    """Seconds of device kernels per call, over ``trials`` traced runs of one jitted program
    of ``calls`` launches of ``fn`` (``jaxinfer.benchmark.traced_kernels``).

    Inputs rotate over ``arg_sets`` so small caches are not served from L2. Kernel time, not
    wall time: a program of microsecond kernels spends tens of microseconds in its dispatch,
    which made the same paged launch read 86.4 us as the sweep's first row and 68.7 us later
    (r209). The mean over the traced runs (no median: kernel time has no dispatch
    outliers to drop)."""
    seq = [arg_sets[i % len(arg_sets)] for i in range(calls)]
    multi = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(multi(seq))
    jax.block_until_ready(multi(seq))
    events = traced_kernels(lambda: multi(seq), trials)
    if not events:
        raise RuntimeError("the profiler recorded no device kernels")
    return sum(d for _, _, d in events) / 1e9 / (trials * calls)


def max_err(a: jax.Array, b: jax.Array) -> float:
    """Largest ``|a - b|`` in float32; NaN where ``a`` holds a NaN (a kernel that read a
    masked slot or an unused page)."""
    a32 = np.asarray(a, np.float32)
    b32 = np.asarray(b, np.float32)
    if np.isnan(a32).any():
        return float("nan")
    return float(np.abs(a32 - b32).max())


# --------------------------------------------------------------------------- ceilings


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device copy (read and write counted), the ceiling the
    decode kernels' K/V rates are compared with; recorded as ``copy_bw_TBps``."""
    x = jnp.ones((1 << 30,), jnp.bfloat16)  # 2 GiB
    f = jax.jit(lambda x: x + 1)
    t = time_fn(f, [(x,)], reps=5, trials=5)
    bw = 2 * x.nbytes / t
    RESULTS["copy_bw_TBps"] = bw / 1e12
    log(f"device copy (read+write) {bw / 1e12:.2f} TB/s")
    return bw


# --------------------------------------------------------------------------- correctness


def check_correctness() -> None:
    """Each kernel (flash, decode, paged, ragged) against its float32 jnp reference on fresh
    inputs whose masked cache slots and unused pages hold NaN; the largest errors go to
    ``correctness_max_abs_err``."""
    key = jax.random.PRNGKey(1)
    errs: dict[str, float] = {}
    ks = jax.random.split(key, 16)
    # flash: GQA 4, lengths not block multiples, bf16 + f32
    for dt, d, causal in ((jnp.bfloat16, 128, True), (jnp.float32, 64, False)):
        b, s, hq, hkv = 3, 333, 8, 2
        q, k, v = rand(ks[0], (b, s, hq, d), dt), rand(ks[1], (b, s, hkv, d), dt), rand(
            ks[2], (b, s, hkv, d), dt)
        lengths = jnp.array([1, 200, 333], jnp.int32)
        o = flash_attention(q, k, v, causal=causal, lengths=lengths)
        r = flash_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                      v.astype(jnp.float32), causal=causal, lengths=lengths)
        errs[f"flash_{jnp.dtype(dt).name}_d{d}_causal{causal}"] = max_err(o, r)
    # decode: NaN past the length
    b, hq, hkv, d, max_len = 4, 32, 8, 128, 1000
    lengths = jnp.array([1, 17, 640, 1000], jnp.int32)
    valid = (jnp.arange(max_len)[None, :] < lengths[:, None])[:, None, :, None]
    q = rand(ks[3], (b, hq, d), jnp.bfloat16)
    kc = jnp.where(valid, rand(ks[4], (b, hkv, max_len, d), jnp.bfloat16), jnp.nan)
    vc = jnp.where(valid, rand(ks[5], (b, hkv, max_len, d), jnp.bfloat16), jnp.nan)
    o = decode_attention(q, kc, vc, lengths)
    r = decode_attention_reference(q.astype(jnp.float32), kc.astype(jnp.float32),
                                   vc.astype(jnp.float32), lengths)
    errs["decode_bf16"] = max_err(o, r)
    # paged: shuffled pages, unused pages NaN
    ps, pps = 16, 40
    npages = b * pps + 7
    perm = np.random.default_rng(0).permutation(npages)
    bt = jnp.asarray(perm[: b * pps].reshape(b, pps), jnp.int32)
    used = np.zeros(npages, bool)
    used[perm[: b * pps]] = True
    kp = rand(ks[6], (hkv, npages, ps, d), jnp.bfloat16)
    vp = rand(ks[7], (hkv, npages, ps, d), jnp.bfloat16)
    kp = jnp.where(jnp.asarray(used)[None, :, None, None], kp, jnp.nan)
    vp = jnp.where(jnp.asarray(used)[None, :, None, None], vp, jnp.nan)
    lengths = jnp.array([1, 100, 333, pps * ps], jnp.int32)
    o = paged_attention(q, kp, vp, bt, lengths)
    r = paged_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32),
                                  vp.astype(jnp.float32), bt, lengths)
    errs["paged_bf16"] = max_err(o, r)
    # ragged: decode tokens, an empty sequence, chunks spanning several query blocks (and
    # straddling into the next sequence), padding tokens, unused pages NaN.
    q_lens, kv_lens = (1, 0, 37, 1, 300, 1), (50, 10, 37, 700, 812, 1)
    q, kp, vp, bt, kl, cu = ragged_inputs(ks[8], q_lens, kv_lens, hq, hkv, d, 16, pad=5)
    o = ragged_attention(q, kp, vp, bt, kl, cu, max_q_len=max(q_lens))
    r = ragged_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32),
                                   vp.astype(jnp.float32), bt, kl, cu)
    errs["ragged_bf16"] = max_err(o, r)
    errs["ragged_bf16_padding_abs_max"] = float(jnp.abs(o[sum(q_lens):]).max())
    RESULTS["correctness_max_abs_err"] = errs
    for name, e in errs.items():
        log(f"check {name}: max |err| = {e:.3g}")


# --------------------------------------------------------------------------- flash


def bench_flash(quick: bool) -> None:
    """Causal bf16 flash attention: ours at several tilings against cuDNN, XLA and JAX's
    Pallas ``mha``, in TFLOP/s by sequence length (``quick``: fewer lengths)."""
    from jax.experimental.pallas.ops.gpu import attention as jax_attn

    rows = []
    key = jax.random.PRNGKey(0)
    configs = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 32, 4, 4),
               (64, 64, 4, 3)]
    if quick:
        configs = configs[:2]
    for s in (4096, 1024, 2048, 8192):
        b, h, d = 4, 32, 128
        kq, kk, kv = jax.random.split(jax.random.fold_in(key, s), 3)
        q = rand(kq, (b, s, h, d), jnp.bfloat16)
        k = rand(kk, (b, s, h, d), jnp.bfloat16)
        v = rand(kv, (b, s, h, d), jnp.bfloat16)
        flops = 4 * b * h * s * s * d / 2  # causal: half the score matrix
        scale = 1 / math.sqrt(d)

        def record(name: str, fn: Callable[..., Any], s=s, q=q, k=k, v=v, flops=flops):
            try:
                t = time_fn(fn, [(q, k, v)], reps=5, trials=5)
                rows.append({"seq": s, "impl": name, "ms": t * 1e3, "tflops": flops / t / 1e12})
                log(f"flash S={s:5d} {name:32s} {t * 1e3:8.3f} ms {flops / t / 1e12:7.1f} TFLOP/s")
            except Exception as e:  # keep going: one failing comparison must not stop the run
                log(f"flash S={s} {name} FAILED: {type(e).__name__}: {str(e)[:300]}")

        cfgs = configs if s == 4096 else configs[:1]
        for bq, bk, nw, ns in cfgs:
            f = jax.jit(lambda q, k, v, bq=bq, bk=bk, nw=nw, ns=ns: flash_attention(
                q, k, v, causal=True, block_q=bq, block_k=bk, num_warps=nw, num_stages=ns))
            record(f"ours bq{bq} bk{bk} w{nw} s{ns}", f)
        if s == 4096:
            o = flash_attention(q, k, v, causal=True)
            ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
            err = max_err(o, ref)
            RESULTS["flash_4096_err_vs_xla"] = err
            log(f"flash S=4096 ours vs XLA max |err| {err:.3g}")
        record("cudnn", jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")))
        if s <= 4096:
            record("xla", jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="xla")))
        record("jax pallas mha", jax.jit(lambda q, k, v, scale=scale: jax_attn.mha(
            q, k, v, None, sm_scale=scale, causal=True)))
        del q, k, v
    RESULTS["flash"] = rows


# --------------------------------------------------------------------------- decode


def _n_sets(bytes_per_set: int) -> int:
    # Rotate over enough input sets that the working set is well past the 50 MB L2.
    return max(1, min(8, math.ceil(256e6 / bytes_per_set)))


def bench_decode(quick: bool) -> None:
    """Decode attention over a contiguous cache and paged attention (32 q / 8 kv heads of
    128), ours against JAX's ``decode_attention.gqa`` / ``paged_attention``, in K/V bytes
    read per second by batch and context (``quick``: fewer cases)."""
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_dec
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    rows = []
    hq, hkv, d = 32, 8, 128
    key = jax.random.PRNGKey(2)
    batches = (1, 8, 64)
    ctxs = (1024, 8192, 32768)
    if quick:
        batches, ctxs = (1, 64), (1024, 32768)
    for b in batches:
        for ctx in ctxs:
            kv_bytes = 2 * b * hkv * ctx * d * 2
            nsets = _n_sets(kv_bytes)
            sets = []
            for i in range(nsets):
                k1, k2, k3 = jax.random.split(jax.random.fold_in(key, b * 100000 + ctx + i), 3)
                sets.append((rand(k1, (b, hq, d), jnp.bfloat16),
                             rand(k2, (b, hkv, ctx, d), jnp.bfloat16),
                             rand(k3, (b, hkv, ctx, d), jnp.bfloat16)))
            lengths = jnp.full((b,), ctx, jnp.int32)

            def record(name: str, fn: Callable[..., Any], arg_sets: list[tuple],
                       b=b, ctx=ctx, kv_bytes=kv_bytes):
                try:
                    t = time_in_jit(fn, arg_sets)
                    rows.append({"batch": b, "ctx": ctx, "impl": name, "us": t * 1e6,
                                 "TBps": kv_bytes / t / 1e12})
                    log(f"decode B={b:3d} ctx={ctx:6d} {name:30s} {t * 1e6:9.1f} us "
                        f"{kv_bytes / t / 1e12:6.2f} TB/s")
                except Exception as e:
                    log(f"decode B={b} ctx={ctx} {name} FAILED: {type(e).__name__}: "
                        f"{str(e)[:300]}")

            for bk, ns, nw in ((128, 3, 4), (64, 4, 4), (256, 2, 8)):
                f = jax.jit(lambda q, k, v, bk=bk, ns=ns, nw=nw, lengths=lengths:
                            decode_attention(q, k, v, lengths, block_k=bk, num_stages=ns,
                                             num_warps=nw))
                record(f"ours contig bk{bk} s{ns} w{nw}", f, sets)
            # JAX's gqa wants [batch, seq, kv_heads, d]: give it its own layout.
            jsets = [(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)) for q, k, v in sets]
            record("jax gqa", jax.jit(lambda q, k, v, lengths=lengths: jax_dec.gqa(
                q, k, v, kv_seq_len=lengths)), jsets)
            del jsets
            # Paged: same K/V scattered into a shuffled page pool.
            for ps in (16, 64):
                pps = ctx // ps
                psets = []
                for i, (q, k, v) in enumerate(sets):
                    perm = jax.random.permutation(jax.random.fold_in(key, 7 + i), b * pps)
                    bt = perm.reshape(b, pps).astype(jnp.int32)
                    inv = jnp.argsort(perm)
                    kp = jnp.transpose(k.reshape(b, hkv, pps, ps, d), (1, 0, 2, 3, 4)).reshape(
                        hkv, b * pps, ps, d)[:, inv]
                    vp = jnp.transpose(v.reshape(b, hkv, pps, ps, d), (1, 0, 2, 3, 4)).reshape(
                        hkv, b * pps, ps, d)[:, inv]
                    psets.append((q, kp, vp, bt))
                if b == batches[0] and ctx == ctxs[0]:
                    q, kp, vp, bt = psets[0]
                    err = max_err(paged_attention(q, kp, vp, bt, lengths),
                                  decode_attention_reference(
                                      q.astype(jnp.float32), sets[0][1].astype(jnp.float32),
                                      sets[0][2].astype(jnp.float32), lengths))
                    log(f"paged ps={ps} vs contiguous reference max |err| {err:.3g}")
                record(f"ours paged ps{ps}", jax.jit(
                    lambda q, kp, vp, bt, lengths=lengths: paged_attention(
                        q, kp, vp, bt, lengths)), psets)
                ks_ = 16 if pps % 16 == 0 else 1
                record(f"jax paged ps{ps}", jax.jit(
                    lambda q, kp, vp, bt, lengths=lengths, ks_=ks_: jax_paged.paged_attention(
                        q, kp, vp, bt, lengths, k_splits=ks_)), psets)
                del psets
            del sets
    RESULTS["decode"] = rows


# --------------------------------------------------------------------------- ragged


def ragged_inputs(key: jax.Array, q_lens: tuple[int, ...], kv_lens: tuple[int, ...],
                  hq: int, hkv: int, d: int, page_size: int, pad: int = 0) -> tuple:
    """Random bf16 inputs for `ragged_attention`: (q, k_pages, v_pages, tables, kv_lens, cu).

    q holds sum(q_lens) + `pad` tokens. Each sequence's keys sit in shuffled pages of one
    pool; table slots past a sequence's pages point at 4 extra NaN pages, which the
    kernel must never read.
    """
    n = len(q_lens)
    pages = [max(1, math.ceil(k / page_size)) for k in kv_lens]
    pps, used = max(pages), sum(pages)
    perm = np.random.default_rng(n).permutation(used)
    bt = np.zeros((n, pps), np.int32)
    off = 0
    for i, p in enumerate(pages):
        bt[i, :p] = perm[off:off + p]
        bt[i, p:] = used + np.arange(pps - p) % 4
        off += p
    kq, kk, kv = jax.random.split(key, 3)
    nan = jnp.full((hkv, 4, page_size, d), jnp.nan, jnp.bfloat16)
    kp = jnp.concatenate([rand(kk, (hkv, used, page_size, d), jnp.bfloat16), nan], axis=1)
    vp = jnp.concatenate([rand(kv, (hkv, used, page_size, d), jnp.bfloat16), nan], axis=1)
    q = rand(kq, (sum(q_lens) + pad, hq, d), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, kp, vp, jnp.asarray(bt), jnp.asarray(kv_lens, jnp.int32), cu


def bench_ragged(quick: bool) -> None:
    """The engine's ragged paged attention on a decode-only step (K/V bytes per second)
    and on a mixed step of decode rows and prefill chunks (TFLOP/s of the causal work), at
    head sizes 128 and 64 (``quick``: fewer tilings)."""
    rows = []
    hq, hkv, ps = 32, 8, 16
    key = jax.random.PRNGKey(3)
    rng = np.random.default_rng(3)
    # (a) 256 decode tokens, keys 896..1152 (~1024); (b) two 1024-token prefill chunks on
    # 1024 cached keys (kv_len 2048) between two runs of 32 decode tokens.
    dec = tuple(int(x) for x in rng.integers(896, 1153, size=256))
    mix_q = (1024,) + (1,) * 32 + (1024,) + (1,) * 32
    mix_kv = (2048,) + dec[:32] + (2048,) + dec[32:64]
    cases = [("decode", (1,) * 256, dec, 1), ("mixed", mix_q, mix_kv, 1024)]
    # (block_q, pages_per_block, num_warps, num_stages); with max_q_len 1 the kernel takes
    # block_q = 4 (the MIN_DOT floor at GQA 4) whatever is asked.
    configs = {"decode": [(16, 4, 4, 2), (16, 8, 4, 2), (16, 8, 4, 3), (16, 16, 8, 2)],
               "mixed": [(16, 4, 4, 2), (32, 4, 4, 2), (64, 4, 8, 2), (32, 8, 4, 3)]}
    for d in (128, 64):
        for name, q_lens, kv_lens, max_q_len in cases:
            args = ragged_inputs(jax.random.fold_in(key, d + max_q_len), q_lens, kv_lens, hq,
                                 hkv, d, ps)
            kv_bytes = 2 * sum(kv_lens) * hkv * d * 2  # K and V, each valid byte once
            # Causal work: local query i of a sequence sees kv_len - q_len + i + 1 keys.
            keys_seen = sum(q * (k - q) + q * (q + 1) // 2
                            for q, k in zip(q_lens, kv_lens, strict=True))
            flops = 4 * hq * d * keys_seen

            def record(cfg: tuple[int, int, int, int], fn: Callable[..., Any], d=d, name=name,
                       kv_bytes=kv_bytes, flops=flops, args=args):
                tokens = args[0].shape[0]
                try:
                    t = time_fn(fn, [args], reps=10, trials=7)
                    rows.append({"case": name, "head_dim": d, "tokens": tokens,
                                 "block_q": cfg[0], "pages_per_block": cfg[1],
                                 "num_warps": cfg[2], "num_stages": cfg[3], "us": t * 1e6,
                                 "TBps": kv_bytes / t / 1e12, "tflops": flops / t / 1e12})
                    rate = (f"{kv_bytes / t / 1e12:6.2f} TB/s" if name == "decode"
                            else f"{flops / t / 1e12:6.1f} TFLOP/s")
                    log(f"ragged {name:6s} d={d:3d} T={tokens:4d} bq{cfg[0]} ppb{cfg[1]} "
                        f"w{cfg[2]} s{cfg[3]} {t * 1e6:9.1f} us {rate}")
                except Exception as e:
                    log(f"ragged {name} d={d} {cfg} FAILED: {type(e).__name__}: "
                        f"{str(e)[:300]}")

            cfgs = configs[name][:2] if quick else configs[name]
            for cfg in cfgs:
                bq, ppb, nw, ns = cfg
                record(cfg, jax.jit(
                    lambda q, kp, vp, bt, kl, cu, bq=bq, ppb=ppb, nw=nw, ns=ns, m=max_q_len:
                    ragged_attention(q, kp, vp, bt, kl, cu, max_q_len=m, block_q=bq,
                                     pages_per_block=ppb, num_warps=nw, num_stages=ns)))
            del args
    RESULTS["ragged"] = rows


# --------------------------------------------------------------------------- split-K


def bench_splits(quick: bool) -> None:
    """Paged decode attention (with its combine) against the split count, per batch and
    head layout, at short and long contexts, with the block table as wide as the context
    or as wide as an 8k-token engine table: the data behind the split-count rule. The keys
    per step and the stages are the default launch's (``paged_decode_launch``: from 128
    (sequence, kv head) pairs, 64 keys; one stage everywhere since r277; before r203, 128
    keys and 3 stages everywhere). Each row gives the K/V bytes read per second and their
    share of the copy test's rate. Times are the kernels' own (``time_in_jit``): the launch
    gaps that made a batch-1 call read ~25-40 us of wall time whatever the split (r178) are
    not in them."""
    rows = RESULTS.setdefault("splits", [])
    d, ps = 128, 16
    key = jax.random.PRNGKey(3)
    # (batch, q_heads, kv_heads) as one GPU sees them: 8B at tp 1 and 2, 70B at tp 2 and 4.
    layouts = ((1, 32, 8), (1, 16, 4), (1, 32, 4), (1, 16, 2), (64, 32, 8), (64, 32, 4))
    # (valid keys, table width in keys)
    contexts = ((192, 256), (192, 8192), (1000, 1024), (8000, 8192))
    if quick:
        layouts, contexts = layouts[::3], contexts[:2]
    for b, hq, hkv in layouts:
        for ctx, width in contexts:
            sets = _paged_sets(jax.random.fold_in(key, b * 7 + ctx), b, hq, hkv, width, ps, d)
            kv_bytes = 2 * b * hkv * ctx * d * 2
            lengths = jnp.full((b,), ctx, jnp.int32)
            n_blocks = max(1, width // (paged_decode_launch(b, hkv, ps, width // ps)[0] * ps))
            for splits in [None] + [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= n_blocks]:
                name = "default" if splits is None else f"splits {splits}"
                try:
                    t = time_in_jit(jax.jit(lambda q, kp, vp, bt, lengths=lengths, s=splits:
                                            paged_attention(q, kp, vp, bt, lengths,
                                                            num_splits=s)), sets)
                except Exception as e:
                    log(f"splits B={b} hq={hq} hkv={hkv} ctx={ctx} {name} FAILED: "
                        f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                rows.append(_paged_row(
                    f"splits {name:10s}", t, kv_bytes, {"batch": b, "q_heads": hq,
                                                        "kv_heads": hkv, "ctx": ctx,
                                                        "table_keys": width, "splits": splits}))
            del sets


def _paged_sets(key: jax.Array, b: int, hq: int, hkv: int, width: int, ps: int,
                d: int) -> list[tuple]:
    """Input sets for ``paged_attention``: (q [b, hq, d], k_pages, v_pages [hkv, b * width /
    ps, ps, d], shuffled block tables [b, width / ps]), bf16, enough sets to pass the L2."""
    pps = width // ps
    num_pages = b * pps
    sets = []
    for i in range(_n_sets(2 * hkv * num_pages * ps * d * 2)):
        k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, i), 4)
        sets.append((rand(k1, (b, hq, d), jnp.bfloat16),
                     rand(k2, (hkv, num_pages, ps, d), jnp.bfloat16),
                     rand(k3, (hkv, num_pages, ps, d), jnp.bfloat16),
                     jax.random.permutation(k4, num_pages).reshape(b, pps).astype(jnp.int32)))
    return sets


def _paged_row(label: str, t: float, kv_bytes: int, fields: dict[str, Any]) -> dict[str, Any]:
    """One timed paged-attention call as a record (``fields`` plus us, TB/s and the share of
    the copy test's rate), logged with ``label``."""
    tbps = kv_bytes / t / 1e12
    floor = tbps / RESULTS["copy_bw_TBps"] if "copy_bw_TBps" in RESULTS else None
    log(f"{label} {' '.join(f'{k}={v}' for k, v in fields.items())} {t * 1e6:7.2f} us "
        f"{tbps:5.2f} TB/s" + ("" if floor is None else f" ({floor:.0%} of the copy test)"))
    return {**fields, "us": t * 1e6, "TBps": tbps, "frac_of_copy_bw": floor}


def engine_lengths(b: int, seed: int = 0) -> np.ndarray:
    """Keys per row of a decode step at ``b`` slots under ``bench_engine.py``'s default
    workload, roughly: a log-uniform 32-1,024-token prompt plus a uniform share of a
    log-uniform 16-512-token output. At 64 rows (seed 0): mean 385, max 1,281 keys (r202's
    script drew another sample of the same law: mean 310, max 1,108)."""
    rng = np.random.default_rng(seed)
    prompt = np.exp(rng.uniform(np.log(32), np.log(1025), b)).astype(int)
    out = np.exp(rng.uniform(np.log(16), np.log(513), b)).astype(int)
    return prompt + (rng.uniform(0, 1, b) * out).astype(int)


def bench_configs(quick: bool) -> None:
    """Paged decode attention at batch 64: the launch settings (splits, pipeline stages,
    keys per block; 4 warps, r188 swept 2-8) per head layout, on rows of one length (192,
    1,000, 4,000 keys) and on the engine's mix of lengths (``engine_lengths``), each beside
    the default launch (``paged_decode_launch``). With one split per row the longest rows
    walk their blocks one after another while the rest of the GPU idles: equal lengths hide
    that, the mix shows it (r188 against r202). The data behind the kernel's defaults at
    large batches."""
    rows = RESULTS.setdefault("configs", [])
    d, ps, b = 128, 16, 64
    key = jax.random.PRNGKey(5)
    # (q_heads, kv_heads) per GPU: 8B at tp 1 and 2, 70B at tp 4
    layouts = ((32, 8), (16, 4), (16, 2))
    contexts: tuple[int | str, ...] = ("mixed", 192, 1000, 4000)
    settings = [None] + [(s, ns, ppb) for s in (1, 2, 4, 8) for ns in (1, 3) for ppb in (4, 8)]
    if quick:  # batch 8: the CPU test interprets every program
        b, layouts, contexts = 8, layouts[1:2], contexts[:1]
        settings = settings[:2] + settings[-1:]
    for hq, hkv in layouts:
        for ctx in contexts:
            lens = engine_lengths(b) if ctx == "mixed" else np.full(b, ctx)
            width = 1 << (int(lens.max()) - 1).bit_length()  # the table as wide as the rows
            sets = _paged_sets(jax.random.fold_in(key, hkv * 10_000 + width), b, hq, hkv,
                               width, ps, d)
            lengths = jnp.asarray(lens, jnp.int32)
            for setting in settings:
                s, ns, ppb = setting or (None, None, None)
                if s is not None and s > max(1, width // (ppb * ps)):
                    continue  # more splits than the table has blocks: keyless programs
                try:
                    t = time_in_jit(jax.jit(
                        lambda q, kp, vp, bt, lengths=lengths, s=s, ns=ns, ppb=ppb:
                        paged_attention(q, kp, vp, bt, lengths, num_splits=s, num_stages=ns,
                                        pages_per_block=ppb)), sets)
                except Exception as e:
                    log(f"configs hkv={hkv} ctx={ctx} {setting} FAILED: "
                        f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                if setting is None:  # what the kernel ran
                    ppb, s, ns = paged_decode_launch(b, hkv, ps, width // ps)
                rows.append(_paged_row("configs", t, 2 * hkv * int(lens.sum()) * d * 2, {
                    "batch": b, "q_heads": hq, "kv_heads": hkv, "ctx": ctx,
                    "mean_keys": float(lens.mean()), "default": setting is None,
                    "splits": s, "num_stages": ns, "pages_per_block": ppb}))
            del sets


def main() -> None:
    """Check the kernels, run the sections not in ``--skip``, write the JSON record."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_kernels.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip", default="", help="comma list of: flash,decode,ragged,splits,configs")
    args = p.parse_args()
    log(f"jax {jax.__version__} on {jax.devices()}")
    skip = set(args.skip.split(","))
    for name, fn in (("ceiling", lambda: copy_bandwidth()), ("check", check_correctness),
                     ("flash", lambda: bench_flash(args.quick)),
                     ("decode", lambda: bench_decode(args.quick)),
                     ("ragged", lambda: bench_ragged(args.quick)),
                     ("splits", lambda: bench_splits(args.quick)),
                     ("configs", lambda: bench_configs(args.quick))):
        if name in skip:
            continue
        try:
            fn()
        except Exception:
            traceback.print_exc()
            RESULTS.setdefault("errors", []).append(f"{name}: {traceback.format_exc()[-800:]}")
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    log(json.dumps({k: v for k, v in RESULTS.items()
                    if k not in ("flash", "decode", "ragged", "splits", "configs")}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
