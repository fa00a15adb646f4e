"""
study.py: what attention really costs, measured on your own machine.

    python study.py            # default sweep for this machine (CUDA if present, else CPU)
    python study.py --quick    # smoke run, under a minute on a 2-core CPU

Sweeps the sequence length n and measures, for every attention path of
minitransformer (naive, chunked, flash; on CUDA also each fused SDPA kernel forced
one at a time), forward and forward+backward:
- time: median of repeats after a warm-up, with device synchronisation;
- peak memory above the inputs, two ways:
  peak_mib: the peak of the bytes that PyTorch's allocator holds for the call's
  tensors (outputs, gradients, temporaries), the same quantity on both devices: on
  CUDA the allocator's peak statistics, reset per point; on CPU the allocator's own
  record of every allocation and free, read through the profiler (profile_memory);
  rss_mib (CPU, Linux): what the process really took from the OS, library
  workspaces and malloc's overhead included: the peak resident set size (VmHWM,
  reset through /proc/self/clear_refs) of a separate worker process minus its
  resident size just before the call; for that call malloc returns every freed
  block over 128 KiB to the OS at once, so memory left over from earlier calls
  cannot hide the call's own; the timed calls run with malloc's usual caching;
- achieved TFLOP/s with FlashAttention's convention (4 * B * H * n^2 * D for a
  forward pass, halved for causal, x3.5 for forward+backward), and that as a
  percentage of the matrix-multiply rate measured on the same device in the same run.

Rows are appended to <out>/study.csv as they are measured (--resume skips the points
already there); an out-of-memory point is recorded as such and its curve stops
there. Plots, fitted exponents, a summary and a "claims checked" section follow.
"""

import argparse
import csv
import ctypes
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

import torch

import minitransformer as mt

COLUMNS = ["device", "torch", "dtype", "series", "path", "kernel", "mode", "causal", "window", "B", "H", "D",
           "n", "ms", "peak_mib", "rss_mib", "tflops", "pct_matmul", "matmul_tflops", "status"]
MODES = ("fwd", "fwd+bwd")
MIB = 2**20
SDPA_SERIES = {"sdpa-flash": "flash", "sdpa-efficient": "efficient", "sdpa-cudnn": "cudnn"}


# -----------------------------------------------------------------------------
# Pure parts: FLOPs, exponent fits


def attention_flops(B, H, n, D, causal=False, window=None, mode="fwd"):
    """FLOPs of attention as FlashAttention's benchmarks count them.

    Forward: two matmuls of 2 * n * n * D each per head: 4 * B * H * n^2 * D; causal
    halves it; forward+backward is 3.5x forward (backward = 2.5x forward: five
    matmuls instead of two). With a window, only the (i, j) pairs inside it count.
    """
    if window is None:
        pairs = n * n / (2 if causal else 1)
    else:
        i = torch.arange(n, dtype=torch.float64)
        before = torch.clamp(i, max=window)  # keys j in [i - w, i)
        after = torch.clamp(n - 1 - i, max=window)  # keys j in (i, i + w]
        pairs = float((1 + before + (0 if causal else after)).sum())
    flops = 4 * B * H * pairs * D
    return flops * (3.5 if mode == "fwd+bwd" else 1.0)


def fit_exponent(ns, ys, last=3):
    """Slope of log y against log n over the `last` largest n: y ~ n^slope there.

    The largest n are used because small n are dominated by fixed costs (Python
    overhead, library workspaces), which say nothing about the asymptotic growth.
    """
    pts = sorted((n, y) for n, y in zip(ns, ys) if y and y > 0)[-last:]
    if len(pts) < 2:
        return float("nan")
    xs = [math.log(n) for n, _ in pts]
    ls = [math.log(y) for _, y in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ls)
    return sum((x - mx) * (l - my) for x, l in zip(xs, ls)) / sum((x - mx) ** 2 for x in xs)


def growth_exponent(ns, ys, last=4):
    """p in y = c + a * n^p, from the successive differences of the `last` largest n.

    With n doubling, y(2n) - y(n) = a * n^p * (2^p - 1): the constant c (fixed
    workspaces, one block of scores) cancels, and the log-log slope of the
    differences is p itself. Needs n in a geometric progression; NaN otherwise.
    """
    pts = sorted((n, y) for n, y in zip(ns, ys) if y is not None and not math.isnan(y))[-last:]
    ratios = {round(b[0] / a[0], 6) for a, b in zip(pts, pts[1:])}
    diffs = [(a[0], b[1] - a[1]) for a, b in zip(pts, pts[1:])]
    if len(ratios) != 1 or len(diffs) < 2 or min(d for _, d in diffs) <= 0:
        return float("nan")
    return fit_exponent([n for n, _ in diffs], [d for _, d in diffs], last=len(diffs))


