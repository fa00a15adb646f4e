"""
study.py: what attention really costs, measured on your own machine.

    python study.py                    # default sweep (CUDA if present, else CPU) -> runs/<device>/
    python study.py --quick            # smoke run, under 30 s on a 2-core CPU -> runs/<device>-quick/
    python study.py --series ring2,ring4 --lengths 1024,4096    # ring attention across 2 and 4 processes
    python study.py --compare          # flash, chunked, chunked-causal timed side by side at n = 4096
    python study.py --report --out D   # redraw D's plots and summary.md from D/study.csv
    python study.py --out results/cpu  # refresh the committed reference (only ever on request)

It sweeps the sequence length n and measures every attention path of minitransformer (naive,
chunked, flash; on CUDA also each fused SDPA kernel forced in turn), forward and
forward+backward:
- time: the median of repeats after a warm-up, with device synchronisation;
- peak_mib: the peak of the bytes PyTorch's allocator holds for the call's tensors (outputs,
  gradients, temporaries) above the inputs, the same quantity on both devices: on CUDA the
  allocator's peak statistics; on CPU its record of every allocation and free (the profiler);
- rss_mib (CPU, Linux only: it needs /proc): what the process took from the OS, library
  workspaces and malloc's overhead included (see _CpuPeak);
- TFLOP/s with FlashAttention's convention, and as a percentage of the matmul rate measured in
  the same run.

Each point runs in a worker process with a memory budget (--mem-budget; CPU: 4 GiB, a small
GPU's memory; CUDA: the GPU's own). A point that needs more is recorded as out of memory and
its curve stops there: that is the memory wall. On Linux the budget is the worker's address
space (RLIMIT_AS); where the OS has no such limit, a point is not run when the curve's last
allocator peak, scaled by (n'/n)^2, exceeds the budget. Rows go to <out>/study.csv as they are
measured (--resume skips those already there); plots, exponents, the wall and a summary follow.
The committed reference (results/<device>) is written only when --out names it; other runs go
to runs/ (git-ignored).
"""

import argparse
import contextlib
import csv
import ctypes
import inspect
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import wait

import torch

import minitransformer as mt
import ring_attention

try:  # POSIX only
    import resource
except ImportError:
    resource = None
# Linux: a peak RSS that can be reset and read (/proc), and an address-space limit that the
# kernel enforces (RLIMIT_AS). Elsewhere rss_mib stays empty and the memory wall is predicted.
LINUX_MEMORY = sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs") and resource is not None

COLUMNS = ["device", "torch", "dtype", "series", "path", "kernel", "mode", "causal", "window", "docs", "B", "H",
           "D", "n", "world", "ms", "comm_ms", "peak_mib", "rss_mib", "tflops", "pct_matmul", "pairs",
           "matmul_tflops", "mem_budget_gib", "status"]
MODES = ("fwd", "fwd+bwd")
MIB = 2**20
SDPA_SERIES = {"sdpa-flash": "flash", "sdpa-efficient": "efficient", "sdpa-cudnn": "cudnn"}


# -----------------------------------------------------------------------------
# Pure parts: FLOPs, exponent fits


def attention_pairs(n, causal=False, window=None):
    """The (query, key) pairs of one (batch, head): n^2, halved by causality (as FlashAttention counts
    it); with a window, only the pairs inside it."""
    if window is None:
        return n * n / (2 if causal else 1)
    i = torch.arange(n, dtype=torch.float64)
    before = torch.clamp(i, max=window)  # keys j in [i - w, i)
    after = torch.clamp(n - 1 - i, max=window)  # keys j in (i, i + w]
    return float((1 + before + (0 if causal else after)).sum())


def attention_flops(B, H, n, D, causal=False, window=None, mode="fwd"):
    """FLOPs of attention as FlashAttention's benchmarks count them.

    Forward: two matmuls of 2 * n * n * D each per head: 4 * B * H * n^2 * D; causal
    halves it; forward+backward is 3.5x forward (backward = 2.5x forward: five
    matmuls instead of two). With a window, only the (i, j) pairs inside it count:
    pass window=None for a kernel that computes every pair and masks the rest.
    """
    return 4 * B * H * attention_pairs(n, causal, window) * D * (3.5 if mode == "fwd+bwd" else 1.0)


def packed_offsets(n, docs, seed=0):
    """cu_seqlens of `docs` documents packed to n: docs - 1 distinct cuts drawn uniformly (a fixed seed), so
    that the lengths are random, average n / docs, and vary widely, as real documents do."""
    if not 1 <= docs <= n:
        raise ValueError(f"cannot pack {docs} non-empty documents into n={n} tokens")
    cuts = torch.randperm(n - 1, generator=torch.Generator().manual_seed(seed))[:docs - 1] + 1
    return [0] + sorted(cuts.tolist()) + [n]


def computed_pairs(point):
    """The pairs one (batch, head) of a series computes: chunked skips what causality and a window hide, and
    with documents the key blocks outside them (counted block by block, as it visits them); the fused
    kernels skip causal pairs only when causality reaches them as a flag; naive, and SDPA given a window
    or documents (only as an (n, n) mask), compute every pair and mask the rest."""
    p, n = point, point["n"]
    if p.get("docs") and p["path"] == "chunked":
        device = p["device"].split(":")[0]  # the device's label: "cpu:...", "cuda:..."
        cq, ck = mt._chunks(p.get("chunk_size") or mt.default_chunk_size(device))
        offsets = packed_offsets(n, p["docs"])
        return sum((rows.stop - rows.start) * (cols.stop - cols.start) for rows in mt._blocks(n, cq)
                   for cols in mt._key_blocks(rows, n, ck, p["causal"], p["window"], offsets))
    dense = p["path"] == "naive" or (p["path"] not in ("chunked", "ring") and (p["window"] or p.get("docs")))
    return attention_pairs(n, p["causal"] and not dense, None if dense else p["window"])


def computed_flops(point):
    """FLOPs of the pairs a series computes: attention_flops of all n^2 pairs, scaled to computed_pairs."""
    p = point
    return attention_flops(p["B"], p["H"], p["n"], p["D"], mode=p["mode"]) * computed_pairs(p) / p["n"] ** 2


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


