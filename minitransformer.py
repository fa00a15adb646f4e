"""
minitransformer: a Transformer encoder in one file, read top-down like a short paper.

1. The core, between "core begins" and "core ends": standard attention and FlashAttention-2's
   blockwise attention, forward and backward, in their plainest correct form, with only math and torch.
2. The model: multi-head attention, positional encodings, the encoder layer, the config and the
   encoder, and a decoder's KV cache. Training it on a task that needs attention, with mixed precision,
   checkpoints and DDP, lives in train.py, which `python minitransformer.py` runs (kept beside this file).
3. The appendix: the hardened paths that attention() runs (impl=), each tested equal to the core: the same
   maths with all that real use asks for (masks, windows, packed documents, ALiBi, FlexAttention's mods,
   dropout, 16-bit dtypes, torch.compile). naive: the textbook formula; chunked: the blockwise algorithm with
   FlashAttention-2's precision recipe; flash: PyTorch's F.scaled_dot_product_attention (SDPA), warning (or
   raising) outside torch.compile where it would fall back from its fused kernels to its unfused math kernel.
   Causality, windows, documents and ALiBi are rules over query and key positions, which Visibility composes
   for every path (chunked: with a user's mods). The input checks close the file.
ring_attention.py continues the chunked path across devices; approximate_attention.py holds the
tutorials' approximate ways out; study.py measures what each path costs, and cost_model.py predicts it.

Where each idea of a Transformer tutorial lives, in the order of the file:
    scaled dot-product attention, O(n^2)  standard_attention (core); naive_attention
    chunked computation, FlashAttention   blockwise_attention (core); chunked_attention; flash_attention
    multi-head attention, grouped heads   MultiHeadAttention (n_kv_heads)
    positional encodings                  SinusoidalPositionalEncoding, LearnedPositionalEncoding,
                                          RotaryEmbedding, alibi_slopes
    encoder layer, residuals, LayerNorm   EncoderLayer (post-LN as in the paper, or pre-LN), Encoder
    decoding: a KV cache                  KVCache (padded prompts, rollback), Encoder.kv_caches
    local, packed and your own variants   window_size=, cu_seqlens=, flex_attention (score_mod, mask_mod)

References:
1) Vaswani et al. 2017, "Attention Is All You Need": https://arxiv.org/abs/1706.03762
2) Rabe & Staats 2021, "Self-attention Does Not Need O(n^2) Memory": https://arxiv.org/abs/2112.05682
3) Dao et al. 2022, "FlashAttention": https://arxiv.org/abs/2205.14135, and Dao 2023,
   "FlashAttention-2": https://arxiv.org/abs/2307.08691
4) Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture":
   https://arxiv.org/abs/2002.04745
5) Su et al. 2021, "RoFormer" (rotary positions): https://arxiv.org/abs/2104.09864
6) Press et al. 2022, "Train Short, Test Long" (ALiBi): https://arxiv.org/abs/2108.12409
7) Dong et al. 2024, "Flex Attention" (score_mod, mask_mod, BlockMask): https://arxiv.org/abs/2412.05496
"""

import bisect
import collections
import contextlib
import functools
import math
import operator
import re
import warnings
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import AuxOutput, BlockMask

# core begins
# Attention, softmax(Q K^T / sqrt(D)) V, at its plainest, forward and backward, in float32/64. Shapes as in
# F.scaled_dot_product_attention: q (B, H, Lq, D), k (B, H_kv, Lk, D), v (B, H_kv, Lk, Dv) -> (B, H, Lq, Dv)
# (D: d_k); or q, k, v of one other ndim, q's leading dimensions and K/V's each equal or 1 (as in SDPA).
# H_kv = H, or in 4-D a divisor of H (grouped-query attention: query head h reads K/V head h // (H // H_kv)).
# A bool attn_mask, True where a query may attend, broadcasts to (B, H, Lq, Lk). is_causal: query i sees keys
# j <= i, from 0; a KV cache's new queries need attn_mask j <= i + Lk - Lq instead. A query seeing no key: 0.


def standard_attention(q, k, v, attn_mask=None, is_causal=False):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(D) + M) V,  M = 0 where a query may see a key, else -inf.

    The scores exist whole: B * H * Lq * Lk numbers, the memory that blockwise_attention saves."""
    k, v = _repeat_kv(q, k, v, attn_mask)  # inputs checked; (B, H, Lk, D): the K/V head of each query head
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # S = Q K^T / sqrt(D), (B, H, Lq, Lk)
    if is_causal:  # query i sees the keys j <= i
        later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)  # (Lq, Lk): j > i
        s = s.masked_fill(later, -math.inf)
    if attn_mask is not None:  # M = -inf, not -1e9: with -1e9 a query that sees no key would get V's mean
        s = s.masked_fill(attn_mask.logical_not(), -math.inf)
    p = torch.softmax(s, dim=-1)
    p = p.masked_fill(torch.isneginf(s).all(-1, keepdim=True), 0.0)  # no key visible: 0, not softmax's NaN
    return p @ v  # (B, H, Lq, Dv)


class BlockwiseAttention(torch.autograd.Function):
    """FlashAttention-2 (Dao 2023): softmax(Q K^T / sqrt(D) + M) V in blocks, never holding all the scores.

    Forward (its Algorithm 1). Each block of queries Q_i visits the key blocks K_j, V_j (causal: up to its
    own), keeping per query a running max m, normaliser l and unnormalised output o (M: the mask):

        S = Q_i K_j^T / sqrt(D) + M,   m' = max(m, rowmax(S)),   P~ = exp(S - m'),   a = exp(m - m'),
        l' = a l + rowsum(P~),   o' = a o + P~ V_j,   and at the end O_i = o / l,   lse = m + log(l).

    Backward (Algorithm 2). The probabilities P are recomputed from lse, the logsumexp kept per query:

        P = exp(S - lse),   dV_j += P^T dO_i,   dP = dO_i V_j^T,   Delta = rowsum(dO_i * O_i),
        dS = P * (dP - Delta),   dQ_i += dS K_j / sqrt(D),   dK_j += dS^T Q_i / sqrt(D).

    So memory is linear in the length: per query m, l, o and lse, and a few tiles of one block (S and P~
    in the forward; P, dP, dS in the backward), beside the attn_mask passed in; with is_causal the key
    blocks wholly after a query block are skipped. A torch.autograd.Function: forward saves in ctx what
    backward needs, and autograd calls backward with dO, the loss's gradient with respect to O."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, block_size):
        Lq, Lk = q.size(-2), k.size(-2)
        out, lse = (q.new_empty(*q.shape[:-1], n) for n in (v.size(-1), 1))  # (B, H, Lq, Dv) and (.., 1)
        for rows in _blocks(Lq, block_size):
            m = q.new_full((*q.shape[:-2], rows.stop - rows.start, 1), float("-inf"))  # (B, H, rows, 1)
            l = torch.zeros_like(m)
            o = q.new_zeros(*q.shape[:-2], rows.stop - rows.start, v.size(-1))  # (B, H, rows, Dv)
            for cols in _blocks(min(Lk, rows.stop) if is_causal else Lk, block_size):  # causal: j < rows.stop
                s = _block_scores(q, k, attn_mask, is_causal, rows, cols)  # (B, H, rows, cols)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # m', but 0 in a row with no key yet:
                p = torch.exp(s - m_safe)  # P~ (exp(-inf - 0) = 0, whereas S - m' = -inf + inf is NaN)
                a = torch.exp(m - m_safe)  # rescales what was summed under the old max (0 there, not NaN)
                l = a * l + p.sum(-1, keepdim=True)
                o = a * o + p @ v[..., cols, :]
                m = m_new
            out[..., rows, :] = o / l.masked_fill(l == 0, 1.0)  # a query that saw no key: o = 0, so 0
            lse[..., rows, :] = (m + torch.log(l)).masked_fill(l == 0, float("inf"))  # P = exp(S - inf) = 0
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.is_causal, ctx.block_size = is_causal, block_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward is not itself differentiated
    def backward(ctx, dout):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        size, scale = ctx.block_size, 1.0 / math.sqrt(q.size(-1))
        dq, dk, dv = torch.zeros_like(q), *(q.new_zeros(*q.shape[:-2], *t.shape[-2:]) for t in (k, v))
        delta = (dout * out).sum(-1, keepdim=True)  # Delta_i = sum_j P_ij dP_ij (all keys j) = dO_i . O_i
        for cols in _blocks(k.size(-2), size):  # keys outside, as in Algorithm 2: dK_j, dV_j summed in place
            first = cols.start // size if ctx.is_causal else 0  # causal: the first query block to reach cols
            for rows in _blocks(q.size(-2), size)[first:]:  # (query and key blocks have one size)
                s = _block_scores(q, k, attn_mask, ctx.is_causal, rows, cols)
                p = torch.exp(s - lse[..., rows, :])  # P
                dv[..., cols, :] += p.transpose(-2, -1) @ dout[..., rows, :]
                dp = dout[..., rows, :] @ v[..., cols, :].transpose(-2, -1)
                ds = p * (dp - delta[..., rows, :])  # softmax's Jacobian (diag(P) - P P^T) times dP
                dq[..., rows, :] += ds @ k[..., cols, :] * scale
                dk[..., cols, :] += ds.transpose(-2, -1) @ q[..., rows, :] * scale
        return dq, dk.sum_to_size(k.shape), dv.sum_to_size(v.shape), None, None, None  # K/V broadcast: summed


def blockwise_attention(q, k, v, attn_mask=None, is_causal=False, block_size=64):
    """standard_attention's result by BlockwiseAttention, in blocks of block_size queries and keys."""
    if block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size}")
    k, v = _repeat_kv(q, k, v, attn_mask)
    q = q.expand(*torch.broadcast_shapes(*(t.shape[:-2] for t in (q, k, v))), -1, -1)  # as out's; dq summed
    keep = None if attn_mask is None else attn_mask.expand(*q.shape[:-1], k.size(-2))  # a (B, H, Lq, Lk) view
    return BlockwiseAttention.apply(q, k, v, keep, is_causal, block_size)


def _block_scores(q, k, keep, is_causal, rows, cols):
    """S = Q K^T / sqrt(D) + M for the queries `rows` and keys `cols` (two slices), (B, H, rows, cols):
    M = -inf where keep (the attn_mask, (B, H, Lq, Lk)) is False or causality hides a key, else 0."""
    s = q[..., rows, :] @ k[..., cols, :].transpose(-2, -1) / math.sqrt(q.size(-1))
    mask = None if keep is None else keep[..., rows, cols]
    if is_causal:
        i, j = (torch.arange(r.start, r.stop, device=q.device) for r in (rows, cols))  # query, key positions
        mask = j <= i[:, None] if mask is None else mask & (j <= i[:, None])  # (rows, cols)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _repeat_kv(q, k, v, attn_mask):
    """The core's inputs checked, then K/V head h // G for query head h (grouped-query attention, G = H /
    H_kv). Refused: 16 bits and autocast (sums far off), a float attn_mask, k or v of another ndim than q (it
    would broadcast over B), k and v unlike but in Dv (one projection's), H_kv not dividing H, and D = 0."""
    autocast = torch.is_autocast_enabled(q.device.type)
    if q.dtype not in (torch.float32, torch.float64) or autocast:
        raise TypeError(f"the core computes in float32 or float64 outside autocast, got {q.dtype}"
                        f"{' under autocast' * autocast}; 16 bits: chunked_attention (FlashAttention-2's)")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be bool, True where a query may attend, got {attn_mask.dtype}")
    G = q.size(1) // k.size(1) if q.dim() == 4 == k.dim() and k.size(1) else 1  # query heads per K/V head
    if (q.dim() != k.dim() or k.shape[:-1] != v.shape[:-1]  # v longer than k: blockwise would read v[:Lk]
            or (q.dim() == 4 and q.size(1) != G * k.size(1)) or q.size(-1) == 0):
        raise ValueError(f"k and v must match but in Dv and have q's ndim, heads dividing q's (4-D), D >= 1 "
                         f"(1 / sqrt(D)): got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return (k, v) if G == 1 else (k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1))


def _blocks(L, size):
    """Consecutive slices of at most `size` positions that cover 0 .. L-1."""
    return [slice(i, min(i + size, L)) for i in range(0, L, size)]
# core ends


# -----------------------------------------------------------------------------
# The model: multi-head attention, positional encodings, the encoder layer, the config and the encoder, then
# a decoder's KV cache. Attention goes through attention(): a path of the appendix (impl=) or your function.
# The appendix also gives it documents() (positions within packed documents), Visibility (which keys each
# query sees), naive_attention (for need_weights) and the input checks.

IMPLS = ("naive", "chunked", "flash")
POS_ENCODINGS = ("sinusoidal", "learned", "rope", "alibi")


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, impl="flash",
              window_size=None, cu_seqlens=None, alibi_slopes=None, chunk_size=None, enable_gqa=False,
              score_mod=None):
    """softmax(Q K^T * scale + M) V; M: 0 where a query sees a key, else -inf, plus a float mask and ALiBi.

    impl picks the path, each tested equal to the core where both apply: "naive", the formula, with all (Lq,
    Lk) scores; "chunked", the core's blockwise algorithm, in O(L) memory; "flash", PyTorch's fused kernels
    (SDPA), warning where SDPA would fall back to its unfused math kernel (on CPU or CUDA, outside
    torch.compile). Or a function of yours, called as f(q, k, v, attn_mask, dropout_p, is_causal, scale,
    **kw), kw: those of window_size, cu_seqlens, alibi_slopes, enable_gqa that the call sets (as the README
    wraps the core; ring_attention.ring_impl()).

    q (B, H, Lq, D), k (B, H_kv, Lk, D), v (B, H_kv, Lk, Dv) -> (B, H, Lq, Dv). attn_mask: bool, True where a
    query may attend, or float, added to the scores; broadcast to (B, H, Lq, Lk). is_causal: query i sees keys
    j <= i. scale: 1 / sqrt(D) by default. dropout_p: on the weights, in training. window_size=w: query i sees
    the keys with |i - j| <= w. cu_seqlens: offsets [0, l1, l1 + l2, ..., L] of packed documents, each query
    seeing its own document's keys. alibi_slopes (H,): ALiBi's bias, -slope_h * |i - j|. enable_gqa: k, v with
    H_kv heads. chunk_size: the chunked path's blocks. score_mod(score, b, h, q_idx, kv_idx) -> the new score,
    and a BlockMask as attn_mask, FlexAttention's ways to write a variant of your own (flex_attention), send
    the call to the chunked path whatever impl names (a function as impl raises ValueError). What all paths
    keep (float masks, causality's alignment, dtypes, compile): the comment "Appendix: the hardened paths"."""
    given = dict(window_size=window_size, cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes)
    kw = {name: x for name, x in given.items() if x is not None}  # unset: not passed (the core takes none)
    kw |= {"enable_gqa": True} if enable_gqa else {}
    if (score_mod is not None) or isinstance(attn_mask, BlockMask):
        if callable(impl):
            raise ValueError("score_mod and a BlockMask run on the chunked path: not with a function as impl")
        impl, kw["score_mod"] = "chunked", score_mod
    if callable(impl):
        return impl(q, k, v, attn_mask, dropout_p, is_causal, scale, **kw)
    if impl == "naive":
        return naive_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, **kw)[0]  # (out, weights)
    if impl == "chunked":
        return chunked_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, chunk_size=chunk_size, **kw)
    if impl == "flash":
        return flash_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, **kw)
    raise ValueError(f"impl must be one of {IMPLS} or a function, got {impl!r}")


# -----------------------------------------------------------------------------
# Multi-head attention


