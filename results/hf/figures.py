"""Hugging Face models on the chunked path (hf_attention, hf_block_mask): the script that produced figures.md.

    pip install transformers          # not a dependency of minitransformer: a scratch environment
    python results/hf/figures.py      # from the repository root; about 2.5 min on 2 CPU cores

1. Equality, float64. Tiny random Llama (grouped-query attention), Mistral (sliding window 6) and Gemma 2
   (tanh softcap 5, every other layer a window of 6), two rows of 24 tokens, the second with 5 padding tokens
   on the left. hf_attention with each mask function (sdpa_mask's bool mask, eager_mask's finfo.min, and
   hf_block_mask's BlockMask) against a reference written here: Hugging Face's eager attention with its
   softmax in float64 (theirs takes it in float32) and rows that see no key zeroed. Given: the largest
   relative error (|a - b| over the largest |b| of that tensor) of every layer's attention output at real
   tokens (not the logits: Hugging Face's RMSNorm computes in float32 and rounds differences away, and
   Gemma 2's norms round every sublayer's output), and of every parameter's gradient of a loss on the last
   layer's output (all but the final norm's and lm_head's), and whether 8 greedy tokens per row match
   (Gemma 2's random weights repeat one token: a weak check there). Gemma 2's query_pre_attn_scalar is not
   its head size, so that a path ignoring the scale hands it fails.
2. Memory, float32. One Llama layer (d_model 512, 8 heads, 2 K/V heads, MLP 1024, vocabulary 256), fwd+bwd
   of its logits' sum, two rows, the second with n / 8 padding tokens on the left: the allocator's peak above
   what was live before (study._AllocPeak), for transformers' eager and SDPA attention and for hf_attention
   with hf_block_mask and with sdpa_mask.
"""

import copy
import os
import sys

sys.path.insert(0, os.getcwd())
import minitransformer as mt  # noqa: E402
import study  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM  # noqa: E402
from transformers import Gemma2Config, LlamaConfig, MistralConfig  # noqa: E402
from transformers.masking_utils import eager_mask, sdpa_mask  # noqa: E402

OUT = os.path.dirname(os.path.abspath(__file__))
# registered names of their own: transformers takes any name holding "sdpa" for its SDPA route
MASKS = {"mt-bool": sdpa_mask, "mt-float": eager_mask, "mt-blocks": mt.hf_block_mask}


def reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Hugging Face's eager attention (scores, softcap, mask, softmax, values), the softmax in the inputs'
    dtype, a row that sees no key giving 0. query (B, H, L, D), key and value (B, H_kv, Lk, D) ->
    ((B, L, H, D), None). The mask: sdpa_mask's, made whole (reference_mask)."""
    assert dropout == 0.0, "the reference has no dropout"
    G = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(G, dim=1), value.repeat_interleave(G, dim=1)  # (B, H, Lk, D)
    s = query @ key.transpose(-2, -1) * scaling  # (B, H, L, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~attention_mask, float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)  # (B, H, L, 1)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return (p @ value).transpose(1, 2).contiguous(), None


def reference_mask(*args, **kwargs):
    """sdpa_mask's bool mask, never skipped for is_causal: the reference reads it whole."""
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


def register():
    AttentionInterface.register("reference", reference)
    AttentionMaskInterface.register("reference", reference_mask)
    for name, mask in MASKS.items():
        AttentionInterface.register(name, mt.hf_attention)
        AttentionMaskInterface.register(name, mask)


def tiny_configs():
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                  initializer_range=0.2)  # weights large enough that attention is far from uniform
    return {"Llama (GQA)": LlamaConfig(**common),
            "Mistral (window 6)": MistralConfig(**common, sliding_window=6),
            "Gemma 2 (softcap 5, window 6)": Gemma2Config(**common, head_dim=16, sliding_window=6,
                                                           attn_logit_softcapping=5.0,
                                                           final_logit_softcapping=None,
                                                           query_pre_attn_scalar=24)}


def model(config, attn, dtype, state=None):
    torch.manual_seed(0)  # a config of its own: from_config writes attn into it, which forward reads
    m = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn, dtype=dtype)
    if state is not None:
        m.load_state_dict(state)
    return m