# An exponent is reported only where the range and the data can carry it. Over two
# doublings, curves that still carry fixed costs gave memory "exponents" of -0.46 and 1.27
# for chunked and flash, two linear paths (--quick); so: the FIT_POINTS largest n, spanning at least MIN_SPAN (three
# doublings), every step up in n raising the value by more than its noise, and for the
# growth exponent, successive differences that follow one power (local exponents within
# MAX_SPREAD of each other: below one block, the chunked path's workspace still grows with
# n, and its differences do not). Otherwise the report says that this range cannot tell,
# and gives no number.
FIT_POINTS, MIN_SPAN, MAX_SPREAD = 4, 8, 0.25
NOISE = {  # (absolute, relative) that a step up in n must exceed
    "peak_mib": (0.5, 0.0),  # exact, written with 0.1 MiB: five times that
    "rss_mib": (4.0, 0.0),  # library workspaces and malloc move it by a few MiB
    "ms": (0.0, 0.25),  # runs on a shared machine differ by about 20%
}


def supported_exponent(ns, ys, noise, growth=False):
    """p in y ~ n^p over the FIT_POINTS largest n, or None where this range cannot tell.

    noise: (absolute, relative); each step up in n must raise y by more than
    max(absolute, relative * y). growth: p from the successive differences
    (growth_exponent, which needs n in a geometric progression) instead of the plain
    log-log slope; the differences must follow one power. A p that is not positive is
    not a growth law: None.
    """
    pts = sorted((n, y) for n, y in zip(ns, ys) if y is not None and not math.isnan(y))[-FIT_POINTS:]
    if len(pts) < FIT_POINTS or pts[-1][0] < MIN_SPAN * pts[0][0]:
        return None
    absolute, relative = noise
    if any(b[1] - a[1] <= max(absolute, relative * a[1]) for a, b in zip(pts, pts[1:])):
        return None
    xs, vs = [n for n, _ in pts], [y for _, y in pts]
    if not growth:
        return fit_exponent(xs, vs, last=FIT_POINTS)  # positive: every step rose
    diffs = [(b[0], b[1] - a[1]) for a, b in zip(pts, pts[1:])]
    local = [math.log(d2 / d1) / math.log(n2 / n1) for (n1, d1), (n2, d2) in zip(diffs, diffs[1:])]
    if max(local) - min(local) > MAX_SPREAD:
        return None
    p = growth_exponent(xs, vs, last=FIT_POINTS)
    return p if p > 0 else None  # NaN (lengths not geometric) fails this too


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


def _available_bytes():
    """Memory available now (Linux), else the machine's physical memory, else None."""
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows
        return None