class MultiHeadAttention(nn.Module):
    """MultiHead(X) = Concat(head_1, ..., head_h) W^O,  head_i = Attention(X W_i^Q, X W_i^K, X W_i^V).

    x: (B, T, C) with C = d_model, batch first. The three input projections are one linear layer, C -> C + 2 *
    n_kv_heads * hs (hs = C / n_heads, the tutorials' d_k), its weight laid out as nn.MultiheadAttention's
    in_proj_weight (with n_kv_heads = n_heads): q's rows, k's, then v's. n_kv_heads below n_heads:
    grouped-query attention (1: multi-query), a KV cache n_heads / n_kv_heads times smaller, query head h
    reading K/V head h // (n_heads // n_kv_heads), as Llama's repeat_kv (x-transformers': h % n_kv_heads).
    impl: one of IMPLS, or an attention function (see attention()). rope: an optional RotaryEmbedding for q
    and k of every head; alibi: ALiBi's bias in every head (alibi_slopes, float32 whatever the module's);
    score_mod: FlexAttention's (flex_attention), a function, a module or a module's method: that module's
    parameters become this one's (a learned bias is trained, moved and saved with the model)."""

    def __init__(self, d_model, n_heads, dropout=0.0, bias=True, impl="flash", *, chunk_size=None,
                 window_size=None, rope=None, alibi=False, n_kv_heads=None, score_mod=None):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if not (type(n_kv_heads) is int and n_kv_heads >= 1 and n_heads % n_kv_heads == 0):
            raise ValueError(f"n_kv_heads must be a positive divisor of n_heads={n_heads}: got {n_kv_heads}")
        if not callable(impl) and impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS} or a function, got {impl!r}")
        if d_model // n_heads < 32:
            warnings.warn(f"head size d_model/n_heads = {d_model // n_heads} is below 32; "
                          "fine for small test models, weak for real ones", stacklevel=2)
        self.d_model, self.n_heads, self.n_kv_heads, self.dropout = d_model, n_heads, n_kv_heads, dropout
        self.impl, self.chunk_size, self.window_size = impl, chunk_size, window_size
        self.rope, self.alibi, self.score_mod = rope, alibi, score_mod
        owner = getattr(score_mod, "__self__", None)  # a bound method's module: a submodule (by assignment)
        self.score_owner = owner if isinstance(owner, nn.Module) else None
        self.qkv = nn.Linear(d_model, d_model + 2 * n_kv_heads * (d_model // n_heads), bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, attn_mask=None, is_causal=False, need_weights=False, positions=None,
                cu_seqlens=None, cache=None):
        """x (B, T, C) -> (B, T, C), and with need_weights also the weights (B, nh, T, Lk) (the naive path;
        nh heads, Lk keys: T, or the cache's slots).

        attn_mask: bool, True where a query may attend, or float, added to the scores, broadcast to (B, nh, T,
        T): key padding is (B, 1, 1, T); or FlexAttention's BlockMask. is_causal: query i sees keys j <= i.
        cu_seqlens: documents packed in every sequence, offsets [0, T_1, T_1 + T_2, .., T] (documents()), each
        attending only within itself. positions: the (T,) positions of x's tokens, for RoPE (default 0 .. T-1,
        or each document's own). cache: a causal decoder's KVCache: the call's k and v go into its next slots,
        and the queries attend to every slot written; positions are then (B, T), each sequence's own (default:
        where the cache counts them)."""
        _check_mha_call(self, x, attn_mask, is_causal, need_weights, positions, cu_seqlens, cache)
        B, T, C = x.size()
        nh, nkv, hs = self.n_heads, self.n_kv_heads, C // self.n_heads
        q, k, v = self.qkv(x).split([C, nkv * hs, nkv * hs], dim=2)  # X W^Q (B, T, C), X W^K and X W^V
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        y, weights = self._attend(q, k, v, attn_mask, is_causal, need_weights, positions, cu_seqlens, cache)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): Concat(head_1, ..., head_h)
        y = self.proj(y)  # W^O
        return (y, weights) if need_weights else y

    def _attend(self, q, k, v, attn_mask, is_causal, need_weights, positions, cu_seqlens, cache):
        """head_i = Attention(Q_i, K_i, V_i) of every head, q (B, nh, T, hs), k and v (B, nkv, T, hs) -> (B,
        nh, T, hs), and forward's weights or None: attention(q, k, v, attn_mask, dropout, is_causal), except
        that RoPE turns q and k first, ALiBi adds -slope * |i - j|, and a KVCache adds its slots' k and v."""
        nh, nkv, T = q.size(1), k.size(1), q.size(2)
        if cache is not None and positions is None:
            positions = cache.positions(T, attn_mask)  # (B, T): each row's own
        elif positions is None and cu_seqlens is not None and self.rope is not None:  # RoPE's, per document
            _, positions = documents(cu_seqlens, T, q.device)  # (ids, positions), restarting in each document
        if self.rope is not None:  # in one call, (B, nh + nkv, T, hs): a token's q and k share its position
            q, k = self.rope(torch.cat([q, k], dim=1), positions).split([nh, nkv], dim=1)
        kw = dict(window_size=self.window_size, cu_seqlens=cu_seqlens, enable_gqa=nkv != nh,
                  alibi_slopes=alibi_slopes(nh, q.device) if self.alibi else None)
        with _all_or_nothing([cache]):  # a call that raises leaves the cache as it was
            if cache is not None:  # all its slots, through one mask: causality, window, ALiBi by position
                slopes = _checked_alibi(kw["alibi_slopes"], q)  # (1, nh, 1, 1), float32 or wider
                k, v, attn_mask = cache.update(k, v, positions, attn_mask, self.window_size, slopes)
                is_causal, kw["window_size"], kw["alibi_slopes"] = False, None, None  # in attn_mask now
            p = self.dropout if self.training else 0.0
            if need_weights:  # only the naive path materialises the weights
                return naive_attention(q, k, v, attn_mask, p, is_causal, **kw)
            return attention(q, k, v, attn_mask, p, is_causal, impl=self.impl, chunk_size=self.chunk_size,
                             score_mod=self.score_mod, **kw), None

    @classmethod
    def from_torch(cls, m, impl="flash"):
        """An equivalent module (same outputs) from an nn.MultiheadAttention with q, k, v of one size."""
        if m.kdim != m.embed_dim or m.vdim != m.embed_dim or m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch supports nn.MultiheadAttention without kdim/vdim, add_bias_kv and "
                             "add_zero_attn")
        _check_batch_first(m, "nn.MultiheadAttention", cls.__name__)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the small-head warning is for models built by hand
            new = cls(m.embed_dim, m.num_heads, m.dropout, bias=m.in_proj_bias is not None, impl=impl)
        new = new.to(m.in_proj_weight.device, m.in_proj_weight.dtype)
        with torch.no_grad():
            new.qkv.weight.copy_(m.in_proj_weight)
            new.proj.weight.copy_(m.out_proj.weight)
            if m.in_proj_bias is not None:
                new.qkv.bias.copy_(m.in_proj_bias)
                new.proj.bias.copy_(m.out_proj.bias)
        return new.train(m.training)  # the mode too: dropout acts in training only


# -----------------------------------------------------------------------------
# Positional encodings. Each takes `positions`, the (T,) positions of x's rows (default 0 .. T-1): a shard of
# a longer sequence (ring_attention.py) sits at its own positions; or (B, T), each row's own (a KVCache's).


class SinusoidalPositionalEncoding(nn.Module):
    """x + PE,  PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    x: (B, T, d_model), T <= max_len. Fixed, not learned; dropout after the sum as in the paper."""

    def __init__(self, d_model, max_len, dropout=0.0):
        super().__init__()
        self.max_len = max_len
        pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
        inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (ceil(d/2),)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * inv_freq)
        pe[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])  # an odd d_model: one cos fewer than sin
        self.register_buffer("pe", pe.float(), persistent=False)  # recomputed, so not in the checkpoint
        self.drop = nn.Dropout(dropout)

    def forward(self, x, positions=None):
        pos = _positions(x.size(1), self.max_len, positions)
        return self.drop(x + self.pe[pos].to(x.dtype))  # pe[pos]: (T, d_model), or (B, T, d_model)


class LearnedPositionalEncoding(nn.Module):
    """x + P[pos], with P a learned (max_len, d_model) table (BERT, GPT-2). x: (B, T, d_model)."""

    def __init__(self, d_model, max_len, dropout=0.0):
        super().__init__()
        self.max_len = max_len
        self.pe = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, positions=None):
        return self.drop(x + self.pe.weight[_positions(x.size(1), self.max_len, positions)])  # (T or B, T, d)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each pair (x_i, x_{i+hs/2}) of q and k by the angle pos * base^(-2i/hs) (the paper pairs
    (x_{2i}, x_{2i+1}); halves, as Llama and GPT-NeoX: the same attention, the dimensions permuted).

    x: (B, heads, T, hs) -> same shape. The score q_m . k_n then depends on positions only through m - n,
    so no position is added to the token embedding; a KVCache keeps keys rotated, never rotated again."""

    def __init__(self, head_size, max_len, base=10000.0):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"RoPE needs an even head size, got {head_size}")
        self.max_len = max_len
        inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)  # (hs/2,)
        angle = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq  # (max_len, hs/2)
        # (max_len, hs) each: pair i and i + hs/2 share an angle; the signed sine is -sin for x1, +sin for x2,
        # so that the rotation is x * cos + (x2, x1) * signed_sin
        self.register_buffer("cos", torch.cat([angle.cos(), angle.cos()], -1).float(), persistent=False)
        signed_sin = torch.cat([-angle.sin(), angle.sin()], -1)
        self.register_buffer("signed_sin", signed_sin.float(), persistent=False)

    def forward(self, x, positions=None):
        """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), x1 and x2 the halves of every head's features."""
        pos = _positions(x.size(-2), self.max_len, positions)
        cos, sin = self.cos[pos].unsqueeze(-3), self.signed_sin[pos].unsqueeze(-3)  # (1 or B, 1, T, hs)
        x1, x2 = x.chunk(2, dim=-1)
        swapped = torch.cat([x2, x1], dim=-1)  # (B, heads, T, hs)
        return (x * cos.to(x.dtype)).addcmul_(swapped, sin.to(x.dtype))  # x * cos + swapped * sin, in place


def alibi_slopes(n_heads, device=None):
    """ALiBi's slopes m_h (Press et al. 2022), (n_heads,) float32: head h adds -m_h * |i - j| to score (i, j),
    a penalty on distance instead of positions added to x: no table to run past, so it applies at any
    length, each head favouring keys within about 1/m_h of the query. For n heads a power of 2,
    m_h = 2^(-8h/n), h = 1 .. n; otherwise those of p, the largest power of 2 below n, then
    2^(-8(2h' - 1)/(2p)), h' = 1 .. n - p: the 1st, 3rd, 5th, ... slopes of 2p heads."""
    if not (type(n_heads) is int and n_heads >= 1):
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    p, h = 2 ** (n_heads.bit_length() - 1), torch.arange(1, n_heads + 1, device=device, dtype=torch.float32)
    return 2 ** -torch.where(h <= p, 8 * h / p, 8 * (2 * (h - p) - 1) / (2 * p))


# -----------------------------------------------------------------------------
# Encoder layer

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class EncoderLayer(nn.Module):
    """One encoder layer, as nn.TransformerEncoderLayer (batch first).

    post-LN (the paper's, and torch's default): x = LN(x + SA(x));   x = LN(x + FF(x))
    pre-LN (norm_first=True, EncoderConfig's):  x = x + SA(LN(x));   x = x + FF(LN(x))
    FF(x) = W2 dropout(act(W1 x + b1)) + b2; SA's and FF's outputs pass through dropout before the sum (the
    paper's residual dropout: dropout1, dropout2), and SA drops attention weights too. x: (B, T, d_model) ->
    (B, T, d_model)."""

    def __init__(self, d_model, n_heads, d_ff, dropout=0.1, norm_first=False, activation="relu", impl="flash",
                 layer_norm_eps=1e-5, *, bias=True, chunk_size=None, window_size=None, rope=None,
                 alibi=False, n_kv_heads=None, score_mod=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(_ACTIVATIONS)}, got {activation!r}")
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout, bias, impl, chunk_size=chunk_size,
                                            window_size=window_size, rope=rope, alibi=alibi,
                                            n_kv_heads=n_kv_heads, score_mod=score_mod)
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)  # inside the feed-forward
        self.dropout1 = nn.Dropout(dropout)  # on the attention branch
        self.dropout2 = nn.Dropout(dropout)  # on the feed-forward branch
        self.activation = _ACTIVATIONS[activation]
        self.norm_first = norm_first

    def _sa(self, x, attn_mask, is_causal, positions, cu_seqlens, cache):
        return self.dropout1(self.self_attn(x, attn_mask, is_causal, positions=positions,
                                            cu_seqlens=cu_seqlens, cache=cache))

    def _ff(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x, attn_mask=None, is_causal=False, positions=None, cu_seqlens=None, cache=None):
        d_model = self.linear1.in_features
        if x.dim() != 3 or x.size(-1) != d_model:  # before LayerNorm, whose own error is less clear
            raise ValueError(f"expected x of shape (B, T, {d_model}), got {tuple(x.shape)}")
        if self.norm_first:
            x = x + self._sa(self.norm1(x), attn_mask, is_causal, positions, cu_seqlens, cache)
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self._sa(x, attn_mask, is_causal, positions, cu_seqlens, cache))
        return self.norm2(x + self._ff(x))

    @classmethod
    def from_torch(cls, layer, impl="flash"):
        """An equivalent layer (same outputs) from an nn.TransformerEncoderLayer with relu or exact gelu."""
        act = layer.activation  # the function or module it was given ("relu", "gelu": F.relu, F.gelu)
        relu = act is F.relu or type(act) is nn.ReLU
        if not (relu or act is F.gelu or (type(act) is nn.GELU and act.approximate == "none")):
            raise ValueError(f"from_torch supports layers with relu or exact gelu, got {act}")
        _check_batch_first(layer.self_attn, "nn.TransformerEncoderLayer", cls.__name__)
        sa = layer.self_attn
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            new = cls(sa.embed_dim, sa.num_heads, layer.linear1.out_features, layer.dropout.p,
                      layer.norm_first, "relu" if relu else "gelu", impl, layer.norm1.eps,
                      bias=layer.linear1.bias is not None)
        new = new.to(layer.linear1.weight.device, layer.linear1.weight.dtype)
        new.self_attn = MultiHeadAttention.from_torch(sa, impl)
        for name in ("linear1", "linear2", "norm1", "norm2"):
            getattr(new, name).load_state_dict(getattr(layer, name).state_dict())
        return new.train(layer.training)


# -----------------------------------------------------------------------------
# Config and encoder


