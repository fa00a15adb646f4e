"""
study.py: what attention really costs, predicted and measured on your own machine.

    python study.py                    # default sweep (CUDA if present, else CPU) -> runs/<device>/
    python study.py --quick            # smoke run, about 18 s on a 2-core CPU -> runs/<device>-quick/
    python study.py --predict --lengths 32768 --batch 8 --heads 16 --head-dim 128 --dtype bfloat16 --mem-budget 80
    python study.py --series ring2,ring4 --lengths 1024,4096    # ring attention across 2 and 4 processes
    python study.py --compare          # flash, chunked, chunked-causal timed side by side at n = 4096
    python study.py --report --out D   # redraw D's plots and summary.md from D/study.csv
    python study.py --out results/cpu  # refresh the committed reference (only ever on request)

It sweeps the sequence length n over every attention path (naive, chunked, flash, each fused SDPA
kernel on CUDA; ring, packed, ALiBi and approximate series when named), forward and forward+backward,
each point in a worker process under a memory budget, and records its time (the spread of its repeats
too), the allocator's peak above its inputs beside the memory model's (predicted_mib, cost_model.py), RSS and
TFLOP/s, row by row into <out>/study.csv; plots, exponents and summary.md follow (study_report.py). Its
manual: results/README.md.
"""

import argparse
import contextlib
import csv
import ctypes
import gc
import importlib
import inspect
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import wait

import torch

import approximate_attention as approx
import cost_model
import minitransformer as mt
import train
from cost_model import (BAND, FLEX_PATHS, MIB, SDPA_SERIES, computed_flops, computed_pairs, input_bytes,
                        packed_offsets, predicted_mib)
from study_report import MODES, NOISY, QUICK_MARK, plot, pyplot, report, spread, table

try:  # POSIX only
    import resource
except ImportError:
    resource = None
# Linux: a peak RSS that can be reset and read (/proc), and an address-space limit that the
# kernel enforces (RLIMIT_AS). Elsewhere rss_mib stays empty and the memory wall is predicted.
LINUX_MEMORY = sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs") and resource is not None

COLUMNS = ["device", "torch", "dtype", "series", "path", "kernel", "mode", "causal", "window", "docs", "alibi", "B",
           "H", "kv_heads", "D", "n", "world", "setting", "ms", "ms_min", "ms_max", "comm_ms", "peak_mib",
           "predicted_mib", "rss_mib", "tflops", "pct_matmul", "pairs", "matmul_tflops", "mem_budget_gib", "status",
           "noise", "error_random", "error_trained", "uniform_random", "uniform_trained"]


# -----------------------------------------------------------------------------
# Measuring one point (in a worker process)


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
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _proc_kib(field, path="/proc/self/status"):
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in {path}")


def _available_bytes():
    """Memory available now (Linux), else the machine's physical memory, else None."""
    with contextlib.suppress(OSError, RuntimeError):  # no /proc/meminfo, or no MemAvailable (Linux < 3.14)
        return _proc_kib("MemAvailable", "/proc/meminfo") * 1024
    with contextlib.suppress(AttributeError, ValueError, OSError):  # Windows
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class _CpuPeak:
    """Peak resident memory of this process during a call, above its resident size before it (Linux).

    Inside the block, blocks over 128 KiB are mmapped and unmapped when freed, and free heap memory is returned
    first (malloc_trim), so every byte the call needs shows up as new resident memory. Afterwards the thresholds
    are set to the largest values glibc's dynamic thresholds reach (mmap 32 MiB, trim 64 MiB): setting them
    switches that adjustment off, so the timed calls run with malloc caching every block below 32 MiB, as a
    long-running glibc process ends up doing."""

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
        if self.libc:
            self.libc.mallopt(M_MMAP_THRESHOLD, 32 * MIB)
            self.libc.mallopt(M_TRIM_THRESHOLD, 64 * MIB)


@contextlib.contextmanager
def _profiled(**kwargs):
    """The profiler on the CPU: torch.profiler.profile's own, without the wrapper, whose start imports torch's
    compiler (2 s). Its start and stop each log a line to file descriptor 2 (Kineto, below Python), which would
    drown the study's own output: those two go to the null device."""
    prof = torch.autograd.profiler.profile(use_cpu=True, use_kineto=True, **kwargs)

    def quietly(call, *args):
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        try:
            call(*args)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)
    quietly(prof.__enter__)
    try:
        yield prof
    finally:
        quietly(prof.__exit__, None, None, None)


class _AllocPeak:
    """Peak bytes held by PyTorch's CPU allocator during a call, from its own record of every
    allocation and free (the profiler's memory events): tensors only, exact, no OS noise. The peak is the
    largest rise above the lowest point before it: a free of a block made before the call is no part of its
    peak, and the profiler may report one with the size of what an earlier measurement made at that address."""

    def __enter__(self):
        self.profiling = _profiled(profile_memory=True)
        self.prof = self.profiling.__enter__()
        return self

    def __exit__(self, *exc):
        self.profiling.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in self.prof.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        held = low = peak = 0
        for _, nbytes in events:  # frees come as negative sizes
            held += nbytes
            low = min(low, held)
            peak = max(peak, held - low)
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
    kw = dict(is_causal=spec["causal"], window_size=spec["window"], cu_seqlens=cu_seqlens,
              alibi_slopes=mt.alibi_slopes(spec["H"]).to(q.device) if spec.get("alibi") else None,
              **({"enable_gqa": True} if k.size(1) != q.size(1) else {}))
    path = spec["path"]
    if path in SDPA_SERIES:  # one fused kernel forced, if this GPU and these inputs allow it
        backend = mt._KERNELS[SDPA_SERIES[path]]
        chosen = None
        with contextlib.suppress(RuntimeError), torch.nn.attention.sdpa_kernel(backend):
            chosen = mt._chosen_kernel(q, k, v, None, 0.0, spec["causal"], None)
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
        import ring_attention  # here, in the worker: importing it loads torch's compiler (1.5 s) at once
        return (lambda: ring_attention.ring_attention(q, k, v, is_causal=spec["causal"])), "ring"
    if path in FLEX_PATHS:
        return _flex_call(spec, q, k, v), path
    if path in approx.STRATEGIES:
        strategy = approx.STRATEGIES[path](spec["setting"], q.size(-2), q.size(-1)).to(q.device, q.dtype)
        return (lambda: strategy(q, k, v, is_causal=spec["causal"])), path
    return (lambda: mt.naive_attention(q, k, v, **kw)[0]), "naive"