class _CpuPeak:
    """Peak resident memory of this process during a call, above its resident size before it (Linux).

    Inside the block, blocks over 128 KiB are mmapped and unmapped when freed, and
    free heap memory is returned first (malloc_trim), so every byte the call needs
    shows up as new resident memory. Afterwards the thresholds are set to the largest
    values glibc's dynamic thresholds reach (mmap 32 MiB, trim 64 MiB): setting them
    switches that dynamic adjustment off, so the timed calls run with malloc caching
    every block below 32 MiB, as a long-running glibc process ends up doing.
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
        if self.libc:  # where glibc's dynamic thresholds stop growing (they are fixed from now on)
            self.libc.mallopt(M_MMAP_THRESHOLD, 32 * MIB)
            self.libc.mallopt(M_TRIM_THRESHOLD, 64 * MIB)


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 sent to the null device: the profiler's start and stop each log a line there
    (Kineto, below Python), which would drown the study's own output."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class _Profiler:
    """torch.profiler on the CPU, with its start and stop silenced (only those: the call profiled
    writes to stderr as usual)."""

    def __init__(self, **kwargs):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **kwargs)

    def __enter__(self):
        with _stderr_silenced():
            self.prof.__enter__()
        return self.prof

    def __exit__(self, *exc):
        with _stderr_silenced():
            self.prof.__exit__(*exc)


class _AllocPeak:
    """Peak bytes held by PyTorch's CPU allocator during a call, from its own record of every
    allocation and free (the profiler's memory events): tensors only, exact, no OS noise."""

    def __enter__(self):
        self.quiet = _Profiler(profile_memory=True)
        self.prof = self.quiet.__enter__()
        return self

    def __exit__(self, *exc):
        self.quiet.__exit__(*exc)
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
    cu_seqlens = torch.tensor(packed_offsets(spec["n"], spec["docs"])) if spec.get("docs") else None
    kw = dict(is_causal=spec["causal"], window_size=spec["window"], cu_seqlens=cu_seqlens)
    path = spec["path"]
    if path in SDPA_SERIES:  # one fused kernel forced, if this GPU and these inputs allow it
        backend = mt._KERNELS[SDPA_SERIES[path]]
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                chosen = mt._chosen_kernel(q, k, v, None, 0.0, spec["causal"], None)
        except RuntimeError:
            chosen = None
        if chosen not in (SDPA_SERIES[path], "unknown"):  # unknown: torch cannot say; running it will tell
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
    if path == "ring":
        return (lambda: ring_attention.ring_attention(q, k, v, is_causal=spec["causal"])), "ring"
    return (lambda: mt.naive_attention(q, k, v, **kw)[0]), "naive"


class _Workload:
    """Inputs of one (B, H, n, D) point and a step() that runs one series on them, synchronised."""

    def __init__(self, spec):
        self.device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
        B, H, n, D = spec["B"], spec["H"], spec["n"] // spec.get("world", 1), spec["D"]  # ring: this rank's shard
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


def _forced_kernel_runs(work, step, kernel):
    """One whole step of a forced SDPA kernel, backward included, before anything is measured.

    SDPA only says which kernel it would choose for the forward; a backward that this GPU
    cannot run (some head dims need a newer architecture, say) fails only when called.
    A plain RuntimeError (what the kernels' own checks raise) from PyTorch's forced kernel is
    this device's answer: recorded as unsupported. Out of memory stays out of memory; its
    subclasses (a CUDA fault, recursion, not implemented) and the same failure in any other
    series are bugs and fail the run.
    """
    work.clear_grads()
    try:
        step()
    except RuntimeError as e:
        if type(e) is not RuntimeError or _is_oom(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PointUnsupported(f"SDPA's {kernel} kernel failed here: {first}"[:150]) from e


def measure_point(spec):
    """Time and peak memory of one (series, mode, n) point; returns a dict of results."""
    work = _Workload(spec)
    step, kernel = work.step_for(spec)
    cuda = work.device.type == "cuda"
    if spec["path"] in SDPA_SERIES:  # also the warm-up
        _forced_kernel_runs(work, step, kernel)
    elif cuda:  # warm-up: cuBLAS / cuDNN workspaces are one-time costs, not this point's memory
        work.timed(step)
    work.clear_grads()
    with (_CudaPeak() if cuda else _AllocPeak()) as alloc:  # on CPU this call is also the warm-up
        step()
    rss = None
    if not cuda and LINUX_MEMORY:
        work.clear_grads()
        with _CpuPeak() as peak:
            step()
        rss = peak.mib
    first = work.timed(step)
    reps = max(spec["min_repeats"] - 1, min(20, int(spec["target_s"] / max(first, 1e-6))) - 1)
    if spec["path"] == "ring":  # every rank must run the same number of ring calls
        reps = spec["min_repeats"] - 1
    times = [first] + [work.timed(step) for _ in range(reps)]
    ms = 1e3 * statistics.median(times)
    comm = None if spec["path"] != "ring" or work.device.type == "cuda" else ms * _ring_wait_share(work, step)
    return {"kernel": kernel, "ms": ms, "comm_ms": comm, "peak_mib": alloc.mib,
            "rss_mib": rss}


def _ring_wait_share(work, step):
    """The share of one ring step spent waiting for K/V blocks (and their gradients) that compute did not
    hide: the "ring_attention.wait" regions of ring_attention.py over the step's own time, both from one
    profiled call (the profiler slows the call, so its absolute times are not the timed ones). CPU only:
    NCCL's wait does not block the host."""
    work.clear_grads()
    t0 = time.perf_counter()
    with _Profiler() as prof:
        step()
    total_us = 1e6 * (time.perf_counter() - t0)
    return min(1.0, sum(e.cpu_time_total for e in prof.key_averages() if e.key == "ring_attention.wait") / total_us)


def measure_compare(spec):
    """Interleaved timing of several series on the same inputs: round r runs every series once,
    in a rotated order, so that a slow spell of a shared machine hits them all alike."""
    work = _Workload(spec)
    steps = {s["series"]: work.step_for({**spec, **s}) for s in spec["series_list"]}
    paths = {s["series"]: s["path"] for s in spec["series_list"]}
    for name, (step, kernel) in steps.items():  # warm-up
        if paths[name] in SDPA_SERIES:
            _forced_kernel_runs(work, step, kernel)
        else:
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


def native_bf16():
    """Whether this GPU computes in bfloat16 natively (compute capability 8.0 on).

    torch.cuda.is_bf16_supported() also says yes where bfloat16 is only emulated (T4,
    V100: it can create a bfloat16 tensor), and emulated bfloat16 is slow; a torch
    without the including_emulation keyword gets the capability asked directly.
    """
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability()[0] >= 8


def describe_device(spec):
    """The device's label, native bfloat16 and memory, asked in the worker so that the
    parent process never creates a CUDA context of its own beside the worker's."""
    if spec["device"] == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"label": f"cuda:{props.name}", "bf16": native_bf16(), "memory_bytes": props.total_memory}
    label = f"cpu:{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return {"label": label, "bf16": True, "memory_bytes": _available_bytes()}


def _cap_gpu_memory(budget_bytes):
    """Out of memory above budget_bytes on this GPU: the caching allocator's cap for this process."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))


def _warm_up_cpu():
    # thread pools, malloc's arenas and the profiler reserve about 300 MiB of address space
    # when first used: reserved here, once, they do not count against the first point's budget
    with _AllocPeak():
        x = torch.randn(2048, 2048, requires_grad=True)
        (x @ x).sum().backward()


def _cap_address_space(budget_bytes):
    """Out of memory above budget_bytes more than this process holds now (RLIMIT_AS): an
    allocation error, recorded, instead of the OS's OOM killer or swapping.

    Set again before every measurement, as a GPU's memory is empty at the start of each:
    what malloc kept from earlier points does not count. Address space also counts thread
    stacks and malloc's arenas that a point may add, some tens of MiB; tensors get the rest.
    """
    limit, hard = _proc_kib("VmSize") * 1024 + budget_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _worker(conn, device, budget_bytes, rank=0, world=1, store=None, linux_memory=LINUX_MEMORY):
    global LINUX_MEMORY
    LINUX_MEMORY = linux_memory  # the parent's answer (tests simulate another OS there)
    if world > 1:  # one rank of a ring series: a process group, the cores shared among the ranks
        if device == "cuda":  # before the process group: NCCL binds to the current device
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}",
                                             rank=rank, world_size=world)
    if budget_bytes and device == "cuda":
        _cap_gpu_memory(budget_bytes)
    elif budget_bytes:
        _warm_up_cpu()
    while (spec := conn.recv()) is not None:
        try:
            if budget_bytes and device == "cpu" and LINUX_MEMORY:
                _cap_address_space(budget_bytes)
            measure = {"matmul": measure_matmul, "compare": measure_compare,
                       "device": describe_device}.get(spec.get("kind"), measure_point)
            result = measure(spec)
            conn.send(("ok", result))
        except PointUnsupported as e:
            conn.send(("unsupported", str(e)))
        except Exception as e:  # only OOM is data; anything else goes back as a failure
            conn.send(("oom", str(e).splitlines()[0][:200]) if _is_oom(e) else ("error", traceback.format_exc()))


class WorkerRunner:
    """Runs measurements in separate processes (`world` of them, a process group, for a ring series),
    restarted if the OS kills one."""

    def __init__(self, device, budget_bytes, world=1):
        self.device, self.budget_bytes, self.world, self.procs, self.conns = device, budget_bytes, world, [], []

    def _start(self):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no state, threads or heap from the parent
        store = os.path.join(tempfile.mkdtemp(prefix="study-ring-"), "store")
        self.conns, self.procs = [], []
        for rank in range(self.world):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, daemon=True, args=(child, self.device, self.budget_bytes, rank,
                                                                   self.world, store, LINUX_MEMORY))
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)

    def _stop(self):
        for proc in self.procs:
            proc.kill()
            proc.join()
        self.procs = []

    def __call__(self, spec):
        if not self.procs or not all(proc.is_alive() for proc in self.procs):
            self._stop()
            self._start()
        for conn in self.conns:
            conn.send(spec)
        pending, answers, deadline = dict(enumerate(self.conns)), {}, None
        while pending:  # after a rank fails, the others may wait in the ring for ever: a minute at most
            ready = wait(list(pending.values()), None if deadline is None else max(0.0, deadline - time.time()))
            if not ready:
                break
            for i in [i for i, conn in pending.items() if conn in ready]:
                try:
                    answers[i] = pending.pop(i).recv()
                except (EOFError, ConnectionResetError):  # the worker died mid-point
                    answers[i] = None
                if answers[i] is None or answers[i][0] != "ok":
                    deadline = deadline or time.time() + 60
        answers = [answers.get(i) for i in range(self.world)]
        said = [answer for answer in answers if answer is not None and answer[0] != "ok"]
        if said:  # a rank that said why: the others (None) were only left waiting for it
            answers = said
        elif any(answer is None for answer in answers):
            codes = [proc.exitcode for proc in self.procs]
            self._stop()
            if self.device == "cuda":  # a GPU out of memory raises in the worker; a dead worker is a crash
                raise RuntimeError(f"a worker died (exit codes {codes}) measuring {spec}")
            raise PointOOM(f"worker killed (exit codes {codes}), most likely out of memory")
        for status, payload in answers:
            if status != "ok" and self.world > 1:
                self._stop()  # the other ranks may still wait for it
            if status == "oom":
                raise PointOOM(payload)
            if status == "unsupported":
                raise PointUnsupported(payload)
            if status == "error":
                raise RuntimeError(f"measurement failed for {spec}:\n{payload}")
        results = [payload for _, payload in answers]
        if self.world == 1:
            return results[0]
        worst = {name: None if results[0][name] is None else max(r[name] for r in results)
                 for name in ("ms", "comm_ms", "peak_mib", "rss_mib")}
        return {**results[0], **worst}  # per rank: the slowest rank's time, the largest memory

    def close(self):
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                conn.send(None)
                proc.join(timeout=10)


class Workers:
    """A WorkerRunner for each number of processes that points ask for (spec["world"], default 1)."""

    def __init__(self, device, budget_bytes):
        self.device, self.budget_bytes, self.runners = device, budget_bytes, {}

    def __call__(self, spec):
        world = spec.get("world", 1)
        if world not in self.runners:
            self.runners[world] = WorkerRunner(self.device, self.budget_bytes, world)
        return self.runners[world](spec)

    def close(self):
        for runner in self.runners.values():
            runner.close()


# -----------------------------------------------------------------------------
# The sweep: declarative series, CSV written row by row


@dataclass
class Series:
    name: str  # label in the CSV, the legend and the summary
    path: str  # naive / chunked / flash / sdpa-flash / sdpa-efficient / sdpa-cudnn / ring
    causal: bool = False
    window: int | None = None
    max_n: int | None = None  # longest n for this series (None: every length of the sweep)
    chunk_size: int | tuple | None = None  # blocks of a chunked series (None: --chunk-size or the default)
    world: int = 1  # processes: a ring series cuts the sequence across `world` of them
    docs: int | None = None  # packed: documents of random lengths side by side (packed_offsets)
    default: bool = True  # in the sweep when --series names none


# The default CPU sweep, 256..16384 within about 2 minutes on 2 cores (results/cpu):
# - naive runs until the 4 GiB budget stops it: at 8192 one (H, n, n) float32 score matrix
#   is 2 GiB and the forward needs two at once;
# - chunked and flash stop at 8192, past naive's wall: 16384 would take four times as long
#   again (quadratic time) for the four curves;
# - chunked-window256 has linear time, so it alone goes on to 16384 and shows a linear-memory
#   path at twice naive's wall;
# - chunked-causal stops at 4096, where its block-skipping speed-up shows;
# - flash-window256 stops at 4096: SDPA takes a window only as an (n, n) mask, whose memory
#   grows as n^2;
# - ring2 and ring4 (the sequence cut across 2 and 4 processes, 1 thread each) run only when
#   --series names them: at 16384 a ring point takes minutes here.
CPU_DEFAULT_CAPS = {"chunked": 8192, "flash": 8192, "chunked-causal": 4096, "flash-window256": 4096}


def default_series(device, causal, window, caps=None):
    """naive, chunked, flash (+ each fused SDPA kernel on CUDA), chunked-causal, chunked-window<w>, flash-window<w>;
    outside the default, <path>-packed8 and -packed32 (8 or 32 documents in every row) for naive, chunked
    and flash, and ring2 and ring4 (P processes: gloo on CPU, NCCL where there are P GPUs or more).

    caps: {series name: longest n}, for series that need not go to the sweep's longest
    length to make their point.
    """
    series = [Series("naive", "naive", causal), Series("chunked", "chunked", causal), Series("flash", "flash", causal)]
    if device.type == "cuda":
        series += [Series(name, name, causal) for name in SDPA_SERIES]
    if not causal:  # block skipping, measured side by side with the dense chunked path
        series.append(Series("chunked-causal", "chunked", True))
    if window:
        series.append(Series(f"chunked-window{window}", "chunked", causal, window))
        series.append(Series(f"flash-window{window}", "flash", causal, window))  # the window as an (n, n) mask
    for docs in (8, 32):  # packed documents; chunked computes about the sum of their squared lengths
        series += [Series(f"{path}-packed{docs}", path, causal, docs=docs, default=False) for path in mt.IMPLS]
    for P in (2, 4):
        if device.type == "cpu" or torch.cuda.device_count() >= P:
            series.append(Series(f"ring{P}", "ring", causal, world=P, default=False))
    return [replace(s, max_n=(caps or {}).get(s.name)) for s in series]


def _key(row):
    return tuple(str(row[c]) for c in ("device", "dtype", "series", "mode", "B", "H", "D", "n"))


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_header(path):
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


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


def sweep(points, runner, log, done, ceiling, say=print, predict_wall=False):
    """Measure every point not in `done`; OOM stops that curve, any other error stops the run.

    predict_wall: no limit holds the worker to its budget (an OS without RLIMIT_AS), so a point
    whose curve's last allocator peak, times (n / n_last)^2, exceeds the budget is recorded as out
    of memory without running: no path here grows faster than n^2, so this never lets a point
    run that would need more.
    """
    stopped = set()  # (series, mode) that ran out of memory at a smaller n
    last_peak = {}  # (series, mode): (n, peak MiB) of its last point measured
    total = len(points)
    for i, p in enumerate(points, 1):
        base = {c: p.get(c, "") for c in COLUMNS}
        label = f"[{i}/{total}] {p['series']} {p['mode']} n={p['n']}"
        if _key(base) in done:
            say(f"{label}: already measured, skipped (--resume)")
            continue
        curve, budget_mib = (p["series"], p["mode"]), 1024 * float(p.get("mem_budget_gib") or "inf")
        if curve in stopped:
            row = {**base, "status": "skipped: oom or unsupported at smaller n"}
        else:
            try:
                if predict_wall and curve in last_peak:
                    n0, peak = last_peak[curve]
                    if peak * (p["n"] / n0) ** 2 > budget_mib:
                        raise PointOOM(f"predicted: {peak:.0f} MiB at n={n0} x (n/{n0})^2 = "
                                       f"{peak * (p['n'] / n0) ** 2:.0f} MiB > the budget (no RLIMIT_AS here)")
                r = runner(p)
                last_peak[curve] = (p["n"], r["peak_mib"])
                flops = computed_flops(p)
                tflops = flops / (r["ms"] / 1e3) / 1e12
                row = {**base, "kernel": r["kernel"], "ms": f"{r['ms']:.3f}", "peak_mib": f"{r['peak_mib']:.1f}",
                       "comm_ms": "" if r.get("comm_ms") is None else f"{r['comm_ms']:.3f}",
                       "rss_mib": "" if r.get("rss_mib") is None else f"{r['rss_mib']:.1f}",
                       "tflops": f"{tflops:.4f}", "pct_matmul": f"{100 * tflops / ceiling:.1f}",
                       "pairs": f"{computed_pairs(p) / p['n'] ** 2:.4f}", "status": "ok"}
                rss = "" if r.get("rss_mib") is None else f" (RSS {r['rss_mib']:.0f} MiB)"
                say(f"{label}: {r['ms']:.1f} ms, {r['peak_mib']:.0f} MiB{rss} ({r['kernel']})")
            except PointOOM as e:
                stopped.add((p["series"], p["mode"]))
                row = {**base, "status": f"oom: {e}"[:120]}
                say(f"{label}: out of memory ({str(e)[:60]}), curve stops here")
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
    "rss_slope": log-log slope of rss_mib (CPU), "time": log-log slope of ms}}, over the largest n;
    None where this range cannot tell (supported_exponent).

    RSS gets the plain slope: its few MiB of noise would swamp the differences that the
    growth exponent is made of."""
    res = {}
    for key, rs in _ok_rows(rows).items():
        ns = [int(r["n"]) for r in rs]
        col = lambda name: [float(r[name]) if r.get(name) else float("nan") for r in rs]  # noqa: E731
        res[key] = {"memory": supported_exponent(ns, col("peak_mib"), NOISE["peak_mib"], growth=True),
                    "memory_slope": supported_exponent(ns, col("peak_mib"), NOISE["peak_mib"]),
                    "rss_slope": supported_exponent(ns, col("rss_mib"), NOISE["rss_mib"]),
                    "time": supported_exponent(ns, col("ms"), NOISE["ms"])}
    return res


def _exp(p):
    return "cannot tell" if p is None else f"{p:.2f}"


def memory_wall(rows):
    """[(series, mode, longest n that ran, first n out of memory or None, budget GiB or None)] per curve."""
    walls = {}
    for r in rows:
        key = (r["series"], r["mode"])
        ok, oom, budget = walls.get(key, (None, None, None))
        n = int(r["n"])
        if r["status"] == "ok":
            ok = max(ok or 0, n)
        elif r["status"].startswith("oom"):
            oom = min(oom or n, n)
        walls[key] = (ok, oom, r.get("mem_budget_gib") or budget)
    return [(s, m, ok, oom, float(b) if b else None) for (s, m), (ok, oom, b) in walls.items()]


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
    walls = memory_wall(rows)
    budgets = {b for *_, b in walls if b}
    budget_mib = 1024 * budgets.pop() if len(budgets) == 1 else None  # runs resumed under another budget: no line
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]  # a panel for each mode measured

    def panels():
        return plt.subplots(1, len(modes), figsize=(12 if len(modes) > 1 else 10, 4.8), sharey=True, squeeze=False)

    for what, col, unit in (("memory", "peak_mib", "peak memory above the inputs (MiB, allocator)"),
                            ("time", "ms", "time (ms)")):
        fig, (axes,) = panels()
        for ax, mode in zip(axes, modes):
            for s in series:
                if rs := curves.get((s, mode)):
                    ax.loglog([int(r["n"]) for r in rs], [max(float(r[col]), 1e-3) for r in rs], "-", base=2,
                              label=f"{s} (exponent {_exp(fits[(s, mode)][what])})", **style[s])
            if what == "memory" and budget_mib:  # the wall: the budget, and where each curve hit it
                ax.axhline(budget_mib, color="gray", ls="--", lw=1, label=f"memory budget {budget_mib / 1024:.3g} GiB")
                for s, m, _, oom, _ in walls:
                    if m == mode and oom:
                        ax.plot([oom], [budget_mib], "X", color=colors[s], ms=10,
                                label=f"{s}: out of memory at n={oom}")
            decorate(ax, mode)
        save(fig, axes, unit, what)
    if not any(s == "naive" for s, _ in curves):  # nothing to compare with
        return files
    fig, (axes,) = panels()
    for ax, mode in zip(axes, modes):
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