@dataclass
class EncoderConfig:
    vocab_size: int = 32  # number of token ids, 0 .. vocab_size - 1
    max_len: int = 512  # longest sequence a positional table holds (ALiBi has none), a KV cache's slots
    d_model: int = 128  # width of the residual stream
    n_heads: int = 4  # attention heads; d_model / n_heads is the head size
    n_kv_heads: int | None = None  # K/V heads, a divisor of n_heads (grouped-query attention); None = n_heads
    n_layers: int = 2  # encoder layers
    d_ff: int = 512  # hidden width of the feed-forward block (4 * d_model in the paper)
    dropout: float = 0.0  # on attention probabilities, residual branches, the feed-forward and embeddings
    norm_first: bool = True  # pre-LN (stable without warm-up tricks); False = post-LN as in the paper
    activation: str = "relu"  # "relu" or "gelu"
    impl: str = "flash"  # attention path: "naive", "chunked" or "flash"
    pos_encoding: str = "sinusoidal"  # "sinusoidal", "learned", "rope" or "alibi"
    chunk_size: int | None = None  # blocks of the chunked path (others ignore it); None: default_chunk_size's
    window_size: int | None = None  # local attention: keys within this distance; None = global
    layer_norm_eps: float = 1e-5  # epsilon of every LayerNorm

    def __post_init__(self):  # what no module it builds checks (they check heads, impl, activation, rope)
        for name in ("vocab_size", "max_len", "d_model", "n_heads", "n_layers", "d_ff"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.pos_encoding not in POS_ENCODINGS:
            raise ValueError(f"pos_encoding must be one of {POS_ENCODINGS}, got {self.pos_encoding!r}")


class Encoder(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, d_model).

    h = PosEnc(Embed(idx) * sqrt(d_model)) (PosEnc adds sinusoidal or learned positions; with RoPE or ALiBi,
    which act inside attention, it is dropout alone), then n_layers EncoderLayers, then a final LayerNorm
    for pre-LN (post-LN layers already end in one). score_mod: FlexAttention's, one for all layers
    (MultiHeadAttention). Called with is_causal=True it is a decoder-only model (GPT's, Llama's: no
    cross-attention), which a KV cache per layer (KVCache, below) serves token by token."""

    def __init__(self, config, score_mod=None):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        rope = RotaryEmbedding(c.d_model // c.n_heads, c.max_len) if c.pos_encoding == "rope" else None
        if c.pos_encoding in ("rope", "alibi"):  # they act in the attention: only dropout here
            self.pos = nn.Dropout(c.dropout)
        else:
            pos = LearnedPositionalEncoding if c.pos_encoding == "learned" else SinusoidalPositionalEncoding
            self.pos = pos(c.d_model, c.max_len, c.dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.norm_first, c.activation, c.impl,
                         c.layer_norm_eps, chunk_size=c.chunk_size, window_size=c.window_size, rope=rope,
                         alibi=c.pos_encoding == "alibi", n_kv_heads=c.n_kv_heads, score_mod=score_mod)
            for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps) if c.norm_first else nn.Identity()
        user = getattr(score_mod, "__self__", score_mod)  # a score_mod module, or a method's module:
        theirs = set(user.modules()) if isinstance(user, nn.Module) else set()  # its weights keep their init
        for module in (m for m in self.modules() if m not in theirs):
            self._init_weights(module)
        for layer in self.layers:  # residual projections: variance of the sum grows with depth (GPT-2)
            for w in (layer.self_attn.proj.weight, layer.linear2.weight):
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * c.n_layers))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):  # tokens: std 1 once _embed multiplies by sqrt(d); positions 1
            nn.init.normal_(module.weight, std=module.embedding_dim ** -0.5 if module is self.embed else 1.0)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def _embed(self, idx, positions):
        """PosEnc(Embed(idx) * sqrt(d_model)), (B, T, d_model), from checked token ids (B, T)."""
        if idx.dim() != 2 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(f"idx must be integer token ids (B, T), got {tuple(idx.shape)} {idx.dtype}")
        _check_range(idx, 0, self.config.vocab_size, "token ids")
        x = self.embed(idx) * math.sqrt(self.config.d_model)
        return self.pos(x) if self.config.pos_encoding in ("rope", "alibi") else self.pos(x, positions)

    def forward(self, idx, attn_mask=None, is_causal=False, positions=None, cu_seqlens=None, cache=None):
        """positions: the (T,) positions of idx's tokens (default 0 .. T-1), as for a shard of a longer
        sequence (ring_attention.ShardedEncoder). cu_seqlens: documents packed in every row (documents()),
        each encoded as if alone. cache: a KVCache per layer (kv_caches()), for a causal decoder."""
        _check_caches(self, idx, cache, positions)
        if (positions is None) and (cu_seqlens is not None) and (self.config.pos_encoding != "alibi"):
            _, positions = documents(cu_seqlens, idx.size(1), idx.device)  # (T,); ALiBi's |i - j| needs none
        caches = [None] * len(self.layers) if cache is None else cache
        with _all_or_nothing(caches):  # a call that raises leaves every cache as it was
            if cache is not None:  # (B, T): each row's own, the same in every layer's cache (_check_caches)
                positions = cache[0].positions(idx.size(1), attn_mask)
            x = self._embed(idx, positions)
            for layer, layer_cache in zip(self.layers, caches):
                x = layer(x, attn_mask, is_causal, positions, cu_seqlens, layer_cache)
        return self.norm(x)

    def kv_caches(self, batch_size, device=None, dtype=None):
        """An empty KVCache per layer, for batch_size sequences of config.max_len tokens (default: on the
        model's device, in its dtype; under autocast, pass autocast's)."""
        c, w = self.config, self.embed.weight
        return [KVCache(batch_size, c.n_kv_heads or c.n_heads, c.max_len, c.d_model // c.n_heads,
                        device or w.device, dtype or w.dtype) for _ in self.layers]

    def attention_weights(self, idx, attn_mask=None, is_causal=False, layer=-1):
        """Attention probabilities (B, H, T, T) of one layer, through the naive path: what a heatmap shows
        (in eval mode: in training, dropped out)."""
        layer = range(len(self.layers))[layer]  # negative indices count from the last layer
        x = self._embed(idx, None)
        for block in self.layers[:layer]:
            x = block(x, attn_mask, is_causal)
        block = self.layers[layer]
        x = block.norm1(x) if block.norm_first else x  # the input its attention sees
        return block.self_attn(x, attn_mask, is_causal, need_weights=True)[1]


# -----------------------------------------------------------------------------
# Decoding: a KV cache, which MultiHeadAttention fills and reads (cache=) and Encoder.kv_caches makes


class KVCache:
    """A KV cache: a causal decoder's keys and values of the tokens so far, for one MultiHeadAttention, so
    that each new token computes only its own q, k, v. Made once, whole, so that a compiled step has one
    shape, one graph and no host read (no .item(): a GPU never waits for the host):
        k, v    (B, n_kv_heads, max_len, hs): a slot per token;
        length  a 0-d long tensor: the slots written in every row;
        pos     (B, max_len): the position of each slot's token, counted over its row's real tokens (Hugging
                Face's cumsum(mask) - 1); a slot that holds no token (padding, a dropped token, a slot not yet
                written) has position max_len, after any query's, so causality hides it (a row padded on the
                left, real [False, False, True, True]: pos [max_len, max_len, 0, 1]);
        tokens  (B, 1): each row's real tokens so far.
    attn_mask, of a MultiHeadAttention call that uses the cache: the call's key padding, (B, 1, 1, T) bool,
    which the cache keeps, or a mask over the max_len slots for that call alone (with T = max_len tokens, a
    (B, 1, 1, T) bool mask is key padding). A call that raises leaves the cache as it was (its length and
    positions: the slots past its length stay masked) on a CPU in eager mode; compiled or on CUDA, a
    device-side assert may stand in."""

    def __init__(self, batch_size, n_kv_heads, max_len, head_size, device=None, dtype=None):
        self.k = torch.zeros(batch_size, n_kv_heads, max_len, head_size, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.pos = torch.full((batch_size, max_len), max_len, dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # each row's real tokens
        self.saved = None  # what an ongoing call restores if it raises (_all_or_nothing)

    def reset(self):
        self._truncate(0)  # what the slots hold stays, hidden until written again

    def rollback(self, n):
        """Drop the last n slots, each row's next position going back by its real tokens among them; or, n a
        (B,) integer tensor, each row b its own last n[b] tokens, which become padding. Batched speculative
        decoding: a small model drafts a few tokens per row, one call of the model checks them all, and each
        row keeps the drafts it accepted; the next call's tokens continue each row's positions."""
        L, (B, _) = self.pos.size(-1), self.pos.shape
        if torch.is_tensor(n) and n.shape == (B,) and not (n.is_floating_point() or n.dtype == torch.bool):
            n = n[:, None].to(self.tokens.device)  # (B, 1)
            _check_range(n, 0, math.inf, "rollback's n[b], the tokens each row drops,")
            kept = self.tokens - n  # row b keeps positions < kept
            _check_range(kept, 0, math.inf, "each row's tokens less the n[b] to drop")
            self.pos.masked_fill_(self.pos >= kept, L)
            self.tokens.copy_(kept)
            return
        if not (type(n) is int and n >= 0):
            raise ValueError(f"rollback(n) drops n slots, a non-negative int, or each row its own, a ({B},) "
                             f"integer tensor: got {n!r}")
        _check_range(self.length - n, 0, math.inf, f"the slots written less the {n} to drop")
        self._truncate(self.length - n)

    def _truncate(self, length):
        """Keep the first `length` slots; the others hold no token (position max_len). Recounts the tokens."""
        L = self.pos.size(-1)
        self.length.fill_(length)  # a number, or a 0-d tensor
        self.pos.masked_fill_(torch.arange(L, device=self.pos.device) >= self.length, L)  # (B, max_len)
        self.tokens.copy_((self.pos < L).sum(-1, keepdim=True))

    def positions(self, T, attn_mask=None):
        """(B, T): the positions of a call's T tokens, counting the row's real tokens (a padding token gets
        the position of the real token before it, or 0 before the first)."""
        L = self.pos.size(-1)  # a named error, before anything is indexed or written:
        _check_range(self.length + T, 0, L + 1, f"KVCache.length after a call of {T} tokens (max_len={L})")
        real = self._read(attn_mask, T)[0]  # (B or 1, T): the call's real tokens, or None: all
        if real is None:
            return self.tokens + torch.arange(T, device=self.pos.device)
        return (self.tokens + real.cumsum(-1) - 1).clamp(min=0)

    def update(self, k, v, positions, attn_mask=None, window_size=None, alibi_slopes=None):
        """Write k, v (B, n_kv_heads, T, hs) into the next T slots; return all of k and v (every one of the
        max_len slots: one shape for every step) and the mask through which queries at `positions` (B, T) see
        them: bool, key j seen where pos_j <= the query's position (and within the window), or with ALiBi's
        slopes ((1, H, 1, 1)) a float bias, -inf where hidden."""
        if any(t.shape[:2] != self.k.shape[:2] or t.dtype != self.k.dtype for t in (k, v)):
            raise ValueError(f"a cache of {tuple(self.k.shape)} {self.k.dtype} takes its (B, H_kv) and "
                             f"dtype: got k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}")
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):  # its graph would grow each step
            raise ValueError("a KV cache serves inference: decode under torch.no_grad() (or inference_mode)")
        T, (real, over_slots) = k.size(-2), self._read(attn_mask, k.size(-2))
        slots, L = self.length + torch.arange(T, device=k.device), self.pos.size(-1)  # (T,): the next T
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        pos = positions if real is None else positions.masked_fill(~real, L)  # padding: after every query
        self.pos.index_copy_(1, slots, pos)
        self.length.add_(T)
        self.tokens.add_(T if real is None else real.sum(-1, keepdim=True))
        rules = named_rules(is_causal=True, window_size=window_size, alibi_slopes=alibi_slopes)
        at = positions.view(-1, 1, T, 1), self.pos.view(-1, 1, 1, L)  # (B, 1, T, 1), (B, 1, 1, L)
        mask = Visibility(rules, positions=at, attn_mask=over_slots).dense(T, L, k.device)  # to (B, H, T, L)
        return self.k, self.v, mask

    def _read(self, attn_mask, T):
        """attn_mask read (see the class): the call's real tokens, (B or 1, T) bool; a mask over the slots."""
        (B, L), shape = self.pos.shape, tuple(getattr(attn_mask, "shape", ()))
        if shape[1:] == (1, 1, T) and shape[0] in (1, B) and attn_mask.dtype == torch.bool:
            return attn_mask[:, 0, 0], None
        if attn_mask is not None and (len(shape) != 4 or shape[-1] != L):
            raise ValueError(f"with a KV cache, attn_mask is a call's key padding, bool ({B}, 1, 1, {T}), or "
                             f"a mask over its max_len={L} slots, (.., {L}); got {attn_mask.dtype} {shape}")
        return None, attn_mask


@contextlib.contextmanager
def _all_or_nothing(caches):
    """If the with-block raises, every KVCache of caches (None: none) is left as it was: its length and
    positions (a call writes slots past its length only, masked once the length is back); saved once, by
    the outermost block (the Encoder's, then not each layer's). Not under torch.compile."""
    caches = [] if torch.compiler.is_compiling() else [c for c in caches if c is not None and c.saved is None]
    for c in caches:
        c.saved = c.length.clone()
    try:
        yield
    except BaseException:
        for c in caches:  # back to its length: the slots past it hold no token (a call writes only those)
            c._truncate(c.saved)
        raise
    finally:
        for c in caches:
            c.saved = None


# -----------------------------------------------------------------------------
# Appendix: the hardened paths. Each computes what the core computes, with everything real use asks for, and
# the tests prove it equal to the core. All three take the arguments and conventions of
# F.scaled_dot_product_attention (SDPA), with the core's shapes, plus:
# - a float attn_mask is added to the scores, and only -inf masks a key (+inf and NaN are refused; chunked
#   adds it in base 2, so finite values beyond +-finfo.max / log2(e), 2.4e38 in float32, count as that bound);
#   integer masks are refused, as SDPA refuses them; is_causal with an attn_mask applies both (SDPA's math
#   kernel refuses the pair);
# - window_size, cu_seqlens, alibi_slopes and enable_gqa as attention() gives them (a window with is_causal:
#   0 <= i - j <= w; K/V head h // G serves query head h);
# - SDPA's CausalBias as attn_mask: causal_lower_right(Lq, Lk) aligns causality, window, ALiBi bottom-right;
# - dropout_p, scale, and under autocast float32 q, k, v computed and returned in autocast's dtype;
# - in float16 and bfloat16 FlashAttention's rule: an error against float64 at most twice that of
#   standard attention computed in the inputs' dtype;
# - torch.compile(fullgraph=True), and no host-device sync: off the CPU no device tensor is read on the host
#   (a CPU has none to wait for: there the checks read values to name them, flash looks for far rows).

# Variants as rules. Each named variant is a small rule over the positions of queries and keys, with the keys
# a block of queries may see beside it, for skipping; Visibility composes a call's rules with its attn_mask
# and a user's FlexAttention mods, and every path asks it: naive and flash for the whole mask, chunked block
# by block, KVCache.update for its slots. No path knows a variant by name.


def padding_mask(lengths, max_len, device=None):
    """Boolean (B, 1, 1, max_len) mask, True on the first lengths[b] keys of sequence b.

    It broadcasts over heads and queries, on the device of lengths (or `device`). nn.MultiheadAttention's
    key_padding_mask is its negation: ~padding_mask(lengths, L)[:, 0, 0]."""
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be a 1-D integer tensor, got {tuple(lengths.shape)} {lengths.dtype}")
    _check_range(lengths, 0, max_len + 1, "lengths")
    keep = torch.arange(max_len, device=lengths.device) < lengths[:, None]  # (B, L)
    return keep[:, None, None, :]  # (B, 1, 1, L)


def documents(cu_seqlens, L, device=None):
    """Packed rows: (doc_ids, positions), two (L,) int64 tensors, the document of every position and
    its position inside that document.

    cu_seqlens: the CPU offsets [0, l_1, l_1 + l_2, ..., L] of a row's documents (FlashAttention's varlen
    convention), empty ones allowed. Computed on the CPU, where cu_seqlens lives, and copied to a GPU pinned
    and non-blocking, so that the host never waits (under torch.compile the copy is the compiler's own)."""
    _check_cu_seqlens(cu_seqlens, L)
    doc = torch.bucketize(torch.arange(L), cu_seqlens[1:], right=True)  # document ends <= p: p's document
    both = torch.stack([doc, torch.arange(L) - cu_seqlens[doc]])  # (2, L)
    if torch.device(device or "cpu").type == "cuda" and not torch.compiler.is_compiling():
        both = both.pin_memory()
    return both.to(device, non_blocking=True).unbind()


class Rule(NamedTuple):
    """One variant over the positions i (.., rows, 1) of queries and j (.., 1, cols) of keys: mask(i, j), True
    where query i sees key j; score(s, i, j), the scores with its bias added; keys(i0, i1), the keys [lo,
    hi) that queries i0 .. i1-1 may see (None: all). The ends of keys never move left as the queries move
    right, so a block's first and last query tell whether all its queries see all its keys."""
    mask: Optional[Callable] = None
    score: Optional[Callable] = None
    keys: Optional[Callable] = None


def causal():
    """Query i sees the keys j <= i."""
    return Rule(mask=lambda i, j: j <= i, keys=lambda i0, i1: (0, i1))


def sliding_window(w):
    """Query i sees the keys j with |i - j| <= w (compared, never subtracted: no int64 block)."""
    return Rule(mask=lambda i, j: (j >= i - w) & (j <= i + w), keys=lambda i0, i1: (i0 - w, i1 + w))


def same_document(cu_seqlens, L, device=None):
    """Packed documents: query i sees the keys of its own document, in a row of L tokens. The keys' range
    reads cu_seqlens on the host (a CPU tensor: no sync); compiled, no key range is given (none skipped)."""
    doc_ids = documents(cu_seqlens, L, device)[0]  # (L,)
    if torch.compiler.is_compiling():
        return Rule(mask=lambda i, j: doc_ids[i] == doc_ids[j])
    offsets = cu_seqlens.tolist()

    def keys(i0, i1):  # from the start of query i0's document to the end of query i1 - 1's
        return offsets[bisect.bisect_right(offsets, i0) - 1], offsets[bisect.bisect_left(offsets, i1)]
    return Rule(mask=lambda i, j: doc_ids[i] == doc_ids[j], keys=keys)


def alibi(slopes):
    """ALiBi's bias, S_ij -= m_h |i - j|, slopes m (B or 1, H, 1, 1) in the scores' dtype (and base)."""
    def score(s, i, j):  # in place on a block's scores; a new tensor from a 0-d s (Visibility.dense)
        distance = (j.to(s.dtype) - i.to(s.dtype)).abs_()  # (.., rows, cols)
        return torch.addcmul(s, slopes, distance, value=-1, out=s if s.dim() else None)
    return Rule(score=score)


def named_rules(is_causal=False, window_size=None, cu_seqlens=None, alibi_slopes=None, L=None, device=None):
    """The rules of the named arguments of every path (the appendix's header); L, device: the packed row's."""
    rules = [causal()] if is_causal else []
    rules += [sliding_window(window_size)] if window_size is not None else []
    rules += [same_document(cu_seqlens, L, device)] if cu_seqlens is not None else []
    rules += [alibi(alibi_slopes)] if alibi_slopes is not None else []
    return rules


