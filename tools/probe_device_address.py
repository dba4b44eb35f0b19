#!/usr/bin/env python3
"""Whether the writer could copy a store's KV to the host with nothing moved by MLX (a
probe for a CUDA GPU; docs/performance.md, "Issue 28 on an H100, fifth day").

On CUDA a host view of an MLX array in device memory (its buffer protocol) moves the
buffer into managed memory, with the GIL held: every other Python thread waits. This
probe checks a route that takes no view: a one-thread custom kernel
(``mx.fast.cuda_kernel``) writes its input's device address into an 8-byte output, and
the CUDA driver copies from that address to the host by the copy engine (the writer's
pinned lanes, `device.cuda`). Per size it prints:

- ``exact``: the bytes copied from the address equal the array's (read afterwards
  through a host view), bit for bit;
- ``address`` and ``copy``: the time to read the address (the kernel, its
  evaluation, and the 8 bytes) and to copy from it;
- ``view`` and ``copy``: the same copy today (a device copy, its host view, which
  moves it, then the copy engine from the managed block);
- ``GIL``: the share of its wall time a Python thread counting beside each route
  could run (near 1: the route leaves the GIL free).
- ``moved``: whether the address changed once a host view had moved the buffer (the
  address route must then never be used on that array again).

    python3 tools/probe_device_address.py [--mib 32,512,2048] [--rounds 3]

A one-off experiment: once it has run, its figures go to docs/performance.md with the
commit it lived at, and it leaves tools/ (docs/development.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

try:
    import persistent_prefix_cache  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from persistent_prefix_cache.device import cuda  # noqa: E402

SOURCE = "if (threadIdx.x == 0 && blockIdx.x == 0) { out[0] = (unsigned long long)inp; }"


class Spinner:
    """A Python thread counting as fast as the GIL lets it, to tell how much of a span
    the GIL was free."""

    def __init__(self) -> None:
        self.count, self._stop = 0, False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()
        time.sleep(0.05)
        start, t = self.count, time.perf_counter()
        time.sleep(0.2)
        self.rate = (self.count - start) / (time.perf_counter() - t)  # counts a second, GIL free

    def _spin(self) -> None:
        while not self._stop:
            self.count += 1

    def share(self, fn) -> tuple[float, float]:
        """`fn`'s seconds, and the share of them this thread could run."""
        start, t = self.count, time.perf_counter()
        fn()
        seconds = time.perf_counter() - t
        return seconds, (self.count - start) / (self.rate * seconds) if seconds else 1.0

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", default="32,512,2048", help="array sizes in MiB, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds per size (medians)")
    args = p.parse_args()
    if not cuda.on_cuda() or cuda._get_driver() is None:
        print("probe_device_address: needs MLX on a CUDA GPU with its driver reachable (nothing run)")
        return 2
    driver = cuda._get_driver()
    kernel = mx.fast.cuda_kernel(name="ppc_address", input_names=["inp"], output_names=["out"], source=SOURCE)

    def address(x: mx.array) -> int:
        (out,) = kernel(
            inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.uint64]
        )
        mx.eval(out)
        return int(out.item())

    spinner = Spinner()

    def one_round(n: int) -> tuple[dict[str, float], bool, bool]:
        """Both routes on a fresh array of `n` bytes: times and GIL shares, exact, moved."""
        x = mx.random.randint(0, 1 << 16, (n // 2,), dtype=mx.uint32).astype(mx.uint16)
        mx.eval(x)
        host = np.empty(n, dtype=np.uint8)
        found: list[int] = []
        t_addr, g_addr = spinner.share(lambda: found.append(address(x)))
        t_copy, g_copy = spinner.share(lambda: cuda._copy_to_host(driver, host, found[0], None))
        y = x + 0  # today's route: a device copy of its own, viewed (moved), then copied
        mx.eval(y)
        views: list[np.ndarray] = []
        t_view, g_view = spinner.share(lambda: views.append(np.asarray(memoryview(y)).view(np.uint8)))
        t_copy2, g_copy2 = spinner.share(lambda: cuda.to_host(views[0]))
        ref = np.asarray(memoryview(x)).view(np.uint8)  # moves x: read after the copy
        exact = bool(np.array_equal(host, ref))
        moved = address(x) != found[0]
        times = {"address": t_addr, "copy": t_copy, "view": t_view, "copy2": t_copy2}
        shares = {"g_address": g_addr, "g_copy": g_copy, "g_view": g_view, "g_copy2": g_copy2}
        return {**times, **shares}, exact, moved

    print(f"device {mx.default_device()}, mlx {mx.__version__}; a Python thread counts {spinner.rate:,.0f}/s alone")
    try:
        for mib in (int(m) for m in args.mib.split(",")):
            n = mib << 20
            rows: dict[str, list[float]] = {}
            exact, moved = True, False
            for r in range(args.rounds):
                figures, same, changed = one_round(n)
                exact, moved = exact and same, moved or changed
                mx.clear_cache()
                if r or args.rounds == 1:  # the first round warms the kernel and the lanes
                    for name, value in figures.items():
                        rows.setdefault(name, []).append(value)
            m = {k: statistics.median(v) for k, v in rows.items()}
            print(
                f"{mib:>6} MiB: exact {exact}; address {m['address'] * 1000:.2f} ms (GIL {m['g_address']:.2f}), "
                f"copy {m['copy'] * 1000:.1f} ms (GIL {m['g_copy']:.2f}, {n / m['copy'] / 1e9:.1f} GB/s) | today: "
                f"view {m['view'] * 1000:.1f} ms (GIL {m['g_view']:.2f}), copy {m['copy2'] * 1000:.1f} ms "
                f"(GIL {m['g_copy2']:.2f}); moved {moved}",
                flush=True,
            )
    finally:
        spinner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