def _flex_call(spec, q, k, v):
    """A flex series' step: its score_mod, a tanh softcap or a learned relative bias table (a gradient in
    fwd+bwd), and with documents or causality a BlockMask (documents, causal inside each), built in the step by
    the path's own create_block_mask (ours at the chunked path's blocks, torch's at its 128): its cost counts."""
    n, path, tf = q.size(-2), spec["path"], torch.nn.attention.flex_attention
    if path != "flex" and spec["mode"] == "fwd+bwd" and q.device.type == "cpu":
        raise PointUnsupported("torch's flex_attention has no backward on a CPU")
    if spec["mod"] == "softcap":
        score_mod = lambda s, b, h, i, j: 30 * torch.tanh(s / 30)  # noqa: E731 (Gemma 2's cap)
    else:
        table = torch.zeros(2 * n - 1, device=q.device, requires_grad=spec["mode"] == "fwd+bwd")
        score_mod = lambda s, b, h, i, j: s + table[i - j + n - 1]  # noqa: E731
    if path == "torch-flex-compiled":
        if q.dtype == torch.float64 and q.device.type == "cpu":
            raise PointUnsupported("torch's compiled flex_attention takes float32 or 16 bits on a CPU")
        # compiled afresh for each point (past 8 graphs Dynamo would run it eagerly), with static shapes
        # (made dynamic by a second length, torch 2.13's CPU flex kernel fails to compile)
        torch.compiler.reset()
    attend = ({"flex": mt.flex_attention, "torch-flex": tf.flex_attention}.get(path)
              or torch.compile(tf.flex_attention, dynamic=False, fullgraph=True))
    if not (spec.get("docs") or spec["causal"]):
        return lambda: attend(q, k, v, score_mod)
    offsets = packed_offsets(n, spec["docs"]) if spec.get("docs") else [0, n]
    docs = mt.documents(torch.tensor(offsets), n, q.device)[0]
    mask_mod = lambda b, h, i, j: (docs[i] == docs[j]) & ((i >= j) | (not spec["causal"]))  # noqa: E731
    if path == "flex":
        return lambda: attend(q, k, v, score_mod, mt.create_block_mask(mask_mod, None, None, n, n, q.device,
                                                                       cost_model.chunk_sizes(spec)))
    return lambda: attend(q, k, v, score_mod, tf.create_block_mask(mask_mod, None, None, n, n, q.device))


class _Workload:
    """Inputs of one (B, H, n, D) point and steps that run a series on them, synchronised."""

    def __init__(self, spec):
        self.device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
        B, H, n, D = spec["B"], spec["H"], spec["n"] // spec.get("world", 1), spec["D"]  # ring: this rank's shard
        self.train = spec["mode"] == "fwd+bwd"
        g = torch.Generator(device=self.device).manual_seed(0)
        self.q, self.k, self.v = (torch.randn(B, heads, n, D, device=self.device, dtype=dtype, generator=g)
                                  .requires_grad_(self.train) for heads in (H, *[spec.get("kv_heads") or H] * 2))
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

    def peak(self, step, meter):
        """A step's peak memory in MiB, as `meter` (_CudaPeak, _AllocPeak, _CpuPeak) reads it."""
        self.clear_grads()
        with meter:
            step()
        return meter.mib