@dataclass
class Visibility:
    """A call's variants, composed: its named rules, its attn_mask (bool, or a float bias: the one variant
    given as data, read by slicing), and a user's FlexAttention mods: score_mod and a BlockMask's mask_mod
    (_Mod), the BlockMask's blocks (plan) and the tensors score_mod reads (score_inputs, or in the backward
    their stand-ins). Query row r sits at position r + shift (0: top-left, Lk - Lq: bottom-right), key c at
    c; or at positions, every row's own (a KVCache's: queries' (B, 1, Lq, 1), keys' (B, 1, 1, Lk)). Blocks:
    slices rows, cols."""
    rules: list
    shift: int = 0
    positions: Optional[tuple] = None
    attn_mask: Optional[torch.Tensor] = None

    score_mod: Optional["_Mod"] = None
    mask_mod: Optional["_Mod"] = None
    plan: Optional[dict] = None
    score_inputs: tuple = ()

    def key_blocks(self, rows, Lk, ck):
        """The key blocks (of at most ck keys) that queries `rows` may see, cut to the keys that the rules let
        some of them see; with a BlockMask, its own blocks within them."""
        lo, hi = 0, Lk
        for rule in self.rules:
            if rule.keys is not None and self.positions is None:
                first, end = rule.keys(rows.start + self.shift, rows.stop + self.shift)
                lo, hi = max(lo, first), min(hi, end)
        if self.plan is not None:
            blocks = self.plan.get(rows.start, ())
            return [slice(k0, min(k0 + ck, Lk)) for k0 in blocks if lo < k0 + ck and k0 < hi]
        return [slice(k0, min(k0 + ck, hi)) for k0 in range(lo, hi, ck)]

    def keep(self, rows, cols, device):
        """The block's bool mask (.., rows, cols), True where a key is seen (None: all are): the masks of the
        rules that hide some of its keys, and a bool attn_mask."""
        keep, ij = None, None
        for rule in self.rules:
            if rule.mask is not None and not self._sees_all(rule, rows, cols):
                ij = ij or self._positions(rows, cols, device)
                keep = rule.mask(*ij) if keep is None else keep & rule.mask(*ij)
        m = self._attn_mask(rows, cols)
        if m is not None and m.dtype == torch.bool:
            keep = m if keep is None else keep & m
        return keep

    def scores(self, s, rows, cols, backward=False):
        """A chunked block's scores s (B, H, rows, cols), q.k * scale made in base 2, or in nats for a
        score_mod that is not a bias: score_mod applied first (it sees torch's flex's score), then in base 2
        the rules' biases and a float attn_mask added (after a softcap, as Hugging Face's models add theirs),
        -inf where a key is hidden; backward: also the pullback of their gradient through score_mod (None:
        the identity)."""
        mod, pullback = self.score_mod, None
        if mod is not None and mod.bias is not None:  # score + f: f added in place, in base 2
            learned = backward and any(t.requires_grad for t in self.score_inputs)
            with torch.set_grad_enabled(learned):  # a learned f's graph: the pullback follows it
                f = mod.bias(None, *mod.indices(rows, cols, self.score_inputs))  # f, or (a, b): f = a * b
                if isinstance(f, tuple) and (learned or torch.result_type(*f) != s.dtype):
                    f = f[0] * f[1]  # made as the mod makes it, unless addcmul multiplies in the same dtype
            s = (torch.addcmul(s, *f, value=mod.sign * LOG2E, out=s) if isinstance(f, tuple)  # f never made
                 else s.add_(f.detach(), alpha=mod.sign * LOG2E))
            pullback = self._bias_pullback(f) if learned else None
        elif mod is not None:  # in nats, then base 2: into S's buffer in the forward, but from an expanded
            out, pullback = self._pullback(s, rows, cols) if backward else (  # view (it may overlap S);
                mod(s, rows, cols, self.score_inputs), None)  # in the backward a new one (autograd keeps S)
            s = torch.mul(out, LOG2E, out=s) if out.is_contiguous() and not backward else out * LOG2E
        ij, m, keep = None, self._attn_mask(rows, cols), self.keep(rows, cols, s.device)
        for rule in self.rules:
            if rule.score is not None:
                ij = ij or self._positions(rows, cols, s.device)
                s = rule.score(s, *ij)
        if m is not None and m.is_floating_point():  # clamped finite, but -inf
            s = s.add_(_finite_bias(m, s.dtype, LOG2E))
        if self.plan is not None:
            keep = self._block_mask(keep, rows, cols)
        if keep is not None:  # a select: -inf where hidden, whatever s held (faster than a fill on a CPU)
            s = torch.where(keep, s, s.new_full((), -math.inf), out=s)
        return (s, pullback) if backward else s

    def dense(self, Lq, Lk, device):
        """The whole (Lq, Lk) mask, broadcastable to (B, H, Lq, Lk), for naive, flash and a KVCache: None (all
        keys seen), bool (True where seen), or a float bias with -inf where hidden."""
        rows, cols = slice(0, Lq), slice(0, Lk)
        keep, bias = self.keep(rows, cols, device), None  # bias: a new tensor, the rules' biases
        for rule in self.rules:
            if rule.score is not None:
                s = torch.zeros((), device=device) if bias is None else bias
                bias = rule.score(s, *self._positions(rows, cols, device))
        m = self._attn_mask(rows, cols)
        if m is not None and m.is_floating_point():
            if bias is None:  # the user's own mask: never written in place
                return m if keep is None else m.masked_fill(~keep, -math.inf)
            bias = bias + m
        if bias is None or keep is None:
            return keep if bias is None else bias
        if torch.broadcast_shapes(bias.shape, keep.shape) == bias.shape:
            return bias.masked_fill_(~keep, -math.inf)
        return bias.masked_fill(~keep, -math.inf)  # a larger tensor: the mask's batch, say

    def _positions(self, rows, cols, device):
        """(i, j): the positions of the queries `rows`, (rows, 1) or (B, 1, rows, 1), and the keys `cols`."""
        if self.positions is not None:  # each row's own, (B, 1, Lq, 1) and (B, 1, 1, Lk), read by dense()
            return self.positions
        i = torch.arange(rows.start + self.shift, rows.stop + self.shift, device=device)[:, None]
        return i, torch.arange(cols.start, cols.stop, device=device)[None, :]

    def _sees_all(self, rule, rows, cols):
        """Whether by this rule every query of `rows` sees every key of `cols`: then no mask is needed."""
        if rule.keys is None or self.positions is not None:
            return False
        first, last = rows.start + self.shift, rows.stop - 1 + self.shift
        return rule.keys(last, last + 1)[0] <= cols.start and cols.stop <= rule.keys(first, first + 1)[1]

    def _attn_mask(self, rows, cols):
        """The attn_mask's block: sliced only where it does not broadcast and the block is not all of it."""
        m = self.attn_mask
        if m is not None and m.size(-2) not in (1, rows.stop - rows.start):
            m = m[..., rows, :]
        if m is not None and m.size(-1) not in (1, cols.stop - cols.start):
            m = m[..., cols]
        return m

    def _block_mask(self, keep, rows, cols):
        """keep, and the BlockMask's verdict: all keys of a full block, its mask_mod's in a partial one."""
        states, partial = self.plan[rows.start][cols.start]
        if states is None:  # full for every (b, h)
            return keep
        seen = states == 2
        if partial:
            seen = seen | ((states == 1) & self.mask_mod(None, rows, cols, self.mask_mod.inputs))
        return seen if keep is None else keep & seen

    def _pullback(self, s, rows, cols):
        """score_mod(s) on a block and its way back, ds -> the gradient of s, adding the gradients of the
        stand-ins into their .grad; under torch.compile, where the mod reads no tensor that requires grad
        (_Mod), torch.func.vjp."""
        mod = functools.partial(self.score_mod, rows=rows, cols=cols, inputs=self.score_inputs)
        if torch.compiler.is_compiling():  # on a copy: the mod may edit its score in place, as eager's below
            out, vjp = torch.func.vjp(lambda x: mod(x.clone()), s)
            return out, lambda ds: vjp(ds)[0]
        with torch.enable_grad():
            s = s.detach().requires_grad_()
            out = mod(s.clone() if self.score_mod.in_place else s)

        def pullback(ds):  # backward, not grad: inside an outer autograd.grad FlopCounterMode refuses grad
            if out.requires_grad:  # else the mod reads neither its score nor a tensor that requires grad
                learned_inputs = [t for t in self.score_inputs if t.requires_grad]
                torch.autograd.backward(out, ds, inputs=[s, *learned_inputs])
            return torch.zeros_like(s) if s.grad is None else s.grad
        return out.detach(), pullback

    def _bias_pullback(self, f):
        """For score + f, f made on a block under autograd: ds passes through unchanged; the stand-ins that
        require grad get f's share of it."""
        def pullback(ds):
            df = ds.sum_to_size(f.shape)  # ds itself where f has the block's shape: never written to
            learned_inputs = [t for t in self.score_inputs if t.requires_grad]
            torch.autograd.backward(f, df if self.score_mod.sign > 0 else -df, inputs=learned_inputs)
            return ds
        return pullback


