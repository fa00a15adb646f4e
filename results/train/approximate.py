"""The approximate strategies, trained: the script that produced approximate.md.

    python results/train/approximate.py       # from the repository root; about 4 min on 2 CPU cores

The reversal task (minitransformer.py's default model, optimiser and 1500 steps, seed 0: sequences of 4
to 32 tokens, padded to 32), with every layer's attention replaced by one of approximate_attention.py's
strategies at a default setting for 32 tokens, beside exact attention (the flash path). Held-out token
accuracy on 2,000 sequences training never draws from, and the training time; and each strategy's error with
its own trained parameters at the length it trained at: in every layer of its trained model, on those held-out
sequences, its output against exact attention on the same q, k, v (and uniform attention's).
"""

import contextlib
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import approximate_attention as approx  # noqa: E402
import minitransformer as mt  # noqa: E402
import train as tr  # noqa: E402
import torch  # noqa: E402
from extrapolation import train  # noqa: E402

OUT = os.path.dirname(os.path.abspath(__file__))
# at 32 tokens: a stride of about sqrt(32), a rank and a ratio that keep a quarter of the keys
SETTINGS = {"exact": None, "strided": 6, "linear": None, "lowrank": 8, "compressed": 4}
# what likely stands between each strategy and the task (readings, not tested): output i must copy input L-1-i
WHY = {
    "strided": "query i sees key L-1-i only when |L-1-2i| < 6 or L-1-2i is a multiple of 6; every other "
               "answer must travel two hops, through a position whose one vector carries it among the "
               "11 to 16 keys that position sees",
    "linear": "no softmax: with positive features phi(q).phi(k), one key's weight cannot stand out from the other "
              "31 as sharply as exp(q.k) lets it (linear, not exponential, in q.k), so the copy blurs",
    "lowrank": "every query of a head reads the same r = 8 mixtures of the values (F V): 8 slots for up to "
               "32 tokens, and E, F fixed per position while the answer's position moves with L",
    "compressed": "each key and value is one convolution over 4 neighbouring tokens: attention can pick the "
                  "group, not one token in it, unless the convolution keeps all four apart in a head's 32 dims",
}


def run(name):
    torch.manual_seed(0)
    cfg = tr.TrainConfig(heatmap=None)
    model = tr.TokenClassifier(cfg.model_config())
    if name != "exact":
        head_dim = cfg.d_model // cfg.n_heads
        approx.use_in(model.encoder, lambda: approx.STRATEGIES[name](SETTINGS[name], cfg.max_len, head_dim))
    seconds = train(model, "reverse", cfg)
    held_out = tr.reverse_batch(cfg.eval_size, cfg.min_len, cfg.max_len, cfg.vocab_size,
                                torch.Generator().manual_seed(2**40 + cfg.seed))  # train()'s own held-out set
    return tr.evaluate(model, held_out, contextlib.nullcontext), seconds, errors(model, held_out)


def errors(model, data):
    """{layer: (error, uniform attention's error)} (approximate_attention.error_of over the real tokens): the
    layer's attention on its own q, k, v (the strategy with its trained parameters) against exact attention."""
    x, _, lengths = data
    keep = mt.padding_mask(lengths, x.size(1))  # (B, 1, 1, L)
    seen, found = {}, {}
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, args, i=i: seen.setdefault(i, args[0]))
             for i, layer in enumerate(model.encoder.layers)]
    with torch.no_grad():
        model(x, keep)
        for i, layer in enumerate(model.encoder.layers):
            attn, B, L = layer.self_attn, x.size(0), x.size(1)
            q, k, v = (t.view(B, L, attn.n_heads, -1).transpose(1, 2) for t in attn.qkv(seen[i]).chunk(3, -1))
            strategy = attn.impl if callable(attn.impl) else mt.chunked_attention  # exact: the exact path itself
            found[i] = tuple(approx.error_of(f, q, k, v, keys=keep) for f in (strategy, approx.uniform_attention))
    for hook in hooks:
        hook.remove()
    return found


def main():
    results = {name: run(name) for name in SETTINGS}
    with open(os.path.join(OUT, "approximate.md"), "w") as f:
        f.write(f"# The approximate strategies, trained on the reversal task (1500 steps, seed 0, torch "
                f"{torch.__version__}, CPU, float32)\n\nCommand: `python results/train/approximate.py`\n\n"
                "minitransformer's default model (2 layers, d_model 64, 2 heads of 32), every layer's attention one "
                "strategy; one seed. Held-out token accuracy over real tokens; sequences exact: the share of the 2,000 "
                "held-out sequences with every token right.\n\n"
                "| attention | setting | held-out token accuracy | sequences exact | training seconds |\n"
                "| --- | --- | --- | --- | --- |\n")
        for name, (metrics, seconds, _) in results.items():
            f.write(f"| {name} | {SETTINGS[name] or '-'} | {metrics['accuracy']:.4f} | {metrics['seq_accuracy']:.3f} | "
                    f"{seconds:.0f} |\n")
            print(name, metrics, f"{seconds:.0f} s", flush=True)
        f.write("\nEach strategy's error with its own trained parameters at its trained length: ||out - exact|| / "
                "||exact|| over the held-out sequences' real tokens, in every layer of the model trained with it, out "
                "its attention on the layer's q, k, v and exact the exact attention on them; in brackets uniform "
                "attention's (every key alike).\n\n| attention | setting | layer 0 | layer 1 |\n| --- | --- | --- | --- |\n")
        for name, (_, _, found) in results.items():
            f.write(f"| {name} | {SETTINGS[name] or '-'} | " + " | ".join(f"{e:.3f} ({u:.3f})" for e, u in found.values())
                    + " |\n")
        short = [name for name, (metrics, _, _) in results.items() if metrics["accuracy"] < 0.99]
        f.write(f"\nBelow 0.99 held-out token accuracy: {', '.join(short) or 'none'}. What likely stands in the "
                "way:\n\n")
        f.writelines(f"- {name}: {WHY[name]}.\n" for name in short if name in WHY)


if __name__ == "__main__":
    main()
