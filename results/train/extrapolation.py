"""Train short, test long: the script that produced extrapolation.md and extrapolation.png.

    python results/train/extrapolation.py      # from the repository root; about 6 min on 2 CPU cores

The tutorials' claim: where long text degrades, the positional encoding is to blame, and relative or
rotary encodings are the fix. Measured here: minitransformer.py's default model and optimiser (2 layers,
d_model 64, 2 heads, 1500 steps, seed 0) trained on sequences of 4 to 32 tokens, then evaluated on
held-out sequences of 4-32, 33-48 and 49-64 tokens, for each positional encoding, on two tasks:
- reverse: output i is input L-1-i, a place that depends on the sequence's own length;
- shift: output i is input i-2 (the first two are not scored), an answer that depends only on the
  relative offset between two tokens; causal attention (query i sees keys j <= i), as in the language
  models ALiBi was made for: its bias -slope * |i - j| is the same on both sides, so without causality
  nothing in the model tells the token two places to the left from the one two places to the right.
Every model has tables for 64 positions (max_len=64): the learned one never sees positions 32-63.
"""

import contextlib
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.getcwd())
import minitransformer as mt  # noqa: E402
import train as tr  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

OUT = os.path.dirname(os.path.abspath(__file__))
TASKS, SHIFT = ("reverse", "shift"), 2
BANDS = ((4, 32), (33, 48), (49, 64))


def batch(task, B, min_len, max_len, vocab_size, gen):
    """x, y (B, max_len) and lengths: the reversal task (train.reverse_batch), or its inputs with
    y_i = x_{i - SHIFT} (padding where i < SHIFT or i >= length, which the loss and the accuracy skip)."""
    x, y, lengths = tr.reverse_batch(B, min_len, max_len, vocab_size, gen)
    if task == "shift":
        y = torch.cat([torch.full((B, SHIFT), tr.PAD), x[:, :-SHIFT]], dim=1)  # (B, max_len)
        y = y.masked_fill(torch.arange(max_len)[None, :] >= lengths[:, None], tr.PAD)
    return x, y, lengths


class Classifier(torch.nn.Module):
    """train.py's TokenClassifier, its encoder causal for the shift task: logits (B, T, vocab_size)."""

    def __init__(self, config, causal):
        super().__init__()
        self.model, self.causal = tr.TokenClassifier(config), causal

    def forward(self, x, attn_mask):
        return self.model.head(self.model.encoder(x, attn_mask, is_causal=self.causal))


def train(model, task, cfg):
    """train.py's training step (AdamW, warm-up and cosine decay, label smoothing, clipping) on `task`'s
    batches of cfg.min_len to cfg.max_len tokens, seed 0; returns the seconds it took."""
    optimizer = tr.make_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: tr.lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    gen, t0 = torch.Generator().manual_seed(0), time.time()
    for _ in range(cfg.steps):
        x, y, lengths = batch(task, cfg.batch_size, cfg.min_len, cfg.max_len, cfg.vocab_size, gen)
        logits = model(x, mt.padding_mask(lengths, x.size(1)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=tr.PAD,
                               label_smoothing=cfg.label_smoothing)
        tr.optimizer_step(loss, model, optimizer, scaler, cfg.clip)
        scheduler.step()
    return time.time() - t0


def past_trained(x, y, lengths):
    """The same sequences, scored only at the positions training never had (32 on): in the shift task, with
    causal attention, outputs 0-31 of a longer sequence see exactly what they saw in training."""
    return x, y.masked_fill(torch.arange(y.size(1)) < BANDS[0][1], tr.PAD), lengths


def run(task, pos_encoding):
    """Train on lengths 4-32; return (accuracy per band, accuracy per length 4..64, seconds)."""
    torch.manual_seed(0)
    cfg = tr.TrainConfig(pos_encoding=pos_encoding, heatmap=None)
    model = Classifier(replace(cfg.model_config(), max_len=BANDS[-1][1]), causal=task == "shift")
    seconds = train(model, task, cfg)
    held_out = torch.Generator().manual_seed(2**40)  # a stream training never draws from
    score = lambda data: tr.evaluate(model, data, contextlib.nullcontext)["accuracy"]  # noqa: E731
    data = {band: batch(task, 2000, *band, cfg.vocab_size, held_out) for band in BANDS}
    bands = {band: score(d) for band, d in data.items()}
    bands |= {(band, "past"): score(past_trained(*d)) for band, d in data.items() if band != BANDS[0]}
    per_length = {n: score(batch(task, 200, n, n, cfg.vocab_size, held_out)) for n in range(BANDS[0][0], BANDS[-1][1] + 1)}
    return bands, per_length, seconds


def main():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {(task, pos): run(task, pos) for task in TASKS for pos in mt.POS_ENCODINGS}
    for (task, pos), (bands, _, seconds) in runs.items():
        print(task, pos, {f"{a}-{b}": round(acc, 4) for (a, b), acc in bands.items()}, f"{seconds:.0f} s", flush=True)
    fig, axes = plt.subplots(1, len(TASKS), figsize=(12, 4.5), sharey=True)
    for ax, task in zip(axes, TASKS):
        for i, pos in enumerate(mt.POS_ENCODINGS):
            per_length = runs[(task, pos)][1]
            ax.plot(list(per_length), list(per_length.values()), "-o", ms=3, color=f"C{i}", label=pos)
        ax.axvspan(BANDS[0][0], BANDS[0][1], color="gray", alpha=0.12, label="trained lengths")
        ax.set_title(f"{task}" + (" (causal)" if task == "shift" else ""))
        ax.set_xlabel("sequence length")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("held-out token accuracy")
    fig.suptitle(f"Train on 4-32 tokens, test longer: 2 layers, d_model 64, 1500 steps, seed 0; torch "
                 f"{torch.__version__}, CPU, float32", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "extrapolation.png"), dpi=110)
    with open(os.path.join(OUT, "extrapolation.md"), "w") as f:
        f.write(f"# Train short, test long (1500 steps, seed 0, torch {torch.__version__}, CPU, float32)\n\n"
                "Command: `python results/train/extrapolation.py`\n\n"
                "Held-out token accuracy, 2000 sequences per band of lengths (trained on 4-32); \"32+\": the same "
                "sequences scored only at positions 32 and on, which training never had. The default model (2 layers, "
                "d_model 64, 2 heads: ALiBi's slopes 1/16 and 1/256), one seed; chance is 1/31 (31 tokens).\n\n"
                "| task | encoding | 4-32 | 33-48 | 49-64 | 33-48, 32+ | 49-64, 32+ | seconds |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- |\n")
        for (task, pos), (bands, _, seconds) in runs.items():
            cells = " | ".join(f"{acc:.4f}" for acc in bands.values())  # the bands, then the same past 32
            f.write(f"| {task} | {pos} | {cells} | {seconds:.0f} |\n")


if __name__ == "__main__":
    main()