def _warm_up(work, step, kernel, path):
    """One whole step, backward included, before anything is measured.

    For a forced SDPA kernel it is also the check: SDPA only says which kernel it would choose for the
    forward; a backward that this GPU cannot run (some head dims need a newer architecture) fails only when
    called. A plain RuntimeError (what the kernels' own checks raise) is this device's answer: unsupported.
    Out of memory stays out of memory; subclasses (a CUDA fault, not implemented) and failures of other
    series are bugs."""
    work.clear_grads()
    try:
        step()
    except RuntimeError as e:
        if path not in SDPA_SERIES or type(e) is not RuntimeError or _is_oom(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PointUnsupported(f"SDPA's {kernel} kernel failed here: {first}"[:150]) from e


def measure_point(spec):
    """Time and peak memory of one (series, mode, n) point; returns a dict of results."""
    work = _Workload(spec)
    step, kernel = work.step_for(spec)
    cuda = work.device.type == "cuda"
    if spec["path"] in SDPA_SERIES or cuda:  # cuBLAS / cuDNN workspaces: one-time, not this point's memory
        _warm_up(work, step, kernel, spec["path"])
    peak = work.peak(step, _CudaPeak() if cuda else _AllocPeak())  # on CPU this call is also the warm-up
    rss = work.peak(step, _CpuPeak()) if not cuda and LINUX_MEMORY else None
    first = work.timed(step)
    reps = max(spec["min_repeats"] - 1, min(20, int(spec["target_s"] / max(first, 1e-6))) - 1)
    if spec["path"] == "ring":  # every rank must run the same number of ring calls
        reps = spec["min_repeats"] - 1
    times = [1e3 * t for t in [first] + [work.timed(step) for _ in range(reps)]]
    ms = statistics.median(times)
    comm = ms * _ring_wait_share(work, step) if spec["path"] == "ring" and not cuda else None
    errors = _errors(spec, work) if spec["path"] in approx.STRATEGIES and spec["mode"] == "fwd" else {}
    lo_hi = (min(times), max(times)) if len(times) > 1 else (None, None)  # one repeat shows no spread
    return {"kernel": kernel, "ms": ms, "ms_min": lo_hi[0], "ms_max": lo_hi[1], "comm_ms": comm,
            "peak_mib": peak, "rss_mib": rss, **errors}


def _errors(spec, work):
    """A strategy's error (approximate_attention.error_of) on the point's random q, k, v, and on those of the last
    layer of an encoder trained on the reversal task (spec["trained"]), which carry what random ones lack; beside
    each, uniform attention's, which knows nothing of q and k."""
    make = approx.STRATEGIES[spec["path"]]
    inputs = {"random": (work.q, work.k, work.v),
              "trained": approx.trained_inputs(spec["trained"], spec["n"], work.device)}
    return {f"{who}_{name}": approx.error_of(strategy, q, k, v, spec["causal"]) for name, (q, k, v) in inputs.items()
            for who, strategy in (("error", make(spec["setting"], q.size(-2), q.size(-1)).to(q.device, q.dtype)),
                                  ("uniform", approx.uniform_attention))}


def _ring_wait_share(work, step):
    """The share of one ring step spent waiting for K/V blocks (and their gradients) that compute did not
    hide: the "ring_attention.wait" regions over the step's own time, both from one profiled call (the
    profiler slows it, so its absolute times are not the timed ones). CPU only: NCCL's wait does not block."""
    work.clear_grads()
    t0 = time.perf_counter()
    with _profiled() as prof:
        step()
    total_us = 1e6 * (time.perf_counter() - t0)
    return min(1.0, sum(e.cpu_time_total for e in prof.key_averages() if e.key == "ring_attention.wait") / total_us)


def measure_compare(spec):
    """Interleaved timing of several series on the same inputs: round r runs every series once, in a
    rotated order, so that a slow spell of a shared machine hits them all alike."""
    work = _Workload(spec)
    steps = {s["series"]: work.step_for({**spec, **s}) for s in spec["series_list"]}
    for s in spec["series_list"]:
        _warm_up(work, *steps[s["series"]], s["path"])
    names = list(steps)
    times = {name: [] for name in names}
    for r in range(spec["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(work.timed(steps[name][0]))
    return {name: {"kernel": steps[name][1], "times": times[name]} for name in names}


def measure_matmul(spec):
    """TFLOP/s of a square matmul in the sweep's dtype: the practical ceiling of this device. The best rate over
    `seconds` of repeats (on a shared machine, the one least disturbed by other work), at size N, or at the
    first of the doubling sizes from 128 whose product takes over a tenth of `seconds`, timed after one to
    warm up (a first product also pays for new pages and waking threads): a dtype the device only emulates
    (bfloat16 on a CPU without native support: a minute at 2048) takes seconds, not minutes."""
    device, dtype, N = torch.device(spec["device"]), getattr(torch, spec["dtype"]), 128
    while True:
        a, b = (torch.randn(N, N, device=device).to(dtype) for _ in range(2))
        a @ b  # the warm-up
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if N >= spec["N"] or time.perf_counter() - t0 > spec["seconds"] / 10:
            break
        N *= 2
    times, t_end = [], time.perf_counter() + spec["seconds"]
    while len(times) < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"tflops": 2 * N**3 / min(times) / 1e12, "N": N}


def emulated(rate, N, dtype):
    """What a matmul rate (measure_matmul's) timed on a product smaller than N x N says of a 16-bit dtype: this
    device emulates it, so slowly that it took the smaller product (None where it is N x N's, or for float32,
    which every device computes natively: there a slow or busy machine took it)."""
    if rate.get("N", N) < N and dtype != "float32":
        return f"the matmul rate is a {rate['N']} x {rate['N']} product's, not {N} x {N}: this device emulates {dtype}"
    return None


def native_bf16():
    """Whether this GPU computes in bfloat16 natively (compute capability 8.0 on): torch.cuda.is_bf16_supported()
    also says yes where bfloat16 is only emulated (T4, V100), and slow; a torch without including_emulation=
    gets the capability asked."""
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability()[0] >= 8


def describe_device(spec):
    """The device's label, native bfloat16, memory and CPU threads, asked in the worker so that the
    parent process never creates a CUDA context of its own beside the worker's."""
    info = {"threads": torch.get_num_threads()}
    if spec["device"] == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {**info, "label": f"cuda:{props.name}", "bf16": native_bf16(), "memory_bytes": props.total_memory}
    label = f"cpu:{_cpu_name()} ({torch.get_num_threads()} threads)"
    return {**info, "label": label, "bf16": True, "memory_bytes": _available_bytes()}


def _cpu_name():
    """The CPU's model (Linux's /proc/cpuinfo), else what platform knows of it: bfloat16 depends on it (AMX)."""
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return platform.processor() or platform.machine()


# -----------------------------------------------------------------------------
# Workers: one process per point (a process group for a ring series), under a memory budget


def _cap_address_space(budget_bytes):
    """Out of memory above budget_bytes more than this process holds now (RLIMIT_AS): an allocation error,
    recorded, instead of the OS's OOM killer or swapping. Set again before every point, as a GPU's memory is
    empty at the start of each. What malloc can give back of earlier points' memory goes back first
    (malloc_trim); free chunks it keeps still count in the address space and may be reused beyond the budget,
    and thread stacks and new arenas count against it: the budget holds to some tens of MiB."""
    if libc := _libc():
        libc.malloc_trim(0)
    limit, hard = _proc_kib("VmSize") * 1024 + budget_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _worker(conn, device, budget_bytes, rank, world, store, linux_memory):
    global LINUX_MEMORY
    LINUX_MEMORY = linux_memory  # the parent's answer (tests simulate another OS there)
    if world > 1:  # one rank of a ring series: a process group, the cores shared among the ranks
        if device == "cuda":  # before the process group: NCCL binds to the current device
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}",
                                             rank=rank, world_size=world)
    if budget_bytes and device == "cuda":  # the caching allocator's cap for this process
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))
    elif budget_bytes:  # what takes address space when first used (some 290 MiB: thread pools, malloc's
        with _AllocPeak():  # arenas, the profiler) takes it here, once, so that no point's budget pays
            x = torch.randn(2048, 2048, requires_grad=True)
            (x @ x).sum().backward()
            mt.chunked_attention(*[x[None, None, :8, :8]] * 3).sum().backward()
    while (spec := conn.recv()) is not None:
        try:
            paths = {spec.get("path"), *(s["path"] for s in spec.get("series_list", ()))}  # --compare's: a list
            if paths & {"ring", "torch-flex", "torch-flex-compiled"}:  # they import torch's compiler (70 MiB of
                importlib.import_module("torch._dynamo")  # address space): here, outside the point's budget
            if budget_bytes and device == "cpu" and LINUX_MEMORY:
                _cap_address_space(budget_bytes)
            measure = {"matmul": measure_matmul, "compare": measure_compare,
                       "device": describe_device}.get(spec.get("kind"), measure_point)
            conn.send(("ok", measure(spec)))
        except PointUnsupported as e:
            conn.send(("unsupported", str(e)))
        except Exception as e:  # only OOM is data; anything else goes back as a failure
            conn.send(("oom", str(e).splitlines()[0][:200]) if _is_oom(e) else ("error", traceback.format_exc()))