def _apply_mask(scores, mask):
    """scores with a Visibility.dense mask applied: -inf where a bool mask is False (never -1e9: it
    overflows float16), the bias of a float mask added in float32 or wider (a finfo.min bias
    plus a negative score would overflow float16 to -inf); in place where the dtype allows."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, float("-inf"))
    wide = torch.promote_types(torch.promote_types(scores.dtype, mask.dtype), torch.float32)
    return scores.add_(mask) if scores.dtype == wide else scores.to(wide) + mask


def _finite_bias(bias, dtype, scale=1.0):
    """bias * scale in dtype, clamped to dtype's finite range, -inf kept -inf. Without the clamp a finite
    value such as finfo(float32).min (Hugging Face's "masked") would overflow to -inf in a narrower
    dtype, or when multiplied by log2(e), and so mask its key: only -inf may do that."""
    finfo = torch.finfo(dtype)
    wide = bias.to(torch.promote_types(bias.dtype, dtype)) * scale
    return wide.clamp(finfo.min, finfo.max).to(dtype).masked_fill(torch.isneginf(bias), float("-inf"))


def _reopen_dead_rows(mask):
    """(mask, dead): a row with every key masked would make softmax 0/0 = NaN, forward and backward; it
    sees every key instead, and `dead` (.., Lq, 1) marks it, for the caller to zero (output and gradient)."""
    if mask.dtype == torch.bool:
        dead = ~mask.any(-1, keepdim=True)
        return mask | dead, dead
    dead = torch.isneginf(mask).all(-1, keepdim=True)
    return mask.masked_fill(dead, 0.0), dead


# -----------------------------------------------------------------------------
# naive: standard_attention with every convention above, and the weights it used. Like the core's, it
# materialises the (Lq, Lk) scores.


def naive_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, window_size=None,
                    cu_seqlens=None, alibi_slopes=None, enable_gqa=False):
    """Attention(Q, K, V) = softmax(Q K^T * scale + M) V,  scale = 1/sqrt(D) by default.

    Returns out (B, H, Lq, Dv) and the weights (B, H, Lq, Lk) it used, after dropout, so that
    out == weights @ v. Standard attention as it is written: computed in the inputs' dtype (softmax
    accumulates in float32 inside), a float mask (and ALiBi's bias, built whole) added in float32 or wider.
    Causality top-left, or bottom-right with causal_lower_right; enable_gqa repeats K, V per query head."""
    q, k, v, attn_mask, is_causal, shift, scale = _attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, window_size, cu_seqlens, enable_gqa)
    slopes = _checked_alibi(alibi_slopes, q)
    rules = named_rules(is_causal, window_size, cu_seqlens, slopes, q.size(-2), q.device)
    mask = Visibility(rules, shift, attn_mask=attn_mask).dense(q.size(-2), k.size(-2), q.device)
    if k.size(1) != q.size(1):  # grouped-query attention, written out: query head h reads K/V head h // G
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    mask, dead = (None, None) if mask is None else _reopen_dead_rows(mask)
    with _no_autocast(q):  # the inputs' dtype decides, as in any function
        scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
        weights = torch.softmax(_apply_mask(scores, mask), dim=-1).to(v.dtype)
        weights = weights if dead is None else weights.masked_fill(dead, 0.0)
        if dropout_p > 0.0:
            weights = F.dropout(weights, dropout_p)  # kept weights scaled by 1/(1-p): same expectation
        return weights @ v, weights


# -----------------------------------------------------------------------------
# chunked: blockwise_attention with every convention above, FlashAttention-2's precision recipe for 16-bit
# inputs, dropout that the backward regenerates, hidden blocks skipped, and custom operators for compile.
#
# As in the core, each block of query rows visits the key blocks (cols) it sees, keeping m, l, o per query,
# out = o / l at the end. A few (cq, ck) blocks of scores are alive beside them (cost_model.py counts them):
# one buffer for every S_j and P_j, reused from j to j (a new block costs a CPU page faults), one for dP_j in
# the backward, 16-bit copies, dropout's hashes, a score_mod's results. Scores are in base 2,
# exp(x) = exp2(x log2 e), as FlashAttention's on a GPU, where exp2 is the native instruction.

LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def attend_block(q, k, v, rows, o, m, l, opts):
    """The forward's block update: queries `rows` against every key block j they see.

        S_j = Q K_j^T * scale * log2(e) + M_j * log2(e)      (M_j: its mask and biases, Visibility.scores)
        m' = max(m, rowmax(S_j)),   P_j = exp2(S_j - m'),   alpha = exp2(m - m'),   (_exp2)
        l' = alpha * l + rowsum(P_j),   o' = alpha * o + (Z_j * P_j) V_j

    Z_j is dropout's keep-mask (all ones without dropout); l counts the dropped weights too, so
    that out = o / (l * (1 - p)) keeps the expectation. o (B, H, rows, Dv), m and l (B, H, rows, 1),
    float32 (float64 for float64), are updated in place; opts: block_options. m starts at the lowest finite
    value, not -inf: a row that has seen no key keeps it, and its P_j is exp2(-inf - m') = 0, where -inf would
    give exp2(-inf + inf) = NaN. k, v may have fewer heads (GQA; o must then be contiguous: the products are
    added into its view (B * H_kv, G * rows, Dv), G = H / H_kv)."""
    if q.size(0) * q.size(1) == 0:  # an empty batch, or no heads: nothing to attend
        return
    q_i = _per_kv_head(q[:, :, rows], k)  # (B * H_kv, G * rows, D)
    k_all, v_all = k.flatten(0, 1), v.flatten(0, 1)  # (B * H_kv, Lk, D or Dv)
    o_i = o.view(*q_i.shape[:-1], o.size(-1))  # (B * H_kv, G * rows, Dv), a view: P V is added into o
    scratch = o.new_empty(q_i.size(0) * q_i.size(1) * min(opts.ck, k.size(-2)))  # S_j and P_j, every j
    for cols in opts.vis.key_blocks(rows, k.size(-2), opts.ck):
        s = _scores(q_i, k_all, rows, cols, opts, scratch=scratch, H=q.size(1))  # (B, H, cq, ck)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = _exp2(s.sub_(m_new), opts.flush)  # P_j, in place: no second block-sized buffer
        alpha = _exp2(m.sub_(m_new), opts.flush)  # in m's place, which takes m' once o is rescaled
        l.mul_(alpha).add_(p.sum(-1, keepdim=True))
        if opts.dropout_p > 0.0:
            _drop(p, _keep_bits(opts.row_hash[:, :, rows], opts.col_hash[cols], opts.dropout_p))
        o.mul_(alpha)
        _matmul(_per_kv_head(p.to(v.dtype), k), v_all[:, cols], out=o_i, add=True)  # P in the inputs' dtype
        m.copy_(m_new)


def _exp2(x, flush):
    """exp2(x) in place; with flush, results at or below the smallest normal float (finfo.tiny, 2^-126 in
    float32) become 0, as on a GPU (ex2.approx.ftz): subnormals slow a CPU's products up to 100x, and beside a
    row's largest weight, 1, change no sum. A bias (ALiBi's) makes many; the backward zeroes a few more."""
    if flush:  # x <= log2(tiny): -inf (NaN stays NaN)
        F.threshold_(x, math.log2(torch.finfo(x.dtype).tiny), -math.inf)
    return x.exp2_()


def chunked_forward(q, k, v, opts, cq):
    """The forward: every block of cq query rows starts from m = finfo.min, l = 0, o = 0, visits its key
    blocks (attend_block), and ends as out = o / (l * (1 - p)). Returns out (B, H, Lq, Dv) and per
    query m and log2(l), (B, H, Lq, 1), float32 or wider, for the backward (kept apart: a finfo.min
    bias makes m so large that m + log2(l) would round to m); a query with every key masked gets
    out = 0 and m = +inf, so that its recomputed P is 0."""
    B, H, Lq, _ = q.shape
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty(B, H, Lq, v.size(-1))
    m_all, log2_l = (q.new_empty(B, H, Lq, 1, dtype=acc_dtype) for _ in range(2))
    for rows in _blocks(Lq, cq):
        m = q.new_full((B, H, rows.stop - rows.start, 1), torch.finfo(acc_dtype).min, dtype=acc_dtype)
        l = torch.zeros_like(m)
        o = q.new_zeros(B, H, rows.stop - rows.start, v.size(-1), dtype=acc_dtype)
        attend_block(q, k, v, rows, o, m, l, opts)
        dead = l == 0  # every key masked
        out[:, :, rows] = o / (l.masked_fill(dead, 1.0) * (1.0 - opts.dropout_p))
        m_all[:, :, rows] = m.masked_fill(dead, float("inf"))
        log2_l[:, :, rows] = torch.log2(l.masked_fill(dead, 1.0))
    return out, m_all, log2_l


def attend_block_backward(dout, q, k, v, out, m, log2_l, rows, dq, dk, dv, dmask, opts):
    """The backward's block update: queries `rows` against every key block j they see.

        P_j = exp2(S_j - m - log2(l))      (the forward's probabilities, recomputed)
        dV_j += (Z_j * P_j)^T dO,   dP_j = Z_j * (dO V_j^T) / (1 - p),   dS_j = P_j * (dP_j - rowsum(dO * O)),
        dQ += dS_j K_j,   dK_j += dS_j^T Q,   dM_j = dS_j (a float mask)

    dq, dk, dv (float32) are added to in place, dq and dk without the scale and dv without 1 / (1 - p) (both
    applied once, at the end), and dmask, a float mask's gradient, when it is not None. The loop runs in the
    forward's order, query blocks outside, adding into dK and dV across them. FlashAttention-2's Algorithm 2
    loops the other way, key blocks outside, so that dK_j and dV_j stay on chip and dQ goes to memory."""
    if q.size(0) * q.size(1) == 0:  # an empty batch, or no heads: no gradient to add
        return
    dout_i = dout[:, :, rows]  # (B, H, cq, Dv)
    m, log2_l = m[:, :, rows], log2_l[:, :, rows]  # (B, H, cq, 1)
    delta = (dout_i.to(m.dtype) * out[:, :, rows].to(m.dtype)).sum(-1, keepdim=True)  # rowsum(dO * O)
    if opts.dlse is not None:  # lse's gradient too: dS = P * (dP - Delta + dlse)
        delta = delta - opts.dlse[:, :, rows]
    q_i, dout_i = _per_kv_head(q[:, :, rows], k), _per_kv_head(dout_i, k)  # (B * H_kv, G * rows, D or Dv)
    k_all, v_all = k.flatten(0, 1), v.flatten(0, 1)  # (B * H_kv, Lk, D or Dv)
    # S_j (then P_j, dS_j) and dP_j, reused for every j; two tensors, not views of one: a write into a view
    # bumps its base's version, and autograd would refuse an S_j that a score_mod's graph saved
    scratch = [m.new_empty(q_i.size(0) * q_i.size(1) * min(opts.ck, k.size(-2))) for _ in range(2)]
    for cols in opts.vis.key_blocks(rows, k.size(-2), opts.ck):
        s, pullback = _scores(q_i, k_all, rows, cols, opts, scratch=scratch[0], backward=True, H=q.size(1))
        p = _exp2(s.sub_(m).sub_(log2_l), opts.flush)  # P_j (B, H, cq, ck)
        dp = _matmul(dout_i, v_all[:, cols].transpose(1, 2), out=scratch[1]).view(p.shape)  # (B, H, cq, ck)
        p_dropped = p
        if opts.dropout_p > 0.0:  # the forward's mask
            keep = _keep_bits(opts.row_hash[:, :, rows], opts.col_hash[cols], opts.dropout_p)
            p_dropped = _drop(p.clone(), keep)
            _drop(dp, keep).mul_(1.0 / (1.0 - opts.dropout_p))
        dv[:, :, cols] += _matmul(_per_kv_head(p_dropped.to(q.dtype), k).transpose(1, 2), dout_i).view(
            dv[:, :, cols].shape)  # summed over G; P_j in q's dtype is a temporary, freed before dS_j's copy
        ds = p.mul_(dp.sub_(delta))  # dS_j
        if dmask is not None:  # the mask is added to the scores: its gradient is dS, summed where broadcast
            dm = dmask[..., rows if dmask.size(-2) != 1 else slice(None), :]
            dm = dm[..., cols] if dmask.size(-1) != 1 else dm
            dm += ds.sum_to_size(dm.shape)
        if pullback is not None:  # back through score_mod; the tensors it reads get theirs (Visibility)
            ds = pullback(ds)
        ds_low = _per_kv_head(ds.to(q.dtype), k)  # rounded to the inputs' dtype for the products, as P is
        dq[:, :, rows] += _matmul(ds_low, k_all[:, cols]).view(dq[:, :, rows].shape)
        dk[:, :, cols] += _matmul(ds_low.transpose(1, 2), q_i).view(dk[:, :, cols].shape)


def chunked_backward(dout, q, k, v, out, m, log2_l, opts, cq, mask_grad=False):
    """The backward: every block of cq query rows adds its share (attend_block_backward) into dq, dk, dv
    (float32 zeros laid out as q, k, v) and, with mask_grad, into the gradient of the float attn_mask (opts);
    then the scale and 1 / (1 - p). Returns dq, dk, dv in the inputs' dtype and the mask's gradient in its
    own (None without mask_grad)."""
    dq, dk, dv = (torch.zeros_like(t, dtype=m.dtype) for t in (q, k, v))  # as q, k, v are (register_fake)
    mask = opts.vis.attn_mask
    dmask = torch.zeros_like(mask, dtype=m.dtype) if mask_grad else None
    dout, q, k, v = (t.contiguous() for t in (dout, q, k, v))  # every block a view, never a copy
    for rows in _blocks(q.size(-2), cq):
        attend_block_backward(dout, q, k, v, out, m, log2_l, rows, dq, dk, dv, dmask, opts)
    dv.mul_(1.0 / (1.0 - opts.dropout_p))
    return (dq.mul_(opts.scale).to(q.dtype), dk.mul_(opts.scale).to(k.dtype), dv.to(v.dtype),
            None if dmask is None else dmask.to(mask.dtype))


def default_chunk_size(device, Lq=None, dtype=torch.float32):
    """(query block, key block). CPU: the best of the sizes measured (results/README.md, "The chunked path");
    elsewhere a guess that keeps kernel launches few, not yet measured. Lq queries of a 32- or 64-bit dtype,
    fewer than a query block, take more keys a block, in the same area cq x ck: a decode step's one query, all
    its keys at once (16-bit blocks are not grown: a CPU copies them to float32, _matmul, and a large block's
    copy costs more than the fewer blocks save)."""
    cq, ck = (256, 256) if torch.device(device).type == "cpu" else (512, 512)
    grow = Lq is not None and Lq < cq and dtype.itemsize >= 4
    return (cq, cq * ck // max(Lq, 1)) if grow else (cq, ck)


def chunked_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                      window_size=None, cu_seqlens=None, alibi_slopes=None, chunk_size=None,
                      enable_gqa=False, return_lse=False, score_mod=None):
    """softmax(Q K^T * scale + M) V, the same result as naive_attention, in O(L) memory.

    chunk_size: int or (query block, key block); None: default_chunk_size. Blocks that causality (top-left, or
    bottom-right with causal_lower_right), window_size or cu_seqlens' documents hide are skipped; ALiBi's bias
    made block by block; with enable_gqa K, V and their gradients keep H_kv heads, never repeated. Gradients
    flow to q, k, v and a float attn_mask that requires grad; dropout's seed is drawn from the device's
    generator once the arguments pass (and a traced mod's result). return_lse: also lse = log sum_j exp(S_ij),
    (B, H, Lq), float32 or wider, -inf where a query sees no key, differentiable: attention over disjoint sets
    of keys merges exactly by it (strided attention, the ring). score_mod and a BlockMask as attn_mask:
    flex_attention's; score_mod sees q.k * scale, then ALiBi and a float attn_mask are added."""
    block_mask, attn_mask = (attn_mask, None) if isinstance(attn_mask, BlockMask) else (None, attn_mask)
    q, k, v, attn_mask, is_causal, shift, scale = _attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, window_size, cu_seqlens, enable_gqa)
    cq, ck = _chunks(default_chunk_size(q.device, q.size(-2), q.dtype) if chunk_size is None else chunk_size)
    alibi_slopes, mods = _checked_alibi(alibi_slopes, q), {}
    if score_mod is not None or block_mask is not None:  # Python functions: no custom operator takes them
        cq, ck = (cq, ck) if block_mask is None else _check_block_mask(block_mask, q, k)
        grad = any(t is not None and t.requires_grad for t in (q, k, v, attn_mask))  # the backward's mods
        call = ((*q.shape[:-1], k.size(-2)), q.device, q.dtype, grad, dropout_p > 0.0)  # _Mod's other args
        if score_mod is not None:
            mods.update(score_mod=_Mod(score_mod, "score_mod", *call))
        if block_mask is not None:
            mods.update(mask_mod=_Mod(block_mask.mask_mod, "mask_mod", *call),
                        plan=_block_plan(block_mask, k.size(-2)))
    seed = torch.randint(0, 2**31, (), dtype=torch.int32, device=q.device) if dropout_p > 0.0 else None
    if mods or not torch.compiler.is_compiling():  # eager, or mods: the autograd.Function (plumbing)
        nats = score_mod is not None and mods["score_mod"].bias is None  # what a score_mod (no bias) reads
        opts = block_options(q, k, attn_mask, seed, dropout_p, is_causal, scale, window_size, ck, cu_seqlens,
                             alibi_slopes, shift, base=1.0 if nats else LOG2E, **mods)
        inputs = [*getattr(mods.get("score_mod"), "inputs", ()), *getattr(mods.get("mask_mod"), "inputs", ())]
        out, m, log2_l = _ChunkedAttention.apply(q, k, v, attn_mask, opts, cq, *inputs)
    else:
        out, m, log2_l = _chunked_fwd(q, k, v, attn_mask, seed, cu_seqlens, alibi_slopes, dropout_p,
                                      is_causal, scale, window_size, cq, ck, shift)  # m, log2(l): backward's
    if not return_lse:
        return out
    return out, ((m + log2_l) * LN2).squeeze(-1).masked_fill(torch.isposinf(m).squeeze(-1), -math.inf)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch.nn.attention.flex_attention on the chunked path (chunked_attention), in O(L) memory, forward and
    backward, on any device: out = softmax(mask_mod(score_mod(Q K^T * scale))) V, query (B, H, Lq, D), key
    (B, H_kv, Lk, D), value (B, H_kv, Lk, Dv) -> (B, H, Lq, Dv), H_kv dividing H with enable_gqa; key and
    value of batch 1 serve every row beside a block_mask of query's batch, as torch's.

    score_mod(score, b, h, q_idx, kv_idx) -> a new score, and mask_mod(b, h, q_idx, kv_idx) -> True where the
    key is seen, are written for one score, as torch's: score float32 (float64 for float64), h the query
    head, the indices int32. Each is traced once a call into a graph whose every tensor read is an input: the
    backward computes with the forward's function and tensors (one changed in place since: autograd's error),
    and the tensors score_mod reads get their gradients, but a float16 or bfloat16 one, refused with gradients
    on (summed over the blocks in 16 bits, its gradient would be too coarse): cast it first, t.float()[h], or
    detach it. A mod torch.fx cannot trace (a Python if on a tensor) runs only without gradients. block_mask
    (create_block_mask) holds mask_mod and the key blocks each block of queries visits; mask_mod runs in its
    partial ones only, as in torch's compiled kernels. kernel_options is ignored. return_lse, or
    return_aux=AuxRequest(lse=True): also lse (B, H, Lq), -inf where a query sees no key (its output 0)."""
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be torch's BlockMask, not a {type(block_mask).__name__}")
    if any(t.is_nested for t in (query, key, value)):
        raise ValueError("flex_attention takes no nested tensors, as torch's: pass dense ones")
    if key.size(0) != query.size(0):  # as torch's: K/V of batch 1 serve every row, beside a BlockMask of q's
        if key.size(0) != 1 or block_mask is None or block_mask.kv_num_blocks.size(0) != query.size(0):
            raise ValueError(f"q of batch {query.size(0)} and k, v of batch {key.size(0)}: as torch's, k and "
                             "v of q's batch, or of batch 1 beside a BlockMask of q's batch")
        key, value = (t.expand(query.size(0), *t.shape[1:]) for t in (key, value))  # their gradient summed
    if return_aux is not None and (return_lse or return_aux.max_scores):
        raise ValueError("return_aux: not with return_lse (as torch), nor max_scores (this path keeps none)")
    lse = return_lse or (return_aux is not None and return_aux.lse)
    out = chunked_attention(query, key, value, block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=lse,
                            score_mod=score_mod)
    if return_aux is None:
        return out
    return (out[0], AuxOutput(lse=out[1])) if lse else (out, AuxOutput())


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False):
    """torch's create_block_mask without the (B, H, Q_LEN, KV_LEN) mask. Queries and keys are cut into blocks
    of BLOCK_SIZE (or (query block, key block)); for a block of queries, a block of keys is full (mask_mod
    True on all its pairs: attended without calling it), partial (mask_mod decides there) or left out.
    mask_mod runs on one row of blocks at a time, (B, H, BLOCK_SIZE, KV_LEN), and the result is torch's
    BlockMask: for each (b, h, block of queries), how many key blocks are partial (kv_num_blocks) and which
    (kv_indices), the same for the full ones. B, H None: blocks from b = h = 0, as torch builds them;
    _compile changes nothing."""
    B, H, (cq, ck) = B or 1, H or 1, (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    nk, counts = -(-KV_LEN // ck), []  # ceil(KV_LEN / ck) key blocks; per row of blocks, the keys they show
    mod = _Mod(mask_mod, "mask_mod", (B, H, Q_LEN, KV_LEN), device, torch.float32)
    for rows in _blocks(Q_LEN, cq):
        seen = mod(None, rows, slice(0, KV_LEN), mod.inputs).expand(B, H, rows.stop - rows.start, KV_LEN)
        seen = F.pad(seen, (0, nk * ck - KV_LEN))
        counts.append(seen.view(B, H, rows.stop - rows.start, nk, ck).sum((2, 4)))  # padding: keys none shows
    counts = torch.stack(counts, 2)  # (B, H, nq, nk)

    def ordered(dense):  # (B, H, nq, nk) bool -> each row's count, and its blocks' indices listed first
        return dense.sum(-1).int(), torch.argsort(dense.int(), dim=-1, descending=True, stable=True).int()
    return BlockMask.from_kv_blocks(*ordered((counts > 0) & (counts < cq * ck)), *ordered(counts == cq * ck),
                                    BLOCK_SIZE=(cq, ck), mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))


def hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Hugging Face's attention interface on the chunked path, for any of its models: register it with
    transformers.AttentionInterface.register("minitransformer", hf_attention) and a mask function under the
    same name (AttentionMaskInterface.register("minitransformer", sdpa_mask): without one HF passes no mask,
    and padding and windows are lost), then build the model with attn_implementation="minitransformer".
    Contract: sdpa_attention_forward's, query (B, H, L, D), key and value (B, H_kv, Lk, D) -> ((B, L, H, D),
    None). attention_mask: sdpa_mask's bool (B, 1, L, Lk), eager_mask's float (finfo.min where hidden), a
    BlockMask, or None: causal as the SDPA route decides (is_causal=, else module.is_causal, with more than
    one query; top-left). softcap: Gemma 2's tanh softcap, as a score_mod, the mask added after it (HF's
    order); position_bias: added to the scores; a sliding window: the mask's own. Sinks (s_aux) are
    refused; other keywords (position_ids, ...) are not used."""
    if kwargs.get("s_aux") is not None:
        raise ValueError("hf_attention has no attention sinks (s_aux): use the model's eager attention")
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    is_causal = bool(is_causal) and attention_mask is None and query.size(2) > 1
    if is_causal and key.size(2) > query.size(2):  # keys after the last query, hidden: cut, as SDPA's route
        key, value = key[:, :, :query.size(2)], value[:, :, :query.size(2)]
    bias, cap = kwargs.get("position_bias"), kwargs.get("softcap")
    if bias is not None and isinstance(attention_mask, BlockMask):
        raise ValueError("hf_attention: position_bias beside a BlockMask; register sdpa_mask or eager_mask")
    if bias is not None:  # a float mask, HF's smallest float where attention_mask hides a key
        bias, mask = bias[..., :key.size(2)], attention_mask
        if mask is not None and mask.is_floating_point():
            bias = bias + mask
        elif mask is not None:
            bias = bias.masked_fill(~mask, max(torch.finfo(key.dtype).min, torch.finfo(bias.dtype).min))
        attention_mask = bias
    softcap = None if cap is None else lambda s, b, h, i, j: cap * torch.tanh(s / cap)
    out = chunked_attention(query, key, value, attention_mask, dropout, is_causal, scaling,
                            enable_gqa=key.size(1) != query.size(1), score_mod=softcap)
    return out.transpose(1, 2).contiguous(), None  # (B, L, H, D)


def hf_block_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, device="cpu", **kwargs):
    """Hugging Face's mask interface (AttentionMaskInterface) as a BlockMask that create_block_mask builds in
    linear memory: mask_function (causal, a window, documents: HF's) and attention_mask's key padding (B,
    up to kv_offset + kv_length; keys past its end hidden, as HF pads it for a static cache), the queries
    and keys at q_offset and kv_offset. Register it beside hf_attention for linear memory: sdpa_mask's
    bool mask holds L x L bytes."""
    if attention_mask is not None and attention_mask.size(-1) < kv_offset + kv_length:  # a static cache's
        attention_mask = F.pad(attention_mask, (0, kv_offset + kv_length - attention_mask.size(-1)))

    def mask_mod(b, h, q_idx, kv_idx):
        seen = mask_function(b, h, q_idx + q_offset, kv_idx + kv_offset)
        return seen if attention_mask is None else seen & attention_mask[b, kv_idx + kv_offset].bool()
    blocks = default_chunk_size(device)
    return create_block_mask(mask_mod, batch_size, None, q_length, kv_length, device, blocks)


# The plumbing of the chunked path: eager calls and calls with mods (Python functions) go through an
# autograd.Function; other compiled calls through two custom operators, opaque nodes compile never unrolls
# (eager calls avoid them: an operator's first call imports torch's compiler, 2 s); then what blocks share.


@dataclass
class BlockOptions:
    """What every block update of one call shares (block_options)."""
    scale: float
    ck: int  # key block size
    vis: Visibility  # every variant of the call: which keys each query sees, and the biases
    dropout_p: float = 0.0
    row_hash: Optional[torch.Tensor] = None  # dropout: hashes of the rows (b, h, i), (B, H, Lq, 1), int32
    col_hash: Optional[torch.Tensor] = None  # and of the key columns j, (Lk,)
    dlse: Optional[torch.Tensor] = None  # the backward's: the gradient of return_lse's lse, (B, H, Lq, 1)
    base: float = LOG2E  # scores in base 2 as they are made; with a user's mods in nats until they have run
    flush: bool = False  # a bias spreads the scores: weights below the normal range made 0 (_exp2)


def block_options(q, k, attn_mask, seed, dropout_p, is_causal, scale, window_size, ck, cu_seqlens=None,
                  alibi_slopes=None, shift=0, base=LOG2E, **mods):
    """The BlockOptions of a call: its named arguments as rules (the slopes in the scores' base), composed
    with its attn_mask and a user's mods (Visibility's score_mod, mask_mod, plan)."""
    slopes = None if alibi_slopes is None else alibi_slopes * LOG2E
    rules = named_rules(is_causal, window_size, cu_seqlens, slopes, q.size(-2), q.device)
    inputs = getattr(mods.get("score_mod"), "inputs", ())
    vis = Visibility(rules, shift, attn_mask=attn_mask, score_inputs=inputs, **mods)
    hashes = _dropout_hashes(seed, *q.shape[:3], k.size(-2)) if dropout_p > 0.0 else (None, None)
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    flush = float_mask or slopes is not None or "score_mod" in mods  # a bias: _exp2 flushes
    return BlockOptions(scale, ck, vis, dropout_p, *hashes, base=base, flush=flush)


# The operators' namespace is the module's own name: a copy imported under another name registers operators
# of its own, never replacing these (importlib.reload, under the same name, replaces them).
_OPS = re.sub(r"\W", "_", __name__)


@torch.library.custom_op(f"{_OPS}::chunked_attention_fwd", mutates_args=())
def _chunked_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 seed: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                 alibi_slopes: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: float,
                 window_size: Optional[int], cq: int, ck: int, shift: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunked_forward as an operator: out, m, log2(l)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # every block a view, never a copy
    opts = block_options(q, k, attn_mask, seed, dropout_p, is_causal, scale, window_size, ck, cu_seqlens,
                         alibi_slopes, shift)
    with _no_autocast(q):  # it reaches the products inside an operator, and would round them to 16 bits
        return chunked_forward(q, k, v, opts, cq)