# -----------------------------------------------------------------------------
# Measuring one point (runs in the worker process)


class PointOOM(Exception):
    """A point ran out of memory: recorded in the CSV, never a crash."""


class PointUnsupported(Exception):
    """A forced SDPA kernel cannot run these inputs on this device: recorded, the curve skipped."""


def _is_oom(e):
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters of glibc's malloc.h


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _proc_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _CpuPeak:
    """Peak resident memory of this process during a call, above its resident size before it (Linux).

    Inside the block, blocks over 128 KiB are mmapped and unmapped when freed, and
    free heap memory is returned first (malloc_trim), so every byte the call needs
    shows up as new resident memory; afterwards malloc's defaults come back, as the
    timed calls must run with them.
    """

    def __enter__(self):
        self.libc = _libc()
        if self.libc:
            self.libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
            self.libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
            self.libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        self.base = _proc_kib("VmRSS")
        return self

    def __exit__(self, *exc):
        self.mib = (_proc_kib("VmHWM") - self.base) / 1024
        if self.libc:  # glibc's defaults: 32 MiB is where its dynamic mmap threshold stops growing
            self.libc.mallopt(M_MMAP_THRESHOLD, 32 * MIB)
            self.libc.mallopt(M_TRIM_THRESHOLD, 64 * MIB)