class WorkerRunner:
    """Runs measurements in `world` separate processes (a process group for a ring series), restarted if
    the OS kills one; a point for another number of processes (spec["world"]) goes to a runner of its own."""

    def __init__(self, device, budget_bytes, world=1):
        self.device, self.budget_bytes, self.world, self.procs, self.conns = device, budget_bytes, world, [], []
        self.others = {}  # world: WorkerRunner

    def start(self):
        self._stop()  # the processes of an earlier start, if any
        ctx = mp.get_context("spawn")  # a fresh interpreter: no state, threads or heap from the parent
        store = os.path.join(tempfile.mkdtemp(prefix="study-ring-"), "store")
        pipes = [ctx.Pipe() for _ in range(self.world)]
        self.conns = [conn for conn, _ in pipes]
        self.procs = [ctx.Process(target=_worker, daemon=True, args=(child, self.device, self.budget_bytes, rank,
                                                                     self.world, store, LINUX_MEMORY))
                      for rank, (_, child) in enumerate(pipes)]
        for proc in self.procs:
            proc.start()

    def _stop(self):
        for proc in self.procs:
            proc.kill()
            proc.join()
        self.procs = []

    def _answers(self):
        """Each rank's (status, payload), None for a rank that died; after a rank fails the others may
        wait in the ring for ever: a minute at most."""
        pending, answers, deadline = dict(enumerate(self.conns)), {}, None
        while pending and (ready := wait(list(pending.values()),
                                         None if deadline is None else max(0.0, deadline - time.time()))):
            for i in [i for i, conn in pending.items() if conn in ready]:
                try:
                    answers[i] = pending.pop(i).recv()
                except (EOFError, ConnectionResetError):  # the worker died mid-point
                    answers[i] = None
                if answers[i] is None or answers[i][0] != "ok":
                    deadline = deadline or time.time() + 60
        return [answers.get(i) for i in range(self.world)]

    def __call__(self, spec):
        if (world := spec.get("world", 1)) != self.world:  # its processes start at its first point
            return self.others.setdefault(world, WorkerRunner(self.device, self.budget_bytes, world))(spec)
        if not self.procs or not all(proc.is_alive() for proc in self.procs):
            self.start()
        for conn in self.conns:
            conn.send(spec)
        answers = self._answers()
        said = [answer for answer in answers if answer is not None and answer[0] != "ok"]
        if not said and None in answers:  # no rank said why: a dead worker
            codes = [proc.exitcode for proc in self.procs]
            self._stop()
            if self.device == "cuda":  # a GPU out of memory raises in the worker; a dead worker is a crash
                raise RuntimeError(f"a worker died (exit codes {codes}) measuring {spec}")
            raise PointOOM(f"worker killed (exit codes {codes}), most likely out of memory")
        for status, payload in said:  # a rank that said why: the others (None) were only left waiting
            if self.world > 1:
                self._stop()
            if status == "error":
                raise RuntimeError(f"measurement failed for {spec}:\n{payload}")
            raise (PointOOM if status == "oom" else PointUnsupported)(payload)
        results = [payload for _, payload in answers]
        worst = {name: None if results[0][name] is None else max(r[name] for r in results)
                 for name in ("ms", "ms_min", "ms_max", "comm_ms", "peak_mib", "rss_mib") if name in results[0]}
        return {**results[0], **worst}  # per rank: the slowest rank's time, the largest memory

    def close(self):
        """Tell every worker to stop. Not waited for: each exits on its own (a daemon process, ended at the
        parent's exit if it has not), while the parent goes on (write_report)."""
        for other in self.others.values():
            other.close()
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                conn.send(None)


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
    alibi: bool = False  # ALiBi's bias, alibi_slopes of the H heads
    gqa: int | None = None  # grouped-query attention: k and v with the largest divisor of H up to H / gqa heads
    setting: int | None = None  # an approximate strategy's stride, rank or ratio (approximate_attention)
    mod: str | None = None  # a flex series' score_mod: "softcap" or "relbias" (_flex_call)
    default: bool = True  # in the sweep when --series names none


# The default CPU sweep, 256..16384 within about a minute on 2 cores (results/cpu): naive until the 1 GiB
# budget stops it (at 4096 each of its two (H, n, n) float32 score matrices is 512 MiB); chunked, flash,
# chunked-causal and flash-window256 (an (n, n) mask) to 4096, where naive ran out; chunked-window256, linear in
# time, on to 16384.
CPU_DEFAULT_CAPS = {"chunked": 4096, "flash": 4096, "chunked-causal": 4096, "flash-window256": 4096}
# approximate_attention's strategies and settings (a stride of about sqrt(n), two ranks, two ratios)
APPROXIMATE = [("strided", 64), ("strided", 128), ("linear", None), ("lowrank", 64), ("lowrank", 256),
               ("compressed", 4), ("compressed", 16)]