def _ratio(row, base, col):
    """row[col] / base[col] as "1.23x"; "-" without a base row."""
    return f"{float(row[col]) / max(float(base[col]), 1e-3):.2f}x" if base else "-"


def _at(curves, series, mode, n):
    for r in curves.get((series, mode), []):
        if int(r["n"]) == n:
            return r
    return None


def report(rows):
    """The summary table, the ratios and the claims checked, as Markdown text."""
    curves, fits = _ok_rows(rows), exponents(rows)
    lines = ["Memory exponent: p in memory = c + a * n^p, from successive differences of the allocator's peak "
             "(the constant c of fixed workspaces cancels); in brackets the plain log-log slope, which a constant "
             "pulls below p. RSS slope and time exponent: plain log-log slopes. Each over the "
             f"{FIT_POINTS} largest n of its curve, and given only where they span at least {MIN_SPAN}x in n and "
             f"every step up in n raised the value by more than its noise (memory {NOISE['peak_mib'][0]:g} MiB, RSS "
             f"{NOISE['rss_mib'][0]:g} MiB, time {NOISE['ms'][1]:.0%}), and for the memory exponent, only where "
             f"the successive differences follow one power (local exponents within {MAX_SPREAD} of each other); "
             "otherwise \"cannot tell\": this range cannot tell, and no number is given.", "",
             "| series | mode | largest n | ms | peak MiB | RSS MiB | TFLOP/s | % of matmul | memory exponent "
             "| RSS slope | time exponent |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (s, mode), rs in curves.items():
        r, f = rs[-1], fits[(s, mode)]
        memory = _exp(f["memory"])  # its plain slope only beside it: alone, a constant makes it look sublinear
        if f["memory"] is not None and f["memory_slope"] is not None:
            memory += f" ({f['memory_slope']:.2f})"
        lines.append(f"| {s} ({r['kernel']}) | {mode} | {r['n']} | {float(r['ms']):.1f} | {float(r['peak_mib']):.1f} | "
                     f"{r.get('rss_mib') or '-'} | {float(r['tflops']):.3f} | {r['pct_matmul']} | "
                     f"{memory} | {_exp(f['rss_slope'])} | {_exp(f['time'])} |")
    not_run = {}  # series and modes that stopped for another reason than memory: never silently absent
    for r in rows:
        if r["status"].startswith(("unsupported", "error")):
            not_run.setdefault((r["series"], r["mode"]), f"n={r['n']}: {r['status']}")
    if not_run:
        lines += ["", "Not measured (from that n on): " + "; ".join(f"{s} {m} at {why}" for (s, m), why in
                                                               not_run.items())]
    if any(r["dtype"] in ("bfloat16", "float16") for r in rows):
        dtype = next(r["dtype"] for r in rows if r["dtype"] in ("bfloat16", "float16"))
        paths = {r["path"] for r in rows}
        said = {"naive": f"naive computes in {dtype}, as standard attention is written (scores and weights in the "
                         "input dtype; softmax accumulates in float32 inside)",
                "chunked": f"chunked multiplies {dtype} operands into float32 results (FlashAttention-2's recipe: "
                           f"P and dS rounded to {dtype} for the products, statistics and rescaling in float32)"}
        lines += ["", "Compute dtypes: " + "; ".join([said[p] for p in said if p in paths] + [
            f"the fused kernels take {dtype} and accumulate in float32"]) + "."]
    walls = [w for w in memory_wall(rows) if w[2] or w[3]]
    if walls:
        lines += ["", "## The memory wall", "",
                  "Each point ran in a worker process with a memory budget (CPU: its address space above its size "
                  "before the point; CUDA: the caching allocator's cap); a point that needed more ran out of memory "
                  "and its curve stopped there. \"-\": did not run out within this sweep.", "",
                  "| series | mode | longest n within budget | first n that ran out | budget |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {s} | {m} | {ok or '-'} | {oom or '-'} | {f'{b:.4g} GiB' if b else 'not recorded'} |"
                  for s, m, ok, oom, b in walls]
    lines += ["", "Ratios at the largest n that both paths reached (naive / path: > 1 means the path uses less "
              "memory or time):", ""]
    for mode in MODES:
        for other in [s for s, m in curves if m == mode and s != "naive" and curves[(s, m)][0]["path"] != "ring"
                      and not curves[(s, m)][0].get("docs")]:  # packed series: their own table
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
    rings = [key for key, rs in curves.items() if rs[0]["path"] == "ring"]
    if rings:
        lines += ["", "## Beyond one device", "",
                  "A ring series cuts the sequence across `world` processes (ring attention); per rank: the slowest "
                  "rank's time and the largest rank's peak memory above its inputs (its shard of q, k, v), beside "
                  "the chunked path in one process; communication: the share of the ring's time spent waiting for "
                  "K/V blocks (and, in the backward, their gradients) that compute did not hide.", "",
                  "| series | mode | n | ms | per-rank peak MiB | chunked ms | chunked peak MiB | memory / chunked "
                  "| time / chunked | communication |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s, mode in rings:
            for r in curves[(s, mode)]:
                c = _at(curves, "chunked", mode, int(r["n"]))
                comm = f"{float(r['comm_ms']) / float(r['ms']):.0%}" if r.get("comm_ms") else "-"
                lines.append(f"| {s} (P={r.get('world') or '?'}) | {mode} | {r['n']} | {float(r['ms']):.1f} | "
                             f"{float(r['peak_mib']):.1f} | {c['ms'] if c else '-'} | {c['peak_mib'] if c else '-'} | "
                             f"{_ratio(r, c, 'peak_mib')} | {_ratio(r, c, 'ms')} | {comm} |")
    packed = [key for key, rs in curves.items() if rs[0].get("docs")]
    if packed:
        lines += ["", "## Packed documents", "",
                  "Every row of n tokens packs `docs` documents of random lengths (study.packed_offsets, a fixed "
                  "seed), and a query sees only its own document. Visible: the share of the n^2 pairs inside documents "
                  "(causal: l^2 / 2 each, as FlashAttention counts); computed: the share the path computes (chunked: "
                  "every pair of the key blocks it visits, pairs across documents inside them included; naive and "
                  "flash: every pair, under an (n, n) mask). One document: the same path on one document of length "
                  "n, so the ratios show what the blocks documents hide save, not packing against padding (that is "
                  "the training's --pack).", "",
                  "| series | mode | n | visible pairs | computed pairs | ms | peak MiB | time / one document "
                  "| memory / one document |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s, mode in packed:
            for r in curves[(s, mode)]:
                n, one = int(r["n"]), _at(curves, r["path"], mode, int(r["n"]))
                offsets = packed_offsets(n, int(r["docs"]))
                visible = sum(attention_pairs(b - a, r["causal"] == "True", int(r["window"]) if r["window"] else None)
                              for a, b in zip(offsets, offsets[1:])) / n**2
                lines.append(f"| {s} | {mode} | {n} | {visible:.3f} | {float(r['pairs']):.3f} | {float(r['ms']):.1f} | "
                             f"{float(r['peak_mib']):.1f} | {_ratio(r, one, 'ms')} | {_ratio(r, one, 'peak_mib')} |")
    lines += ["", "## Claims checked", ""]
    fb = "fwd+bwd"
    if ("naive", fb) in fits:
        e = {s: fits[(s, fb)] for s in ("naive", "chunked", "flash") if (s, fb) in fits}
        known = {s: x["memory"] for s, x in e.items() if x["memory"] is not None}
        if not known:
            verdict = "this range cannot tell"
        elif (len(known) == len(e) > 1 and known["naive"] > 1.5
              and all(p < 1.5 for s, p in known.items() if s != "naive")):
            verdict = "true of the naive path only"
        else:
            verdict = "not settled by this range"
        rss = {s for s in e if any(r.get("rss_mib") for r in curves[(s, fb)])}  # none on CUDA
        lines.append(f"- \"Attention memory is O(n^2)\": {verdict}. Memory exponents "
                     "(fwd+bwd, allocator; in brackets the plain slope of the process RSS): "
                     + ", ".join(f"{s} {_exp(x['memory'])}" + (f" ({_exp(x['rss_slope'])})" if s in rss else "")
                                 for s, x in e.items()) + ".")
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


def _gib(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive size in GiB, got {text!r}")
    return value


CPU_BUDGET_GIB = 4.0  # the memory of a small GPU: naive's wall falls inside the default CPU sweep


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to measure (auto: CUDA if present)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on a GPU that computes in it natively, else float16; float32 on CPU")
    p.add_argument("--series", default=None,
                   help="comma-separated subset of series names to run (default: all for the device; see --list)")
    p.add_argument("--list", action="store_true", help="print the series of this configuration and exit")
    p.add_argument("--lengths", type=_lengths, default=None,
                   help="comma-separated sequence lengths (default: powers of two, CPU 256..16384, CUDA 512..32768)")
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
    p.add_argument("--mem-budget", type=_gib, default=None, metavar="GIB",
                   help="memory of the worker process that measures, in GiB; a point that needs more is recorded as "
                        f"out of memory (default: {CPU_BUDGET_GIB:g} on CPU, the memory of a small GPU; on CUDA the "
                        "GPU's own). Not applied to --compare")
    p.add_argument("--out", default=None,
                   help="output folder (default runs/<device>, runs/<device>-quick with --quick, runs/<device>-custom "
                        "when what is measured differs from the default sweep, runs/<device>-compare with --compare; "
                        "the committed reference, results/<device>, is written only when named here)")
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
    args = p.parse_args(argv)
    if args.window < 0:
        p.error(f"--window must be >= 0, got {args.window}")
    # is_available() only counts devices (cudaGetDeviceCount, or NVML with PYTORCH_NVML_BASED_CUDA_CHECK=1;
    # torch/cuda/__init__.py, and the "CUDA in forked subprocesses" note of PyTorch's CUDA docs): that
    # initialises the driver (cuInit), which would only matter to a forked worker (ours is spawned),
    # but creates no context and holds no GPU memory. Everything that would (device name, capability,
    # memory) is asked of the worker (describe_device).
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if args.target_seconds <= 0:
        p.error(f"--target-seconds must be positive, got {args.target_seconds}")
    return args, p


def configure(args, p):
    """(device, lengths, series) from the options; the dtype waits for the worker's answer (choose_dtype)."""
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    cpu = device.type == "cpu"
    default_sweep = not args.lengths and not args.quick
    if args.lengths:
        lengths = args.lengths
    elif args.quick:
        lengths = [256, 512, 1024]
    else:
        lengths = [2**i for i in (range(8, 15) if cpu else range(9, 16))]  # CPU 256..16384, CUDA 512..32768
    series = default_series(device, args.causal, args.window, CPU_DEFAULT_CAPS if cpu and default_sweep else None)
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
    elif not args.list:
        series = [s for s in series if s.default]
    return device, lengths, series


def choose_dtype(requested, device, native_bf16):
    if requested != "auto":
        return requested
    if device.type == "cuda":  # emulated bfloat16 (T4, V100) is slower than float16 there
        return "bfloat16" if native_bf16 else "float16"
    return "float32"


# What is measured: a run that changes any of these is not the default sweep
MEASURED = ("dtype", "series", "lengths", "batch", "tokens", "heads", "head_dim", "causal", "window", "mode",
            "chunk_size", "mem_budget", "target_seconds")


def out_dir(args, p, device):
    """Where a run writes: --out, else a folder under runs/ (git-ignored) named for the kind of run.

    results/<device> holds the committed reference: a run that replaced its plots and
    summary unasked, or a --quick run that set its CSV aside, would pass for new reference
    data; so it is written only when --out names it.
    """
    if args.out:
        return args.out
    if args.compare:
        kind = "-compare"
    elif args.quick:
        kind = "-quick"
    elif any(getattr(args, name) != p.get_default(name) for name in MEASURED):
        kind = "-custom"
    else:
        kind = ""
    return os.path.join("runs", device.type + kind)


def compare(args, info, dtype, lengths, series, B, modes, runner, out, command):
    """--compare: interleaved side-by-side timing; prints and writes <out>/compare.md, rewritten after
    every (n, mode), so that a run stopped early keeps what it measured."""
    lines = [f"# Side-by-side timing ({args.rounds} interleaved rounds, median)", "",
             f"{info['label']}, {dtype}, torch {torch.__version__}, B={B}, H={args.heads}, D={args.head_dim}",
             "", f"Command: `{command}`", ""]
    path = os.path.join(out, "compare.md")
    for n in lengths:
        for mode in modes:
            spec = {"kind": "compare", "device": info["device"], "dtype": dtype, "B": B, "H": args.heads,
                    "D": args.head_dim, "n": n, "mode": mode, "rounds": args.rounds,
                    "series_list": [{**asdict(s), "series": s.name,
                                     "chunk_size": s.chunk_size or args.chunk_size} for s in series]}
            start = len(lines)
            lines += [f"## n={n}, {mode}", ""]
            try:
                res = runner(spec)
            except (PointOOM, PointUnsupported) as e:  # recorded; the other lengths and modes still run
                lines += [f"Not measured: {'out of memory' if isinstance(e, PointOOM) else 'unsupported'}: {e}", ""]
            else:
                names = list(res)
                lines += ["| series | kernel | median ms |", "| --- | --- | --- |"]
                lines += [f"| {m} | {res[m]['kernel']} | {1e3 * statistics.median(res[m]['times']):.1f} |"
                          for m in names]
                lines += ["", "| time(a) / time(b), median of per-round ratios | ratio |", "| --- | --- |"]
                for i, a in enumerate(names):
                    for b in names[i + 1:]:
                        ratio = statistics.median(x / y for x, y in zip(res[a]["times"], res[b]["times"]))
                        lines.append(f"| {a} / {b} | {ratio:.2f}x |")
                lines.append("")
            print("\n".join(lines[start:]))
            with open(path, "w") as f:
                f.write("\n".join(lines))
    print(f"wrote {path}")


def main(argv=None, runner=None):
    """Run the sweep; `runner(spec) -> result` may be injected (tests), else a WorkerRunner measures."""
    args, p = parse_args(argv)
    command = "python study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.compare:  # its own defaults: the side-by-side point
        args.lengths = args.lengths or [4096]
        args.series = args.series or "flash,chunked,chunked-causal"
    device, lengths, series = configure(args, p)
    if args.list:
        print("\n".join(s.name + ("" if s.default or args.series else "  (only when --series names it)")
                        for s in series))
        return
    out = out_dir(args, p, device)
    os.makedirs(out, exist_ok=True)
    if args.report:
        return _report_only(p, out, command)
    modes = MODES if args.mode == "both" else (args.mode,)
    batch = args.batch or (1 if device.type == "cpu" else 4)
    budget_gib = None if args.compare else args.mem_budget or (CPU_BUDGET_GIB if device.type == "cpu" else None)
    if runner is None:  # the worker processes start at their first measurement, not here
        runner = Workers(device.type, budget_gib and int(budget_gib * 2**30))
    try:
        info = {**runner({"kind": "device", "device": device.type}), "device": device.type}
        dtype = choose_dtype(args.dtype, device, info["bf16"])
        if args.compare:
            return compare(args, info, dtype, lengths, series, batch, modes, runner, out, command)
        if device.type == "cuda":  # a budget above the GPU's memory is the GPU's memory
            budget_gib = min(budget_gib or math.inf, info["memory_bytes"] / 2**30)
        elif budget_gib * 2**30 > info["memory_bytes"]:
            print(f"warning: --mem-budget {budget_gib:g} GiB is more than the {info['memory_bytes'] / 2**30:.1f} GiB "
                  "available now: the OS may stop the worker first (also recorded as out of memory)")
        return _sweep_and_report(args, p, info, dtype, lengths, series, batch, modes, budget_gib, runner, out,
                                 command)
    finally:
        if isinstance(runner, Workers):
            runner.close()


def _report_only(p, out, command):
    csv_path = os.path.join(out, "study.csv")
    rows = read_rows(csv_path)
    if not rows:
        p.error(f"--report: no measurements in {csv_path}")
    r = rows[0]  # the title from what was measured, not from this machine
    title = f"{r['device']}, {r['dtype']}, torch {r['torch']}, B={r['B']}, H={r['H']}, D={r['D']}"
    if r.get("mem_budget_gib"):
        title += f", memory budget {float(r['mem_budget_gib']):.4g} GiB"
    note = f"report redrawn from {csv_path}; command: `{command}`"
    summary = os.path.join(out, "summary.md")
    if os.path.exists(summary):  # the sweep's own time and command are measurements too: kept
        with open(summary) as f:
            note = "".join(line.strip().split("; report redrawn")[0] + "; " for line in f
                           if line.startswith("sweep took ")) + note
    return write_report(csv_path, out, title, note)


def _sweep_and_report(args, p, info, dtype, lengths, series, batch, modes, budget_gib, runner, out, command):
    csv_path = os.path.join(out, "study.csv")
    title = (f"{info['label']}, {dtype}, torch {torch.__version__}, "
             f"{f'B={batch}' if not args.tokens else f'B*n={args.tokens}'}, H={args.heads}, D={args.head_dim}"
             f"{', causal' if args.causal else ''}, memory budget {budget_gib:.4g} GiB")
    if args.resume and os.path.exists(csv_path) and read_header(csv_path) != COLUMNS:
        p.error(f"--resume: {csv_path} has other columns than this version writes; run without --resume "
                "(the old CSV is then set aside, not overwritten)")
    log = CsvLog(csv_path, args.resume)
    done = {_key(r) for r in read_rows(csv_path) if r["status"] == "ok"} if args.resume else set()
    t0 = time.time()
    try:
        ceiling = runner({"kind": "matmul", "device": info["device"], "dtype": dtype,
                          "N": 2048 if info["device"] == "cpu" else 8192, "seconds": 2.0})["tflops"]
        points = [{"device": info["label"], "torch": torch.__version__, "dtype": dtype, "series": s.name,
                   "path": s.path, "mode": mode, "causal": s.causal, "window": s.window, "docs": s.docs,
                   "H": args.heads, "D": args.head_dim, "n": n, "B": max(1, args.tokens // n) if args.tokens else batch,
                   "world": s.world,
                   "matmul_tflops": f"{ceiling:.4f}", "mem_budget_gib": f"{budget_gib:.3f}",
                   "chunk_size": s.chunk_size or args.chunk_size, "min_repeats": 1 if args.quick else 3,
                   "target_s": 0.2 if args.quick else args.target_seconds}
                  for n in lengths for s in series for mode in modes
                  if s.max_n is None or n <= s.max_n]  # n outermost: paths side by side
        print(f"study: {title}; {len(points)} points -> {csv_path}")
        print(f"matmul ceiling: {ceiling:.3f} TFLOP/s ({dtype}, measured now)")
        sweep(points, lambda pt: runner({**pt, "device": info["device"]}), log, done, ceiling,
              predict_wall=info["device"] == "cpu" and not LINUX_MEMORY)
    finally:
        log.close()
    note = f"sweep took {time.time() - t0:.0f} s; command: `{command}`"
    if info["device"] == "cpu" and not LINUX_MEMORY:
        note += ("\n\nNot measured on this OS: rss_mib (it needs Linux's /proc/self to reset and read a peak RSS). "
                 "The memory wall is predicted (no RLIMIT_AS here): a point is not run when its curve's last "
                 "allocator peak, times (n / n_last)^2, exceeds the budget.")
    write_report(csv_path, out, title, note)


def write_report(csv_path, out, title, note):
    """Plots and summary.md from the CSV alone, so that they can be redrawn without measuring (--report)."""
    rows = read_rows(csv_path)
    text = f"# Attention scaling study\n\n{title}\n\n{note}\n\n" + report(rows) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:  # first: a plotting failure must not lose it
        f.write(text)
    files = plot(rows, out, title)
    print("\n" + text)
    print("wrote " + ", ".join([os.path.join(out, "summary.md")] + files))


if __name__ == "__main__":
    main()
