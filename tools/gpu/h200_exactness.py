"""Follow-up to h200_routes.py: pins down the buffer-size dependence of MLX CUDA's decode attention
and re-runs the exactness tests with cuDNN SDPA disabled (MLX_CUDA_USE_CUDNN_SDPA=0, subprocess).
Also: mx.load tensor size vs file count, more preadv threads, weight-hashing side effects.
Run: python3 diag2.py            (default env, then spawns itself with 'nocudnn')
"""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h200_routes as kb  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "default"
log = kb.log
fd = kb.fd
bits_diff = kb.bits_diff
N_LIST = [256, 300] if kb.SMALL else [4096, 8192]
REPS = 8


def exactness(model, tag):
    """split vs rebuilt (a, b, c), chunked mlx-lm repeats, restored-from-file vs in-memory"""
    summary = {}
    for n in N_LIST:
        x = kb.tokens(n, 1000 + n)
        cnt = {"a": 0, "b": 0, "c": 0, "split_vs_split0": 0}
        split0 = None
        for rep in range(REPS):
            cache = make_prompt_cache(model)
            model(x[:n - 1][None], cache=cache)
            mx.eval([c.state for c in cache])
            snap = [(c.keys[..., :n - 1, :], c.values[..., :n - 1, :]) for c in cache]
            split = kb.last_logits(model(x[n - 1:][None], cache=cache))
            mx.eval(split)
            del cache
            if split0 is None:
                split0 = split
            if bits_diff(split, split0)[1]:
                cnt["split_vs_split0"] += 1
            lens = {"a": n - 1, "b": ((n - 1 + 255) // 256) * 256,
                    "c": ((n - 1 + 255) // 256) * 256 + 256}
            for t, L in lens.items():
                caches = [KVCache.from_state((kb.pad_to(mx.contiguous(k), L),
                                              kb.pad_to(mx.contiguous(v), L), n - 1))
                          for k, v in snap]
                mx.eval([c.keys for c in caches] + [c.values for c in caches])
                lg = kb.last_logits(model(x[n - 1:][None], cache=caches))
                mx.eval(lg)
                if bits_diff(lg, split)[1]:
                    cnt[t] += 1
                del caches
            del snap
            kb.free()
        cold, _ = kb.cold_oneshot(model, x)
        sc = bits_diff(split0, cold)
        summary[n] = cnt
        log(f"[{tag}] N={n}: runs (of {REPS}) where the rebuilt cache's logits differ from the "
            f"split cache's: a={cnt['a']} b={cnt['b']} c={cnt['c']}; split differs from split rep0 "
            f"in {cnt['split_vs_split0']}; split vs one-shot cold: {fd(sc)}")
    # mlx-lm chunked prefill repeated
    n = N_LIST[-1]
    x = kb.tokens(n, 1234)
    outs = []
    for _ in range(REPS):
        lg, _ = kb.cold_chunked_mlxlm(model, x)
        outs.append(lg)
        kb.free()
    nd = sum(1 for o in outs[1:] if bits_diff(o, outs[0])[1])
    log(f"[{tag}] mlx-lm chunked prefill N={n}: {nd} of {REPS - 1} repeats differ from rep 0")
    # restored from a file (load_prompt_cache) vs in-memory, 1-token continuation
    cache = make_prompt_cache(model)
    model(kb.tokens(n, 99)[None], cache=cache)
    mx.eval([c.state for c in cache])
    orig = [(mx.contiguous(c.keys[..., :n, :]), mx.contiguous(c.values[..., :n, :])) for c in cache]
    mx.eval(orig)
    del cache
    path = f"/tmp/diag2-{tag}.safetensors"
    save_prompt_cache(path, [KVCache.from_state((k, v, n)) for k, v in orig])
    tok = mx.array([[7]], dtype=mx.int32)
    nd = 0
    refs = []
    for _ in range(4):
        ref = model(tok, cache=[KVCache.from_state((k, v, n)) for k, v in orig])[0, -1]
        res = model(tok, cache=load_prompt_cache(path))[0, -1]
        mx.eval(ref, res)
        refs.append(ref)
        if bits_diff(ref, res)[1]:
            nd += 1
        kb.free()
    nref = sum(1 for r in refs[1:] if bits_diff(r, refs[0])[1])
    os.unlink(path)
    log(f"[{tag}] load_prompt_cache + 1 token vs in-memory cache + 1 token: differ in {nd} of 4; "
        f"in-memory repeats differ from the first in {nref} of 3")
    # prefill timings in this mode
    for n in ([256] if kb.SMALL else [8192]):
        x = kb.tokens(n, 5000 + n)
        for name, fn in [("oneshot", kb.cold_oneshot), ("mlxlm_chunks", kb.cold_chunked_mlxlm)]:
            ts = []
            for i in range(4):
                kb.free()
                t0 = kb.now()
                fn(model, x)
                kb.sync()
                if i:
                    ts.append(kb.now() - t0)
            log(f"[{tag}] prefill N={n} {name}: {kb.fmt_t(ts)}")
    return summary


def sdpa_alloc_proof():
    """decode attention over the same keys: exact-size buffer vs a buffer reused from MLX's cache
    that is 16 KiB larger (allocator rounds to 16 KiB pages and reuses up to +32 KiB)."""
    D, H, KVH = 128, kb.CFG["num_attention_heads"], kb.CFG["num_key_value_heads"]
    S, T = (255, 256) if kb.SMALL else (8191, 8192)
    mx.random.seed(3)
    q = (mx.random.normal((1, H, 1, D)) * 2).astype(mx.bfloat16)
    kc = (mx.random.normal((1, KVH, S, D)) * 2).astype(mx.bfloat16)
    vc = mx.random.normal((1, KVH, S, D)).astype(mx.bfloat16)
    mx.eval(q, kc, vc)
    scale = D ** -0.5
    ref_vec = kb.sdpa(q, kc, vc, scale)  # T_kv = S, not a multiple of 256: vector kernel
    mx.eval(ref_vec)
    nbytes = KVH * T * D * 2

    def run(extra_bytes):
        mx.synchronize()
        mx.clear_cache()
        if extra_bytes:
            d = [mx.zeros(((nbytes + extra_bytes) // 2,), mx.bfloat16) for _ in range(2)]
            mx.eval(d)
            del d          # both now sit in MLX's buffer cache
        kbuf = kb.pad_to(kc, T)
        vbuf = kb.pad_to(vc, T)
        mx.eval(kbuf, vbuf)
        o = kb.sdpa(q, kbuf[..., :S, :], vbuf[..., :S, :], scale)
        mx.eval(o)
        return o

    rows = {}
    outs = {}
    for extra in [0, 16384, 0, 16384, 65536, 0]:
        o = run(extra)
        key = f"cached buffer +{extra // 1024} KiB" if extra else "fresh exact buffer"
        outs.setdefault(key, []).append(o)
    exact = outs["fresh exact buffer"][0]
    for key, os_ in outs.items():
        rows[key] = [(bits_diff(o, ref_vec), bits_diff(o, exact)) for o in os_]
        log(f"SDPA decode S={S} in a T_kv={T} buffer, {key:24s}: " + "; ".join(
            f"vs vector-kernel ref {fd(a)} | vs exact {fd(b)}" for a, b in rows[key]))
    return rows


def load_variants(workdir):
    names, arrs = [], []
    mx.random.seed(5)
    S = 512 if kb.SMALL else 8192
    KVH = kb.CFG["num_key_value_heads"]
    L = kb.CFG["num_hidden_layers"]
    for i in range(2 * L):
        names.append(f"t{i}")
        arrs.append(mx.random.normal((1, KVH, S, 128)).astype(mx.bfloat16))
    mx.eval(arrs)
    nbytes = sum(a.nbytes for a in arrs)
    one = os.path.join(workdir, "d2one.safetensors")
    mx.save_safetensors(one, dict(zip(names, arrs)))
    seg = S // 16
    many = os.path.join(workdir, "d2many.safetensors")
    mx.save_safetensors(many, {f"{n}.{j}": mx.contiguous(a[..., j * seg:(j + 1) * seg, :])
                               for n, a in zip(names, arrs) for j in range(16)})
    os.sync()
    kb.warm_page_cache([one, many])
    for label, path in [("64 tensors of 16 MiB", one), ("1024 tensors of 1 MiB", many)]:
        ts, tt = [], []
        for i in range(4):
            kb.free()
            t0 = kb.now()
            d = mx.load(path)
            xs = list(d.values())
            mx.eval(xs)
            kb.sync()
            t1 = kb.now()
            kb.touch(xs)
            t2 = kb.now()
            if i:
                ts.append(t1 - t0)
                tt.append(t2 - t0)
            del d, xs
        log(f"mx.load one file, {label}: load+eval {kb.med(ts) * 1e3:.1f} ms "
            f"({kb.gbps(nbytes, kb.med(ts)):.2f} GB/s); +touch {kb.med(tt) * 1e3:.1f} ms "
            f"({kb.gbps(nbytes, kb.med(tt)):.2f} GB/s)")
    # preadv into MLX arrays with 16 threads
    base, hdr = kb.st_header(one)
    for alloc_kind in ["zeros_gpu", "zeros_cpu_stream"]:
        for nthr in [8, 16]:
            res = []
            for i in range(4):
                kb.free()
                t0 = kb.now()
                if alloc_kind == "zeros_gpu":
                    dst = [mx.zeros(a.shape, dtype=mx.uint16) for a in arrs]
                else:
                    dst = [mx.zeros(a.shape, dtype=mx.uint16, stream=mx.cpu) for a in arrs]
                mx.eval(dst)
                kb.sync()
                t1 = kb.now()
                fdn = os.open(one, os.O_RDONLY)

                def rd(j):
                    s, e = hdr[names[j]]["data_offsets"]
                    mv = memoryview(dst[j]).cast("B")
                    done = 0
                    while done < e - s:
                        done += os.preadv(fdn, [mv[done:]], base + s + done)

                with ThreadPoolExecutor(nthr) as ex:
                    list(ex.map(rd, range(len(names))))
                os.close(fdn)
                t2 = kb.now()
                bf = [a.view(mx.bfloat16) for a in dst]
                kb.touch(bf)
                t3 = kb.now()
                # copy into fresh GPU-stream (device-memory) arrays
                cp = [a * 1 for a in bf]
                mx.eval(cp)
                kb.sync()
                t4 = kb.now()
                if i:
                    res.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0, t4 - t3))
                ok = all(bool(mx.array_equal(a, b).item()) for a, b in zip(bf, arrs))
                del dst, bf, cp
            m = [kb.med([r[k] for r in res]) for k in range(5)]
            log(f"preadv {alloc_kind:16s} {nthr:2d} threads: alloc {m[0] * 1e3:.1f} ms, read "
                f"{m[1] * 1e3:.1f} ms, first GPU op {m[2] * 1e3:.1f} ms, total {m[3] * 1e3:.1f} ms "
                f"({kb.gbps(nbytes, m[3]):.2f} GB/s); then a device copy {m[4] * 1e3:.1f} ms; content ok={ok}")
    os.unlink(one)
    os.unlink(many)


def weights_hash_effect(model):
    try:
        import xxhash
    except ImportError:
        log("xxhash missing: skipped")
        return
    x = kb.tokens(256 if kb.SMALL else 8192, 77)

    def prefill_time():
        kb.free()
        t0 = kb.now()
        kb.cold_oneshot(model, x)
        kb.sync()
        return kb.now() - t0
    before = [prefill_time() for _ in range(3)]
    ws = [v for _, v in tree_flatten(model.parameters())]
    nbytes = sum(w.nbytes for w in ws)
    for p in range(2):
        t0 = kb.now()
        with ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda w: xxhash.xxh3_128_intdigest(memoryview(w)), ws))
        t = kb.now() - t0
        log(f"hash all weights ({nbytes / 1e9:.1f} GB) via memoryview, 16 threads, pass {p + 1}: "
            f"{t:.2f} s ({kb.gbps(nbytes, t):.1f} GB/s)")
    after = [prefill_time() for _ in range(3)]
    log(f"prefill N={x.shape[0]} before hashing: " + ", ".join(f"{t * 1e3:.0f}" for t in before) +
        " ms; after hashing: " + ", ".join(f"{t * 1e3:.0f}" for t in after) + " ms")


def main():
    log(f"diag2 mode={MODE} mlx {mx.__version__} MLX_CUDA_USE_CUDNN_SDPA="
        f"{os.environ.get('MLX_CUDA_USE_CUDNN_SDPA')}")
    model = kb.build_model()
    x = kb.tokens(64 if kb.SMALL else 2048, 1)
    for _ in range(2):
        kb.cold_oneshot(model, x)
        kb.cold_chunked_mlxlm(model, kb.tokens(130 if kb.SMALL else 4097, 2),
                              64 if kb.SMALL else 2048)
    kb.free()
    if MODE == "default":
        try:
            sdpa_alloc_proof()
        except Exception as e:
            log(f"sdpa_alloc_proof failed: {e!r}")
    exactness(model, MODE)
    if MODE == "default":
        del model
        kb.free()
        env = dict(os.environ, MLX_CUDA_USE_CUDNN_SDPA="0")
        subprocess.run([sys.executable, os.path.abspath(__file__), "nocudnn"], env=env)
        model = kb.build_model()
        try:
            load_variants(os.environ.get("WORKDIR", "/tmp"))
        except Exception as e:
            log(f"load_variants failed: {e!r}")
        try:
            weights_hash_effect(model)
        except Exception as e:
            log(f"weights_hash_effect failed: {e!r}")
    log("done")


if __name__ == "__main__":
    main()