def padded_batch(n, pad, vocab, gen):
    """Two rows of n token ids, the second with `pad` padding tokens (0) on the left, and its attention_mask."""
    ids = torch.randint(1, vocab, (2, n), generator=gen)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def rel(a, b):
    """|a - b| over the largest |b|; NaN anywhere in a gives NaN (so does a b of zeros)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def worst(errors):
    return torch.tensor(errors).max().item()  # NaN propagates, where Python's max would skip it


def equality():
    rows = []
    for name, config in tiny_configs().items():
        gen = torch.Generator().manual_seed(1)
        ids, mask = padded_batch(24, 5, config.vocab_size, gen)
        weights = torch.randn(2, 24, config.hidden_size, generator=gen, dtype=torch.float64)
        real = mask.bool()[..., None]  # (2, 24, 1)

        def run(m):
            attn, last = [], []  # every layer's attention output (B, L, C); the last layer's output
            hooks = [layer.self_attn.register_forward_hook(lambda module, args, out: attn.append(out[0]))
                     for layer in m.model.layers]
            hooks.append(m.model.layers[-1].register_forward_hook(lambda module, args, out: last.append(out)))
            m(ids, attention_mask=mask)
            for hook in hooks:
                hook.remove()
            (last[0] * weights).masked_fill(~real, 0.0).sum().backward()
            grads = {p_name: p.grad for p_name, p in m.named_parameters() if p.grad is not None}
            assert all(t.isfinite().all() for t in [*attn, *grads.values()]), "NaN or inf"
            new = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)[:, ids.size(1):]
            return [a.detach().masked_fill(~real, 0.0) for a in attn], grads, new
        ref = model(config, "reference", torch.float64)
        ref_hidden, ref_grads, ref_new = run(ref)
        cells = []
        for mask_name in MASKS:
            hidden, grads, new = run(model(config, mask_name, torch.float64, ref.state_dict()))
            out_error = worst([rel(a, b) for a, b in zip(hidden, ref_hidden, strict=True)])
            grad_error = worst([rel(grads[p], ref_grads[p]) for p in ref_grads])
            cells.append(f"{out_error:.1e}, {grad_error:.1e}, "
                         f"{'same' if torch.equal(new, ref_new) else 'DIFFERENT'}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    return rows


def memory(lengths=(4096, 16384)):
    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max(lengths),
                         pad_token_id=0)
    base = model(config, "sdpa", torch.float32)
    rows = []
    for n in lengths:
        ids, mask = padded_batch(n, n // 8, config.vocab_size, torch.Generator().manual_seed(2))
        cells = []
        for attn in ("eager", "sdpa", "mt-blocks", "mt-bool"):
            if attn == "eager" and n > 4096:  # its (2, 8, n, n) float32 weights: 16 GiB at 16384
                cells.append("-")
                continue
            m = model(config, attn, torch.float32, base.state_dict())
            with study._AllocPeak() as peak:
                m(ids, attention_mask=mask).logits.sum().backward()
            cells.append(f"{peak.mib:.0f}")
            del m
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    return rows


def main():
    register()
    device = study.describe_device({"device": "cpu"})["label"]
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    sections = [
        ("Equality, float64: tiny random models, two rows of 24 tokens (the second with 5 padding tokens on the "
         "left), hf_attention with each mask function against a float64 reference (Hugging Face's eager "
         "attention, softmax in float64). Each cell: the largest relative error of any layer's attention output at "
         "real tokens, of any parameter's gradient, and whether 8 greedy tokens per row match",
         "| model | sdpa_mask (bool) | eager_mask (finfo.min) | hf_block_mask (BlockMask) |\n| --- | --- | --- | --- |", equality()),
        ("Memory, float32: one Llama layer (d_model 512, 8 heads, 2 K/V heads), fwd+bwd, two rows (the second "
         "with n / 8 padding tokens on the left), the allocator's peak above what was live before, MiB",
         "| n | eager | sdpa | hf_attention + hf_block_mask | hf_attention + sdpa_mask |\n"
         "| --- | --- | --- | --- | --- |", memory()),
    ]
    with open(os.path.join(OUT, "figures.md"), "w") as f:
        f.write(f"# Hugging Face models on the chunked path ({device}, {versions})\n\n"
                "Command: `python results/hf/figures.py`\n")
        for title, header, rows in sections:
            f.write(f"\n{title}:\n\n{header}\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