@torch.library.custom_op(f"{_OPS}::chunked_attention_bwd", mutates_args=())
def _chunked_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 m: torch.Tensor, log2_l: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 seed: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                 alibi_slopes: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: float,
                 window_size: Optional[int], cq: int, ck: int, mask_grad: bool, shift: int = 0,
                 dlse: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunked_backward as an operator: dq, dk, dv, and a float attn_mask's gradient when mask_grad
    (else an empty tensor)."""
    opts = replace(block_options(q, k, attn_mask, seed, dropout_p, is_causal, scale, window_size, ck,
                                 cu_seqlens, alibi_slopes, shift), dlse=dlse)
    with _no_autocast(q):  # as the forward's
        dq, dk, dv, dmask = chunked_backward(dout, q, k, v, out, m, log2_l, opts, cq, mask_grad)
    return dq, dk, dv, q.new_empty(0) if dmask is None else dmask


@_chunked_fwd.register_fake
def _(q, k, v, attn_mask, seed, cu_seqlens, alibi_slopes, dropout_p, is_causal, scale, window_size, cq, ck,
      shift=0):
    stats = q.new_empty(*q.shape[:-1], 1, dtype=torch.promote_types(q.dtype, torch.float32))
    return q.new_empty(*q.shape[:-1], v.size(-1)), stats, torch.empty_like(stats)


@_chunked_bwd.register_fake
def _(dout, q, k, v, out, m, log2_l, attn_mask, seed, cu_seqlens, alibi_slopes, dropout_p, is_causal, scale,
      window_size, cq, ck, mask_grad, shift=0, dlse=None):
    dmask = torch.empty_like(attn_mask) if mask_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


def _chunked_save(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # a gradient of None: that output is unused (lse without return_lse)
    q, k, v, attn_mask, seed, cu_seqlens, alibi_slopes, *options = inputs
    ctx.save_for_backward(q, k, v, *output, attn_mask, seed, cu_seqlens, alibi_slopes)  # out, m, log2 l
    *ctx.options, ctx.shift = options  # dropout_p, is_causal, scale, window_size, cq, ck; shift


def _chunked_grad(ctx, dout, _dm, dlog2_l):
    q, k, v, out, m, log2_l, attn_mask, seed, cu_seqlens, alibi_slopes = ctx.saved_tensors
    mask_grad = ctx.needs_input_grad[3]  # a float mask that requires grad: a learned bias (T5)
    dout = torch.zeros_like(out) if dout is None else dout  # a loss of lse alone
    dlse = None if dlog2_l is None else dlog2_l / LN2  # lse = (m + log2(l)) ln 2: m's gradient is the same
    dq, dk, dv, dmask = _chunked_bwd(dout, q, k, v, out, m, log2_l, attn_mask, seed, cu_seqlens, alibi_slopes,
                                     *ctx.options, mask_grad, ctx.shift, dlse)
    return dq, dk, dv, dmask if mask_grad else None, *[None] * 10


_chunked_fwd.register_autograd(_chunked_grad, setup_context=_chunked_save)


class _ChunkedAttention(torch.autograd.Function):
    """chunked_forward and chunked_backward for eager calls and a user's mods: the gradients of q, k, v, of a
    float attn_mask, and of `inputs`, the tensors score_mod and then mask_mod read (_Mod). opts stays on ctx,
    unsaved: the backward reads its rules and dropout's hashes as the forward did. create_graph=True is
    refused here (compiled, one backward later); torch.func cannot run it."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, opts, cq, *inputs):
        ctx.set_materialize_grads(False)  # a gradient of None: that output is unused
        with _no_autocast(q):
            out, m, log2_l = chunked_forward(q.contiguous(), k.contiguous(), v.contiguous(), opts, cq)
        ctx.save_for_backward(q, k, v, out, m, log2_l, attn_mask, *inputs)  # autograd refuses them changed
        ctx.opts, ctx.cq = opts, cq
        return out, m, log2_l

    @staticmethod
    def backward(ctx, dout, _dm, dlog2_l):
        if torch.is_grad_enabled():  # create_graph=True: this backward has no backward of its own
            raise RuntimeError("chunked_attention's backward cannot be differentiated (create_graph=True)")
        q, k, v, out, m, log2_l, _, *inputs = ctx.saved_tensors  # the mask: the same as opts.vis's
        # score_mod reads stand-ins of the tensors that need a gradient: theirs adds up over the blocks
        wants = ctx.needs_input_grad[6:]
        standins = [t.detach().requires_grad_() if want else t for t, want in zip(inputs, wants)]
        vis = replace(ctx.opts.vis, score_inputs=tuple(standins[:len(ctx.opts.vis.score_inputs)]))
        opts = replace(ctx.opts, vis=vis, dlse=None if dlog2_l is None else dlog2_l / LN2)  # as _chunked_grad
        dout = torch.zeros_like(out) if dout is None else dout  # a loss of lse alone
        with _no_autocast(q):
            grads = chunked_backward(dout, q, k, v, out, m, log2_l, opts, ctx.cq, ctx.needs_input_grad[3])
        return (*grads, None, None, *[t.grad if want else None for t, want in zip(standins, wants)])


class _Mod:
    """A user's mod, score_mod(score, b, h, q_idx, kv_idx) or mask_mod(b, h, q_idx, kv_idx), as the blocks
    call it: mod(s or None, rows, cols, inputs) -> the block's scores (B, H, rows, cols), or its bool mask
    (broadcastable).

    Traced once a call by torch.fx into a graph whose every tensor input is explicit (_ReadsAsInputs): a
    tensor the mod reads without making it from its arguments (a closure's, a global, a module's parameter, or
    a value it computes from them) becomes an argument of the graph, `inputs`. The forward and the backward
    then call one graph on the same tensors, which autograd saves, and the gradients of those that require
    grad are the graph's, summed over the blocks and handed back to autograd once, hooks included. A mod that
    torch.fx cannot trace runs as written only where no backward will call it again (grad: whether one may);
    any mod under torch.compile, which inlines it, runs as written. Each block calls it on broadcast indices
    b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, rows, 1), kv_idx (1, 1, 1, cols), int32 as in torch's
    compiled kernels, where its graph works element by element (_elementwise: arithmetic, comparisons, a table
    indexed by all the indices at once); else vmapped, as torch runs it. A score_mod score + f(b, h, q_idx,
    kv_idx) (ALiBi, a relative table) is run as its bias f (bias, sign). shape: (B, H, Lq, Lk) of the call."""

    def __init__(self, mod, name, shape, device, dtype, grad=False, dropout=False):  # dropout_p > 0
        if isinstance(mod, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):  # as torch's flex_attention
            raise ValueError(f"{name}: a TorchScript function, which cannot be traced: pass it as Python")
        self.name, self.score, self.fn, self.inputs, self.in_place = name, name == "score_mod", mod, (), True
        self.b, self.h = (torch.arange(n, device=device, dtype=torch.int32) for n in shape[:2])
        gm, untraced = None, None
        if not torch.compiler.is_compiling():
            try:
                gm, reads = _traced(mod, self.score)
            except Exception as e:
                untraced = e
            else:  # an inference tensor has no version to check: its values now
                self.fn, self.inputs = gm.forward, tuple(t.clone() if t.is_inference() else t for t in reads)
                self.in_place = any(n.op == "call_method" and n.target[-1] == "_" != n.target[-2]
                                    for n in gm.graph.nodes)  # a method such as add_: it edits its score
                subclass = next((t for t in reads if type(t) not in (torch.Tensor, nn.Parameter)), None)
                if self.score and subclass is not None:  # its __torch_function__ may read what no graph shows
                    raise ValueError(f"score_mod reads a {type(subclass).__name__}, a tensor subclass: pass "
                                     "a plain tensor")
                half = [t for t in reads if t.requires_grad and t.dtype in (torch.float16, torch.bfloat16)]
                if self.score and half and torch.is_grad_enabled():
                    raise ValueError(f"score_mod learns a {half[0].dtype} tensor {tuple(half[0].shape)}: "
                                     "summed over the blocks in 16 bits, its gradient would break Flash"
                                     "Attention's precision rule (cast it first, t.float()[h], or detach it)")
        self.vmapped = self.fn
        for n in (3, 2, 1, 0):  # kv_idx innermost, b outermost; the score mapped along with each
            dims = tuple(0 if d == n else None for d in range(4)) + (None,) * len(self.inputs)
            self.vmapped = torch.vmap(self.vmapped, in_dims=(0,) * self.score + dims)
        learned = self.score and torch.is_grad_enabled() and gm is None and self._learned(dtype)
        if untraced is not None and torch.is_grad_enabled() and (grad or learned):
            raise ValueError(f"{name}: torch.fx cannot trace it ({untraced}), and the backward calls it "
                             "again on the tensors it read, which only a trace finds: write it with torch "
                             "functions (torch.where for an if on a tensor), or call it without gradients")
        if learned:
            raise ValueError("under torch.compile, score_mod may read no tensor that requires grad: finding "
                             "it takes torch.fx, which runs outside the compiled graph (compile around the "
                             "attention: torch.compiler.disable)")
        probed = gm is not None and 0 not in shape and (dropout or _elementwise(gm))  # no element: no block
        self.broadcast = probed and self._broadcasts(shape, dtype) and _elementwise(gm)
        self.bias, self.sign = _additive(gm) if self.score and self.broadcast else (None, 0)

    def __call__(self, s, rows, cols, inputs, broadcast=None):
        args, (b, h, i, j, *reads) = [] if s is None else [s], self.indices(rows, cols, inputs)
        if self.broadcast if broadcast is None else broadcast:
            out = self.fn(*args, b, h, i, j, *reads)
        else:
            out = self.vmapped(*args, self.b, self.h, i.flatten(), j.flatten(), *inputs)  # 0-d as they are
        shape = (len(self.b), len(self.h), i.numel(), j.numel())
        ok = torch.is_tensor(out) and (out.is_floating_point() if self.score else out.dtype == torch.bool)
        if not (ok and out.dim() <= 4 and all(n in (1, m) for n, m in zip(out.shape[::-1], shape[::-1]))):
            raise TypeError(f"{self.name} must return a {'float' if self.score else 'bool'} for each (b, h, "
                            f"q_idx, kv_idx), as torch's FlexAttention: got {getattr(out, 'dtype', out)} "
                            f"{tuple(getattr(out, 'shape', ()))} for {shape}")
        return (out if out.shape == shape else out.expand(shape)).to(s.dtype) if self.score else out

    def indices(self, rows, cols, inputs):
        """b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, rows, 1), kv_idx (1, 1, 1, cols), then the inputs, a
        0-d one as (1, 1, 1, 1): promoted as in vmap (c * table[i], c a float64 0-d: float64, not float16)."""
        i, j = (torch.arange(r.start, r.stop, device=self.b.device, dtype=torch.int32) for r in (rows, cols))
        return (self.b.view(-1, 1, 1, 1), self.h.view(1, -1, 1, 1), i.view(1, 1, -1, 1), j.view(1, 1, 1, -1),
                *[t.view(1, 1, 1, 1) if t.dim() == 0 else t for t in inputs])

    def _learned(self, dtype):
        """Whether the mod, on one key, reads a tensor that requires grad (autograd tells, however read)."""
        s = self.b.new_zeros(len(self.b), len(self.h), 1, 1, dtype=torch.promote_types(dtype, torch.float))
        with torch.enable_grad():
            return self(s, slice(0, 1), slice(0, 1), self.inputs, broadcast=False).requires_grad

    def _broadcasts(self, shape, dtype):
        """Whether a broadcast call, as a vmapped one, returns a value per (b, h, q_idx, kv_idx), on 4 queries
        and 5 keys at most (a table read whole, s + table, broadcasts where vmap gives one per element); the
        vmapped call first, raising what blocks would raise on these keys, before dropout's seed is drawn."""
        rows, cols = slice(0, min(shape[2], 4)), slice(0, min(shape[3], 5))
        s = self.b.new_zeros(*shape[:2], rows.stop, cols.stop, dtype=torch.promote_types(dtype, torch.float))
        with warnings.catch_warnings():  # vmap's (masked_fill has no batching rule): again where it runs
            warnings.simplefilter("ignore")
            self(s.clone() if self.score else None, rows, cols, self.inputs, broadcast=False)
            with contextlib.suppress(Exception):  # where this call fails, every block runs vmapped
                self(s.clone() if self.score else None, rows, cols, self.inputs, broadcast=True)
                return True  # the shapes alone were checked (__call__): no value is read
        return False


# The operations whose broadcast result is, element by element, their result on one element (the in-place
# methods too: name + "_"); any other on something made from the indices or the score (a reduction, a reshape,
# a tensor indexed by a slice or twice) runs the mod vmapped.
_ELEMENTWISE = frozenset("""add sub mul truediv floordiv div mod remainder fmod pow neg pos abs and_ or_ xor
    invert not_ eq ne lt le gt ge where tanh exp exp2 expm1 log log2 log1p sigmoid sqrt rsqrt sin cos atan
    sign floor ceil round trunc clamp clamp_min clamp_max clip minimum maximum logical_and logical_or
    logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not isnan isinf isneginf isposinf
    nan_to_num square erf relu softplus gelu silu masked_fill float double half bfloat16 int long bool to
    type_as""".split())
_ELEMENTWISE |= {f"__{r}{op}__" for r in ("", "r")
                 for op in "add sub mul truediv floordiv mod pow and or xor".split()}
_ELEMENTWISE |= {f"__{op}__" for op in "neg pos abs invert eq ne lt le gt ge".split()}


def _elementwise(gm):
    """Whether the traced mod gm computes each (b, h, q_idx, kv_idx) from that element alone: every operation
    on something made from its score or indices is in _ELEMENTWISE, or indexes a tensor made from neither by
    one index tensor or a tuple of them (table[q_idx - kv_idx], table[h, q_idx])."""
    indexed = {n for n in gm.graph.nodes if n.op == "placeholder" and not n.target.startswith("read")}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or not indexed.intersection(n.all_input_nodes):
            continue
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if n.target in (operator.getitem, "__getitem__"):
            index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
            if n.args[0] in indexed or not all(isinstance(a, (torch.fx.Node, int)) for a in index):
                return False
        elif name not in _ELEMENTWISE and not (n.op == "call_method" and name[:-1] in _ELEMENTWISE):
            return False
        indexed.add(n)
    return True


def _additive(gm):
    """(f, sign) where the traced score_mod gm is score + sign * f(b, h, q_idx, kv_idx), a bias (ALiBi, a
    relative table): f, gm's graph cut to what the bias reads, takes gm's arguments, ignores the score and
    returns the bias, or the pair (a, b) where the bias is a product a * b (slopes[h] * distance), so that
    Visibility.scores can add it by torch.addcmul without making it; else (None, 0)."""
    nodes = list(gm.graph.nodes)
    score, out = nodes[0], nodes[-1].args[0]
    adds = (operator.add, torch.add, "add", "add_", "__add__", "__radd__")
    subs = (operator.sub, torch.sub, "sub", "sub_")
    if not (isinstance(out, torch.fx.Node) and out.target in adds + subs and len(out.args) == 2
            and not out.kwargs and list(score.users) == [out]):  # the score read once, by that sum
        return None, 0
    other, sign = (out.args[1], 1 if out.target in adds else -1) if out.args[0] is score else (out.args[0], 1)
    if (out.target in subs and out.args[0] is not score) or not isinstance(other, torch.fx.Node) or (
            other is score):  # f - score, a constant added, or score + score
        return None, 0
    product = other.target in (operator.mul, torch.mul, "mul", "__mul__", "__rmul__") and not other.kwargs
    product = product and all(isinstance(a, torch.fx.Node) for a in other.args)  # a constant: not a factor
    graph, copies = torch.fx.Graph(), {}
    graph.graph_copy(gm.graph, copies)
    graph.output(tuple(copies[a] for a in other.args) if product else copies[other])
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(gm, graph).forward, sign


class _ReadsAsInputs(torch.fx.Tracer):
    """torch.fx's tracer, through modules too, recording as `reads` every tensor a mod uses that is not made
    from its arguments; each becomes a get_attr node "read<n>" (n: its index in reads), an input (_traced)."""

    def __init__(self):
        super().__init__(autowrap_modules=(), autowrap_functions=())
        self.reads = []

    def call_module(self, module, forward, args, kwargs):  # through every module, part of the graph or not
        return forward(*args, **kwargs)

    def create_arg(self, a):
        if isinstance(a, torch.Tensor):
            n = next((n for n, t in enumerate(self.reads) if t is a), len(self.reads))
            self.reads[n:n + 1] = [a]
            return self.create_node("get_attr", f"read{n}", (), {})
        return super().create_arg(a)


def _traced(mod, score):
    """(the mod as a graph module taking its tensor reads as arguments after the indices, those tensors)."""
    tracer = _ReadsAsInputs()  # the graph's inputs named as flex's arguments
    graph = tracer.trace((lambda score, b, h, q_idx, kv_idx: mod(score, b, h, q_idx, kv_idx)) if score
                         else (lambda b, h, q_idx, kv_idx: mod(b, h, q_idx, kv_idx)))
    with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
        reads = [graph.placeholder(f"read{n}") for n in range(len(tracer.reads))]
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        node.replace_all_uses_with(reads[int(node.target[4:])])
        graph.erase_node(node)
    for node in [n for n in graph.nodes if n.target in ("masked_fill", "masked_fill_", torch.masked_fill)]:
        user, read = node, node.kwargs.get("value", node.args[2] if len(node.args) > 2 else None)
        while isinstance(read, torch.fx.Node) and read.target in ("type_as", "to") and len(read.users) == 1:
            user, read = read, read.args[0]  # the value, or the read a cast serves alone: masked_fill takes
        if read in reads and tracer.reads[reads.index(read)].dim() == 0:  # a tensor 0-d only, and a 0-d read
            with graph.inserting_before(user):  # is (1, 1, 1, 1) in a broadcast call
                user.replace_input_with(read, graph.call_method("reshape", (read, ())))
    return torch.fx.GraphModule(nn.Module(), graph), tuple(tracer.reads)