def default_series(device, causal, window, caps=None, gpus=None):
    """naive, chunked, flash (+ each fused SDPA kernel on CUDA), chunked-causal, chunked-window<w>, flash-window<w>;
    outside the default (run when --series names them): packed, ALiBi, grouped-query, approximate,
    FlexAttention and ring series. gpus: the GPUs a ring series may use (default: the count here); caps:
    {series name: longest n}."""
    series = [Series("naive", "naive", causal), Series("chunked", "chunked", causal), Series("flash", "flash", causal)]
    if device.type == "cuda":
        series += [Series(name, name, causal) for name in SDPA_SERIES]
    if not causal:  # block skipping, measured side by side with the dense chunked path
        series.append(Series("chunked-causal", "chunked", True))
    if window:  # flash: the window as an (n, n) mask
        series += [Series(f"{path}-window{window}", path, causal, window) for path in ("chunked", "flash")]
    for docs in (8, 32):  # packed documents; chunked computes about the sum of their squared lengths
        series += [Series(f"{path}-packed{docs}", path, causal, docs=docs, default=False) for path in mt.IMPLS]
    series += [Series(f"{path}-alibi", path, causal, alibi=True, default=False) for path in ("chunked", "flash")]
    series += [Series(f"{path}-gqa8", path, causal, gqa=8, default=False) for path in ("chunked", "flash")]
    series += [Series(f"{path}{setting or ''}", path, causal, setting=setting, default=False)
               for path, setting in APPROXIMATE if not causal or path != "lowrank"]  # low rank is never causal
    if not causal:  # their causal forms beside them, as chunked-causal
        series += [Series(f"{path}{setting or ''}-causal", path, True, setting=setting, default=False)
                   for path, setting in APPROXIMATE if path != "lowrank"]
    for path in FLEX_PATHS:  # a softcap on 4 documents, causal inside each; a learned relative bias
        series += [Series(f"{path}-causal-packed4-softcap", path, True, docs=4, mod="softcap", default=False),
                   Series(f"{path}-relbias", path, causal, mod="relbias", default=False)]
    series.append(Series("chunked-causal-packed4", "chunked", True, docs=4, default=False))  # flex-softcap's mask
    gpus = torch.cuda.device_count() if gpus is None else gpus
    series += [Series(f"ring{P}", "ring", causal, world=P, default=False) for P in (2, 4)
               if device.type == "cpu" or gpus >= P]  # P processes: gloo on CPU, NCCL on P GPUs
    return [replace(s, max_n=(caps or {}).get(s.name)) for s in series]


def _key(row):
    return tuple(str(row[c]) for c in ("device", "dtype", "series", "mode", "B", "H", "D", "n"))


RUN_COLUMNS = ("device", "torch", "dtype", "H", "D", "mem_budget_gib")  # one value in a study.csv
SERIES_COLUMNS = ("path", "causal", "window", "docs", "alibi", "kv_heads", "world", "setting")  # one per series


def resume_conflict(rows, todo):
    """Why --resume may not add todo's points to the CSV rows (None: it may): a row of another device, torch,
    dtype, H, D or budget, or of a series this run defines otherwise (its B too, at a point both have),
    would share curves and tables with this run's."""
    mine, at = {t["series"]: t for t in todo}, {_key(t): t for t in todo}
    text = lambda v: "" if v is None else str(v)
    for r in rows if todo else ():
        t = at.get(_key(r)) or mine.get(r["series"]) or todo[0]
        cols = RUN_COLUMNS + SERIES_COLUMNS * (r["series"] in mine) + ("B",) * (_key(r) in at)
        if diff := [c for c in cols if text(r[c]) != text(t[c])]:
            return (f"it holds {r['series']} {r['mode']} n={r['n']} with " + ", ".join(f"{c}={r[c]}" for c in diff)
                    + "; this run has " + ", ".join(f"{c}={text(t[c])}" for c in diff))
    return None


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
        new = not os.path.exists(path)
        self.f = open(path, "a", newline="")
        self.w = csv.DictWriter(self.f, COLUMNS)
        if new:
            self.w.writeheader()

    def write(self, row):
        self.w.writerow(row)
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self):
        self.f.close()


_FORMATS = {".3f": ("ms", "ms_min", "ms_max", "comm_ms"), ".1f": ("peak_mib", "rss_mib", "predicted_mib", "pct_matmul"),
            ".4f": ("tflops", "pairs"), ".3e": COLUMNS[-4:]}  # how a measured row is written (.3e: the errors)


def _measured_once_more(p, r, runner, remeasure=True):
    """(result, noise): a point whose repeats spread wider than NOISY is measured once more, and the run of
    the two that spread less is kept; noise says so, with the other run's median and spread (so nothing
    measured is lost), and "noisy" where both spread wider than NOISY. remeasure=False (--quick): only marked."""
    if (first := spread(r)) is None or first <= NOISY:
        return r, ""
    if not remeasure:
        return r, QUICK_MARK
    try:
        again = runner(p)
    except (PointOOM, PointUnsupported) as e:  # the first run stands, marked
        return r, f"noisy, measured twice; the second run failed: {e}"[:120]
    kept, other = (again, r) if spread(again) < first else (r, again)
    noise = f"measured twice; the other run: {other['ms']:.3f} ms, spread {spread(other):.2f}x"
    return kept, ("noisy, " if spread(kept) > NOISY else "") + noise


def sweep(points, runner, log, done, ceiling, threads, predict_wall=False, remeasure=True):
    """Measure every point not in `done`; OOM stops that curve, any other error stops the run. A point whose
    repeats spread wide is measured once more, unless remeasure=False (_measured_once_more).

    predict_wall: no limit holds the worker to its budget (an OS without RLIMIT_AS), so a point whose predicted
    peak and inputs, times the model's band (BAND[1]: the most it may be off), exceed the budget is recorded
    as out of memory without running (a point no model covers runs unguarded)."""
    stopped = set()  # (series, mode) that ran out of memory, or is unsupported, at a smaller n
    for i, p in enumerate(points, 1):
        base = {c: p.get(c, "") for c in COLUMNS}
        label = f"[{i}/{len(points)}] {p['series']} {p['mode']} n={p['n']}"
        if _key(base) in done:
            print(f"{label}: already measured, skipped (--resume)")
            continue
        if (p["series"], p["mode"]) in stopped:
            log.write({**base, "status": "skipped: oom or unsupported at smaller n"})
            continue
        try:
            if predict_wall and (need := predicted_mib(p, threads)) is not None:
                need = BAND[1] * (need + input_bytes(p) / MIB)
                if need > 1024 * float(p["mem_budget_gib"]):
                    raise PointOOM(f"predicted: {need:.0f} MiB with the inputs and the model's margin > the "
                                   "budget (no RLIMIT_AS here)")
            r, noise = _measured_once_more(p, runner(p), runner, remeasure)
            predicted = predicted_mib({**p, "kernel": r["kernel"]}, threads)
            tflops = computed_flops(p) / (r["ms"] / 1e3) / 1e12
            measured = {**r, "predicted_mib": predicted, "tflops": tflops, "pct_matmul": 100 * tflops / ceiling,
                        "pairs": computed_pairs(p) / p["n"] ** 2}
            row = {**base, "kernel": r["kernel"], "noise": noise, "status": "ok", **{
                c: "" if measured.get(c) is None else format(measured[c], f) for f, cs in _FORMATS.items() for c in cs}}
            rss = "" if r.get("rss_mib") is None else f", RSS {r['rss_mib']:.0f}"
            model = "not modelled" if predicted is None else f"predicted {predicted:.0f}"
            said = f", {noise.split(';')[0]}" if noise else ""
            print(f"{label}: {r['ms']:.1f} ms, {r['peak_mib']:.0f} MiB ({model}{rss}) ({r['kernel']}){said}")
        except (PointOOM, PointUnsupported) as e:
            stopped.add((p["series"], p["mode"]))
            oom = isinstance(e, PointOOM)
            row = {**base, "status": f"{'oom' if oom else 'unsupported'}: {e}"[:120]}
            print(f"{label}: out of memory ({str(e)[:60]}), curve stops here" if oom
                  else f"{label}: {e}, series skipped")
        log.write(row)


