"""Exactness and restore-route measurements for an 8B-shaped llama on MLX (CUDA or CPU).

Standalone: imports mlx, mlx_lm, numpy, stdlib (and xxhash if present).
SMALL=1 in the environment runs a tiny configuration (for a CPU syntax/logic check).
SECTIONS=A,B,C picks sections.  Results: printed tables, and JSON to $OUT/results.json.
"""

import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import (
    KVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

SMALL = os.environ.get("SMALL") == "1"
SECTIONS = set(os.environ.get("SECTIONS", "A,B,C").split(","))
OUT = os.environ.get("OUT", "/tmp")
T_START = time.perf_counter()
RESULTS = {}

if SMALL:
    CFG = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    A_NS = [64, 256, 300]
    A1_N = 256
    B_S = 512           # tokens of the KV used in section B
    B_SEG = 16          # segment files
    B_BLOCK = 64        # RAM-tier block size
    B1_NS = [64, 256]
    SDPA_S = [255, 256, 257, 512]
    MM_M = [1, 255, 256]
    TRACE_NS = [256]
else:
    CFG = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    A_NS = [1024, 4096, 8192, 16384]
    A1_N = 8192
    B_S = 8192
    B_SEG = 16
    B_BLOCK = 64
    B1_NS = [1024, 8192, 16384]
    SDPA_S = [1023, 1024, 4095, 4096, 8191, 8192, 8193, 8448, 16383, 16384]
    MM_M = [1, 1024, 4095, 4096, 8191, 8192, 16383, 16384]
    TRACE_NS = [4096, 8192]

REPS = 3   # timed repetitions after one warm-up
A_REPS = 4


def now():
    return time.perf_counter()


def log(*a):
    print(f"[{now() - T_START:7.1f}s]", *a, flush=True)


def sync():
    mx.synchronize()


def med(xs):
    return statistics.median(xs)


def fmt_t(xs):
    return f"{med(xs) * 1e3:9.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})"


def gbps(nbytes, secs):
    return nbytes / secs / 1e9


def free():
    gc.collect()
    mx.clear_cache()


def section(name):
    def deco(fn):
        def run(*a, **k):
            if name[0] not in SECTIONS:
                return None
            log(f"==== {name} ====")
            try:
                return fn(*a, **k)
            except Exception:
                log(f"!!!! {name} FAILED")
                traceback.print_exc()
                sys.stdout.flush()
                RESULTS.setdefault("failed", []).append(name)
            finally:
                free()
        return run
    return deco


# --------------------------------------------------------------------------- model

def build_model():
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000,
                           tie_word_embeddings=False, **CFG)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    # evaluate layer by layer to keep the float32 init temporaries small
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    sync()
    return model


def tokens(n, seed):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, CFG["vocab_size"], size=n).astype(np.int32))


def last_logits(out):
    return out[0, -1]


def bits_diff(a, b):
    """(max abs diff in float32, count of bitwise-differing entries, nan count in a)"""
    a = a.reshape(-1)
    b = b.reshape(-1)
    d = mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)))
    if a.dtype == mx.bfloat16:
        ne = mx.sum(a.view(mx.uint16) != b.view(mx.uint16))
    elif a.dtype == mx.float32:
        ne = mx.sum(a.view(mx.uint32) != b.view(mx.uint32))
    else:
        ne = mx.sum(a != b)
    nan = mx.sum(mx.isnan(a.astype(mx.float32)))
    mx.eval(d, ne, nan)
    return float(d.item()), int(ne.item()), int(nan.item())


def fd(t):
    return f"max {t[0]:.4g} n={t[1]}" + (f" nan={t[2]}" if t[2] else "")


def cold_oneshot(model, x):
    cache = make_prompt_cache(model)
    lg = last_logits(model(x[None], cache=cache))
    mx.eval(lg)
    return lg, cache


def cold_chunked_mlxlm(model, x, step=2048):
    """mlx-lm generate_step: chunks of `step` over the first N-1 tokens, then the last token."""
    cache = make_prompt_cache(model)
    n = x.shape[0]
    done = 0
    while n - done > 1:
        k = min(step, n - done - 1)
        model(x[done:done + k][None], cache=cache)
        mx.eval([c.state for c in cache])
        done += k
    lg = last_logits(model(x[done:][None], cache=cache))
    mx.eval(lg)
    return lg, cache


def cold_chunked_plain(model, x, step=2048):
    """All N tokens in chunks of `step` (last chunk holds the last token)."""
    cache = make_prompt_cache(model)
    n = x.shape[0]
    lg = None
    for s in range(0, n, step):
        out = model(x[s:s + step][None], cache=cache)
        if s + step >= n:
            lg = last_logits(out)
            mx.eval(lg)
        else:
            mx.eval([c.state for c in cache])
    return lg, cache


def pad_to(a, length):
    n = a.shape[2]
    if length == n:
        return a
    z = mx.zeros(a.shape[:2] + (length - n,) + a.shape[3:], a.dtype)
    return mx.concatenate([a, z], axis=2)