def _block_plan(block_mask, Lk):
    """A BlockMask read on the host, once a call (a GPU would wait for it): {q0: {k0: (states, partial)}} for
    the key blocks some (b, h) sees from each block of queries; states (B or 1, H or 1, 1, 1): 2 where all its
    keys are seen, 1 where mask_mod decides, 0 none, or None if all are 2; partial: any 1."""
    if torch.compiler.is_compiling():
        raise ValueError("a BlockMask is read on the host to choose the blocks: not under torch.compile")
    (cq, ck), nk, plan = block_mask.BLOCK_SIZE, -(-Lk // block_mask.BLOCK_SIZE[1]), {}
    states = block_mask.kv_num_blocks.new_zeros(*block_mask.kv_num_blocks.shape, nk + 1, dtype=torch.int8)
    for value, num, idx in ((1, block_mask.kv_num_blocks, block_mask.kv_indices),
                            (2, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if num is not None:  # each row's first num indices; the rest to an extra column, dropped after
            listed = torch.arange(idx.size(-1), device=idx.device) < num[..., None]
            if not (((idx >= 0) & (idx < nk)) | ~listed).all():
                raise ValueError(f"a BlockMask lists key blocks outside the {nk} of BLOCK_SIZE {ck} for "
                                 f"{Lk} keys")
            states.scatter_(-1, idx.long().masked_fill(~listed, nk), value)
    states = states[..., :nk]  # (B, H, nq, nk)
    seen, partial, full = [x.tolist() for x in ((states > 0).any((0, 1)), (states == 1).any((0, 1)),
                                                (states == 2).all((0, 1)))]
    for i, j in [(i, j) for i in range(len(seen)) for j in range(nk) if seen[i][j]]:
        block = None if full[i][j] else states[:, :, i, j, None, None]  # (B or 1, H or 1, 1, 1)
        plan.setdefault(i * cq, {})[j * ck] = block, partial[i][j]
    return plan


_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()  # torch.bmm(a, b, out_dtype=...), CUDA


def _per_kv_head(x, k):
    """x (B, H, rows, n) as (B * H_kv, G * rows, n) for bmm, each K/V head's G query heads stacked along the
    rows: one product per K/V block serves them all (GQA); a view of a contiguous x, or its rows if G = 1."""
    return x.reshape(x.size(0) * k.size(1), x.size(1) // k.size(1) * x.size(2), x.size(-1))


def _matmul(a, b, alpha=1.0, out=None, add=False):
    """alpha * (a @ b) for a (N, m, k) and b (N, k, n), in float32 (float64 for float64). out: a flat
    buffer the product is written to, reused block after block (a new block each step costs the CPU a pass of
    page faults); with add, an (N, m, n) tensor the product is added to, inside the GEMM (on CUDA in 16
    bits the product is made apart, then added).

    FlashAttention-2's precision: the operands are multiplied in the inputs' dtype and the
    products accumulated in float32, as tensor cores do; on CUDA by bmm(..., out_dtype=float32);
    elsewhere float16 and bfloat16 are converted to float32 first, which is exact, so a CPU
    computes what a GPU does (up to the order of the sums)."""
    shape = (a.size(0), a.size(1), b.size(2))  # (N, m, n)
    res = None if out is None or add else out[:math.prod(shape)].view(shape)
    if a.dtype in (torch.float16, torch.bfloat16):
        if a.is_cuda and _BMM_OUT_DTYPE:
            prod = torch.bmm(a, b, out_dtype=torch.float32, out=res)
            prod = prod if alpha == 1.0 else prod.mul_(alpha)
            return out.add_(prod) if add else prod
        a, b = a.float(), b.float()
    if add:
        return out.baddbmm_(a, b, alpha=alpha)
    if alpha == 1.0:
        return torch.bmm(a, b, out=res)
    return torch.baddbmm(a.new_empty(()), a, b, beta=0, alpha=alpha, out=res)  # alpha in the GEMM


def _scores(q_i, k_all, rows, cols, opts, scratch=None, backward=False, *, H):
    """S_j of one block, (B, H, rows, cols), float32 (float64 for float64), in base 2, with every variant of
    the call applied (Visibility.scores); the backward also gets the pullback through a user's score_mod (None
    without one). q_i: the queries `rows` as _per_kv_head lays them out; k_all: every key, (B * H_kv, Lk, D);
    H: q's heads; scratch: a flat buffer to make S_j in (_matmul's out)."""
    k_j = k_all[:, cols].transpose(1, 2)  # (B * H_kv, D, cols)
    s = _matmul(q_i, k_j, opts.scale * opts.base, scratch)  # (B * H_kv, G * rows, cols)
    s = s.view(-1, H, rows.stop - rows.start, s.size(-1))  # (B, H, rows, cols)
    return opts.vis.scores(s, rows, cols, backward)


# Dropout multiplies P_j by a keep-mask Z_j in the products with V and dO, and divides by 1 - p. Z is a
# hash of (seed, b, h, i, j): the backward regenerates it without storing it, whatever the block sizes.

_HASH = 0x2C1B3C6D  # odd: multiplying by it permutes the integers mod 2^31


def _mix(x):
    """Hash int32 values in [0, 2^31) in place, a permutation of that range: two rounds of
    xor-shift and multiply (the product wraps mod 2^32; the mask keeps 31 bits)."""
    for _ in range(2):
        x.bitwise_xor_(x.bitwise_right_shift(15)).mul_(_HASH).bitwise_and_(0x7FFFFFFF)
    return x


def _dropout_hashes(seed, B, H, Lq, Lk):
    """Hashes of the rows (b, h, i) with the seed, (B, H, Lq, 1), and of the columns j, (Lk,), int32.
    seed: an int32 tensor of shape () on the device. Row ids (b * H + h) * Lq + i wrap above 2^31."""
    rows = (torch.arange(B * H, dtype=torch.int32, device=seed.device).view(B, H, 1, 1) * Lq
            + torch.arange(Lq, dtype=torch.int32, device=seed.device)[:, None])  # (B, H, Lq, 1)
    cols = torch.arange(Lk, dtype=torch.int32, device=seed.device)  # (Lk,)
    return _mix(_mix(rows.bitwise_and_(0x7FFFFFFF)) ^ seed), _mix(cols)


def _keep_bits(row_hash, col_hash, dropout_p):
    """Dropout's keep-mask of one block, (B, H, rows, cols): all bits set where a weight is kept
    (probability 1 - p), none where it is dropped."""
    x = _mix(row_hash ^ col_hash)  # uniform in [0, 2^31)
    x -= round(dropout_p * 2**31)  # negative where dropped
    x.bitwise_right_shift_(31)  # the sign, spread to every bit: -1 (all set) where dropped, 0 where kept
    return x.bitwise_not_()


def _drop(t, keep_bits):
    """Zero the dropped weights of t in place, by AND-ing its bits with the mask: a bool mask costs
    two more passes over the block (its conversion to float, then the product)."""
    bits = t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)
    bits &= keep_bits.to(bits.dtype)  # int64 from int32 keeps every bit set
    return t


# -----------------------------------------------------------------------------
# flash: the core's result by PyTorch's fused kernels (SDPA), with every convention above, and the kernel
# that runs named. A fused kernel runs the online softmax inside one kernel: its blocks of scores stay in
# on-chip memory, and no (Lq, Lk) matrix is written out. "flash" names SDPA's fused path, not only the
# FlashAttention kernel: SDPA picks among FlashAttention, memory-efficient and cuDNN kernels (on CUDA any
# attn_mask rules FlashAttention out), and where none accepts the inputs it falls back to its unfused math
# kernel without a word; so we ask which kernel runs, about the very inputs it gets, and warn or raise before
# the math kernel would.

_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
_KERNEL_NAMES = {int(backend): name for name, backend in _KERNELS.items()}


def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                    window_size=None, cu_seqlens=None, alibi_slopes=None, enable_gqa=False, on_math="warn"):
    """softmax(Q K^T * scale + M) V by F.scaled_dot_product_attention's fused kernels.

    When no fused kernel accepts the inputs (dropout on a CPU, say), on_math decides: "warn" and run the math
    kernel, "raise" a RuntimeError, or "allow". A mask, window, documents or bottom-right causality
    (causal_lower_right, Lq != Lk) reach SDPA as one (.., Lq, Lk) mask (ALiBi's bias too: (B|1, H, Lq, Lk));
    top-left is_causal alone as the kernel's flag; enable_gqa as SDPA's own. Under torch.compile, and where
    torch cannot report its kernel (MPS, XPU), SDPA runs unchecked.

    Float masks: a CPU's fused kernel adds them in float32, so the precision rule holds for any bias. On CUDA
    a fused kernel reads the mask in q's dtype: a float32 bias b (each row shifted to a maximum of 0 first)
    reaches it rounded to 16 bits, an error of up to |b| * 2^-8 in the logits in bfloat16 (2^-11 in float16,
    which also clamps it to +-65504); the rule then holds while that stays below the rounding of the scores
    themselves, |b| no larger than the scores. For larger biases in 16 bits use chunked, which adds them in
    float32. Rows whose bias is far from 0, which the fused kernels get wrong, are shifted and, where swamped,
    computed as SDPA's math computes them; off the CPU and under compile that costs every float mask a copy
    and, with k's gradient, twice the time (_far_rows)."""
    if on_math not in ("warn", "raise", "allow"):
        raise ValueError(f"on_math must be 'warn', 'raise' or 'allow', got {on_math!r}")
    q, k, v, attn_mask, is_causal, shift, scale = _attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, window_size, cu_seqlens, enable_gqa)
    call = _sdpa_plan(q, k, v, attn_mask, dropout_p, is_causal, scale, window_size, cu_seqlens,
                      alibi_slopes=_checked_alibi(alibi_slopes, q), shift=shift)
    if call.kernel == "math" and on_math != "allow":
        why = (f"no fused SDPA kernel accepts these inputs (device={q.device.type}, dtype={q.dtype}, "
               f"dropout_p={dropout_p}, mask={None if call.mask is None else call.mask.dtype}, "
               f"head dim={call.q.size(-1)}); running the unfused math kernel")
        if on_math == "raise":
            raise RuntimeError(why)
        warnings.warn(why, stacklevel=2)
    with _no_autocast(q):  # autocast would round a float mask to 16 bits
        out = F.scaled_dot_product_attention(call.q, call.k, call.v, call.mask, dropout_p, call.is_causal,
                                             scale=scale, enable_gqa=enable_gqa)
    if call.v is not v:  # (B, H, Lq, Dv): without a second half of the head dimension (_switch_off_scores)
        out = out[..., :v.size(-1)]
    return out if call.dead is None else out.masked_fill(call.dead, 0.0)


# What SDPA gets (q, k, v, mask, is_causal), the rows to zero after it (dead), and the kernel that runs
_SdpaCall = collections.namedtuple("_SdpaCall", "q k v mask is_causal dead kernel")


def _sdpa_plan(q, k, v, attn_mask, dropout_p, is_causal, scale, window_size, cu_seqlens, device_type=None,
               choose=None, alibi_slopes=None, shift=0):
    """The call SDPA gets (_SdpaCall), and the kernel that runs on it ('unknown' under torch.compile, which
    picks its own). device_type and choose (the kernel SDPA would pick: _chosen_kernel's arguments) stand in
    for a device's own, so that a CPU test can plan what a CUDA kernel gets."""
    device_type, choose = device_type or ("cpu" if q.is_cpu else q.device.type), choose or _chosen_kernel
    mask, dead = attn_mask, None
    rules = named_rules(is_causal, window_size, cu_seqlens, alibi_slopes, q.size(-2), q.device)
    if rules and not (is_causal and len(rules) == 1 and attn_mask is None and not shift):  # SDPA's own flag
        mask = Visibility(rules, shift, attn_mask=attn_mask).dense(q.size(-2), k.size(-2), q.device)
        is_causal = False
    float_mask = mask is not None and mask.is_floating_point()
    # a float mask in q's dtype, or float32 beside 16 bits (what the CPU kernel adds in): torch's CPU kernel
    # misreads a float32 mask beside float64 q at every vector width, from 8 keys on with AVX2 (keys 4-7 of
    # every 8 unscaled, unmasked), from 16 with AVX-512
    sdpa_dtype = q.dtype if q.dtype.itemsize >= 4 else torch.float32
    if float_mask and mask.dtype != sdpa_dtype:
        mask = _finite_bias(mask, sdpa_dtype)
    compiling = torch.compiler.is_compiling()

    def ask(q, k, v, m):  # the kernel SDPA runs on these (under compile its Python int would break the graph)
        return "unknown" if compiling else choose(q, k, v, m, dropout_p, is_causal, scale)
    kernel = ask(q, k, v, mask)
    if device_type == "cpu" and not float_mask:  # nothing to shift, round or re-open: a CPU zeroes dead rows
        return _SdpaCall(q, k, v, mask, is_causal, None, kernel)
    # far rows shifted before any kernel reads them or a 16-bit copy rounds them: a fused kernel's backward
    # breaks on them, and the math kernel in float32 would round their scores away (_far_rows)
    user_float = attn_mask is not None and attn_mask.is_floating_point()
    # ALiBi's bias alone peaks at 0, on the diagonal; a mask, or queries past the last key (Lq > Lk), leave a
    # row at -slope * distance, which only a 16-bit copy rounds (one key dominates there: never swamped)
    alibi_far = alibi_slopes is not None and device_type != "cpu" and (attn_mask is not None
                                                                       or q.size(-2) > k.size(-2))
    if user_float or alibi_far:
        mask, swamped = _far_rows(mask, device_type == "cpu" and not compiling, may_swamp=user_float)
        if swamped is not None:
            q, k, v = _switch_off_scores(q, k, v, swamped)
            kernel = ask(q, k, v, mask)
    if float_mask and device_type != "cpu" and mask.dtype != q.dtype:  # CUDA's fused kernels read a float
        low = _finite_bias(mask, q.dtype)  # mask in q's dtype; the math kernel keeps the wider one
        low_kernel = ask(q, k, v, low)
        if low_kernel != "math":
            mask, kernel = low, low_kernel
    # a row with every key masked: the CPU's kernels, the math kernel and NVIDIA's efficient kernel give
    # it zeros; the others (cuDNN, ROCm, MPS) NaN, so it is re-opened, and SDPA asked again about that mask
    zeroes_dead_rows = (device_type == "cpu" or kernel == "math"
                        or (kernel == "efficient" and not torch.version.hip))
    if mask is not None and not zeroes_dead_rows:
        mask, dead = _reopen_dead_rows(mask)
        kernel = ask(q, k, v, mask)
    return _SdpaCall(q, k, v, mask, is_causal, dead, kernel)


# A bias far from 0 breaks the fused kernels' backward. They keep per query the logsumexp m + log(l) and
# recompute P = exp(S - m - log(l)); beside |m| >= 2^24 a float32 m + log(l) loses log(l), so P comes out
# up to l times too large (PyTorch's CPU flash kernel: dq off by 8.7 with one finfo.min row of 12 keys).
# Softmax does not change when a row's bias is shifted, so flash shifts such a row to a maximum of 0, and
# then computes it as float64 would: exactly, where float32 attention (naive, chunked, SDPA's math kernel)
# rounds its scores to the bias's precision. A row whose every key carries -2^64 or less (Hugging Face's
# finfo(float32).min, under causal masking with left padding) swamps its scores, even in float64: SDPA's
# math gives it softmax(bias) V, with the gradients of the formula, in which the scores still count.
# Flash gives it that too, with its scores switched off (_switch_off_scores); where it cannot look, for
# every row that might be swamped. A bool mask (True = may attend) costs none of this.
_FAR, _SWAMPING = 2.0**24, 2.0**64


def _far_rows(mask, can_look, may_swamp=True):
    """(mask, swamped): the float mask with every row whose largest finite bias is 2^24 or more from 0
    shifted to a maximum of 0, and the rows (.., Lq, 1) whose largest bias is -2^64 or less (None if none,
    or not may_swamp). can_look: a CPU outside torch.compile, where reading whether any row is far waits for
    no device, and where the mask is copied only if one is. Elsewhere every finite row is shifted, which also
    keeps a row of large, close biases apart in the 16-bit copy a fused CUDA kernel reads."""
    if torch.finfo(mask.dtype).max < _FAR or mask.size(-1) == 0:  # float16: no value is far; or no keys
        return mask, None
    row_max = mask.detach().amax(-1, keepdim=True)  # (.., Lq, 1)
    finite = torch.isfinite(row_max)
    far, swamped = finite & (row_max.abs() >= _FAR if can_look else True), finite & (row_max <= -_SWAMPING)
    swamped = swamped if may_swamp else None
    if can_look:
        if not _host_value(far.any()):
            return mask, None
        swamped = swamped if swamped is not None and _host_value(swamped.any()) else None
    return mask - torch.where(far, row_max, 0.0), swamped


def _switch_off_scores(q, k, v, swamped):
    """q, k, v with which any SDPA kernel gives the `swamped` rows (.., Lq, 1) SDPA's math result: scores
    of exactly 0 in the forward, and in the backward the gradients of softmax(Q K^T * scale + M) V. Their
    rows of q are zeroed straight through (q - q.detach(): 0, with q's gradient), which gives dQ. Their
    share of dK = dS^T Q needs their real q: it travels in a second half of the head dimension, against
    k - k.detach() (0, with k's gradient); v gets zeros beside it, for kernels that need Dv = D. Without
    a gradient for k the second half is left out. Returns q, k (B, H, L, 2D) and v (B, H, Lk, 2Dv)."""
    q_off = torch.where(swamped, q - q.detach(), q)
    if not (torch.is_grad_enabled() and k.requires_grad):
        return q_off, k, v
    q = torch.cat([q_off, torch.where(swamped, q, 0.0).detach()], dim=-1)  # (B, H, Lq, 2D)
    k = torch.cat([k, k - k.detach()], dim=-1)  # (B, H, Lk, 2D)
    if 2 * v.size(-1) == q.size(-1):
        v = torch.cat([v, torch.zeros_like(v)], dim=-1)  # (B, H, Lk, 2Dv)
    return q, k, v


def _chosen_kernel(q, k, v, mask, dropout_p, is_causal, scale):
    """The SDPA kernel these inputs get: 'flash', 'efficient', 'cudnn', 'math', or 'unknown' where torch
    cannot tell. torch._fused_sdp_choice is what SDPA itself consults (it honours an enclosing
    sdpa_kernel(...)); it is private, so we ask whether it is there."""
    fused_sdp_choice = getattr(torch, "_fused_sdp_choice", None)
    if not (q.is_cpu or q.is_cuda) or fused_sdp_choice is None:
        return "unknown"
    try:
        choice = fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                  enable_gqa=k.size(-3) != q.size(-3))
    except RuntimeError as e:  # every enabled kernel refuses these inputs
        raise RuntimeError(f"no enabled SDPA kernel can run these inputs: {str(e).splitlines()[0]}") from e
    if choice not in _KERNEL_NAMES:
        raise RuntimeError(f"no enabled SDPA kernel can run these inputs (SDPA chose {SDPBackend(choice)})")
    return _KERNEL_NAMES[choice]