# -----------------------------------------------------------------------------
# Command line


def _checked(parse, valid, expected):
    """An argparse type: parse(text) where valid(value), else an error that says what was expected."""
    def convert(text):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return convert


_positive_int = _checked(int, lambda x: x >= 1, "a positive integer")
_lengths = _checked(lambda text: sorted({int(x) for x in text.split(",") if x}), lambda ns: ns and min(ns) >= 1,
                    "comma-separated positive lengths")
def _block_sizes(text):
    """256 -> (256, 256), 256x512 -> (256, 512): the query and key blocks of the chunked path."""
    sizes = tuple(int(x) for x in text.lower().split("x"))
    return sizes * 2 if len(sizes) == 1 else sizes


_chunk_size = _checked(_block_sizes, lambda sizes: len(sizes) == 2 and min(sizes) >= 1,
                       "a block size like 256 or 256x512 (queries x keys)")
_gib = _checked(float, lambda x: 0 < x < math.inf, "a positive size in GiB")
CPU_BUDGET_GIB = 1.0  # naive's wall falls inside the default CPU sweep, at n = 4096 (CPU_DEFAULT_CAPS)
TARGET_SECONDS = {False: 0.5, True: 0.2}  # --target-seconds's default, by --quick


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to measure, or with --predict what to predict for (auto: CUDA if present)")
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
    p.add_argument("--window", type=_checked(int, lambda x: x >= 0, "a window >= 0"), default=256,
                   help="window of the sliding-window series (0: no such series)")
    p.add_argument("--mode", choices=["fwd", "fwd+bwd", "both"], default="both",
                   help="forward (inference, no autograd graph), forward+backward, or both")
    p.add_argument("--chunk-size", type=_chunk_size, default=None,
                   help="blocks of the chunked path, 256 or 256x512 (queries x keys); default: its own")
    p.add_argument("--mem-budget", type=_gib, default=None, metavar="GIB",
                   help="memory of the worker process that measures, in GiB; a point that needs more is recorded as "
                        f"out of memory (default: {CPU_BUDGET_GIB:g} on CPU, where naive's wall falls at n = 4096; "
                        "on CUDA the GPU's own). Not applied to --compare")
    p.add_argument("--out", default=None,
                   help="output folder (default runs/<device>, or runs/<device>-quick, -custom (what is measured "
                        "differs from the default sweep), -compare; results/<device> is written only when named here)")
    p.add_argument("--resume", action="store_true", help="keep <out>/study.csv and skip the points it already has")
    p.add_argument("--quick", action="store_true", help="smoke run: three short lengths, few repeats")
    p.add_argument("--predict", action="store_true",
                   help="measure nothing (but this machine's matmul rate): print the memory model's peak, the FLOPs, "
                        "whether it fits --mem-budget and a time lower bound, for every series and mode")
    p.add_argument("--compare", action="store_true",
                   help="instead of the sweep: time the series side by side, interleaved round by round, at each "
                        "--lengths (default 4096), and report their time ratios (default series: flash, chunked, "
                        "chunked-causal)")
    p.add_argument("--rounds", type=_positive_int, default=10, help="rounds of --compare")
    p.add_argument("--report", action="store_true",
                   help="measure nothing: redraw plots and summary.md from <out>/study.csv")
    p.add_argument("--target-seconds", type=_checked(float, lambda x: 0 < x < math.inf, "a positive time"),
                   help=f"time spent on repeats per point, up to 20 repeats (default {TARGET_SECONDS[False]:g}, "
                        f"{TARGET_SECONDS[True]:g} with --quick; at least 2 timed repeats, 1 with --quick)")
    args = p.parse_args(argv)
    # is_available() only counts devices (cudaGetDeviceCount, or NVML with PYTORCH_NVML_BASED_CUDA_CHECK=1):
    # it initialises the driver but creates no context and holds no GPU memory. Everything that would
    # (device name, capability, memory) is asked of the worker (describe_device).
    if args.device == "cuda" and not args.predict and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if args.tokens and args.batch:
        p.error("--tokens sets B = tokens // n at each length: not with --batch")
    if args.compare and args.quick:  # --quick's lengths and repeats are the sweep's
        p.error("--quick is the sweep's smoke run: --compare takes --rounds (default 10) and --lengths instead")
    return args, p


