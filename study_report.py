"""
study_report.py: what a study's CSV says, written as study.py writes it (python study.py --report redraws it):
the exponent each curve supports, the plots, the memory wall, the ratios, the memory model checked point by
point, and the claims of the usual tutorial material checked against the measurements. Rows are study.csv's,
as dicts of strings (study.read_rows).
"""

import math
import os
import statistics

import approximate_attention as approx
from cost_model import BAND, CHECKED_MIB, FLEX_PATHS, MIB, attention_pairs, packed_offsets

MODES = ("fwd", "fwd+bwd")
NOISY = 1.25  # a point whose slowest repeat took over 1.25x its fastest is measured once more (not by --quick)
QUICK_MARK = "noisy, not measured again (--quick)"  # the noise column of a wide point of --quick


def spread(result):
    """The slowest repeat of a point over its fastest (1.0: all alike), or None where not recorded."""
    lo, hi = result.get("ms_min"), result.get("ms_max")
    return float(hi) / max(float(lo), 1e-9) if lo not in (None, "") and hi not in (None, "") else None


# -----------------------------------------------------------------------------
# Exponents: y ~ n^p, only where the range and the data can carry it


def fit_exponent(ns, ys, last=3):
    """Slope of log y against log n over the `last` largest n: y ~ n^slope there. The largest n, because
    fixed costs (Python overhead, library workspaces) dominate small n and say nothing of the growth."""
    pts = sorted((n, y) for n, y in zip(ns, ys) if y and y > 0)[-last:]
    if len(pts) < 2:
        return float("nan")
    return statistics.linear_regression([math.log(n) for n, _ in pts], [math.log(y) for _, y in pts]).slope


# Over two doublings fixed costs give linear paths memory "exponents" of -0.46 and 1.27 (--quick): an exponent
# spans MIN_SPAN (three doublings); MAX_SPREAD: below one block the chunked workspace still grows.
FIT_POINTS, MIN_SPAN, MAX_SPREAD = 4, 8, 0.25
NOISE = {  # (absolute, relative) that a step up in n must exceed
    "peak_mib": (0.5, 0.0),  # exact, written with 0.1 MiB: five times that
    "rss_mib": (4.0, 0.0),  # library workspaces and malloc move it by a few MiB
    "ms": (0.0, 0.25),  # runs on a shared machine differ by about 20%
}


def supported_exponent(ns, ys, noise, growth=False):
    """p in y ~ n^p over the FIT_POINTS largest n, spanning MIN_SPAN, or None where this range cannot tell.

    noise: (absolute, relative); each step up in n must raise y by more than max(absolute, relative * y).
    growth: p in y = c + a * n^p, from the successive differences: with n doubling, y(2n) - y(n) = a * n^p *
    (2^p - 1), so the constant c (fixed workspaces, one block of scores) cancels and the differences' log-log
    slope is p itself. It needs n in a geometric progression, and differences that follow one power (local
    exponents within MAX_SPREAD). A p that is not positive is not a growth law: None."""
    pts = sorted((n, y) for n, y in zip(ns, ys) if y is not None and not math.isnan(y))[-FIT_POINTS:]
    if len(pts) < FIT_POINTS or pts[-1][0] < MIN_SPAN * pts[0][0]:
        return None
    absolute, relative = noise
    if any(b[1] - a[1] <= max(absolute, relative * a[1]) for a, b in zip(pts, pts[1:])):
        return None
    if not growth:
        return fit_exponent([n for n, _ in pts], [y for _, y in pts], last=FIT_POINTS)  # positive: every step rose
    if len({round(b[0] / a[0], 6) for a, b in zip(pts, pts[1:])}) != 1:
        return None  # not geometric
    diffs = [(a[0], b[1] - a[1]) for a, b in zip(pts, pts[1:])]
    local = [math.log(d2 / d1) / math.log(n2 / n1) for (n1, d1), (n2, d2) in zip(diffs, diffs[1:])]
    if max(local) - min(local) > MAX_SPREAD:
        return None
    p = fit_exponent([n for n, _ in diffs], [d for _, d in diffs], last=len(diffs))
    return p if p > 0 else None