# --------------------------------------------------------------------------- section A

@section("A1 cold prefill determinism")
def a1(model):
    x = tokens(A1_N, 1234)
    res = {}
    for name, fn in [("oneshot", cold_oneshot), ("chunked_mlxlm", cold_chunked_mlxlm),
                     ("chunked_plain", cold_chunked_plain)]:
        outs = []
        for r in range(6):
            lg, _ = fn(model, x)
            outs.append(lg)
            free()
        diffs = [bits_diff(o, outs[0]) for o in outs[1:]]
        res[name] = {"vs_rep0": diffs}
        log(f"A1 N={A1_N} {name:14s} rep k vs rep 0:", "; ".join(fd(d) for d in diffs),
            f"| nan in rep0: {bits_diff(outs[0], outs[0])[2]}")
        res[name]["ref"] = outs[0]
    # cross-mode comparisons
    cmp = {}
    for a, b in [("chunked_mlxlm", "oneshot"), ("chunked_plain", "oneshot"),
                 ("chunked_plain", "chunked_mlxlm")]:
        cmp[f"{a}_vs_{b}"] = bits_diff(res[a]["ref"], res[b]["ref"])
        log(f"A1 {a} vs {b}: {fd(cmp[f'{a}_vs_{b}'])}")
    RESULTS["A1"] = {k: v["vs_rep0"] for k, v in res.items()} | cmp