def configure(args, p):
    """(device, lengths, series) from the options; the dtype waits for the worker's answer (choose_dtype)."""
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    cpu = device.type == "cpu"
    full = [2**i for i in (range(8, 15) if cpu else range(9, 16))]  # CPU 256..16384, CUDA 512..32768
    lengths = args.lengths or ([256, 512, 1024] if args.quick else full)
    caps = CPU_DEFAULT_CAPS if cpu and not args.lengths and not args.quick and not args.predict else None
    series = default_series(device, args.causal, args.window, caps, gpus=4 if args.predict else None)
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
        if len({x.name for x in chosen}) < len(chosen):
            p.error(f"--series names a series twice: {args.series}")
        series = chosen
    elif not args.list and not args.predict:
        series = [s for s in series if s.default]
    for ring in (x for x in series if x.world > 1):  # each of P ranks holds n / P tokens: all of them
        if any(n % ring.world for n in lengths):
            p.error(f"{ring.name} splits n over {ring.world} ranks: --lengths must be multiples of {ring.world}, "
                    f"got {','.join(map(str, lengths))}")
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
    """--out, else a folder under runs/ (git-ignored) named for the kind of run: results/<device> holds the
    committed reference, and a run that replaced it unasked would pass for new reference data."""
    default = {"target_seconds": TARGET_SECONDS[args.quick]}  # given as it would be by default: not custom
    custom = any(getattr(args, name) not in (p.get_default(name), default.get(name)) for name in MEASURED)
    kind = "-compare" if args.compare else "-quick" if args.quick else "-custom" if custom else ""
    return args.out or os.path.join("runs", device.type + kind)