class _AllocPeak:
    """Peak bytes held by PyTorch's CPU allocator during a call, from its own record of every
    allocation and free (the profiler's memory events): tensors only, exact, no OS noise."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in self.prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        held = peak = 0
        for _, nbytes in events:  # frees come as negative sizes
            held += nbytes
            peak = max(peak, held)
        self.mib = peak / MIB


class _CudaPeak:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.mib = (torch.cuda.max_memory_allocated() - self.base) / MIB


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _attention_call(spec, q, k, v):
    """The call measured for one series: returns (fn, kernel label)."""
    kw = dict(is_causal=spec["causal"], window_size=spec["window"])
    path = spec["path"]
    if path in SDPA_SERIES:  # one fused kernel forced, if this GPU and these inputs allow it
        backend = mt._KERNELS[SDPA_SERIES[path]]
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                chosen = mt._chosen_kernel(q, k, v, None, 0.0, spec["causal"], None)
        except RuntimeError:
            chosen = None
        if chosen != SDPA_SERIES[path]:
            raise PointUnsupported(f"SDPA's {SDPA_SERIES[path]} kernel does not support these inputs here")

        def fn():
            with torch.nn.attention.sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=spec["causal"])
        return fn, SDPA_SERIES[path]
    if path == "flash":
        kernel = mt.sdpa_kernel_name(q, k, v, **kw)
        return (lambda: mt.flash_attention(q, k, v, on_math="allow", **kw)), kernel
    if path == "chunked":
        return (lambda: mt.chunked_attention(q, k, v, chunk_size=spec["chunk_size"], **kw)), "chunked"
    return (lambda: mt.naive_attention(q, k, v, **kw)[0]), "naive"


class _Workload:
    """Inputs of one (B, H, n, D) point and a step() that runs one series on them, synchronised."""

    def __init__(self, spec):
        self.device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
        B, H, n, D = spec["B"], spec["H"], spec["n"], spec["D"]
        self.train = spec["mode"] == "fwd+bwd"
        g = torch.Generator(device=self.device).manual_seed(0)
        self.q, self.k, self.v = (torch.randn(B, H, n, D, device=self.device, dtype=dtype, generator=g)
                                  .requires_grad_(self.train) for _ in range(3))
        self.dout = torch.randn(B, H, n, D, device=self.device, dtype=dtype, generator=g)

    def step_for(self, series_spec):
        """(step, kernel label); gradients are cleared before each step, outside any measurement."""
        fn, kernel = _attention_call(series_spec, self.q, self.k, self.v)

        def step():
            if self.train:
                fn().backward(self.dout)
            else:
                with torch.no_grad():
                    fn()
            _sync(self.device)
        return step, kernel

    def clear_grads(self):  # the new gradients count in a step's memory, the old ones do not
        for t in (self.q, self.k, self.v):
            t.grad = None

    def timed(self, step):
        self.clear_grads()
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0


def measure_point(spec):
    """Time and peak memory of one (series, mode, n) point; returns a dict of results."""
    work = _Workload(spec)
    step, kernel = work.step_for(spec)
    cuda = work.device.type == "cuda"
    if cuda:  # warm-up: cuBLAS / cuDNN workspaces are one-time costs, not this point's memory
        work.timed(step)
    work.clear_grads()
    with (_CudaPeak() if cuda else _AllocPeak()) as alloc:  # on CPU this call is also the warm-up
        step()
    rss = None
    if not cuda:
        work.clear_grads()
        with _CpuPeak() as peak:
            step()
        rss = peak.mib
    first = work.timed(step)
    reps = max(spec["min_repeats"] - 1, min(20, int(spec["target_s"] / max(first, 1e-6))) - 1)
    times = [first] + [work.timed(step) for _ in range(reps)]
    return {"kernel": kernel, "ms": 1e3 * statistics.median(times), "peak_mib": alloc.mib, "rss_mib": rss}


def measure_compare(spec):
    """Interleaved timing of several series on the same inputs: round r runs every series once,
    in a rotated order, so that a slow spell of a shared machine hits them all alike."""
    work = _Workload(spec)
    steps = {s["series"]: work.step_for({**spec, **s}) for s in spec["series_list"]}
    for step, _ in steps.values():  # warm-up
        work.clear_grads()
        step()
    names = list(steps)
    times = {name: [] for name in names}
    for r in range(spec["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(work.timed(steps[name][0]))
    return {name: {"kernel": steps[name][1], "times": times[name]} for name in names}


def measure_matmul(spec):
    """TFLOP/s of a square matmul in the sweep's dtype: the practical ceiling of this device.

    The best rate over `seconds` of repeats: a ceiling, not a typical value, and on a
    shared machine the best rate is the one least disturbed by other work.
    """
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    N = spec["N"]
    a, b = (torch.randn(N, N, device=device).to(dtype) for _ in range(2))
    for _ in range(2):
        a @ b
    _sync(device)
    times, t_end = [], time.perf_counter() + spec["seconds"]
    while len(times) < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"tflops": 2 * N**3 / min(times) / 1e12}


def _worker(conn, mem_limit_bytes):
    if mem_limit_bytes:  # a point that needs more fails with an allocation error, not the OOM killer
        limit = _proc_kib("VmSize") * 1024 + mem_limit_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    while (spec := conn.recv()) is not None:
        try:
            measure = {"matmul": measure_matmul, "compare": measure_compare}.get(spec.get("kind"), measure_point)
            result = measure(spec)
            conn.send(("ok", result))
        except PointUnsupported as e:
            conn.send(("unsupported", str(e)))
        except Exception as e:  # only OOM is data; anything else goes back as a failure
            conn.send(("oom", str(e).splitlines()[0][:200]) if _is_oom(e) else ("error", traceback.format_exc()))


class WorkerRunner:
    """Runs measurements in a separate process, restarted if the OS kills it."""

    def __init__(self, mem_limit_bytes):
        self.mem_limit_bytes, self.proc = mem_limit_bytes, None

    def _start(self):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no state, threads or heap from the parent
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, self.mem_limit_bytes), daemon=True)
        self.proc.start()

    def __call__(self, spec):
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(spec)
        try:
            status, payload = self.conn.recv()
        except (EOFError, ConnectionResetError):  # the worker died mid-point
            self.proc.join()
            code, self.proc = self.proc.exitcode, None
            raise PointOOM(f"worker killed (exit code {code}), most likely out of memory") from None
        if status == "oom":
            raise PointOOM(payload)
        if status == "unsupported":
            raise PointUnsupported(payload)
        if status == "error":
            raise RuntimeError(f"measurement failed for {spec}:\n{payload}")
        return payload

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(timeout=10)


# -----------------------------------------------------------------------------
# The sweep: declarative series, CSV written row by row


@dataclass
class Series:
    name: str  # label in the CSV, the legend and the summary
    path: str  # naive / chunked / flash / sdpa-flash / sdpa-efficient / sdpa-cudnn
    causal: bool = False
    window: int | None = None
    max_n: int | None = None  # longest n for this series (None: every length of the sweep)
    chunk_size: int | tuple | None = None  # blocks of a chunked series (None: --chunk-size or the default)


def default_series(device, causal, window, cpu_max_n=None):
    """naive, chunked, flash (+ each fused SDPA kernel on CUDA), chunked-causal, chunked-window<w>.

    cpu_max_n caps the series that do not need the longest lengths to make their point.
    """
    series = [Series("naive", "naive", causal, max_n=cpu_max_n), Series("chunked", "chunked", causal),
              Series("flash", "flash", causal)]
    if device.type == "cuda":
        series += [Series(name, name, causal) for name in SDPA_SERIES]
    if not causal:  # block skipping, measured side by side with the dense chunked path
        series.append(Series("chunked-causal", "chunked", True, max_n=cpu_max_n))
    if window:
        series.append(Series(f"chunked-window{window}", "chunked", causal, window))
    return series


def _key(row):
    return tuple(str(row[c]) for c in ("device", "dtype", "series", "mode", "B", "H", "D", "n"))


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class CsvLog:
    """Appends one row at a time and flushes it to disk: an interrupted run loses nothing."""

    def __init__(self, path, resume):
        if os.path.exists(path) and not resume:  # keep earlier data: set it aside, never overwrite it
            stamp, i = time.strftime("%Y%m%d-%H%M%S"), 0
            while os.path.exists(backup := f"{path[:-4]}-{stamp}{f'-{i}' if i else ''}.csv"):
                i += 1
            os.replace(path, backup)
        self.new = not os.path.exists(path)
        self.f = open(path, "a", newline="")
        self.w = csv.DictWriter(self.f, COLUMNS)
        if self.new:
            self.w.writeheader()

    def write(self, row):
        self.w.writerow(row)
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self):
        self.f.close()


def sweep(points, runner, log, done, ceiling, say=print):
    """Measure every point not in `done`; OOM stops that curve, any other error stops the run."""
    stopped = set()  # (series, mode) that ran out of memory at a smaller n
    total = len(points)
    for i, p in enumerate(points, 1):
        base = {c: p.get(c, "") for c in COLUMNS}
        label = f"[{i}/{total}] {p['series']} {p['mode']} n={p['n']}"
        if _key(base) in done:
            say(f"{label}: already measured, skipped (--resume)")
            continue
        if (p["series"], p["mode"]) in stopped:
            row = {**base, "status": "skipped: oom or unsupported at smaller n"}
        else:
            try:
                r = runner(p)
                flops = attention_flops(p["B"], p["H"], p["n"], p["D"], p["causal"], p["window"], p["mode"])
                tflops = flops / (r["ms"] / 1e3) / 1e12
                row = {**base, "kernel": r["kernel"], "ms": f"{r['ms']:.3f}", "peak_mib": f"{r['peak_mib']:.1f}",
                       "rss_mib": "" if r.get("rss_mib") is None else f"{r['rss_mib']:.1f}",
                       "tflops": f"{tflops:.4f}", "pct_matmul": f"{100 * tflops / ceiling:.1f}", "status": "ok"}
                rss = "" if r.get("rss_mib") is None else f" (RSS {r['rss_mib']:.0f} MiB)"
                say(f"{label}: {r['ms']:.1f} ms, {r['peak_mib']:.0f} MiB{rss} ({r['kernel']})")
            except PointOOM as e:
                stopped.add((p["series"], p["mode"]))
                row = {**base, "status": f"oom: {e}"[:120]}
                say(f"{label}: out of memory, curve stops here")
            except PointUnsupported as e:
                stopped.add((p["series"], p["mode"]))
                row = {**base, "status": f"unsupported: {e}"[:120]}
                say(f"{label}: {e}, series skipped")
        log.write(row)


# -----------------------------------------------------------------------------
# Report: plots, summary, claims


def _ok_rows(rows):
    out = {}
    for r in rows:
        if r["status"] == "ok":
            out.setdefault((r["series"], r["mode"]), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: int(r["n"]))
    return out


def exponents(rows):
    """{(series, mode): {"memory": growth exponent of peak_mib, "memory_slope": its plain log-log slope,
    "rss_slope": log-log slope of rss_mib (CPU), "time": log-log slope of ms}}, over the largest n.

    RSS gets the plain slope: its few MiB of noise would swamp the differences that the
    growth exponent is made of."""
    res = {}
    for key, rs in _ok_rows(rows).items():
        ns = [int(r["n"]) for r in rs]
        col = lambda name: [float(r[name]) if r.get(name) else float("nan") for r in rs]  # noqa: E731
        res[key] = {"memory": growth_exponent(ns, col("peak_mib")), "memory_slope": fit_exponent(ns, col("peak_mib")),
                    "rss_slope": fit_exponent(ns, col("rss_mib")), "time": fit_exponent(ns, col("ms"))}
    return res


def plot(rows, out_dir, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, fits = _ok_rows(rows), exponents(rows)
    series = list(dict.fromkeys(r["series"] for r in rows))
    colors = {s: f"C{i}" for i, s in enumerate(series)}
    markers = {s: "osD^vx*P"[i % 8] for i, s in enumerate(series)}  # curves that coincide stay visible
    files = []
    def decorate(ax, title):
        ax.set_title(title)
        ax.set_xlabel("sequence length n")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)

    def save(fig, axes, ylabel, name):
        axes[0].set_ylabel(ylabel)
        fig.suptitle(f"{name}: {title}", fontsize=10)
        fig.tight_layout()
        files.append(os.path.join(out_dir, f"{name}.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    style = {s: dict(marker=markers[s], fillstyle="none", color=colors[s]) for s in series}
    for what, col, unit in (("memory", "peak_mib", "peak memory above the inputs (MiB, allocator)"),
                            ("time", "ms", "time (ms)")):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
        for ax, mode in zip(axes, MODES):
            for s in series:
                if rs := curves.get((s, mode)):
                    ax.loglog([int(r["n"]) for r in rs], [max(float(r[col]), 1e-3) for r in rs], "-", base=2,
                              label=f"{s} (exponent {fits[(s, mode)][what]:.2f})", **style[s])
            decorate(ax, mode)
        save(fig, axes, unit, what)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, mode in zip(axes, MODES):
        naive = {int(r["n"]): float(r["ms"]) for r in curves.get(("naive", mode), [])}
        for s in series:
            rs = [r for r in curves.get((s, mode), []) if int(r["n"]) in naive]
            if rs and s != "naive":
                ax.semilogx([int(r["n"]) for r in rs], [naive[int(r["n"])] / float(r["ms"]) for r in rs], "-",
                            base=2, label=s, **style[s])
        ax.axhline(1.0, color="gray", lw=1)
        decorate(ax, f"speed-up over naive, {mode}")
    save(fig, axes, "naive time / path time", "speedup")
    return files


def _at(curves, series, mode, n):
    for r in curves.get((series, mode), []):
        if int(r["n"]) == n:
            return r
    return None


def report(rows):
    """The summary table, the ratios and the claims checked, as Markdown text."""
    curves, fits = _ok_rows(rows), exponents(rows)
    lines = ["Memory exponent: p in memory = c + a * n^p, from successive differences of the allocator's peak "
             "(the constant c of fixed workspaces cancels); in brackets the plain log-log slope over the three "
             "largest n, which a constant pulls below p. RSS slope and time exponent: log-log slopes over the three "
             "largest n.", "",
             "| series | mode | largest n | ms | peak MiB | RSS MiB | TFLOP/s | % of matmul | memory exponent "
             "| RSS slope | time exponent |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (s, mode), rs in curves.items():
        r, f = rs[-1], fits[(s, mode)]
        lines.append(f"| {s} ({r['kernel']}) | {mode} | {r['n']} | {float(r['ms']):.1f} | {float(r['peak_mib']):.1f} | "
                     f"{r.get('rss_mib') or '-'} | {float(r['tflops']):.3f} | {r['pct_matmul']} | "
                     f"{f['memory']:.2f} ({f['memory_slope']:.2f}) | {f['rss_slope']:.2f} | {f['time']:.2f} |")
    oom = sorted({(r["series"], r["mode"], int(r["n"])) for r in rows if r["status"].startswith("oom")})
    if oom:
        lines.append("\nOut of memory: " + ", ".join(f"{s} {m} n={n}" for s, m, n in oom))
    lines += ["", "Ratios at the largest n that both paths reached (naive / path: > 1 means the path uses less "
              "memory or time):", ""]
    for mode in MODES:
        for other in [s for s, m in curves if m == mode and s != "naive"]:
            common = sorted({int(r["n"]) for r in curves.get(("naive", mode), [])} &
                            {int(r["n"]) for r in curves[(other, mode)]})
            if common:
                n = common[-1]
                a, b = _at(curves, "naive", mode, n), _at(curves, other, mode, n)
                mem_ratio = float(a["peak_mib"]) / max(float(b["peak_mib"]), 1e-3)
                lines.append(f"- {mode} n={n}: naive/{other} memory {mem_ratio:.1f}x, "
                             f"time {float(a['ms']) / float(b['ms']):.2f}x")
    pairs = [("flash", "chunked", "Throughput of the chunked path relative to the fused kernel (flash time / chunked "
                                  "time; 1.00x = as fast)"),
             ("chunked", "chunked-causal", "Speed-up of causal block skipping (chunked time / chunked causal time; "
                                           "2x is the ideal)")]
    for a_name, b_name, what in pairs:
        ns = sorted({int(r["n"]) for m in MODES for r in curves.get((a_name, m), [])} &
                    {int(r["n"]) for m in MODES for r in curves.get((b_name, m), [])})
        if ns:
            lines += ["", f"{what}, measured side by side:", "",
                      "| n | " + " | ".join(MODES) + " |", "| --- |" + " --- |" * len(MODES)]
            for n in ns:
                cells = []
                for mode in MODES:
                    a, b = _at(curves, a_name, mode, n), _at(curves, b_name, mode, n)
                    cells.append(f"{float(a['ms']) / float(b['ms']):.2f}x" if a and b else "-")
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "## Claims checked", ""]
    fb = "fwd+bwd"
    if ("naive", fb) in fits:
        e = {s: fits[(s, fb)] for s in ("naive", "chunked", "flash") if (s, fb) in fits}
        lines.append("- \"Attention memory is O(n^2)\": true of the naive path only. Measured memory exponents "
                     "(fwd+bwd, allocator; in brackets the plain slope of the process RSS): "
                     + ", ".join(f"{s} {x['memory']:.2f} ({x['rss_slope']:.2f})" for s, x in e.items()) + ".")
    r2048 = _at(curves, "naive", "fwd", 2048)
    one = 2048 * 2048 * 4
    claim = (f"- \"At n=2048 one single-precision score matrix takes 16 GB\": one 2048 x 2048 float32 matrix is "
             f"{one} bytes = {one / MIB:.0f} MiB, a thousandth of that; 16 GiB would be {16 * 2**30 // one} such "
             "matrices (batch x heads = 1024, e.g. batch 32 x 32 heads).")
    if r2048:
        per = float(r2048["peak_mib"]) / (int(r2048["B"]) * int(r2048["H"]))
        claim += (f" Measured: the naive forward at n=2048 ({r2048['dtype']}, B={r2048['B']}, H={r2048['H']}) peaks at "
                  f"{float(r2048['peak_mib']):.0f} MiB above its inputs, {per:.1f} MiB per (batch, head) (scores and "
                  f"softmax output), so it would reach 16 GiB at batch x heads = {16 * 1024 / per:.0f}.")
    lines.append(claim)
    for mode in MODES:
        common = sorted({int(r["n"]) for r in curves.get(("naive", mode), [])} &
                        {int(r["n"]) for r in curves.get(("flash", mode), [])})
        if common:
            n = common[-1]
            a, b = _at(curves, "naive", mode, n), _at(curves, "flash", mode, n)
            x = float(a["ms"]) / float(b["ms"])
            verdict = "within" if 2 <= x <= 4 else ("above" if x > 4 else "below")
            lines.append(f"- \"The fused kernel is 2-4x faster than the standard implementation\" ({mode}, n={n}, "
                         f"kernel {b['kernel']}): measured {x:.2f}x, {verdict} the claimed range on this device.")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Command line


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _lengths(text):
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive lengths, got {text!r}")
    return sorted(set(values))


def _chunk_size(text):
    try:
        sizes = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        sizes = ()
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected a block size like 256 or 256x512 (queries x keys), got {text!r}")
    return sizes[0] if len(sizes) == 1 else sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to measure (auto: CUDA if present)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on a GPU that has it, float32 on CPU")
    p.add_argument("--series", default=None,
                   help="comma-separated subset of series names to run (default: all for the device; see --list)")
    p.add_argument("--list", action="store_true", help="print the series of this configuration and exit")
    p.add_argument("--lengths", type=_lengths, default=None,
                   help="comma-separated sequence lengths (default: powers of two that fit)")
    p.add_argument("--batch", type=_positive_int, default=None, help="batch size B (default 1 on CPU, 4 on CUDA)")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help="fixed total tokens instead of a fixed batch: B = tokens // n (FlashAttention's benchmarks)")
    p.add_argument("--heads", type=_positive_int, default=8, help="number of heads H")
    p.add_argument("--head-dim", type=_positive_int, default=64, help="head dimension D")
    p.add_argument("--causal", action="store_true", help="causal attention in every series")
    p.add_argument("--window", type=int, default=256, help="window of the sliding-window series (0: no such series)")
    p.add_argument("--mode", choices=["fwd", "fwd+bwd", "both"], default="both",
                   help="forward (inference, no autograd graph), forward+backward, or both")
    p.add_argument("--chunk-size", type=_chunk_size, default=None,
                   help="blocks of the chunked path, 256 or 256x512 (queries x keys); default: its own")
    p.add_argument("--out", default=None, help="output folder (default results/<device>)")
    p.add_argument("--resume", action="store_true", help="keep <out>/study.csv and skip the points it already has")
    p.add_argument("--quick", action="store_true", help="smoke run: three short lengths, few repeats")
    p.add_argument("--compare", action="store_true",
                   help="instead of the sweep: time the series side by side, interleaved round by round, at each "
                        "--lengths (default 4096), and report their time ratios (default series: flash, chunked, "
                        "chunked-causal)")
    p.add_argument("--rounds", type=_positive_int, default=10, help="rounds of --compare")
    p.add_argument("--report", action="store_true",
                   help="measure nothing: redraw plots and summary.md from <out>/study.csv")
    p.add_argument("--target-seconds", type=float, default=0.5,
                   help="time spent on repeats per point (at least 3 repeats)")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="CPU: memory a point may use before it counts as out of memory (default 70%% of available)")
    args = p.parse_args(argv)
    if args.window < 0:
        p.error(f"--window must be >= 0, got {args.window}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if args.target_seconds <= 0:
        p.error(f"--target-seconds must be positive, got {args.target_seconds}")
    return args, p


def _available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * 2**30


def configure(args, p):
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if args.dtype != "auto":
        dtype = args.dtype
    elif device.type == "cuda":
        dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    else:
        dtype = "float32"
    cpu = device.type == "cpu"
    if args.lengths:
        lengths = args.lengths
    elif args.quick:
        lengths = [256, 512, 1024]
    else:
        lengths = [2**i for i in (range(8, 14) if cpu else range(9, 16))]  # CPU 256..8192, CUDA 512..32768
    # on a CPU the quadratic naive path (and the causal ratio) stop at 4096, so that the sweep stays
    # within about 3 minutes; the linear-memory paths go on to 8192 to show their slope
    cpu_max_n = 4096 if cpu and not args.lengths and not args.quick else None
    series = default_series(device, args.causal, args.window, cpu_max_n)
    if args.series:  # a chunked series may carry its own blocks: chunked@256x512, chunked-causal@512
        known, chosen = {x.name: x for x in series}, []
        for name in (s.strip() for s in args.series.split(",")):
            base, _, size = name.partition("@")
            if base not in known or (size and known[base].path != "chunked"):
                p.error(f"unknown series {name!r}; for this configuration choose from {list(known)} "
                        "(chunked ones may end in @SIZE, e.g. chunked@256x512)")
            try:
                chosen.append(replace(known[base], name=name, chunk_size=_chunk_size(size) if size else None))
            except argparse.ArgumentTypeError as e:
                p.error(str(e))
        series = chosen
    return device, dtype, lengths, series


def _device_label(device):
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def compare(args, device, dtype, lengths, series, B, modes, runner, out, command):
    """--compare: interleaved side-by-side timing; prints and writes <out>/compare.md."""
    lines = [f"# Side-by-side timing ({args.rounds} interleaved rounds, median)", "",
             f"{_device_label(device)}, {dtype}, torch {torch.__version__}, B={B}, H={args.heads}, D={args.head_dim}",
             "", f"Command: `{command}`", ""]
    for n in lengths:
        for mode in modes:
            spec = {"kind": "compare", "device": device.type, "dtype": dtype, "B": B, "H": args.heads,
                    "D": args.head_dim, "n": n, "mode": mode, "rounds": args.rounds,
                    "series_list": [{**asdict(s), "series": s.name,
                                     "chunk_size": s.chunk_size or args.chunk_size} for s in series]}
            res = runner(spec)
            names = list(res)
            lines += [f"## n={n}, {mode}", "", "| series | kernel | median ms |", "| --- | --- | --- |"]
            lines += [f"| {m} | {res[m]['kernel']} | {1e3 * statistics.median(res[m]['times']):.1f} |" for m in names]
            lines += ["", "| time(a) / time(b), median of per-round ratios | ratio |", "| --- | --- |"]
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    ratio = statistics.median(x / y for x, y in zip(res[a]["times"], res[b]["times"]))
                    lines.append(f"| {a} / {b} | {ratio:.2f}x |")
            lines.append("")
            print("\n".join(lines[-(len(names) * 2 + 8):]))
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.join(out, 'compare.md')}")


def main(argv=None, runner=None):
    """Run the sweep; `runner(spec) -> result` may be injected (tests), else a WorkerRunner measures."""
    args, p = parse_args(argv)
    command = "python study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.compare:  # its own defaults: the side-by-side point
        args.lengths = args.lengths or [4096]
        args.series = args.series or "flash,chunked,chunked-causal"
    device, dtype, lengths, series = configure(args, p)
    if args.list:
        print("\n".join(s.name for s in series))
        return
    out = args.out or os.path.join("results", device.type)
    os.makedirs(out, exist_ok=True)
    modes = MODES if args.mode == "both" else (args.mode,)
    batch = args.batch or (1 if device.type == "cpu" else 4)
    if runner is None:  # the worker process starts at its first measurement, not here
        limit = None
        if device.type == "cpu" and not args.compare:
            limit = int((args.mem_limit_gib * 2**30) if args.mem_limit_gib else 0.7 * _available_bytes())
        runner = WorkerRunner(limit)
    try:
        if args.compare:
            return compare(args, device, dtype, lengths, series, batch, modes, runner, out, command)
        return _sweep_and_report(args, p, device, dtype, lengths, series, batch, modes, runner, out, command)
    finally:
        if isinstance(runner, WorkerRunner):
            runner.close()


def _sweep_and_report(args, p, device, dtype, lengths, series, batch, modes, runner, out, command):
    csv_path = os.path.join(out, "study.csv")
    dev_label = _device_label(device)
    title = (f"{dev_label}, {dtype}, torch {torch.__version__}, "
             f"{f'B={batch}' if not args.tokens else f'B*n={args.tokens}'}, H={args.heads}, D={args.head_dim}"
             f"{', causal' if args.causal else ''}")
    if args.report:
        rows = read_rows(csv_path)
        if not rows:
            p.error(f"--report: no measurements in {csv_path}")
        r = rows[0]  # the title from what was measured, not from this machine
        title = f"{r['device']}, {r['dtype']}, torch {r['torch']}, B={r['B']}, H={r['H']}, D={r['D']}"
        return write_report(csv_path, out, title, f"report redrawn from {csv_path}; command: `{command}`")
    log = CsvLog(csv_path, args.resume)
    done = {_key(r) for r in read_rows(csv_path) if r["status"] == "ok"} if args.resume else set()
    t0 = time.time()
    try:
        ceiling = runner({"kind": "matmul", "device": device.type, "dtype": dtype,
                          "N": 2048 if device.type == "cpu" else 8192, "seconds": 2.0})["tflops"]
        points = [{"device": dev_label, "torch": torch.__version__, "dtype": dtype, "series": s.name, "path": s.path,
                   "mode": mode, "causal": s.causal, "window": s.window, "H": args.heads, "D": args.head_dim, "n": n,
                   "B": max(1, args.tokens // n) if args.tokens else batch, "matmul_tflops": f"{ceiling:.4f}",
                   "chunk_size": s.chunk_size or args.chunk_size, "min_repeats": 1 if args.quick else 3,
                   "target_s": 0.2 if args.quick else args.target_seconds}
                  for n in lengths for s in series for mode in modes
                  if s.max_n is None or n <= s.max_n]  # n outermost: paths side by side
        print(f"study: {title}; {len(points)} points -> {csv_path}")
        print(f"matmul ceiling: {ceiling:.3f} TFLOP/s ({dtype}, measured now)")
        sweep(points, lambda pt: runner({**pt, "device": device.type}), log, done, ceiling)
    finally:
        log.close()
    write_report(csv_path, out, title, f"sweep took {time.time() - t0:.0f} s; command: `{command}`")


def write_report(csv_path, out, title, note):
    """Plots and summary.md from the CSV alone, so that they can be redrawn without measuring (--report)."""
    rows = read_rows(csv_path)
    files = plot(rows, out, title)
    text = f"# Attention scaling study\n\n{title}\n\n{note}\n\n" + report(rows) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    print("wrote " + ", ".join([os.path.join(out, "summary.md")] + files))


if __name__ == "__main__":
    main()