def sdpa_kernel_name(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                     window_size=None, cu_seqlens=None, alibi_slopes=None, enable_gqa=False):
    """Which SDPA kernel flash_attention would run for these inputs (see _chosen_kernel)."""
    q, k, v, attn_mask, is_causal, shift, scale = _attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, window_size, cu_seqlens, enable_gqa)
    return _sdpa_plan(q, k, v, attn_mask, dropout_p, is_causal, scale, window_size, cu_seqlens,
                      alibi_slopes=_checked_alibi(alibi_slopes, q), shift=shift).kernel


# -----------------------------------------------------------------------------
# Input checks, once at each boundary: a clear error that names the problem, kept out of the algorithms' way


def _attention_args(q, k, v, attn_mask, dropout_p, is_causal, scale, window_size, cu_seqlens=None,
                    enable_gqa=False):
    """The arguments every path takes, checked, then as SDPA takes them (scale = 1/sqrt(D) unless given, and
    under autocast float32 q, k, v in autocast's dtype, SDPA being on its lower-precision list): (q, k, v,
    attn_mask ready for Visibility, is_causal, shift, scale). shift: query i sits at key position i + shift, 0
    (top-left, is_causal's alignment, as SDPA's) or Lk - Lq for SDPA's causal_lower_right (bottom-right: a KV
    cache's). Each attribute is read once: this is most of flash's own cost."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        name, t = next((name, t) for name, t in (("q", q), ("k", k), ("v", v)) if t.dim() != 4)
        raise ValueError(f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
    (B, H, Lq, D), (Bk, Hk, Lk, Dk), (Bv, Hv, Lv, _) = q.shape, k.shape, v.shape
    if B != Bk or (Bk, Hk) != (Bv, Hv) or ((H % Hk if Hk else H) if enable_gqa else H != Hk):
        raise ValueError(f"q, k, v must share (B, H), or with enable_gqa=True k and v have H_kv heads, a "
                         f"divisor of q's H (grouped-query attention); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, enable_gqa={enable_gqa}")
    if D != Dk or Lk != Lv:
        raise ValueError(f"q and k must share the head dim, k and v the key length: got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    dtype, device = q.dtype, q.device
    if not (dtype == k.dtype == v.dtype) or not dtype.is_floating_point:
        raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    _check_window(window_size)
    if cu_seqlens is not None:
        if Lq != Lk:
            raise ValueError(f"cu_seqlens is for self-attention: Lq must equal Lk, got {Lq} and {Lk}")
        _check_cu_seqlens(cu_seqlens, Lq)
    shift = 0
    if _is_causal_bias(attn_mask):  # SDPA's causality as a mask
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (Lq, Lk) or is_causal:
            raise ValueError(f"a CausalBias of (Lq, Lk) = {(attn_mask.seq_len_q, attn_mask.seq_len_kv)} "
                             f"for q and k of {(Lq, Lk)}, with is_causal={is_causal}: it must match them, "
                             "and it is the causality (SDPA refuses is_causal=True beside it)")
        attn_mask, is_causal, shift = None, True, (Lk - Lq) * (attn_mask.variant.name == "LOWER_RIGHT")
    elif is_causal and Lq != Lk and not torch.compiler.is_compiling():  # Python shows it once a call site
        warnings.warn("is_causal=True with Lq != Lk aligns the diagonal top-left, as SDPA does: query i sees "
                      "keys 0 .. i. Queries that follow Lk - Lq cached keys (a KV cache) see keys 0 .. "
                      "i + Lk - Lq with attn_mask=torch.nn.attention.bias.causal_lower_right(Lq, Lk)",
                      stacklevel=3)
    if dtype == torch.float32 and torch.is_autocast_enabled("cpu" if q.is_cpu else device.type):  # as SDPA's
        dtype = torch.get_autocast_dtype(device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if torch.is_tensor(scale) and scale.requires_grad:  # float() would drop its gradient silently
        raise TypeError("scale must be a number, not a tensor that requires grad (SDPA refuses it too)")
    scale = (1.0 / math.sqrt(D) if D else 1.0) if scale is None else float(scale)  # SDPA's; D = 0: scores 0
    if not abs(scale) < math.inf:  # compiled, a symbolic scale (naive's, once it varied) lets +-inf by
        raise ValueError(f"scale must be a finite number, got {scale}")
    attn_mask = None if attn_mask is None else _check_mask(attn_mask, q, (B, H, Lq, Lk))
    return q, k, v, attn_mask, is_causal, shift, scale


def _is_causal_bias(attn_mask):
    """Whether attn_mask is SDPA's CausalBias (none exists unless torch.nn.attention.bias was imported)."""
    bias = getattr(torch.nn.attention, "bias", None)  # not imported here: it loads torch's compiler, 1.5 s
    return bias is not None and isinstance(attn_mask, bias.CausalBias)


def _check_window(window_size):
    if window_size is not None and (not isinstance(window_size, int) or window_size < 0):
        raise ValueError(f"window_size must be a non-negative int or None, got {window_size!r}")


def _check_mha_call(mha, x, attn_mask, is_causal, need_weights, positions, cu_seqlens, cache):
    """MultiHeadAttention.forward's arguments, or a clear error, before anything is computed or written."""
    if x.dim() != 3 or x.size(-1) != mha.d_model:
        raise ValueError(f"expected x of shape (B, T, {mha.d_model}), got {tuple(x.shape)}")
    if cu_seqlens is not None and callable(mha.impl):  # the paths check it; a function as impl may not
        _check_cu_seqlens(cu_seqlens, x.size(1))
    if cache is not None:
        if not is_causal or cu_seqlens is not None or _is_causal_bias(attn_mask) or len(x) != len(cache.k):
            raise ValueError(f"a KV cache serves a causal decoder (is_causal=True), its rows x's, no "
                             f"cu_seqlens or CausalBias; got is_causal={is_causal}, rows "
                             f"{len(x)}/{len(cache.k)}, cu_seqlens={cu_seqlens is not None}, "
                             f"{type(attn_mask).__name__}")
        _check_window(mha.window_size)  # the cache's mask takes it, not a path that would check it
        if (attn_mask is not None) and (cache._read(attn_mask, x.size(1))[1] is not None):  # over the slots
            _check_mask(attn_mask, x, (x.size(0), mha.n_heads, x.size(1), cache.pos.size(-1)))
    if positions is not None and cache is not None:  # each row's own, where its tokens sit among the slots'
        if positions.shape != x.shape[:2]:
            raise ValueError(f"with a KV cache, positions are each row's own, ({len(x)}, {x.size(1)}): got "
                             f"{tuple(positions.shape)}")
        if cache.saved is None:  # else an Encoder's call, which gives every layer its first cache's, checked
            _check_range(positions, 0, cache.pos.size(-1), "positions with a KV cache (its max_len)")
    elif positions is not None:
        _check_positions(positions, x.size(1))
        if mha.alibi:
            raise ValueError("positions= with ALiBi: its bias is -slope * |i - j| for the tokens' places")
    if (need_weights or cache is not None) and callable(mha.impl):
        what = ("need_weights (naive attention computes the weights, on this module's own q, k, v)" if
                need_weights else "a KV cache (it hands attention its causality as a mask over the slots)")
        raise ValueError(f"{what}: not with an attention function as impl")
    if ((mha.score_mod is not None) or isinstance(attn_mask, BlockMask)) and (need_weights or cache):
        raise ValueError("FlexAttention's mods (score_mod, a BlockMask) run on the chunked path: not with "
                         "need_weights (the naive path) or a KV cache, whose q_idx and kv_idx would be slots")


def _check_caches(enc, idx, cache, positions):
    """cache: one KVCache of its own per layer, each with idx's batch size and all of one max_len, each
    holding as many slots (its length) and as many tokens in each row (its tokens) as the first, so that the
    first cache's positions serve every layer; positions= is refused: the caches place the tokens."""
    if cache is None:
        return
    if positions is not None:
        raise ValueError("positions= with a KV cache: the caches place each row's tokens (KVCache)")
    distinct, rows = len({id(c) for c in cache}), {len(c.k) for c in cache}
    max_len = {c.k.size(2) for c in cache}
    if len(cache) != len(enc.layers) or distinct != len(cache) or rows != {len(idx)} or len(max_len) != 1:
        raise ValueError(f"cache holds {len(cache)} KVCaches, {distinct} of them distinct, of {rows} rows "
                         f"and max_len {max_len}, for {len(enc.layers)} layers and {len(idx)} rows of idx: "
                         "one per layer, each its own, all of one max_len (kv_caches())")
    c0, why = cache[0], "every layer's KVCache must hold as many slots, and tokens in each row, as the first"
    if c0.pos.is_cpu and not torch.compiler.is_compiling():  # read on the host: no device to wait for
        if not all(torch.equal(c.length, c0.length) and torch.equal(c.tokens, c0.tokens) for c in cache[1:]):
            state = [[_host_value(c.length), *_host_value(c.tokens.flatten())] for c in cache]
            raise ValueError(f"{why}: got [slots, each row's tokens] {state}")
        return
    lengths, tokens = torch.stack([c.length for c in cache]), torch.cat([c.tokens.T for c in cache])
    state = torch.cat([lengths[:, None], tokens], 1)  # (layers, 1 + B)
    torch._assert_async((state == state[0]).all(), why)


def _check_block_mask(block_mask, q, k):
    """The BLOCK_SIZE of torch's BlockMask for q's and k's lengths, B and H 1 or q's, or a clear error."""
    (B, H, Lq), (Bm, Hm, nq), (cq, ck) = q.shape[:3], block_mask.kv_num_blocks.shape, block_mask.BLOCK_SIZE
    if Bm not in (1, B) or Hm not in (1, H) or tuple(block_mask.seq_lengths) != (Lq, k.size(-2)) or (
            nq != -(-Lq // cq) or block_mask.kv_num_blocks.device != q.device):
        raise ValueError(f"a BlockMask of (B, H) = ({Bm}, {Hm}), lengths {tuple(block_mask.seq_lengths)}, "
                         f"BLOCK_SIZE {(cq, ck)}, for q {tuple(q.shape)}, k {tuple(k.shape)}: B and H 1 or "
                         f"q's, its lengths q's and k's, its device q's ({q.device})")
    return cq, ck


def _checked_alibi(slopes, q):
    """ALiBi's slopes as FlashAttention takes them (float32, (H,) or (B, H), non-negative constants), made
    (B or 1, H, 1, 1) in q's accumulation dtype; or a clear error."""
    if slopes is None:
        return None
    B, H = q.shape[:2]
    if not torch.is_tensor(slopes) or slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be a float32 tensor, got {getattr(slopes, 'dtype', slopes)}")
    if tuple(slopes.shape) not in ((H,), (B, H)) or slopes.device != q.device or slopes.requires_grad:
        raise ValueError(f"alibi_slopes must be constants of shape ({H},) or ({B}, {H}) on {q.device}, got "
                         f"shape {tuple(slopes.shape)} on {slopes.device}"
                         f"{' that requires grad' * slopes.requires_grad}")
    _check_range(slopes, 0, math.inf, "alibi_slopes")
    return slopes.to(torch.promote_types(q.dtype, torch.float32)).reshape(-1, H, 1, 1)


def _check_mask(attn_mask, q, target):
    """attn_mask as it is (bool or float, on q's device, broadcasting to target, (B, H, Lq, Lk)), or a clear
    error."""
    if type(attn_mask) not in (torch.Tensor, nn.Parameter):  # a subclass may mean more than its values
        raise TypeError(f"attn_mask must be a plain bool or float tensor (or SDPA's CausalBias; a BlockMask: "
                        f"chunked_attention), got a {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be bool (True = may attend) or floating (added to the scores), got "
                        f"{attn_mask.dtype}; for a 0/1 integer mask pass mask.bool() (1 = may attend), for "
                        "nn.MultiheadAttention's convention (1 = ignore) pass ~mask.bool()")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} and q on {q.device}: move the mask once, where "
                         "it is made (a copy in every call would make the host wait for the device)")
    shape = tuple(attn_mask.shape)
    b, h, i, j = (1,) * (4 - len(shape)) + shape if len(shape) <= 4 else (0,) * 4
    B, H, Lq, Lk = target
    if b not in (1, B) or h not in (1, H) or i not in (1, Lq) or j not in (1, Lk):
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to (B, H, Lq, Lk) = {tuple(target)}")
    if attn_mask.is_floating_point():  # only -inf hides a key; +inf or NaN would make its row NaN
        _check_range(attn_mask.detach(), -math.inf, math.inf, "a float attn_mask, added to the scores,")
    return attn_mask if len(shape) >= 2 else attn_mask.expand(1, Lk)  # (Lk,) or (): one row for all queries


def _check_cu_seqlens(cu_seqlens, L):
    """cu_seqlens as FlashAttention's varlen API takes it, or a clear error. It lives on the CPU (the
    chunked path reads it to choose its blocks), so reading it never waits for a device."""
    t = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else None
    if t is None or t.device.type != "cpu" or t.dim() != 1 or t.numel() < 2 \
            or t.dtype not in (torch.int32, torch.int64):
        got = type(cu_seqlens).__name__ if t is None else f"shape {tuple(t.shape)} {t.dtype} on {t.device}"
        raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 CPU tensor [0, l_1, l_1 + l_2, ..., L], "
                         f"got {got}")
    why = f"cu_seqlens must start at 0, never decrease and end at the sequence length {L}"
    if torch.compiler.is_compiling():
        ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == L) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
        torch._assert_async(ok, why)
        return
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != L or any(a > b for a, b in zip(c, c[1:])):
        raise ValueError(f"{why}, got {c}")


def _no_autocast(q):
    """Autocast switched off where it is on: inside, the inputs' dtypes decide."""
    device_type = "cpu" if q.is_cpu else q.device.type
    on = torch.is_autocast_enabled(device_type)
    return torch.autocast(device_type, enabled=False) if on else contextlib.nullcontext()


def _chunks(chunk_size):
    sizes = (chunk_size,) * 2 if isinstance(chunk_size, int) else tuple(chunk_size) if isinstance(
        chunk_size, (tuple, list)) else ()
    if len(sizes) != 2 or not all(type(n) is int and n >= 1 for n in sizes):
        raise ValueError(f"chunk_size must be a positive int or a pair of them (query block, key block), got "
                         f"{chunk_size!r}")
    return sizes


def _positions(T, max_len, positions):
    """What a positional encoding indexes its table with: positions, (T,) or (B, T), checked to lie in the
    table, or 0 .. T-1 after checking T (a slice past the table's end would silently be shorter)."""
    if positions is not None:
        if positions.dim() != 2 or positions.size(-1) != T:  # (B, T): each row's own, a KVCache's
            _check_positions(positions, T)
        _check_range(positions, 0, max_len, f"positions (the table's max_len: {max_len})")
        return positions
    if T > max_len:
        raise ValueError(f"sequence length {T} exceeds max_len={max_len}")
    return slice(0, T)


def _check_positions(positions, T):
    """A clear error unless positions is (T,), one per token: broadcast, any other shape misplaces tokens."""
    if positions.shape != (T,):
        raise ValueError(f"positions must give one position to each of the {T} tokens, a ({T},) tensor, got "
                         f"shape {tuple(positions.shape)}")


def _host_value(t):
    """A CPU tensor's value on the host, outside torch.compile: a CPU has no device to wait for."""
    return t.tolist()


def _check_range(t, lo, hi, name):
    """Raise unless lo <= t < hi everywhere, without a host-device sync: on a CPU the values are read
    (_host_value) and named; elsewhere, and under torch.compile, a device-side assert (torch._assert_async,
    here and in the checks above: torch has no public one)."""
    if t.numel() == 0:
        return
    t_min, t_max = torch.aminmax(t)  # two numbers: no temporary of t's size
    if t.device.type == "cpu" and not torch.compiler.is_compiling():
        t_min, t_max = _host_value(t_min), _host_value(t_max)
        if not lo <= t_min <= t_max < hi:  # NaN fails it too
            raise ValueError(f"{name} must lie in [{lo}, {hi}), got min {t_min} max {t_max}")
    else:
        torch._assert_async((t_min >= lo) & (t_max < hi), f"{name} must lie in [{lo}, {hi})")


def _check_batch_first(attn, torch_name, our_name):
    """from_torch converts weights, not layouts: a (T, B, C) module would silently disagree with ours."""
    if not attn.batch_first:
        raise ValueError(f"from_torch needs batch_first=True: this {torch_name} has batch_first=False and "
                         f"takes (T, B, C), {our_name} (B, T, C). Build it with batch_first=True (its "
                         "weights do not depend on it), or transpose your inputs and set batch_first = True.")


if __name__ == "__main__":  # training, which lives in train.py beside this file (--help: its options)
    from train import parse_args, train
    train(parse_args())
