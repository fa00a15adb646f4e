"""FlexAttention's figures beside the study's flex series: the script that produced figures.md.

    python results/cpu-flex/figures.py      # from the repository root; about 4 min on 2 CPU cores

B = 1, H = 8, D = 64, float32, one process; times are medians of interleaved rounds, memory the allocator's
peak above what was live before (study._AllocPeak):
- each named option of chunked_attention beside flex_attention with the mod a user writes, fwd+bwd at n = 4096,
  the BlockMask built once at the chunked path's CPU block size (256): 10 rounds; and four causal documents
  through is_causal and cu_seqlens beside the same as a mask_mod, alone, with s / 2 as score_mod (a mod that
  is not a bias, without a tanh) and with a tanh softcap as score_mod;
- fwd+bwd memory at n = 16384: four equal documents with causality inside each and a tanh softcap through
  flex_attention, beside chunked with is_causal and cu_seqlens;
- create_block_mask (this module's) beside torch's eager one: four equal documents, causal inside each,
  B = H = None, BLOCK_SIZE 128; at n = 16384 beside one fwd+bwd of flex_attention with that mask;
- torch.compile(fullgraph=True) of an encoder layer (d_model 512, 8 heads) whose attention has a tanh softcap
  as score_mod, causal, at n = 1024: the first call's seconds (compiling, forward and backward), then one call.
"""

import os
import statistics
import sys
import time
import warnings

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # the compile time from scratch, not from an earlier run's cache
sys.path.insert(0, os.getcwd())
import minitransformer as mt  # noqa: E402
import study  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import flex_attention as torch_flex  # noqa: E402

OUT = os.path.dirname(os.path.abspath(__file__))
H, D = 8, 64


def seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(fns, rounds):
    """Median seconds of each of fns, run in alternating order for `rounds` rounds after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(seconds(fns[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def fwd_bwd(attend, q, k, v, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return lambda: attend(*leaves).backward(dout)


def named_options(n=4096, rounds=10):
    q, k, v, dout = (torch.randn(1, H, n, D) for _ in range(4))
    cu_seqlens = torch.arange(0, n + 1, n // 4)
    docs, slopes = mt.documents(cu_seqlens, n)[0], mt.alibi_slopes(H)
    block_mask = lambda mask_mod: mt.create_block_mask(mask_mod, None, None, n, n, BLOCK_SIZE=256)  # noqa: E731
    cases = {
        "causal": (dict(is_causal=True), dict(block_mask=block_mask(lambda b, h, i, j: i >= j))),
        "window 256": (dict(window_size=256), dict(block_mask=block_mask(lambda b, h, i, j: (i - j).abs() <= 256))),
        "4 documents": (dict(cu_seqlens=cu_seqlens), dict(block_mask=block_mask(lambda b, h, i, j: docs[i] == docs[j]))),
        "ALiBi": (dict(alibi_slopes=slopes), dict(score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j).abs())),
    }
    causal_named = dict(is_causal=True, cu_seqlens=cu_seqlens)  # four causal documents
    causal_docs = block_mask(lambda b, h, i, j: (docs[i] == docs[j]) & (i >= j))
    cases |= {  # then the cost of a score_mod that is not a bias on top: one without a tanh, and the softcap
        "4 causal documents": (causal_named, dict(block_mask=causal_docs)),
        "4 causal documents, + s / 2 as its mod": (causal_named, dict(
            block_mask=causal_docs, score_mod=lambda s, b, h, i, j: s / 2)),
        "4 causal documents, + tanh softcap as its mod": (causal_named, dict(
            block_mask=causal_docs, score_mod=lambda s, b, h, i, j: 30 * torch.tanh(s / 30))),
    }
    rows = []
    for name, (named, mods) in cases.items():
        t = side_by_side({"named": fwd_bwd(lambda q, k, v: mt.chunked_attention(q, k, v, **named), q, k, v, dout),
                          "mod": fwd_bwd(lambda q, k, v: mt.flex_attention(q, k, v, **mods), q, k, v, dout)}, rounds)
        rows.append(f"| {name} | {t['named'] * 1e3:.0f} | {t['mod'] * 1e3:.0f} | {t['mod'] / t['named']:.2f} |")
        print(rows[-1], flush=True)
    return rows


def peak_mib(fn):
    with study._AllocPeak() as peak:
        fn()
    return peak.mib


def builders(lengths=(8192, 16384, 65536), attend_at=16384):
    rows = []
    for n in lengths:
        docs = torch.arange(n) // (n // 4)
        mask_mod = lambda b, h, i, j: (docs[i] == docs[j]) & (i >= j)  # noqa: E731
        fns = {"ours": lambda: mt.create_block_mask(mask_mod, None, None, n, n)}
        if n <= 8192:  # torch's builds the (n, n) mask: 640 MiB at 8192
            fns["torch"] = lambda: torch_flex.create_block_mask(mask_mod, None, None, n, n, "cpu")
        t = side_by_side(fns, 3 if n <= 16384 else 1)
        mib = {name: peak_mib(fn) for name, fn in fns.items()}
        cell = lambda name: f"{t[name]:.3f} s, {mib[name]:.1f} MiB" if name in t else "-"  # noqa: E731
        attend = "-"
        if n == attend_at:  # one fwd+bwd of flex_attention with that mask and a tanh softcap
            q, k, v, dout = (torch.randn(1, H, n, D) for _ in range(4))
            block_mask, softcap = fns["ours"](), lambda s, b, h, i, j: 30 * torch.tanh(s / 30)
            attend = f"{seconds(fwd_bwd(lambda q, k, v: mt.flex_attention(q, k, v, softcap, block_mask), q, k, v, dout)):.2f} s"
        rows.append(f"| {n} | {cell('ours')} | {cell('torch')} | {attend} |")
        print(rows[-1], flush=True)
    return rows


def memory(n=16384):
    """fwd+bwd peaks: flex_attention with four equal documents, causal inside each, as mask_mod and a tanh softcap
    as score_mod (its BlockMask built inside the measured call, at the chunked path's CPU blocks, 256), beside chunked
    with is_causal and cu_seqlens (no softcap)."""
    q, k, v, dout = (torch.randn(1, H, n, D) for _ in range(4))
    cu_seqlens = torch.arange(0, n + 1, n // 4)
    docs = mt.documents(cu_seqlens, n)[0]
    mask_mod = lambda b, h, i, j: (docs[i] == docs[j]) & (i >= j)  # noqa: E731
    flex = lambda q, k, v: mt.flex_attention(  # noqa: E731
        q, k, v, lambda s, b, h, i, j: 30 * torch.tanh(s / 30),
        mt.create_block_mask(mask_mod, None, None, n, n, BLOCK_SIZE=256))
    mib = {name: peak_mib(fwd_bwd(attend, q, k, v, dout)) for name, attend in (
        ("chunked", lambda q, k, v: mt.chunked_attention(q, k, v, is_causal=True, cu_seqlens=cu_seqlens)),
        ("flex", flex))}
    row = f"| {n} | {mib['flex']:.1f} | {mib['chunked']:.1f} | {mib['flex'] / mib['chunked']:.2f} |"
    print(row, flush=True)
    return [row]


def compile_time(n=1024):
    torch.manual_seed(0)
    layer = mt.EncoderLayer(512, 8, 2048, dropout=0.0, impl="chunked",
                            score_mod=lambda s, b, h, i, j: 30 * torch.tanh(s / 30))
    x = torch.randn(1, n, 512, requires_grad=True)
    step = lambda f: torch.autograd.grad(f(x, is_causal=True).sum(), x)[0]  # noqa: E731
    compiled = torch.compile(layer, fullgraph=True)
    first = seconds(lambda: step(compiled))
    t = side_by_side({"eager": lambda: step(layer), "compiled": lambda: step(compiled)}, 5)
    error = (step(compiled) - step(layer)).abs().max().item()
    row = f"| {n} | {first:.1f} | {t['compiled'] * 1e3:.0f} | {t['eager'] * 1e3:.0f} | {error:.1e} |"
    print(row, flush=True)
    return [row]


def main():
    warnings.simplefilter("ignore")  # chunked's small-block and torch's eager-flex warnings
    torch.manual_seed(0)
    device = study.describe_device({"device": "cpu"})["label"]
    sections = [
        ("Each named option of chunked_attention and its mod through flex_attention: fwd+bwd at n = 4096, ms, "
         "medians of 10 interleaved rounds (the last two rows: a score_mod on top of the mask_mod)", "| option | named | as its mod | mod / named |\n| --- | --- | --- | --- |",
         named_options()),
        ("create_block_mask, four documents with causality inside each, B = H = None, BLOCK_SIZE 128: median of 3 "
         "interleaved rounds (1 at 65536) and the allocator's peak; beside it, one fwd+bwd of flex_attention with "
         "that mask and a tanh softcap", "| n | this module's | torch's (eager) | flex_attention fwd+bwd |\n"
         "| --- | --- | --- | --- |", builders()),
        ("fwd+bwd, allocator peak above the inputs (MiB): four equal documents, causal inside each, and a tanh "
         "softcap through flex_attention (mask_mod, score_mod; the BlockMask built in the call, BLOCK_SIZE 256), beside chunked with "
         "is_causal and cu_seqlens", "| n | flex | chunked | flex / chunked |\n| --- | --- | --- | --- |", memory()),
        ("torch.compile(fullgraph=True) of an encoder layer (d_model 512, 8 heads) with a tanh softcap as score_mod, "
         "causal, forward and backward", "| n | first call, s | compiled, ms | eager, ms | max difference of dx |\n"
         "| --- | --- | --- | --- | --- |", compile_time()),
    ]
    with open(os.path.join(OUT, "figures.md"), "w") as f:
        f.write(f"# FlexAttention's figures ({device}, float32, torch {torch.__version__}, B = 1, H = 8, D = 64)\n\n"
                "Command: `python results/cpu-flex/figures.py`\n")
        for title, header, rows in sections:
            f.write(f"\n{title}:\n\n{header}\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