@section("A2 split prefill and rebuilt caches")
def a2(model):
    out = {}
    for n in A_NS:
        x = tokens(n, 1000 + n)
        rows = []
        cold0 = None
        for rep in range(A_REPS):
            cold, _ = cold_oneshot(model, x)
            free()
            if cold0 is None:
                cold0 = cold
            # split: N-1 then 1
            cache = make_prompt_cache(model)
            model(x[:n - 1][None], cache=cache)
            mx.eval([c.state for c in cache])
            buflen = cache[0].keys.shape[2]
            snap = [(c.keys[..., :n - 1, :], c.values[..., :n - 1, :]) for c in cache]
            split = last_logits(model(x[n - 1:][None], cache=cache))
            mx.eval(split)
            del cache
            r = {"cold_vs_cold0": bits_diff(cold, cold0), "split_vs_cold": bits_diff(split, cold)}
            step = 256
            lens = {"a": n - 1, "b": ((n - 1 + step - 1) // step) * step,
                    "c": ((n - 1 + step - 1) // step) * step + step}
            for tag, L in lens.items():
                caches = []
                for k, v in snap:
                    kk = pad_to(mx.contiguous(k), L)
                    vv = pad_to(mx.contiguous(v), L)
                    caches.append(KVCache.from_state((kk, vv, n - 1)))
                mx.eval([c.keys for c in caches] + [c.values for c in caches])
                lg = last_logits(model(x[n - 1:][None], cache=caches))
                mx.eval(lg)
                r[f"{tag}_vs_split"] = bits_diff(lg, split)
                r[f"{tag}_vs_cold"] = bits_diff(lg, cold)
                del caches
            del snap
            free()
            rows.append(r)
            log(f"A2 N={n:5d} rep{rep} splitbuf={buflen} lens={lens} :: " +
                " | ".join(f"{k} {fd(v)}" for k, v in r.items()))
        out[n] = rows
    RESULTS["A2"] = out


# ---- A3 narrowing

def sdpa(q, k, v, scale, mask=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@section("A3a sdpa kernel: determinism and buffer-shape dependence")
def a3_sdpa():
    D = 128
    H, KVH = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    scale = D ** -0.5
    mx.random.seed(7)
    res = {}
    smax = max(SDPA_S) + 512
    kbig = (mx.random.normal((1, KVH, smax, D)) * 2).astype(mx.bfloat16)
    vbig = mx.random.normal((1, KVH, smax, D)).astype(mx.bfloat16)
    q1 = (mx.random.normal((1, H, 1, D)) * 2).astype(mx.bfloat16)
    mx.eval(kbig, vbig, q1)
    for S in SDPA_S:
        kc = mx.contiguous(kbig[..., :S, :])
        vc = mx.contiguous(vbig[..., :S, :])
        mx.eval(kc, vc)
        # decode (1 query) repeated
        o = [sdpa(q1, kc, vc, scale) for _ in range(5)]
        mx.eval(o)
        rep = max(bits_diff(x, o[0])[1] for x in o[1:])
        # same logical keys, inside a bigger buffer (as a slice view), as KVCache returns them
        variants = {}
        for extra in (1, 255, 256, 512):
            kb = pad_to(kc, S + extra)
            vb = pad_to(vc, S + extra)
            mx.eval(kb, vb)
            ov = sdpa(q1, kb[..., :S, :], vb[..., :S, :], scale)
            variants[f"slice_of_{S + extra}"] = bits_diff(ov, o[0])
        # float32 reference of the same attention (for the size of the error, not bitwise)
        qf = q1.astype(mx.float32).reshape(1, KVH, H // KVH, 1, D)
        sc = (qf * scale) @ kc.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
        ref = (mx.softmax(sc, axis=-1) @ vc.astype(mx.float32)[:, :, None]).reshape(1, H, 1, D)
        err = bits_diff(o[0].astype(mx.float32), ref)[0]
        res[S] = {"decode_repeat_ndiff": rep, "slices": variants, "err_vs_f32": err}
        log(f"A3a S={S:6d} decode 5x repeat ndiff={rep} err_vs_f32={err:.3g} :: " +
            " | ".join(f"{k} {fd(v)}" for k, v in variants.items()))
        del kc, vc, o
        free()
    # prefill path: causal L=S, repeated; last row vs the decode kernel on the same last query
    for S in [s for s in SDPA_S if s in (255, 256, 257, 1024, 4096, 8191, 8192, 16384)]:
        qs = (mx.random.normal((1, H, S, D)) * 2).astype(mx.bfloat16)
        kc = mx.contiguous(kbig[..., :S, :])
        vc = mx.contiguous(vbig[..., :S, :])
        mx.eval(qs, kc, vc)
        o = []
        for _ in range(3):
            o.append(sdpa(qs, kc, vc, scale, mask="causal"))
            mx.eval(o[-1])
        rep = [bits_diff(x, o[0]) for x in o[1:]]
        dec = sdpa(qs[:, :, -1:, :], kc, vc, scale)
        last = bits_diff(o[0][:, :, -1:, :], dec)
        # split prefill: queries S-1 .. as prefill of S-1 then decode last -- the prefill with
        # L = S-1 has no relation to row S-1; here compare causal S rows vs causal S-1 rows
        o_m1 = sdpa(qs[:, :, :S - 1, :], kc[..., :S - 1, :], vc[..., :S - 1, :], scale,
                    mask="causal")
        prev = bits_diff(o[0][:, :, :S - 1, :], o_m1)
        res[f"prefill_{S}"] = {"repeat": rep, "lastrow_vs_decode": last,
                               "rows_vs_prefill_Sminus1": prev}
        log(f"A3a prefill S={S:6d} causal 3x repeat: " + "; ".join(fd(r) for r in rep) +
            f" | last row vs 1-query kernel: {fd(last)} | first S-1 rows vs prefill(S-1): {fd(prev)}")
        del qs, kc, vc, o, dec, o_m1
        free()
    RESULTS["A3a"] = res


@section("A3b matmul: determinism and M dependence")
def a3_mm(model):
    res = {}
    layer = model.model.layers[0]
    mx.random.seed(11)
    xs = (mx.random.normal((max(MM_M), CFG["hidden_size"]))).astype(mx.bfloat16)
    mx.eval(xs)
    for wname, lin in [("q_proj", layer.self_attn.q_proj), ("k_proj", layer.self_attn.k_proj),
                       ("gate_proj", layer.mlp.gate_proj), ("lm_head", model.lm_head)]:
        one = lin(xs[-1:][None])  # M = 1 (the last row)
        mx.eval(one)
        row = {}
        for M in MM_M:
            xm = xs[-M:][None]
            outs = [lin(xm) for _ in range(3)]
            mx.eval(outs)
            rep = max(bits_diff(o, outs[0])[1] for o in outs[1:])
            lastrow = bits_diff(outs[0][:, -1:], one)
            row[M] = {"repeat_ndiff": rep, "lastrow_vs_M1": lastrow}
            del outs
        free()
        res[wname] = row
        log(f"A3b {wname:9s} " + " | ".join(
            f"M={M}: rep n={v['repeat_ndiff']} lastrow-vs-M1 {fd(v['lastrow_vs_M1'])}"
            for M, v in row.items()))
    # the model's last-position logits computed from the same hidden state, M=1 vs M=N
    RESULTS["A3b"] = res


def keep(a):
    return a * 1   # an exact copy (keeps -0.0), so the full-size intermediates can be freed


def traced_forward(model, x, cache):
    """llama forward written out op by op; records the last position of every intermediate."""
    m = model.model
    h = m.embed_tokens(x[None])
    mask = create_attention_mask(h, cache[0])
    rec = []
    for layer, c in zip(m.layers, cache):
        at = layer.self_attn
        xn = layer.input_layernorm(h)
        B, L, _ = xn.shape
        q, k, v = at.q_proj(xn), at.k_proj(xn), at.v_proj(xn)
        r = {"xn": keep(xn[0, -1]), "q": keep(q[0, -1]), "k": keep(k[0, -1]), "v": keep(v[0, -1])}
        q = q.reshape(B, L, at.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, at.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, at.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = at.rope(q, offset=c.offset)
        k = at.rope(k, offset=c.offset)
        r["q_rope"] = keep(q[0, :, -1])
        r["k_rope"] = keep(k[0, :, -1])
        k, v = c.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=at.scale, mask=mask)
        r["sdpa"] = keep(o[0, :, -1])
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        a = at.o_proj(o)
        r["o_proj"] = keep(a[0, -1])
        h = h + a
        mo = layer.mlp(layer.post_attention_layernorm(h))
        r["mlp"] = keep(mo[0, -1])
        h = h + mo
        r["h"] = keep(h[0, -1])
        rec.append(r)
    hn = m.norm(h)
    lg = model.lm_head(hn[:, -1:])[0, -1]   # last row only (M = 1)
    lg_all = model.lm_head(hn)[0, -1]        # as model() does it (M = L)
    mx.eval(lg, lg_all, rec)
    return lg_all, lg, rec


FIELDS = ["xn", "q", "k", "v", "q_rope", "k_rope", "sdpa", "o_proj", "mlp", "h"]


def first_diff(ra, rb):
    for i, (a, b) in enumerate(zip(ra, rb)):
        for f in FIELDS:
            d = bits_diff(a[f], b[f])
            if d[1]:
                return f"layer {i} field {f}: {fd(d)}"
    return "none (all fields of all layers bitwise equal)"


def per_field_summary(ra, rb):
    """number of layers in which each field differs"""
    cnt = {f: 0 for f in FIELDS}
    for a, b in zip(ra, rb):
        for f in FIELDS:
            if bits_diff(a[f], b[f])[1]:
                cnt[f] += 1
    return cnt


@section("A3c traced forward: where do paths diverge")
def a3_trace(model):
    res = {}
    for n in TRACE_NS:
        x = tokens(n, 1000 + n)   # same tokens as A2
        ref, _ = cold_oneshot(model, x)
        free()
        runs = {}
        for name in ["cold1", "cold2", "cold3"]:
            lg_all, lg1, rec = traced_forward(model, x, make_prompt_cache(model))
            runs[name] = (lg_all, lg1, rec)
            free()
        # split: prefill n-1 normally, then trace the last token
        cache = make_prompt_cache(model)
        model(x[:n - 1][None], cache=cache)
        mx.eval([c.state for c in cache])
        snap = [(c.keys[..., :n - 1, :], c.values[..., :n - 1, :]) for c in cache]
        runs["split"] = traced_forward(model, x[n - 1:], cache)
        del cache
        free()
        ca = [KVCache.from_state((mx.contiguous(k), mx.contiguous(v), n - 1)) for k, v in snap]
        mx.eval([c.keys for c in ca])
        runs["rebuilt_a"] = traced_forward(model, x[n - 1:], ca)
        del ca, snap
        free()
        r = {
            "traced_cold_vs_model": bits_diff(runs["cold1"][0], ref),
            "cold_lmhead_M1_vs_MN": bits_diff(runs["cold1"][1], runs["cold1"][0]),
            "cold2_vs_cold1_logits": bits_diff(runs["cold2"][0], runs["cold1"][0]),
            "cold3_vs_cold1_logits": bits_diff(runs["cold3"][0], runs["cold1"][0]),
            "cold2_vs_cold1_first": first_diff(runs["cold1"][2], runs["cold2"][2]),
            "cold3_vs_cold1_first": first_diff(runs["cold1"][2], runs["cold3"][2]),
            "split_vs_cold_logits": bits_diff(runs["split"][0], runs["cold1"][0]),
            "split_vs_cold_first": first_diff(runs["cold1"][2], runs["split"][2]),
            "split_vs_cold_layers_differing": per_field_summary(runs["cold1"][2], runs["split"][2]),
            "rebuilt_a_vs_split_logits": bits_diff(runs["rebuilt_a"][0], runs["split"][0]),
            "rebuilt_a_vs_split_first": first_diff(runs["split"][2], runs["rebuilt_a"][2]),
        }
        res[n] = r
        for k, v in r.items():
            log(f"A3c N={n} {k}: {fd(v) if isinstance(v, tuple) else v}")
        del runs
        free()
    RESULTS["A3c"] = res


# --------------------------------------------------------------------------- section B

def touch(arrs):
    """a GPU op reading every element of every array"""
    mx.eval([mx.sum(a.astype(mx.float32)) for a in arrs])
    sync()


def kv_from_prefill(model):
    x = tokens(B_S, 99)
    cache = make_prompt_cache(model)
    model(x[None], cache=cache)
    mx.eval([c.state for c in cache])
    names, arrs = [], []
    for i, c in enumerate(cache):
        k, v = c.keys[..., :B_S, :], c.values[..., :B_S, :]
        names += [f"l{i}.k", f"l{i}.v"]
        arrs += [mx.contiguous(k), mx.contiguous(v)]
    mx.eval(arrs)
    sync()
    return names, arrs, x


def warm_page_cache(paths):
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(mv):
                pass


def st_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return 8 + n, hdr


def timed(fn, reps=REPS, warm=1, label=""):
    """fn() -> dict of stage times (cumulative seconds) ; returns list of dicts"""
    out = []
    for i in range(warm + reps):
        free()
        r = fn()
        if i >= warm:
            out.append(r)
    return out


def summarize(label, runs, nbytes):
    keys = list(runs[0].keys())
    parts = []
    row = {}
    for k in keys:
        xs = [r[k] for r in runs]
        m = med(xs)
        row[k] = {"median_s": m, "min_s": min(xs), "max_s": max(xs),
                  "GBps": gbps(nbytes, m) if m > 0 else None}
        parts.append(f"{k}={m * 1e3:.1f}ms" + (f" ({gbps(nbytes, m):.2f} GB/s)" if m > 0 else ""))
    log(f"B {label:40s} " + "  ".join(parts))
    RESULTS.setdefault("B", {})[label] = row
    return row


@section("B1 cold prefill timing")
def b1(model):
    for n in B1_NS:
        x = tokens(n, 5000 + n)

        def oneshot():
            t0 = now()
            cache = make_prompt_cache(model)
            out = model(x[None], cache=cache)
            mx.eval(out[0, -1])
            sync()
            return {"total": now() - t0}

        def chunked():
            t0 = now()
            cold_chunked_mlxlm(model, x)
            sync()
            return {"total": now() - t0}

        for name, f in [("oneshot_all_logits", oneshot), ("mlxlm_2048_chunks", chunked)]:
            runs = timed(f)
            xs = [r["total"] for r in runs]
            log(f"B1 prefill N={n:5d} {name:20s} {fmt_t(xs)}  {n / med(xs):,.0f} tok/s")
            RESULTS.setdefault("B1", {})[f"{n}_{name}"] = {"median_s": med(xs), "min_s": min(xs),
                                                          "max_s": max(xs), "tok_per_s": n / med(xs)}


@section("B restore routes")
def b_routes(model, workdir):
    names, orig, xtok = kv_from_prefill(model)
    nbytes = sum(a.nbytes for a in orig)
    shape = orig[0].shape
    log(f"B KV: {len(orig)} tensors of {shape} bf16, {nbytes / 2**30:.3f} GiB")
    RESULTS["B_meta"] = {"nbytes": nbytes, "shape": list(shape), "tensors": len(orig)}

    def verify(arrs, label):
        ok = mx.all(mx.array([mx.array_equal(a.view(mx.uint16) if a.dtype != mx.uint16 else a,
                                             o.view(mx.uint16)) for a, o in zip(arrs, orig)]))
        ok = bool(ok.item())
        if not ok:
            log(f"B !!! {label}: restored content differs from the original")
        RESULTS.setdefault("B_verify", {})[label] = ok
        return ok

    # ---- baseline: touch cost on resident arrays, device copy
    def r_touch():
        t0 = now()
        touch(orig)
        return {"touch_resident": now() - t0}
    summarize("B7 touch (sum) of resident 1 GiB", timed(r_touch), nbytes)

    big = mx.concatenate([a.reshape(-1) for a in orig])
    mx.eval(big)
    half = big.shape[0] // 2

    def r_copy_mul():
        t0 = now()
        y = big * 1
        mx.eval(y)
        sync()
        return {"copy": now() - t0}

    def r_copy_cat():
        t0 = now()
        y = mx.concatenate([big[half:], big[:half]])
        mx.eval(y)
        sync()
        return {"copy": now() - t0}

    def r_copy_per_tensor():
        t0 = now()
        y = [a * 1 for a in orig]
        mx.eval(y)
        sync()
        return {"copy": now() - t0}
    summarize("B7 device copy 1 GiB (x*1, one array)", timed(r_copy_mul), nbytes)
    summarize("B7 device copy 1 GiB (concat halves)", timed(r_copy_cat), nbytes)
    summarize("B7 device copy 64 tensors (x*1)", timed(r_copy_per_tensor), nbytes)
    del big
    free()

    # ---- write files
    t0 = now()
    one = os.path.join(workdir, "one.safetensors")
    mx.save_safetensors(one, dict(zip(names, orig)))
    segs = []
    seglen = B_S // B_SEG
    for j in range(B_SEG):
        p = os.path.join(workdir, f"seg{j:02d}.safetensors")
        part = {n: mx.contiguous(a[..., j * seglen:(j + 1) * seglen, :]) for n, a in zip(names, orig)}
        mx.save_safetensors(p, part)
        segs.append(p)
    pc_path = os.path.join(workdir, "prompt.safetensors")
    ref_cache = [KVCache.from_state((orig[2 * i], orig[2 * i + 1], B_S))
                 for i in range(len(orig) // 2)]
    save_prompt_cache(pc_path, ref_cache)
    del ref_cache
    os.sync()
    log(f"B wrote files in {now() - t0:.1f}s; sizes one={os.path.getsize(one)} "
        f"seg={os.path.getsize(segs[0])}x{len(segs)} prompt={os.path.getsize(pc_path)}")
    warm_page_cache([one, pc_path] + segs)

    # ---- B7 raw read baselines
    rawbuf = bytearray(os.path.getsize(one))
    rawmv = memoryview(rawbuf)

    def r_raw_readinto():
        t0 = now()
        with open(one, "rb", buffering=0) as f:
            done = 0
            while done < len(rawmv):
                n = f.readinto(rawmv[done:done + (64 << 20)])
                if not n:
                    break
                done += n
        return {"read": now() - t0}

    def r_raw_osread():
        t0 = now()
        fdn = os.open(one, os.O_RDONLY)
        try:
            done = 0
            while True:
                b = os.read(fdn, 64 << 20)
                if not b:
                    break
                rawmv[done:done + len(b)] = b
                done += len(b)
        finally:
            os.close(fdn)
        return {"read": now() - t0}
    summarize("B7 raw readinto(bytearray) page cache", timed(r_raw_readinto), nbytes)
    summarize("B7 raw os.read + copy into bytearray", timed(r_raw_osread), nbytes)
    del rawbuf, rawmv

    # ---- B2 mx.load of one file
    def r_load(touch_after):
        def f():
            t0 = now()
            d = mx.load(one)
            arrs = [d[n] for n in names]
            mx.eval(arrs)
            sync()
            t1 = now()
            r = {"load_eval": t1 - t0}
            if touch_after:
                touch(arrs)
                r["+touch"] = now() - t0
                t2 = now()
                touch(arrs)
                r["2nd_touch_only"] = now() - t2
            f.last = arrs
            return r
        return f
    summarize("B2 mx.load one file (no device op)", timed(r_load(False)), nbytes)
    f = r_load(True)
    summarize("B2 mx.load one file + touch", timed(f), nbytes)
    verify(f.last, "B2 mx.load")
    del f
    free()

    # mx.load after dropping the file from the page cache (disk read; may not evict on this VM)
    def r_load_dropped():
        fdn = os.open(one, os.O_RDONLY)
        os.posix_fadvise(fdn, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fdn)
        t0 = now()
        d = mx.load(one)
        arrs = [d[n] for n in names]
        mx.eval(arrs)
        sync()
        r = {"load_eval": now() - t0}
        touch(arrs)
        r["+touch"] = now() - t0
        return r
    try:
        summarize("B2 mx.load one file after FADV_DONTNEED", timed(r_load_dropped), nbytes)
    except Exception as e:
        log(f"B2 fadvise variant failed: {e!r}")
    warm_page_cache([one])

    # ---- B3 16 segment files + concatenate per tensor
    def r_segs():
        t0 = now()
        ds = [mx.load(p) for p in segs]
        out = [mx.concatenate([d[n] for d in ds], axis=2) for n in names]
        mx.eval(out)
        sync()
        r = {"load+concat": now() - t0}
        touch(out)
        r["+touch"] = now() - t0
        r_segs.last = out
        return r
    summarize(f"B3 {B_SEG} segment files + concatenate", timed(r_segs), nbytes)
    verify(r_segs.last, "B3 segments")
    r_segs.last = None

    def r_segs_eval_first():
        t0 = now()
        ds = [mx.load(p) for p in segs]
        parts = [[d[n] for d in ds] for n in names]
        mx.eval(parts)
        sync()
        t1 = now()
        out = [mx.concatenate(p, axis=2) for p in parts]
        mx.eval(out)
        sync()
        return {"load_eval": t1 - t0, "+concat": now() - t0}
    summarize(f"B3 {B_SEG} segment files, load then concat", timed(r_segs_eval_first), nbytes)

    # ---- B4 np.fromfile + mx.array per tensor
    base, hdr = st_header(one)

    def r_np():
        t0 = now()
        raw = np.fromfile(one, dtype=np.uint8)
        t1 = now()
        arrs = []
        for n in names:
            s, e = hdr[n]["data_offsets"]
            view = raw[base + s:base + e].view(np.uint16).reshape(hdr[n]["shape"])
            arrs.append(mx.array(view).view(mx.bfloat16))
        mx.eval(arrs)
        sync()
        t2 = now()
        touch(arrs)
        t3 = now()
        r_np.last = arrs
        return {"fromfile": t1 - t0, "+mx.array": t2 - t0, "+touch": t3 - t0}
    summarize("B4 np.fromfile + mx.array per tensor", timed(r_np), nbytes)
    verify(r_np.last, "B4 numpy")
    r_np.last = None

    # ---- B5 preadv into MLX arrays
    def alloc(kind):
        shp = tuple(shape)
        if kind == "zeros_gpu":
            arrs = [mx.zeros(shp, dtype=mx.uint16) for _ in names]
        elif kind == "zeros_cpu_stream":
            arrs = [mx.zeros(shp, dtype=mx.uint16, stream=mx.cpu) for _ in names]
        elif kind == "from_np_empty":
            arrs = [mx.array(np.empty(shp, dtype=np.uint16)) for _ in names]
        else:
            raise ValueError(kind)
        mx.eval(arrs)
        sync()
        return arrs

    def read_into(arrs, nthreads=1):
        fdn = os.open(one, os.O_RDONLY)
        try:
            def one_tensor(i):
                n = names[i]
                s, e = hdr[n]["data_offsets"]
                mv = memoryview(arrs[i]).cast("B")
                done = 0
                while done < e - s:
                    got = os.preadv(fdn, [mv[done:]], base + s + done)
                    if not got:
                        raise RuntimeError("short read")
                    done += got
            if nthreads == 1:
                for i in range(len(names)):
                    one_tensor(i)
            else:
                with ThreadPoolExecutor(nthreads) as ex:
                    list(ex.map(one_tensor, range(len(names))))
        finally:
            os.close(fdn)

    def r_preadv(kind, nthreads=1):
        def f():
            t0 = now()
            arrs = alloc(kind)
            t1 = now()
            read_into(arrs, nthreads)
            t2 = now()
            bf = [a.view(mx.bfloat16) for a in arrs]
            touch(bf)
            t3 = now()
            touch(bf)
            t4 = now()
            f.last = bf
            return {"alloc": t1 - t0, "read": t2 - t1, "first_gpu_op": t3 - t2,
                    "total": t3 - t0, "2nd_gpu_op": t4 - t3}
        return f
    for kind in ["zeros_gpu", "zeros_cpu_stream", "from_np_empty"]:
        f = r_preadv(kind)
        summarize(f"B5 preadv into MLX ({kind})", timed(f), nbytes)
        verify(f.last, f"B5 {kind}")
        f.last = None
    f = r_preadv("from_np_empty", 8)
    summarize("B5 preadv into MLX (from_np_empty, 8 thr)", timed(f), nbytes)
    verify(f.last, "B5 from_np_empty 8 threads")
    f.last = None
    f = r_preadv("zeros_gpu", 8)
    summarize("B5 preadv into MLX (zeros_gpu, 8 thr)", timed(f), nbytes)
    verify(f.last, "B5 zeros_gpu 8 threads")
    f.last = None
    free()

    # race check: write from the CPU right after the allocation's eval, several times
    bad = 0
    for _ in range(3):
        arrs = alloc("zeros_gpu")
        read_into(arrs)
        bf = [a.view(mx.bfloat16) for a in arrs]
        if not verify(bf, "B5 race check"):
            bad += 1
        del arrs, bf
        free()
    RESULTS["B5_race_bad"] = bad
    log(f"B5 race check (zeros_gpu, write immediately after eval): {bad}/3 runs corrupted")

    # ---- B6 RAM tier on the device: 64-token blocks
    nblk = B_S // B_BLOCK
    blocks = [[mx.contiguous(a[..., i * B_BLOCK:(i + 1) * B_BLOCK, :]) for i in range(nblk)]
              for a in orig]
    mx.eval(blocks)
    sync()

    def r_cat():
        t0 = now()
        out = [mx.concatenate(b, axis=2) for b in blocks]
        mx.eval(out)
        sync()
        r_cat.last = out
        return {"concat": now() - t0}
    summarize(f"B6 RAM tier {nblk} blocks: concatenate", timed(r_cat), nbytes)
    verify(r_cat.last, "B6 concat")
    r_cat.last = None

    def r_slice(prealloc):
        def f():
            bufs = None
            if prealloc:
                bufs = [mx.zeros(tuple(shape), mx.bfloat16) for _ in names]
                mx.eval(bufs)
                sync()
            t0 = now()
            if not prealloc:
                bufs = [mx.zeros(tuple(shape), mx.bfloat16) for _ in names]
            for j, b in enumerate(blocks):
                buf = bufs[j]
                for i, blk in enumerate(b):
                    buf[..., i * B_BLOCK:(i + 1) * B_BLOCK, :] = blk
                bufs[j] = buf
            mx.eval(bufs)
            sync()
            f.last = bufs
            return {"slice_assign": now() - t0}
        return f
    f = r_slice(False)
    summarize(f"B6 RAM tier {nblk} blocks: slice-assign (+alloc)", timed(f), nbytes)
    verify(f.last, "B6 slice assign")
    f.last = None
    f = r_slice(True)
    summarize(f"B6 RAM tier {nblk} blocks: slice-assign prealloc", timed(f), nbytes)
    f.last = None
    del blocks
    free()

    # ---- B8 mlx-lm load_prompt_cache + one forward
    tok = mx.array([7], dtype=mx.int32)
    ref_c = [KVCache.from_state((orig[2 * i], orig[2 * i + 1], B_S)) for i in range(len(orig) // 2)]
    ref_lg = model(tok[None], cache=ref_c)[0, -1]
    mx.eval(ref_lg)
    del ref_c

    def r_lpc():
        t0 = now()
        c = load_prompt_cache(pc_path)
        t1 = now()
        lg = model(tok[None], cache=c)[0, -1]
        mx.eval(lg)
        sync()
        r_lpc.last = lg
        return {"load_prompt_cache": t1 - t0, "+forward_1tok": now() - t0}
    summarize("B8 load_prompt_cache + 1-token forward", timed(r_lpc), nbytes)
    d = bits_diff(r_lpc.last, ref_lg)
    RESULTS["B8_logits_vs_inmemory"] = d
    log(f"B8 restored 1-token logits vs in-memory cache: {fd(d)}")

    def r_fwd_only():
        c = [KVCache.from_state((orig[2 * i], orig[2 * i + 1], B_S)) for i in range(len(orig) // 2)]
        t0 = now()
        lg = model(tok[None], cache=c)[0, -1]
        mx.eval(lg)
        sync()
        return {"forward_1tok_resident": now() - t0}
    summarize("B8 1-token forward on resident cache", timed(r_fwd_only), nbytes)

    for p in [one, pc_path] + segs:
        os.unlink(p)
    return orig


# --------------------------------------------------------------------------- section C

@section("C xxhash threads")
def c_hash(orig):
    try:
        import xxhash
    except ImportError:
        log("C: xxhash not installed, skipped")
        RESULTS["C"] = "xxhash not installed"
        return
    nbytes = sum(a.nbytes for a in orig)
    res = {"xxhash_version": xxhash.VERSION}

    def fresh():
        arrs = [a * 1 for a in orig]   # written by the GPU
        mx.eval(arrs)
        sync()
        return arrs

    def hash_all(arrs, nthreads, chunk=None):
        views = [memoryview(a) for a in arrs]
        if chunk:
            views = [v.cast("B")[i:i + chunk] for v in (memoryview(a.view(mx.uint8)) for a in arrs)
                     for i in range(0, v.nbytes, chunk)]
        if nthreads == 1:
            return [xxhash.xxh3_128_intdigest(v) for v in views]
        with ThreadPoolExecutor(nthreads) as ex:
            return list(ex.map(xxhash.xxh3_128_intdigest, views))

    # does the hash release the GIL? (two threads on host memory)
    host = np.frombuffer(np.random.default_rng(0).bytes(256 << 20), dtype=np.uint8)
    t0 = now(); xxhash.xxh3_128_intdigest(host); t1 = now()
    th = [threading.Thread(target=xxhash.xxh3_128_intdigest, args=(host,)) for _ in range(4)]
    t2 = now()
    [t.start() for t in th]
    [t.join() for t in th]
    t3 = now()
    res["gil_test"] = {"one_256MiB_s": t1 - t0, "four_threads_4x256MiB_s": t3 - t2}
    log(f"C host 256 MiB: 1 call {(t1 - t0) * 1e3:.1f} ms ({gbps(256 << 20, t1 - t0):.1f} GB/s); "
        f"4 threads x 256 MiB {(t3 - t2) * 1e3:.1f} ms -> GIL "
        f"{'released' if (t3 - t2) < 2.5 * (t1 - t0) else 'held'}")
    del host
    for nthr in [1, 4, 8, 16]:
        t_first, t_second = [], []
        for rep in range(REPS + 1):
            arrs = fresh()
            t0 = now()
            h1 = hash_all(arrs, nthr)
            t1 = now()
            h2 = hash_all(arrs, nthr)
            t2 = now()
            assert h1 == h2
            if rep:
                t_first.append(t1 - t0)
                t_second.append(t2 - t1)
            del arrs
            free()
        res[nthr] = {"first_pass_s": med(t_first), "second_pass_s": med(t_second)}
        log(f"C xxh3_128 {nthr:2d} threads over 64 MLX arrays (1 GiB): first pass (GPU-written) "
            f"{med(t_first) * 1e3:.1f} ms ({gbps(nbytes, med(t_first)):.2f} GB/s), second pass "
            f"{med(t_second) * 1e3:.1f} ms ({gbps(nbytes, med(t_second)):.2f} GB/s)")
    RESULTS["C"] = res


# --------------------------------------------------------------------------- main

def main():
    log(f"mlx {mx.__version__} device {mx.default_device()} SMALL={SMALL} sections={SECTIONS}")
    try:
        import mlx_lm
        log(f"mlx_lm {mlx_lm.__version__}; numpy {np.__version__}; python {sys.version.split()[0]}")
    except Exception:
        pass
    t0 = now()
    model = build_model()
    log(f"model built in {now() - t0:.1f}s; params "
        f"{sum(v.size for _, v in __import__('mlx.utils', fromlist=['x']).tree_flatten(model.parameters())) / 1e9:.2f} B; "
        f"active memory {mx.get_active_memory() / 2**30:.1f} GiB")
    # warm-up (kernel compilation)
    x = tokens(2048 if not SMALL else 64, 1)
    for _ in range(2):
        lg, _ = cold_oneshot(model, x)
        lg, _ = cold_chunked_mlxlm(model, tokens(4097 if not SMALL else 130, 2), 2048 if not SMALL else 64)
    free()
    log("warm-up done")
    a1(model)
    a2(model)
    a3_sdpa()
    a3_mm(model)
    a3_trace(model)
    b1(model)
    workdir = tempfile.mkdtemp(prefix="kvb-", dir=os.environ.get("WORKDIR", "/tmp"))
    orig = b_routes(model, workdir)
    if orig is not None:
        c_hash(orig)
    log(f"peak memory {mx.get_peak_memory() / 2**30:.1f} GiB; total {now() - T_START:.1f}s")

    def conv(o):
        if isinstance(o, dict):
            return {str(k): conv(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [conv(v) for v in o]
        if isinstance(o, mx.array):
            return None
        return o
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(conv(RESULTS), f, indent=1)


if __name__ == "__main__":
    main()