# -----------------------------------------------------------------------------
# Report: plots, summary, the model checked, claims


def _ok_rows(rows):
    out = {}  # {(series, mode): its measured rows, n ascending}
    for r in sorted((r for r in rows if r["status"] == "ok"), key=lambda r: int(r["n"])):
        out.setdefault((r["series"], r["mode"]), []).append(r)
    return out


def exponents(rows):
    """{(series, mode): {"memory": growth exponent of peak_mib, "memory_slope": its plain log-log slope,
    "rss_slope": log-log slope of rss_mib (CPU), "time": log-log slope of ms}}, over the largest n; None
    where this range cannot tell. RSS gets the plain slope: its few MiB of noise would swamp differences."""
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


def pyplot():
    """matplotlib.pyplot, drawing to files only (Agg); imported here, not with this module, as --predict never
    draws (study.main imports it while its workers start)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(rows, out_dir, title):
    plt = pyplot()
    curves, fits, walls = _ok_rows(rows), exponents(rows), memory_wall(rows)
    series = list(dict.fromkeys(r["series"] for r in rows))
    hue = plt.get_cmap("tab10" if len(series) <= 10 else "tab20").colors  # tab10: C0-C9; past 10 series, 20
    style = {s: dict(marker="osD^vx*P"[i % 8], fillstyle="none", color=hue[i % len(hue)]) for i, s in enumerate(series)}
    budgets = {b for *_, b in walls if b}
    budget_mib = 1024 * budgets.pop() if len(budgets) == 1 else None  # runs resumed under another budget: no line
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]  # a panel for each mode measured
    files = []

    def figure(name, ylabel, draw):
        fig, (axes,) = plt.subplots(1, len(modes), figsize=(12 if len(modes) > 1 else 10, 4.8), sharey=True,
                                    squeeze=False, layout="constrained")
        for ax, mode in zip(axes, modes):
            ax.set_title(draw(ax, mode))
            ax.set_xlabel("sequence length n")
            ax.grid(True, which="both", alpha=0.3)
            entries = len(ax.get_legend_handles_labels()[0])
            if entries > 6:  # below the panel, where it hides no curve
                ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
                fig.set_figheight(4.8 + 0.2 * entries)
            elif entries:
                ax.legend(fontsize=8)
        axes[0].set_ylabel(ylabel)
        save(fig, name)

    def save(fig, name):
        fig.suptitle(f"{name}: {title}", fontsize=10)
        if fig.get_layout_engine() is None:
            fig.tight_layout()
        files.append(os.path.join(out_dir, f"{name}.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    def curve(what, col):
        def draw(ax, mode):
            for s in series:
                if rs := curves.get((s, mode)):
                    ns, ys = [int(r["n"]) for r in rs], [max(float(r[col]), 1e-3) for r in rs]
                    ax.loglog(ns, ys, "-", base=2, label=f"{s} (exponent {_exp(fits[(s, mode)][what])})", **style[s])
                    bars = [(int(r["n"]), *(float(r[c]) for c in ("ms", "ms_min", "ms_max"))) for r in rs if spread(r)]
                    if what == "time" and bars:  # the fastest and slowest repeat of each point
                        n_, ms, lo, hi = zip(*bars)
                        ax.errorbar(n_, ms, yerr=[[m - a for m, a in zip(ms, lo)], [b - m for m, b in zip(ms, hi)]],
                                    fmt="none", ecolor=style[s]["color"], capsize=3, lw=1)
            if what == "memory" and budget_mib:  # the wall: the budget, and where each curve hit it
                ax.axhline(budget_mib, color="gray", ls="--", lw=1, label=f"memory budget {budget_mib / 1024:.3g} GiB")
                for s, m, _, oom, _ in walls:
                    if m == mode and oom:
                        ax.plot([oom], [budget_mib], "X", color=style[s]["color"], ms=10,
                                label=f"{s}: out of memory at n={oom}")
            return mode
        return draw

    def speedup(ax, mode):
        naive = {int(r["n"]): float(r["ms"]) for r in curves.get(("naive", mode), [])}
        for s in series:
            rs = [r for r in curves.get((s, mode), []) if int(r["n"]) in naive]
            if rs and s != "naive":
                ax.semilogx([int(r["n"]) for r in rs], [naive[int(r["n"])] / float(r["ms"]) for r in rs], "-",
                            base=2, label=s, **style[s])
        ax.axhline(1.0, color="gray", lw=1)
        return f"speed-up over naive, {mode}"

    figure("memory", "peak memory above the inputs (MiB, allocator)", curve("memory", "peak_mib"))
    figure("time", "time (ms; bars: fastest and slowest repeat)", curve("time", "ms"))
    if any(s == "naive" for s, _ in curves):  # else nothing to compare with
        figure("speedup", "naive time / path time", speedup)
    if trade := tradeoff(curves):  # error against time, the marker's area the square root of peak memory
        fig, ax = plt.subplots(figsize=(9, 5.4))
        n, flash, uniform = trade.pop("n"), trade.pop("flash"), trade.pop("uniform")
        ax.scatter([float(flash["ms"])], [0], s=20 * float(flash["peak_mib"]) ** 0.5, color="k", label="exact (flash)")
        for s, (r, e) in trade.items():  # each series in its colour of the other figures
            for on, face in (("random", None), ("trained", "none")):  # filled: random inputs; hollow: a trained layer's
                if e.get(f"error_{on}"):
                    ax.scatter([float(r["ms"])], [float(e[f"error_{on}"])], s=20 * float(r["peak_mib"]) ** 0.5,
                               color=style[s]["color"], facecolors=face, label=f"{s}, {on} inputs")
        for on, ls in (("random", "--"), ("trained", ":")):
            ax.axhline(uniform.get(on, math.nan), color="gray", ls=ls, lw=1, label=f"uniform attention, {on} inputs")
        ax.set(xscale="log", xlabel=f"time, fwd+bwd at n = {n} (ms)", ylabel="error ||out - exact|| / ||exact|| (fwd)",
               title=f"the trade at n = {n}: marker area ~ sqrt(peak memory, fwd+bwd, MiB)")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
        save(fig, "tradeoff")
    return files


def tradeoff(curves):
    """The approximate strategies at the largest n where flash ran fwd+bwd too, causal as flash: {series: (its fwd+bwd
    row, its fwd row, with the errors)}, "n", flash's row and uniform attention's errors ("uniform"); {} if none."""
    pairs = {(s, int(r["n"])): r for (s, m), rs in curves.items() for r in rs if m == "fwd+bwd"
             and r["path"] in approx.STRATEGIES and _flash_beside(curves, r)}
    if not pairs:
        return {}
    n = max(n for _, n in pairs)
    trade = {s: (r, _at(curves, s, "fwd", n) or {}) for (s, at), r in pairs.items() if at == n}
    uniform = {on: float(e[f"uniform_{on}"]) for _, e in trade.values() for on in ("random", "trained")
               if e.get(f"uniform_{on}")}
    return {**trade, "n": n, "flash": _at(curves, "flash", "fwd+bwd", n), "uniform": uniform}


def _time_range(row, base):
    """The range of row's time over base's that their repeats allow, or None where either lacks its spread."""
    if spread(row) is None or spread(base) is None:
        return None
    return float(row["ms_min"]) / float(base["ms_max"]), float(row["ms_max"]) / max(float(base["ms_min"]), 1e-3)


def _ratio(row, base, col):
    """row[col] / base[col] as "1.23x"; "-" where either row is missing; times with their range (_time_range)."""
    if not (row and base):
        return "-"
    limits = _time_range(row, base) if col == "ms" else None
    return f"{float(row[col]) / max(float(base[col]), 1e-3):.2f}x" + (" (%.2f-%.2f)" % limits if limits else "")


def _at(curves, series, mode, n):
    return next((r for r in curves.get((series, mode), []) if int(r["n"]) == n), None)


def _flash_beside(curves, r):  # flash's row at r's n and mode where its causality is r's: the attention r approximates
    f = _at(curves, "flash", r["mode"], int(r["n"]))
    return f if f and str(f["causal"]) == str(r["causal"]) else None


def table(header, rows):
    """A Markdown table: header cells, then one list of cells per row."""
    return ["| " + " | ".join(str(c) for c in header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _wider(x):
    """A spread wider than NOISY, with the decimals that show it wider: 1.2504x, not 1.25x (the CSV's times, to
    the microsecond, may also read as 1.25x at most)."""
    return next((f"{x:.{d}f}x" for d in range(2, 8) if float(f"{x:.{d}f}") > NOISY), f"{x:.2f}x")


def noise_report(rows):
    """The spread of the repeats: which points were measured twice (a default run's wide ones), which --quick
    only marked (it measures no point twice), and which stayed noisy."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not any(spread(r) is not None for r in ok):
        once = ok and "ms_min" in ok[0]  # the column is there, empty: one repeat each
        return ["", "Spread of the repeats: none, every point timed once (--quick, where one repeat took its target "
                "time)." if once else "Spread of the repeats: not recorded in this CSV (written before study.py did)."]
    spread_known = [r for r in ok if spread(r) is not None]
    twice = [r for r in ok if "measured twice" in r.get("noise", "")]
    failed = sum("second run failed" in r["noise"] for r in twice)
    marked = [r for r in ok if r.get("noise", "").endswith("(--quick)")]
    noisy = [f"{r['series']} {r['mode']} n={r['n']} ({_wider(spread(r))})" for r in ok
             if r.get("noise", "").startswith("noisy")]
    said = ["Spread: each point's slowest repeat over its fastest (time: their median), for the "
            f"{len(spread_known)} of {len(ok)} points timed more than once."]
    were = lambda n: f"{n} spread wider than {NOISY:g}x and {'was' if n == 1 else 'were'}"  # noqa: E731
    if twice:
        said.append(f"{were(len(twice))} measured once more, keeping the run that spread less"
                    + (f"; for {failed} the second run failed, and the first stands." if failed else "."))
    if marked:
        said.append(f"{were(len(marked))} not measured again (--quick).")
    if noisy:
        lead = (f"{len(noisy)} stayed wider after it, so their times and the ratios from them are noisy"
                if twice and not marked else f"Noisy ({len(noisy)}), and so are the ratios from their times")
        said.append(f"{lead}: {'; '.join(noisy)}.")
    else:
        said.append(f"None stayed wider than {NOISY:g}x." if twice else f"None spread wider than {NOISY:g}x.")
    return ["", " ".join(said)]


def _over_predicted(r):
    return float(r["peak_mib"]) / max(float(r["predicted_mib"]), 1e-3)


def model_report(rows, curves):
    """Measured over predicted, point by point (curves: _ok_rows(rows)), and the points outside the band."""
    rated = [r for rs in curves.values() for r in rs if r.get("predicted_mib")]
    unmodelled = {}  # "series mode (kernel)": the lengths that no model covers
    for r in (r for rs in curves.values() for r in rs if "predicted_mib" in r and not r["predicted_mib"]):
        unmodelled.setdefault(f"{r['series']} {r['mode']} ({r['kernel']})", []).append(str(r["n"]))
    paths = {r["path"] for rs in curves.values() for r in rs}
    why = ("an approximate strategy, " * bool(paths & set(approx.STRATEGIES))
           + "FlexAttention's mods and block masks (their blocks as chunked's, the mods' temporaries a few blocks, "
           "torch's eager (B, H, n, n) scores), " * bool(paths & set(FLEX_PATHS)))
    said = ["", f"Not modelled ({why}{'or ' * bool(why)}a kernel the model does not cover): "
            + "; ".join(f"{key} at n = {', '.join(ns)}" for key, ns in unmodelled.items()) + "."] if unmodelled else []
    if not rated:
        return said
    checked = [r for r in rated if float(r["peak_mib"]) >= CHECKED_MIB]
    ratios = sorted(_over_predicted(r) for r in checked)
    lines = ["", "## Measured over predicted", "",
             "The memory model (cost_model.py: naive_memory, chunked_memory, flash_memory, ring_memory) predicts each "
             "point's allocator peak above its inputs. Measured / predicted for every point; in brackets the "
             f"points below {CHECKED_MIB:g} MiB, where small tensors that the model leaves out (and on CUDA the "
             "allocator's rounding) weigh."]
    if ratios:
        worst = max(ratios, key=lambda x: abs(math.log(x)))
        lines.append(f"Over the {len(ratios)} points of {CHECKED_MIB:g} MiB or more: worst {worst:.3f}, median "
                     f"{statistics.median(ratios):.3f}, band {BAND[0]}-{BAND[1]}.")

    def cell(series, mode, n):
        if not (r := _at(curves, series, mode, n)) or not r.get("predicted_mib"):
            return ""
        return f"{_over_predicted(r):.2f}" if float(r["peak_mib"]) >= CHECKED_MIB else f"({_over_predicted(r):.2f})"
    ns = sorted({int(r["n"]) for r in rated})
    lines += [""] + table(["series", "mode"] + ns, [[s, m] + [cell(s, m, n) for n in ns] for s, m in curves
                                                     if any(cell(s, m, n) for n in ns)])
    outside = [f"{r['series']} {r['mode']} n={r['n']} ({_over_predicted(r):.2f})" for r in checked
               if not BAND[0] <= _over_predicted(r) <= BAND[1]]
    why = "not explained by the model: a defect to fix"
    if rows[0]["device"].startswith("cuda"):
        why = "not explained by the model; on CUDA the caching allocator may also count a block over 1 MiB whole"
    lines += ["", f"Outside the band: {'; '.join(outside)}; {why}." if outside else
              f"Outside the band: none of the {len(checked)} points of {CHECKED_MIB:g} MiB or more."]
    return lines + said


def report(rows):
    """The summary table, the memory wall, the ratios, the model checked and the claims, as Markdown."""
    curves, fits = _ok_rows(rows), exponents(rows)
    lines = ["Memory exponent: p in memory = c + a * n^p, from successive differences of the allocator's peak "
             "(the constant c of fixed workspaces cancels); in brackets the plain log-log slope, which a constant "
             "pulls below p. RSS slope and time exponent: plain log-log slopes. Each over the "
             f"{FIT_POINTS} largest n of its curve, and given only where they span at least {MIN_SPAN}x in n and "
             f"every step up in n raised the value by more than its noise (memory {NOISE['peak_mib'][0]:g} MiB, RSS "
             f"{NOISE['rss_mib'][0]:g} MiB, time {NOISE['ms'][1]:.0%}), and for the memory exponent, only where "
             f"the successive differences follow one power (local exponents within {MAX_SPREAD} of each other); "
             "otherwise \"cannot tell\": this range cannot tell, and no number is given.", ""]
    summary = []
    for (s, mode), rs in curves.items():
        r, f = rs[-1], fits[(s, mode)]
        memory = _exp(f["memory"])  # its plain slope only beside it: alone, a constant makes it look sublinear
        if f["memory"] is not None and f["memory_slope"] is not None:
            memory += f" ({f['memory_slope']:.2f})"
        flops = [f"{float(r['tflops']):.3f}", r["pct_matmul"]] if float(r.get("pairs") or 1) else ["-", "-"]  # no S
        summary.append([f"{s} ({r['kernel']})", mode, r["n"], f"{float(r['ms']):.1f}",
                        "-" if spread(r) is None else f"{spread(r):.2f}x", f"{float(r['peak_mib']):.1f}",
                        r.get("predicted_mib") or "-", r.get("rss_mib") or "-", *flops, memory,
                        _exp(f["rss_slope"]), _exp(f["time"])])
    lines += table(["series", "mode", "largest n", "ms", "spread", "peak MiB", "predicted MiB", "RSS MiB", "TFLOP/s",
                    "% of matmul", "memory exponent", "RSS slope", "time exponent"], summary)
    lines += noise_report(rows)
    not_run = {}  # series and modes that stopped for another reason than memory: never silently absent
    for r in rows:
        if r["status"].startswith(("unsupported", "error")):
            not_run.setdefault((r["series"], r["mode"]), f"n={r['n']}: {r['status']}")
    if not_run:
        lines += ["", "Not measured (from that n on): " + "; ".join(f"{s} {m} at {why}"
                                                               for (s, m), why in not_run.items())]
    if low := next((r["dtype"] for r in rows if r["dtype"] in ("bfloat16", "float16")), None):
        said = {"naive": f"naive computes in {low}, as standard attention is written (softmax accumulates in "
                         "float32 inside)",
                "chunked": f"chunked multiplies {low} operands into float32 results (P and dS rounded to {low} "
                           "for the products, as FlashAttention-2)"}
        lines += ["", "Compute dtypes: " + "; ".join([said[p] for p in said if any(r["path"] == p for r in rows)] + [
            f"the fused kernels take {low} and accumulate in float32"]) + "."]
    walls = [w for w in memory_wall(rows) if w[2] or w[3]]
    if walls:
        lines += ["", "## The memory wall", "",
                  "Each point ran in a worker process with a memory budget (CPU: its address space above its size "
                  "before the point; CUDA: the caching allocator's cap); a point that needed more ran out of memory "
                  "and its curve stopped there. \"-\": did not run out within this sweep.", ""]
        lines += table(["series", "mode", "longest n within budget", "first n that ran out", "budget"],
                       [[s, m, ok or "-", oom or "-", f"{b:.4g} GiB" if b else "not recorded"]
                        for s, m, ok, oom, b in walls])
    ratios = []
    for mode in MODES:
        for other in [s for s, m in curves if m == mode and s != "naive" and curves[(s, m)][0]["path"] != "ring"
                      and not curves[(s, m)][0].get("docs")]:  # packed series: their own table
            common = sorted({int(r["n"]) for r in curves.get(("naive", mode), [])} &
                            {int(r["n"]) for r in curves[(other, mode)]})
            if common:
                a, b = _at(curves, "naive", mode, common[-1]), _at(curves, other, mode, common[-1])
                ratios.append(f"- {mode} n={common[-1]}: naive/{other} memory {_ratio(a, b, 'peak_mib')}, "
                              f"time {_ratio(a, b, 'ms')}")
    if ratios:
        lines += ["", "Ratios at the largest n that both paths reached (naive / path: > 1 means the path uses "
                  "less memory or time):", ""] + ratios
    for a_name, b_name, what in [("flash", "chunked", "Throughput of the chunked path relative to the fused kernel "
                                                      "(flash time / chunked time; 1.00x = as fast)"),
                                 ("chunked", "chunked-causal", "Speed-up of causal block skipping (chunked time / "
                                                               "chunked causal time; 2x is the ideal)")]:
        ns = sorted({int(r["n"]) for m in MODES for r in curves.get((a_name, m), [])} &
                    {int(r["n"]) for m in MODES for r in curves.get((b_name, m), [])})
        if ns:
            lines += ["", f"{what}, measured side by side:", ""] + table(["n", *MODES], [
                [n] + [_ratio(_at(curves, a_name, m, n), _at(curves, b_name, m, n), "ms") for m in MODES] for n in ns])
    rings = [key for key, rs in curves.items() if rs[0]["path"] == "ring"]
    if rings:
        lines += ["", "## Beyond one device", "",
                  "A ring series cuts the sequence across `world` processes (ring attention); per rank: the slowest "
                  "rank's time and the largest rank's peak memory above its inputs (its shard of q, k, v), beside "
                  "the chunked path in one process; communication: the share of the ring's time spent waiting for "
                  "K/V blocks (and, in the backward, their gradients) that compute did not hide.", ""]
        lines += table(["series", "mode", "n", "ms", "per-rank peak MiB", "chunked ms", "chunked peak MiB",
                        "memory / chunked", "time / chunked", "communication"], [
            [f"{s} (P={r.get('world') or '?'})", mode, r["n"], f"{float(r['ms']):.1f}",
             f"{float(r['peak_mib']):.1f}", f"{float(c['ms']):.1f}" if c else "-",
             c["peak_mib"] if c else "-", _ratio(r, c, "peak_mib"), _ratio(r, c, "ms"),
             f"{float(r['comm_ms']) / float(r['ms']):.0%}" if r.get("comm_ms") else "-"]
            for s, mode in rings for r in curves[(s, mode)]
            for c in [_at(curves, "chunked", mode, int(r["n"]))]])
    def pairs(r):  # the visible and the computed share of the n^2 pairs, packed
        offsets = packed_offsets(int(r["n"]), int(r["docs"]))
        window = int(r["window"]) if r["window"] else None
        visible = sum(attention_pairs(b - a, r["causal"] == "True", window) for a, b in zip(offsets, offsets[1:]))
        return [f"{visible / int(r['n']) ** 2:.3f}", f"{float(r['pairs']):.3f}"]
    families = [  # (heading, text, member, columns, cells, plain): beside their path's plain series
        ("Packed documents", "Every row of n tokens packs `docs` documents of random lengths "
         "(cost_model.packed_offsets, a fixed seed), and a query sees only its own document. Visible: the share of "
         "the n^2 pairs inside documents (causal: l^2 / 2 each, as FlashAttention counts); computed: the share the "
         "path computes (chunked: every pair of the key blocks it visits, pairs across documents inside them "
         "included; naive and flash: every pair, under an (n, n) mask). One document: the same path on one "
         "document of length n, so the ratios show what the blocks documents hide save, not packing against "
         "padding (that is the training's --pack).",
         lambda r: r.get("docs"), ["visible pairs", "computed pairs"], pairs, "one document"),
        ("ALiBi", "ALiBi's bias, -slope * |i - j| in every head (alibi_slopes): chunked makes it block by block, "
         "flash hands SDPA the whole (H, n, n) bias in float32. Beside the same path without it:",
         lambda r: str(r.get("alibi")) == "True", [], lambda r: [], "without"),
        ("Grouped-query attention", "K and V with kv_heads heads, each serving H / kv_heads query heads "
         "(enable_gqa): chunked never repeats them, SDPA's CPU kernel neither. Beside the same path with H K/V "
         "heads (memory above the inputs, which are smaller too):",
         lambda r: r.get("kv_heads") not in (None, "", r["H"]), ["K/V heads"], lambda r: [r["kv_heads"]], "H heads")]
    for heading, text, member, columns, cells, plain in families:
        if keys := [key for key, rs in curves.items() if member(rs[0])]:
            lines += ["", f"## {heading}", "", text, ""] + table(
                ["series", "mode", "n", *columns, "ms", "peak MiB", f"time / {plain}", f"memory / {plain}"],
                [[s, mode, r["n"], *cells(r), f"{float(r['ms']):.1f}", f"{float(r['peak_mib']):.1f}",
                  _ratio(r, base, "ms"), _ratio(r, base, "peak_mib")] for s, mode in keys
                 for r in curves[(s, mode)] for base in [_at(curves, r["path"], mode, int(r["n"]))]])
    strategies = [key for key, rs in curves.items() if rs[0]["path"] in approx.STRATEGIES]
    if strategies:
        lines += ["", "## Approximate attention", "", "approximate_attention's strategies at the largest n each "
                  "reached, beside exact attention; error: ||out - exact|| / ||exact|| on the point's random q, k, v "
                  "and on those of a layer trained on the reversal task, in brackets uniform attention's (every key "
                  "alike: what knowing nothing of q and k gives). A series whose causality is not flash's gets no "
                  "ratio to it.", ""]
        error = lambda e, on: f"{e[f'error_{on}']} ({e.get(f'uniform_{on}') or '-'})" if e.get(f"error_{on}") else "-"
        pays = lambda s, mode, col: min((int(r["n"]) for r in curves[(s, mode)] if (f := _flash_beside(curves, r))
                                         and float(r[col]) < float(f[col])), default="-")  # the first n it beats flash
        lines += table(["series", "mode", "largest n", "ms", "peak MiB", "time / flash", "memory / flash",
                        "faster from n", "less memory from n", "error, random", "error, trained", "memory exponent",
                        "time exponent"], [
            [s, mode, r["n"], f"{float(r['ms']):.1f}", f"{float(r['peak_mib']):.1f}", _ratio(r, flash, "ms"),
             _ratio(r, flash, "peak_mib"), pays(s, mode, "ms"), pays(s, mode, "peak_mib"), error(e, "random"),
             error(e, "trained"), _exp(fits[(s, mode)]["memory"]), _exp(fits[(s, mode)]["time"])]
            for s, mode in strategies + [key for key in curves if key[0] in ("flash", "chunked")]
            for r in [curves[(s, mode)][-1]] for e in [_at(curves, s, "fwd", int(r["n"])) or {}]
            for flash in [_flash_beside(curves, r)]])
    return "\n".join(lines + model_report(rows, curves) + ["", "## Claims checked", ""] + claims(curves, fits))


def claims(curves, fits):
    """The claims of the usual tutorial material, checked against the measurements."""
    lines, fb = [], "fwd+bwd"
    if ("naive", fb) in fits:
        e = {s: fits[(s, fb)] for s in ("naive", "chunked", "flash") if (s, fb) in fits}
        known = {s: x["memory"] for s, x in e.items() if x["memory"] is not None}
        linear = [s for s, p in known.items() if s != "naive" and p < 1.5]  # one exact linear path refutes it
        quadratic, unknown = [s for s, p in known.items() if p >= 1.5], [s for s in e if s not in known]
        if not known:
            verdict = "this range cannot tell"
        elif known.get("naive", 0) > 1.5 and linear:
            verdict = ("true of the naive path only" if quadratic == ["naive"] and not unknown else
                       f"true of {' and '.join(quadratic)}, not of {' or '.join(linear)}"
                       + (f" ({' and '.join(unknown)}: this range cannot tell)" if unknown else ""))
        else:
            verdict = "not settled by this range"
        rss = {s for s in e if any(r.get("rss_mib") for r in curves[(s, fb)])}  # none on CUDA
        lines.append(f"- \"Attention memory is O(n^2)\": {verdict}. Memory exponents (fwd+bwd, allocator; in brackets "
                     "the plain slope of the process RSS): " + ", ".join(
                         f"{s} {_exp(x['memory'])}" + (f" ({_exp(x['rss_slope'])})" if s in rss else "")
                         for s, x in e.items()) + ".")
    one = 2048 * 2048 * 4  # bytes of one (2048, 2048) float32 matrix
    claim = (f"- \"At n=2048 one single-precision score matrix takes 16 GB\": one 2048 x 2048 float32 matrix is "
             f"{one} bytes = {one / MIB:.0f} MiB, 1/1024 of 16 GiB (the claim reads MiB as GB); 16 GiB would be "
             f"{16 * 2**30 // one} such matrices. The naive forward holds two per (batch, head), S and P "
             "(naive_memory).")
    r = _at(curves, "naive", "fwd", 2048)
    if r and (r["dtype"], r["causal"]) != ("float32", "False"):  # S and P of float32 alone, no (n, n) mask
        kind = r["dtype"] + ", causal" * (r["causal"] == "True")
        claim += f" Not measured here: this run's naive at n=2048 is {kind}."
    elif r:
        per = float(r["peak_mib"]) / (int(r["B"]) * int(r["H"]))
        claim += (f" Measured: the naive forward at n=2048 ({r['dtype']}, B={r['B']}, H={r['H']}, D={r['D']}) peaks "
                  f"at {float(r['peak_mib']):.0f} MiB above its inputs, {per:.1f} MiB per (batch, head) with its "
                  f"output, so it would reach 16 GiB at batch x heads = {16 * 1024 / per:.0f}.")
    lines.append(claim)
    for mode in MODES:
        common = sorted({int(r["n"]) for r in curves.get(("naive", mode), [])} &
                        {int(r["n"]) for r in curves.get(("flash", mode), [])})
        if common:
            a, b = _at(curves, "naive", mode, common[-1]), _at(curves, "flash", mode, common[-1])
            x = float(a["ms"]) / float(b["ms"])
            lo, hi = _time_range(a, b) or (x, x)  # the range the repeats allow decides, not the median alone
            verdict = "within" if 2 <= lo and hi <= 4 else "above" if lo > 4 else "below" if hi < 2 else "partly within"
            lines.append(f"- \"The fused kernel is 2-4x faster than the standard implementation\" ({mode}, "
                         f"n={common[-1]}, kernel {b['kernel']}): measured {_ratio(a, b, 'ms')}, {verdict} the "
                         "claimed range.")
    return lines
