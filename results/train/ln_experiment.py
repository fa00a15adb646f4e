"""Post-LN vs pre-LN, measured: the script that produced ln-placement.png and ln-placement.md.

    python results/train/ln_experiment.py       # from the repository root; about 10 min on 2 CPU cores

Trains the reversal task (minitransformer.py's defaults but depth, LayerNorm placement and
warm-up) with 6 and 12 layers, post-LN (the paper) and pre-LN, with the default 100 warm-up
steps and with none; same seed, same data, same steps. Logs loss and gradient norm (before
clipping) every 10 steps, and plots them.
"""

import os
import re
import sys
import time

sys.path.insert(0, os.getcwd())
import minitransformer as mt  # noqa: E402
import train as tr  # noqa: E402

OUT = os.path.dirname(os.path.abspath(__file__))
STEPS = 800
LINE = re.compile(r"step\s+(\d+) \| loss ([\d.]+|nan|inf) \|.*\| grad norm ([\d.]+|nan|inf)")


def run(n_layers, norm_first, warmup):
    lines = []
    cfg = tr.TrainConfig(steps=STEPS, n_layers=n_layers, norm_first=norm_first, warmup=warmup, log_every=10,
                         eval_every=100, heatmap=None)
    t0 = time.time()
    try:
        result = tr.train(cfg, log=lines.append)
    except FloatingPointError as e:  # a diverged run is a result too
        result = {"accuracy": float("nan"), "error": str(e)}
    curve = [(int(s), float(l), float(g)) for s, l, g in (LINE.search(x).groups() for x in lines if LINE.search(x))]
    return curve, result, time.time() - t0


def main():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {}
    for n_layers in (6, 12):
        for norm_first in (False, True):
            for warmup in (100, 0):
                name = f"{n_layers} layers, {'pre' if norm_first else 'post'}-LN, warm-up {warmup}"
                runs[name] = run(n_layers, norm_first, warmup)
                print(name, runs[name][1], f"{runs[name][2]:.0f} s", flush=True)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, n_layers in enumerate((6, 12)):
        for name, (curve, result, _) in runs.items():
            if not name.startswith(f"{n_layers} "):
                continue
            style = dict(ls="-" if "pre-LN" in name else "--", color="C0" if "pre-LN" in name else "C3",
                         alpha=1.0 if "warm-up 100" in name else 0.55, lw=1.6 if "warm-up 100" in name else 1.2)
            label = f"{name.split(', ', 1)[1]} (accuracy {result['accuracy']:.3f})"
            axes[0, col].plot([s for s, _, _ in curve], [l for _, l, _ in curve], label=label, **style)
            axes[1, col].semilogy([s for s, _, _ in curve], [g for _, _, g in curve], **style)
        axes[0, col].set_title(f"{n_layers} layers")
        axes[0, col].legend(fontsize=8)
        axes[1, col].set_xlabel("step")
    axes[0, 0].set_ylabel("training loss (label smoothing 0.1)")
    axes[1, 0].set_ylabel("gradient norm before clipping")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"LayerNorm placement, reversal task, d_model=64, lr 2e-3, {STEPS} steps, seed 0; "
                 f"torch {mt.torch.__version__}, CPU, float32", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "ln-placement.png"), dpi=110)
    with open(os.path.join(OUT, "ln-placement.md"), "w") as f:
        f.write(f"# Post-LN vs pre-LN ({STEPS} steps, seed 0, torch {mt.torch.__version__}, CPU, float32)\n\n"
                "Command: `python results/train/ln_experiment.py`\n\n"
                "| run | held-out token accuracy | final loss | largest grad norm | seconds |\n"
                "| --- | --- | --- | --- | --- |\n")
        for name, (curve, result, seconds) in runs.items():
            f.write(f"| {name} | {result['accuracy']:.4f} | {curve[-1][1] if curve else float('nan'):.4f} | "
                    f"{max((g for _, _, g in curve), default=float('nan')):.2f} | {seconds:.0f} |\n")


if __name__ == "__main__":
    main()
