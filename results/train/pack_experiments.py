"""The figures behind the README's paragraph on --pack: python results/train/pack_experiments.py

1. the pairs chunked computes in a packed row (2048 tokens, blocks of 256) against a padded batch (64 x 32);
2. recompilations under --pack --compile over 50 steps, every step with new boundaries, for each path;
3. tokens/s of 400 steps of --pack --impl chunked at four block sizes (the median of the 50-step lines).
"""
import dataclasses
import os
import statistics
import sys

import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import minitransformer as mt  # noqa: E402
import train as tr  # noqa: E402

pairs, real = [], []
for seed in range(20):
    x, _, cu = tr.packed_reverse_batch(2048, 4, 32, 32, torch.Generator().manual_seed(seed),
                                       torch.Generator().manual_seed(seed))
    visibility = mt.Visibility(mt.named_rules(cu_seqlens=cu, L=2048))
    pairs.append(sum((rows.stop - rows.start) * (cols.stop - cols.start) for rows in mt._blocks(2048, 256)
                     for cols in visibility.key_blocks(rows, 2048, 256)))
    real.append((x != tr.PAD).float().mean().item())
print(f"20 packed rows: chunked computes {statistics.mean(pairs) / (64 * 32 * 32):.2f}x the pairs of a padded "
      f"64 x 32 batch; {100 * statistics.mean(real):.2f}% of the packed tokens are real")

quiet = lambda *args, **kwargs: None  # noqa: E731
for impl in mt.IMPLS:
    torch._dynamo.reset()
    counters.clear()
    tr.train(tr.TrainConfig(impl=impl, pack=True, compile_model=True, steps=50, log_every=50, eval_every=50,
                            heatmap=None), log=quiet)
    print(f"--pack --compile --impl {impl}, 50 steps: {counters['stats']['unique_graphs']} graph(s), "
          f"{sum(counters['recompiles'].values())} recompilations, {sum(counters['graph_break'].values())} breaks")

model_config = tr.TrainConfig.model_config
for chunk_size in (None, 128, 64, 32):
    tr.TrainConfig.model_config = lambda self, cs=chunk_size: dataclasses.replace(model_config(self), chunk_size=cs)
    lines = []
    tr.train(tr.TrainConfig(impl="chunked", pack=True, steps=400, log_every=50, eval_every=400, heatmap=None),
             log=lines.append)
    tok = [float(line.split("|")[5].split()[0].replace(",", "")) for line in lines if "tok/s" in line][1:]
    print(f"--pack --impl chunked, blocks {chunk_size or mt.default_chunk_size('cpu')[0]}: "
          f"median {statistics.median(tok):,.0f} tokens/s over steps 100-400")