def points(args, device_label, dtype, lengths, series, batch, modes, **extra):
    """One dict per (n, series, mode) to measure or predict, n outermost: paths side by side."""
    return [{"device": device_label, "torch": torch.__version__, "dtype": dtype, "series": s.name, "path": s.path,
             "mode": mode, "causal": s.causal, "window": s.window, "docs": s.docs, "alibi": s.alibi, "H": args.heads,
             "kv_heads": next(d for d in range(max(1, args.heads // (s.gqa or 1)), 0, -1) if args.heads % d == 0),
             "D": args.head_dim, "n": n, "B": max(1, args.tokens // n) if args.tokens else batch, "world": s.world,
             "setting": s.setting, "mod": s.mod, "chunk_size": s.chunk_size or args.chunk_size, **extra}
            for n in lengths for s in series for mode in modes if s.max_n is None or n <= s.max_n]


def predict(args, device, lengths, series, batch, modes):
    """--predict (cost_model.predict), with this machine's matmul rate for the time bound where it has the device."""
    cpu = device.type == "cpu"
    dtype = choose_dtype(args.dtype, device, True)
    budget = args.mem_budget or (CPU_BUDGET_GIB if cpu else None)
    spec = {"device": device.type, "dtype": dtype, "N": 2048 if cpu else 8192, "seconds": 1.0}
    rate = measure_matmul(spec) if cpu or torch.cuda.is_available() else None
    if rate and (slow := emulated(rate, spec["N"], dtype)):
        print(f"({dtype} products were slow here: {slow})")
    rate = rate and rate["tflops"]
    cost_model.predict(points(args, device.type, dtype, lengths, series, batch, modes), device.type, dtype, budget,
                       rate, args.causal)


def compare(args, info, dtype, lengths, series, B, modes, runner, out, command):
    """--compare: interleaved side-by-side timing; prints and writes <out>/compare.md, rewritten after every
    (n, mode), so that a run stopped early keeps what it measured."""
    lines = [f"# Side-by-side timing ({args.rounds} interleaved rounds, median)", "",
             f"{info['label']}, {dtype}, torch {torch.__version__}, B={B}, H={args.heads}, D={args.head_dim}",
             "", f"Command: `{command}`", ""]
    path = os.path.join(out, "compare.md")
    for n in lengths:
        for mode in modes:
            spec = {"kind": "compare", "device": info["device"], "dtype": dtype, "B": B, "H": args.heads,
                    "D": args.head_dim, "n": n, "mode": mode, "rounds": args.rounds,
                    "series_list": points(args, info["device"], dtype, [n], series, B, [mode])}
            start = len(lines)
            lines += [f"## n={n}, {mode}", ""]
            try:
                res = runner(spec)
            except (PointOOM, PointUnsupported) as e:  # recorded; the other lengths and modes still run
                lines += [f"Not measured: {'out of memory' if isinstance(e, PointOOM) else 'unsupported'}: {e}", ""]
            else:
                names = list(res)
                lines += table(["series", "kernel", "median ms", "fastest - slowest ms"], [
                    [m, res[m]["kernel"], f"{1e3 * statistics.median(res[m]['times']):.1f}",
                     f"{1e3 * min(res[m]['times']):.1f} - {1e3 * max(res[m]['times']):.1f}"] for m in names])
                per_round = {(a, b): [x / y for x, y in zip(res[a]["times"], res[b]["times"])]
                             for i, a in enumerate(names) for b in names[i + 1:]}
                lines += [""] + table(["time(a) / time(b), per-round ratios", "median", "lowest - highest"], [
                    [f"{a} / {b}", f"{statistics.median(r):.2f}x", f"{min(r):.2f}x - {max(r):.2f}x"]
                    for (a, b), r in per_round.items()]) + [""]
            print("\n".join(lines[start:]))
            with open(path, "w") as f:
                f.write("\n".join(lines))
    print(f"wrote {path}")


def main(argv=None, runner=None):
    """Run the sweep; `runner(spec) -> result` may be injected (tests), else worker processes measure."""
    args, p = parse_args(argv)
    command = "python study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.compare:  # its own defaults: the side-by-side point
        args.lengths = args.lengths or [4096]
        args.series = args.series or "flash,chunked,chunked-causal"
    device, lengths, series = configure(args, p)
    modes = MODES if args.mode == "both" else (args.mode,)
    batch = args.batch or (1 if device.type == "cpu" else 4)
    if args.list:
        return print("\n".join(s.name + ("" if s.default or args.series else "  (only when --series names it)")
                               for s in series))
    if args.predict:
        return predict(args, device, lengths, series, batch, modes)
    out = out_dir(args, p, device)
    os.makedirs(out, exist_ok=True)
    if args.report:
        return _report_only(p, out, command)
    budget_gib = None if args.compare else args.mem_budget or (CPU_BUDGET_GIB if device.type == "cpu" else None)
    with contextlib.ExitStack() as stack:
        if runner is None:
            workers = WorkerRunner(device.type, budget_gib and int(budget_gib * 2**30))
            runner = stack.enter_context(contextlib.closing(workers))
            workers.start()  # they import torch and warm up for seconds, while this process loads matplotlib
            if not args.compare:
                pyplot()  # imported only: plot() finds it loaded
        info = {**runner({"kind": "device", "device": device.type}), "device": device.type}
        dtype = choose_dtype(args.dtype, device, info["bf16"])
        if args.compare:
            return compare(args, info, dtype, lengths, series, batch, modes, runner, out, command)
        if device.type == "cuda":  # a budget above the GPU's memory is the GPU's memory
            budget_gib = min(budget_gib or math.inf, info["memory_bytes"] / 2**30)
        elif budget_gib * 2**30 > (info["memory_bytes"] or math.inf):
            print(f"warning: --mem-budget {budget_gib:g} GiB is more than the {info['memory_bytes'] / 2**30:.1f} GiB "
                  "available now: the OS may stop the worker first (also recorded as out of memory)")
        report = _sweep(args, p, info, dtype, lengths, series, batch, modes, budget_gib, runner, out, command)
    write_report(*report)  # the workers told to stop: they exit while it draws


def _report_only(p, out, command):
    csv_path = os.path.join(out, "study.csv")
    rows = read_rows(csv_path)
    if not rows:
        p.error(f"--report: no measurements in {csv_path}")
    r = rows[0]  # the title from what was measured, not from this machine
    title = f"{r['device']}, {r['dtype']}, torch {r['torch']}, B={r['B']}, H={r['H']}, D={r['D']}"
    title += ", causal" * all(x["causal"] == "True" for x in rows)  # every series causal, as --causal makes them
    if r.get("mem_budget_gib"):
        title += f", memory budget {float(r['mem_budget_gib']):.4g} GiB"
    note = f"report redrawn from {csv_path}; command: `{command}`"
    if os.path.exists(summary := os.path.join(out, "summary.md")):  # the sweep's own time and command: kept
        with open(summary) as f:
            note = "".join(line.strip().split("; report redrawn")[0] + "; " for line in f
                           if line.startswith("sweep took ")) + note
    write_report(csv_path, out, title, note)


def _sweep(args, p, info, dtype, lengths, series, batch, modes, budget_gib, runner, out, command):
    """Measure every point into out/study.csv; returns write_report's arguments."""
    csv_path = os.path.join(out, "study.csv")
    title = (f"{info['label']}, {dtype}, torch {torch.__version__}, "
             f"{f'B={batch}' if not args.tokens else f'B*n={args.tokens}'}, H={args.heads}, D={args.head_dim}"
             f"{', causal' if args.causal else ''}, memory budget {budget_gib:.4g} GiB")
    if args.resume and os.path.exists(csv_path):
        with open(csv_path, newline="") as f:
            if next(csv.reader(f), []) != COLUMNS:
                p.error(f"--resume: {csv_path} has other columns than this version writes; run without "
                        "--resume (the old CSV is then set aside, not overwritten)")
        mine = points(args, info["label"], dtype, lengths, series, batch, modes, mem_budget_gib=f"{budget_gib:.3f}")
        if why := resume_conflict(read_rows(csv_path), mine):
            p.error(f"--resume: {csv_path} is another run's: {why}. Run without --resume (the old CSV is then set "
                    "aside, not overwritten), or give another --out")
    done = {_key(r) for r in read_rows(csv_path) if r["status"] == "ok"} if args.resume else set()
    code = code_version()  # before the CSV is set aside: a committed folder's would make the checkout dirty
    if done:  # the code of the points kept is not recorded: said, not credited to this run's
        code += f" (the {len(done)} points kept by --resume: their run's, not recorded)"
    with contextlib.closing(CsvLog(csv_path, args.resume)) as log:
        t0 = time.time()
        N = 2048 if info["device"] == "cpu" else 8192
        rate = runner({"kind": "matmul", "device": info["device"], "dtype": dtype, "N": N,
                       "seconds": 0.5 if args.quick else 1.0})
        ceiling, slow = rate["tflops"], emulated(rate, N, dtype)
        slow = slow and f"For the ceiling {slow}: a kernel computing in float32 inside exceeds it (pct_matmul > 100)."
        trained = os.path.join(out, "reversal.pt") if any(s.path in approx.STRATEGIES for s in series) else None
        if trained:  # the approximate series' error on a trained layer: one encoder, trained here on the CPU
            train.train(train.TrainConfig(out=trained, heatmap=None, device="cpu"), log=lambda *a: None)
        todo = points(args, info["label"], dtype, lengths, series, batch, modes, matmul_tflops=f"{ceiling:.4f}",
                      trained=trained, mem_budget_gib=f"{budget_gib:.3f}", min_repeats=1 if args.quick else 2,
                      target_s=args.target_seconds or TARGET_SECONDS[args.quick])
        print(f"study: {title}; {len(todo)} points -> {csv_path}")
        print(f"matmul ceiling: {ceiling:.3f} TFLOP/s ({dtype}, measured now)" + f"\n{slow}" * bool(slow))
        sweep(todo, lambda pt: runner({**pt, "device": info["device"]}), log, done, ceiling,
              info.get("threads"), predict_wall=info["device"] == "cpu" and not LINUX_MEMORY,
              remeasure=not args.quick)
    note = f"sweep took {time.time() - t0:.0f} s; command: `{command}`; code: {code}"
    if slow:
        note += f"\n\n{slow}"
    if info["device"] == "cpu" and not LINUX_MEMORY:
        note += ("\n\nNot measured on this OS: rss_mib (it needs Linux's /proc/self to reset and read a peak RSS). "
                 "The memory wall is predicted (no RLIMIT_AS here): a point is not run when the memory model's "
                 "peak and the inputs exceed the budget.")
    return csv_path, out, title, note


def code_version():
    """The commit of the code that measured (git describe --always --dirty), "unknown" where study.py is not
    tracked by the git checkout it sits in: a folder of results is what the code of its day measured."""
    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, cwd=here,  # noqa: E731
                                       timeout=10)
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # tracked here, not by an outer repository:
        if git("ls-files", "--error-unmatch", os.path.basename(__file__)).returncode == 0:
            return git("describe", "--always", "--dirty").stdout.strip() or "unknown"
    return "unknown"


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
    gc.freeze()  # the exit's garbage collections then skip every object alive now (torch's, matplotlib's)
