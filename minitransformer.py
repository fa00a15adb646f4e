"""
minitransformer: a Transformer encoder in one file, with three attention paths.

Read it top-down: masks, the three attention paths (naive, chunked, flash), multi-head
attention, positional encodings, the encoder layer, the config and the encoder, then the
training loop and its command line; input checks come last, out of the algorithms' way.

References:
1) Vaswani et al. 2017, "Attention Is All You Need": https://arxiv.org/abs/1706.03762
2) Rabe & Staats 2021, "Self-attention Does Not Need O(n^2) Memory": https://arxiv.org/abs/2112.05682
3) Dao et al. 2022, "FlashAttention": https://arxiv.org/abs/2205.14135, and Dao 2023,
   "FlashAttention-2": https://arxiv.org/abs/2307.08691
4) Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture":
   https://arxiv.org/abs/2002.04745
5) Su et al. 2021, "RoFormer" (rotary positions): https://arxiv.org/abs/2104.09864
6) Micikevicius et al. 2018, "Mixed Precision Training": https://arxiv.org/abs/1710.03740

The attention paths share the signature and conventions of F.scaled_dot_product_attention (SDPA):
- q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> out (B, H, Lq, Dv);
- attn_mask broadcasts to (B, H, Lq, Lk). A bool mask is True where a query MAY attend (the
  opposite of nn.MultiheadAttention's key_padding_mask); a float mask is added to the scores,
  and only -inf masks a key; integer masks are refused, as SDPA refuses them;
- is_causal: query i sees keys j <= i; with an attn_mask both apply (SDPA refuses the pair);
- window_size=w: query i sees keys with |i - j| <= w (with is_causal: 0 <= i - j <= w);
- a query whose keys are all masked gets a zero output and zero gradients, never NaN.
In float16 and bfloat16 every path meets FlashAttention's rule: its error against float64 is at
most twice that of standard attention computed in the inputs' dtype. Every module and path
compiles with torch.compile(fullgraph=True) and reads no tensor value on the host in its
forward or backward.
"""

import argparse
import functools
import gc
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

IMPLS = ("naive", "chunked", "flash")
POS_ENCODINGS = ("sinusoidal", "learned", "rope")

# -----------------------------------------------------------------------------
# Masks. mask_block gives the mask of any block of the score matrix: naive and flash ask
# for the whole matrix, chunked for one block at a time.


def causal_mask(Lq, Lk=None, device=None):
    """Boolean (Lq, Lk) mask, True where key j <= query i (SDPA's top-left alignment)."""
    Lk = Lq if Lk is None else Lk
    return torch.ones(Lq, Lk, dtype=torch.bool, device=device).tril()


def padding_mask(lengths, max_len, device=None):
    """Boolean (B, 1, 1, max_len) mask, True on the first lengths[b] keys of sequence b.

    It broadcasts over heads and queries, on the device of lengths (or `device`).
    nn.MultiheadAttention's key_padding_mask is its negation: ~padding_mask(lengths, L)[:, 0, 0].
    """
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be a 1-D integer tensor, got {tuple(lengths.shape)} {lengths.dtype}")
    _check_range(lengths, 0, max_len + 1, "lengths")
    keep = torch.arange(max_len, device=lengths.device) < lengths[:, None]  # (B, L)
    return keep[:, None, None, :]  # (B, 1, 1, L)


def mask_block(attn_mask, rows, cols, *, is_causal=False, window_size=None, device=None):
    """The mask of scores[..., rows, cols] (rows, cols: slices of query and key positions).

    Returns a bool mask (True = keep), a float mask (added to the scores), or None (keep
    every key), broadcastable to (B, H, rows, cols). attn_mask has passed
    _check_attention_args. Causality and the window are built from positions, and only for
    a block that straddles the diagonal or the window's edge.
    """
    q0, q1, k0, k1 = rows.start, rows.stop, cols.start, cols.stop
    causal = is_causal and k1 - 1 > q0  # some key lies after some query
    local = window_size is not None and (k1 - 1 - q0 > window_size or q1 - 1 - k0 > window_size)
    keep = None
    if causal or local:
        i = torch.arange(q0, q1, device=device)[:, None]  # (rows, 1)
        j = torch.arange(k0, k1, device=device)[None, :]  # (1, cols)
        keep = j <= i if causal else None
        if local:  # compared, never subtracted: i - j would be an int64 (rows, cols) temporary
            near = (j >= i - window_size) & (j <= i + window_size)
            keep = near if keep is None else keep & near
    if attn_mask is None:
        return keep
    m = attn_mask  # sliced only where it does not broadcast and the block is not all of it
    if m.size(-2) not in (1, q1 - q0):
        m = m[..., rows, :]
    if m.size(-1) not in (1, k1 - k0):
        m = m[..., cols]
    if keep is None:
        return m
    return m & keep if m.dtype == torch.bool else m.masked_fill(~keep, float("-inf"))


def _apply_mask(scores, mask):
    """scores with a mask_block mask applied: -inf where a bool mask is False (never -1e9: it
    overflows float16), the bias of a float mask added in float32 or wider (a finfo.min bias
    plus a negative score would overflow float16 to -inf); in place where the dtype allows."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, float("-inf"))
    wide = torch.promote_types(torch.promote_types(scores.dtype, mask.dtype), torch.float32)
    return scores.add_(mask) if scores.dtype == wide else scores.to(wide) + mask


def _finite_bias(bias, dtype, scale=1.0):
    """bias * scale in dtype, a finite value kept finite: finfo(float32).min (the Hugging Face
    "masked") would overflow to -inf in a narrower dtype, or times log2(e), and mask its key,
    which only -inf does."""
    finfo = torch.finfo(dtype)
    wide = bias.to(torch.promote_types(bias.dtype, dtype)) * scale
    return wide.clamp(finfo.min, finfo.max).to(dtype).masked_fill(torch.isneginf(bias), float("-inf"))


def _reopen_dead_rows(mask):
    """(mask, dead): a row with every key masked would make softmax 0/0 = NaN, forward and
    backward; it is let to attend to every key instead, and `dead` (.., Lq, 1) marks it, for
    the caller to zero its output (which also zeroes its gradients)."""
    if mask.dtype == torch.bool:
        dead = ~mask.any(-1, keepdim=True)
        return mask | dead, dead
    dead = torch.isneginf(mask).all(-1, keepdim=True)
    return mask.masked_fill(dead, 0.0), dead


# -----------------------------------------------------------------------------
# Path 1: naive attention, the textbook formula. It materialises the (Lq, Lk) scores.


def naive_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, window_size=None):
    """Attention(Q, K, V) = softmax(Q K^T * scale + M) V,  scale = 1/sqrt(D) by default.

    Returns out (B, H, Lq, Dv) and the weights (B, H, Lq, Lk) it used, after dropout, so
    that out == weights @ v. Standard attention as it is written: computed in the inputs'
    dtype (softmax accumulates in float32 inside), except that a float mask is added in float32
    or wider; autocast does not reach inside.
    """
    attn_mask, scale = _check_attention_args(q, k, v, attn_mask, dropout_p, scale, window_size)
    Lq, Lk = q.size(-2), k.size(-2)
    mask = mask_block(attn_mask, slice(0, Lq), slice(0, Lk), is_causal=is_causal, window_size=window_size,
                      device=q.device)
    dead = None
    if mask is not None:
        mask, dead = _reopen_dead_rows(mask)
    with torch.autocast(q.device.type, enabled=False):  # the inputs' dtype decides, as for any function
        scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
        weights = torch.softmax(_apply_mask(scores, mask), dim=-1).to(v.dtype)
        if dead is not None:
            weights = weights.masked_fill(dead, 0.0)
        if dropout_p > 0.0:
            weights = F.dropout(weights, dropout_p)  # kept weights scaled by 1/(1-p): same expectation
        return weights @ v, weights


# -----------------------------------------------------------------------------
# Path 2: chunked attention: an online softmax over blocks, forward and backward by hand.
#
# Forward. For one block of queries, visit the keys block by block. With a running row max
# m, normaliser l and output o, a block of scores S_j = Q K_j^T * scale + M_j updates
#     m' = max(m, rowmax(S_j)),   P_j = exp(S_j - m'),   alpha = exp(m - m'),
#     l' = alpha * l + rowsum(P_j),   o' = alpha * o + P_j V_j,
# and at the end out = o / l. Only one (cq, ck) block of scores exists at a time: memory is
# linear in the length. m and log(l) are saved for the backward, kept apart (a finfo.min
# bias makes m so large that m + log(l) would round to m).
#
# Backward (FlashAttention-2, Algorithm 2). Recompute P_j = exp(S_j - m - log(l)), then
#     dV_j += P_j^T dO,   dP_j = dO V_j^T,   dS_j = P_j * (dP_j - rowsum(dO * O)),
#     dQ += dS_j K_j * scale,   dK_j += dS_j^T Q * scale,   dM_j = dS_j (a float mask).
#
# Precision, FlashAttention-2's recipe: every product takes its operands in the inputs' dtype
# and accumulates in float32 (tensor cores, on a GPU): S_j = Q K_j^T, P~_j V_j, dO V_j^T,
# P~_j^T dO, dS~_j K_j, dS~_j^T Q, where P~ and dS~ are P and dS rounded to the inputs' dtype.
# S, P, dS, m, l and the rescaling stay in float32; the scale multiplies S in float32.
#
# Dropout multiplies P_j by a keep-mask Z_j in the products with V and dO, and divides by
# 1 - p. Z is a hash of (seed, b, h, i, j): the backward regenerates it without storing it.
# Scores are kept in base 2, exp(x) = exp2(x * log2(e)), as in FlashAttention: exp2 is the
# cheaper instruction. The block loops are one torch.library.custom_op: torch.compile sees
# one call with known output shapes and never unrolls them.

LOG2E = math.log2(math.e)


def default_chunk_size(device):
    """(query block, key block). CPU: the best of the sizes measured (README, "Chunk sizes");
    elsewhere a guess that keeps kernel launches few, not yet measured."""
    return (256, 256) if torch.device(device).type == "cpu" else (512, 512)


def chunked_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                      window_size=None, chunk_size=None):
    """softmax(Q K^T * scale + M) V, the same result as naive_attention, in O(L) memory.

    chunk_size: int or (query block, key block); None: default_chunk_size. Blocks that
    is_causal or window_size hide are skipped. Gradients flow to q, k, v and to a float
    attn_mask that requires grad. Dropout's seed is drawn from the device's generator.
    """
    attn_mask, scale = _check_attention_args(q, k, v, attn_mask, dropout_p, scale, window_size)
    cq, ck = _chunks(default_chunk_size(q.device) if chunk_size is None else chunk_size)
    seed = torch.randint(0, 2**31, (), dtype=torch.int32, device=q.device) if dropout_p > 0.0 else None
    return _chunked_fwd(q, k, v, attn_mask, seed, dropout_p, is_causal, scale, window_size, cq, ck)[0]


def _autocast_off(op):
    """Run op with autocast disabled: autocast reaches the products inside a custom op and would
    round them to 16 bits (and the backward, run outside autocast, would then disagree)."""
    @functools.wraps(op)
    def run(*args, **kwargs):
        with torch.autocast(args[0].device.type, enabled=False):
            return op(*args, **kwargs)
    return run


@torch.library.custom_op("minitransformer::chunked_attention_fwd", mutates_args=())
@_autocast_off
def _chunked_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 seed: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: float,
                 window_size: Optional[int], cq: int, ck: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (B, H, Lq, Dv), and per query the row max m and log2(l), (B, H, Lq, 1) in base 2,
    float32 or wider; a query with every key masked gets m = +inf, so that its P is 0."""
    B, H, Lq, _ = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # every block a view, never a copy
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty(B, H, Lq, v.size(-1))
    row_max, log2_sum = q.new_empty(B, H, Lq, 1, dtype=acc), q.new_empty(B, H, Lq, 1, dtype=acc)
    options = _block_options(q, k, attn_mask, seed, dropout_p, is_causal, scale, window_size, ck)
    for rows in _blocks(Lq, cq):
        m = q.new_full((B, H, rows.stop - rows.start, 1), float("-inf"), dtype=acc)
        l = torch.zeros_like(m)
        o = q.new_zeros(B, H, rows.stop - rows.start, v.size(-1), dtype=acc)
        _attend(q, k, v, rows, o, m, l, **options)
        dead = l == 0  # every key masked
        out[:, :, rows] = o / (l.masked_fill(dead, 1.0) * (1.0 - dropout_p))
        row_max[:, :, rows] = m.masked_fill(dead, float("inf"))
        log2_sum[:, :, rows] = torch.log2(l.masked_fill(dead, 1.0))
    return out, row_max, log2_sum


def _attend(q, k, v, rows, o, m, l, *, bias, keys, dropout_p, is_causal, scale, window_size, ck):
    """The forward's block update: queries `rows` against every key block they see, updating their
    running output o, row max m and normaliser l (float32) in place."""
    for cols in _key_blocks(rows, k.size(-2), ck, is_causal, window_size):
        s = _scores(q, k, bias, rows, cols, scale, is_causal, window_size)  # (B, H, cq, ck)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        # a row masked so far has m_new = -inf, and exp2(-inf - (-inf)) = NaN: the lowest
        # finite value makes it exp2(-inf) = 0 and changes no other row
        m_safe = m_new.clamp(min=torch.finfo(m.dtype).min)
        p = s.sub_(m_safe).exp2_()  # P_j, in place: no second block-sized buffer
        alpha = torch.exp2(m - m_safe)
        l.mul_(alpha).add_(p.sum(-1, keepdim=True))  # the normaliser counts dropped weights too
        if dropout_p > 0.0:
            _drop(p, _keep_bits(keys[0][:, :, rows], keys[1][cols], dropout_p))
        o.mul_(alpha).add_(_matmul(p.to(v.dtype), v[:, :, cols]))  # P rounded to the inputs' dtype
        m.copy_(m_new)


@torch.library.custom_op("minitransformer::chunked_attention_bwd", mutates_args=())
@_autocast_off
def _chunked_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 row_max: torch.Tensor, log2_sum: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 seed: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: float,
                 window_size: Optional[int], cq: int, ck: int, mask_grad: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, and the gradient of a float attn_mask when mask_grad (else an empty tensor)."""
    acc = row_max.dtype
    dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))  # laid out as q, k, v (register_fake)
    dmask = torch.zeros_like(attn_mask, dtype=acc) if mask_grad else q.new_empty(0)
    dout, q, k, v = dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous()
    options = _block_options(q, k, attn_mask, seed, dropout_p, is_causal, scale, window_size, ck)
    for rows in _blocks(q.size(-2), cq):
        dm = dmask if mask_grad else None
        _attend_backward(dout, q, k, v, out, row_max, log2_sum, rows, dq, dk, dv, dm, **options)
    dq.mul_(scale)
    dk.mul_(scale)
    dv.mul_(1.0 / (1.0 - dropout_p))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask.to(attn_mask.dtype) if mask_grad else dmask


def _attend_backward(dout, q, k, v, out, row_max, log2_sum, rows, dq, dk, dv, dmask, *, bias, keys, dropout_p,
                     is_causal, scale, window_size, ck):
    """The backward's block update: queries `rows` against every key block they see, adding to dq,
    dk, dv (float32; dq and dk still to be multiplied by the scale) and to a float mask's dmask."""
    acc = row_max.dtype
    dout_i = dout[:, :, rows]  # (B, H, cq, Dv)
    m, log2l = row_max[:, :, rows], log2_sum[:, :, rows]  # (B, H, cq, 1)
    delta = (dout_i.to(acc) * out[:, :, rows].to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
    for cols in _key_blocks(rows, k.size(-2), ck, is_causal, window_size):
        s = _scores(q, k, bias, rows, cols, scale, is_causal, window_size)
        p = s.sub_(m).sub_(log2l).exp2_()  # P_j, the forward's probabilities
        dp = _matmul(dout_i, v[:, :, cols].transpose(-2, -1))  # (B, H, cq, ck)
        p_dropped = p
        if dropout_p > 0.0:  # the forward's mask; 1/(1-p) is applied to dV once, at the end
            keep = _keep_bits(keys[0][:, :, rows], keys[1][cols], dropout_p)
            p_dropped = _drop(p.clone(), keep)
            _drop(dp, keep).mul_(1.0 / (1.0 - dropout_p))
        dv[:, :, cols] += _matmul(p_dropped.to(q.dtype).transpose(-2, -1), dout_i)
        ds = p.mul_(dp.sub_(delta))  # dS_j = P_j * (dP_j - delta)
        ds_low = ds.to(q.dtype)  # rounded to the inputs' dtype for the products, as P is
        dq[:, :, rows] += _matmul(ds_low, k[:, :, cols])
        dk[:, :, cols] += _matmul(ds_low.transpose(-2, -1), q[:, :, rows])
        if dmask is not None:  # the mask is added to the scores: its gradient is dS, summed where broadcast
            dm = dmask[..., rows if dmask.size(-2) != 1 else slice(None), :]
            dm = dm[..., cols] if dmask.size(-1) != 1 else dm
            dm += ds.sum_to_size(dm.shape)


def _block_options(q, k, attn_mask, seed, dropout_p, is_causal, scale, window_size, ck):
    """What every block update of one call shares: the base-2 bias, dropout's row and column hashes."""
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = _dropout_keys(seed, *q.shape[:3], k.size(-2)) if dropout_p > 0.0 else None
    return dict(bias=_base2_bias(attn_mask, acc), keys=keys, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, window_size=window_size, ck=ck)


_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()  # torch.bmm(a, b, out_dtype=...), CUDA


def _matmul(a, b, alpha=1.0):
    """alpha * (a @ b) for a (B, H, m, k) and b (B, H, k, n), in float32 (float64 for float64).

    The operands are multiplied as they are and the products accumulated in float32, as
    tensor cores do: on CUDA by bmm(..., out_dtype=float32); elsewhere float16 and bfloat16
    are converted to float32 first, which is exact, so a CPU computes what a GPU does (up to
    the order of the sums).
    """
    if a.dtype in (torch.float16, torch.bfloat16):
        if a.is_cuda and _BMM_OUT_DTYPE:
            out = torch.bmm(a.flatten(0, 1), b.flatten(0, 1), out_dtype=torch.float32)  # (B*H, m, n)
            out = out.view(*a.shape[:-1], b.size(-1))  # (B, H, m, n)
            return out if alpha == 1.0 else out.mul_(alpha)
        a, b = a.float(), b.float()
    if alpha == 1.0:
        return a @ b
    out = torch.baddbmm(a.new_empty(()), a.flatten(0, 1), b.flatten(0, 1), beta=0, alpha=alpha)  # in the GEMM
    return out.view(*a.shape[:-1], b.size(-1))  # (B, H, m, n)


def _scores(q, k, bias, rows, cols, scale, is_causal, window_size):
    """Masked scores of one block in base 2, (B, H, rows, cols): Q K^T * scale * log2(e) + bias,
    bias already in base 2 (_base2_bias). The backward recomputes them instead of storing them."""
    s = _matmul(q[:, :, rows], k[:, :, cols].transpose(-2, -1), alpha=scale * LOG2E)
    return _apply_mask(s, mask_block(bias, rows, cols, is_causal=is_causal, window_size=window_size,
                                     device=q.device))


def _blocks(L, size):
    return [slice(i, min(i + size, L)) for i in range(0, L, size)]


def _key_blocks(rows, Lk, ck, is_causal, window_size):
    """Slices of the key blocks that queries `rows` can see: blocks hidden by causality or the
    window alone are never computed, and the visible range is cut to the visible keys."""
    lo, hi = 0, Lk
    if is_causal:
        hi = min(hi, rows.stop)  # keys j <= i < rows.stop
    if window_size is not None:
        lo, hi = max(lo, rows.start - window_size), min(hi, rows.stop + window_size)
    return [slice(k0, min(k0 + ck, hi)) for k0 in range(lo, hi, ck)]


def _base2_bias(attn_mask, acc):
    """A float mask times log2(e), in acc (float32 or wider); bool masks and None pass through."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    return _finite_bias(attn_mask, acc, LOG2E)


_HASH = 0x2C1B3C6D  # odd: multiplying by it permutes the integers mod 2^31


def _mix(x):
    """Hash int32 values in [0, 2^31) in place, a permutation of that range: two rounds of
    xor-shift and multiply (the product wraps mod 2^32; the mask keeps 31 bits)."""
    for _ in range(2):
        x.bitwise_xor_(x.bitwise_right_shift(15)).mul_(_HASH).bitwise_and_(0x7FFFFFFF)
    return x


def _dropout_keys(seed, B, H, Lq, Lk):
    """Hashes of the rows (b, h, i) with the seed, (B, H, Lq, 1), and of the columns j, (Lk,), int32.

    seed: an int32 tensor of shape () on the device. Row ids (b * H + h) * Lq + i wrap above
    2^31 rows.
    """
    dev = seed.device
    rows = (torch.arange(B * H, dtype=torch.int32, device=dev).view(B, H, 1, 1) * Lq
            + torch.arange(Lq, dtype=torch.int32, device=dev)[:, None])  # (B, H, Lq, 1)
    cols = torch.arange(Lk, dtype=torch.int32, device=dev)  # (Lk,)
    return _mix(_mix(rows.bitwise_and_(0x7FFFFFFF)) ^ seed), _mix(cols)


def _keep_bits(row_key, col_key, dropout_p):
    """Dropout's keep-mask of one block, (B, H, rows, cols): all bits set where a weight is kept
    (probability 1 - p), none where it is dropped. A hash of (seed, b, h, i, j), so the forward
    and the backward draw the same mask, whatever the block sizes."""
    x = _mix(row_key ^ col_key)  # uniform in [0, 2^31)
    x -= round(dropout_p * 2**31)  # negative where dropped
    x.bitwise_right_shift_(31)  # the sign, spread to every bit: -1 (all set) where dropped, 0 where kept
    return x.bitwise_not_()


def _drop(t, keep_bits):
    """Zero the dropped weights of t in place, by AND-ing its bits with the mask: a bool mask costs
    two more passes over the block (its conversion to float, then the product)."""
    bits = t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)
    bits &= keep_bits.to(bits.dtype)  # int64 from int32 keeps every bit set
    return t


@_chunked_fwd.register_fake
def _(q, k, v, attn_mask, seed, dropout_p, is_causal, scale, window_size, cq, ck):
    acc = torch.promote_types(q.dtype, torch.float32)
    stats = q.new_empty(*q.shape[:-1], 1, dtype=acc)
    return q.new_empty(*q.shape[:-1], v.size(-1)), stats, torch.empty_like(stats)


@_chunked_bwd.register_fake
def _(dout, q, k, v, out, row_max, log2_sum, attn_mask, seed, dropout_p, is_causal, scale, window_size,
      cq, ck, mask_grad):
    dmask = torch.empty_like(attn_mask) if mask_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


def _chunked_setup_context(ctx, inputs, output):
    q, k, v, attn_mask, seed, *options = inputs
    out, row_max, log2_sum = output
    ctx.save_for_backward(q, k, v, out, row_max, log2_sum, attn_mask, seed)
    ctx.options = options  # dropout_p, is_causal, scale, window_size, cq, ck


def _chunked_backward(ctx, dout, _drow_max, _dlog2_sum):
    q, k, v, out, row_max, log2_sum, attn_mask, seed = ctx.saved_tensors
    mask_grad = ctx.needs_input_grad[3]  # a float mask that requires grad: a learned bias (T5, ALiBi)
    dq, dk, dv, dmask = _chunked_bwd(dout, q, k, v, out, row_max, log2_sum, attn_mask, seed, *ctx.options,
                                     mask_grad)
    return dq, dk, dv, dmask if mask_grad else None, None, None, None, None, None, None, None


_chunked_fwd.register_autograd(_chunked_backward, setup_context=_chunked_setup_context)


# -----------------------------------------------------------------------------
# Path 3: PyTorch's fused kernel. SDPA picks a kernel by itself and falls back to its
# unfused math kernel without a word when no fused one accepts the inputs: we ask first.

_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
_KERNEL_NAMES = {int(backend): name for name, backend in _KERNELS.items()}


def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                    window_size=None, on_math="warn"):
    """softmax(Q K^T * scale + M) V by F.scaled_dot_product_attention's fused kernels.

    When no fused kernel accepts the inputs (dropout on a CPU, say), on_math decides: "warn"
    and run the math kernel, "raise" a RuntimeError, or "allow". A mask or window is passed
    as an (.., Lq, Lk) mask; pure is_causal as the kernel's flag. Under torch.compile, and
    where torch cannot report its kernel (MPS, XPU), SDPA runs unchecked.
    """
    if on_math not in ("warn", "raise", "allow"):
        raise ValueError(f"on_math must be 'warn', 'raise' or 'allow', got {on_math!r}")
    attn_mask, scale = _check_attention_args(q, k, v, attn_mask, dropout_p, scale, window_size)
    q, k, v, mask, causal, sdpa = _sdpa_inputs(q, k, v, attn_mask, is_causal, window_size)
    # the compiler picks the kernel itself, and the query's Python int would break its graph
    compiling = torch.compiler.is_compiling()
    kernel = "unknown" if compiling else _chosen_kernel(q, k, v, mask, dropout_p, causal, scale)
    if kernel == "math" and on_math != "allow":
        why = (f"no fused SDPA kernel accepts these inputs (device={q.device.type}, dtype={q.dtype}, "
               f"dropout_p={dropout_p}, mask={None if mask is None else mask.dtype}, head dim={q.size(-1)}); "
               "running the unfused math kernel")
        if on_math == "raise":
            raise RuntimeError(why)
        warnings.warn(why, stacklevel=2)
    dead = None
    if mask is not None and q.device.type != "cpu" and kernel != "math":  # CPU kernels need neither step
        if mask.is_floating_point():
            mask = _finite_bias(mask, q.dtype)  # CUDA's fused kernels read a float mask in q's dtype
        if kernel != "efficient" or torch.version.hip:  # only NVIDIA's efficient kernel is known to zero a
            mask, dead = _reopen_dead_rows(mask)  # row with every key masked (cuDNN, ROCm, MPS: not)
    out = sdpa(q, k, v, mask, dropout_p, causal, scale=scale)  # SDPA makes the choice reported above
    return out if dead is None else out.masked_fill(dead, 0.0)


def _sdpa_inputs(q, k, v, attn_mask, is_causal, window_size):
    """(q, k, v, mask, is_causal, sdpa) as SDPA is to get them, so that the kernel asked about is the one run.

    Pure causality stays a flag. A float mask comes in a dtype SDPA takes (q's or float32).
    Under autocast, q, k, v are cast as autocast would cast them and SDPA runs with autocast
    off: autocast would round a float mask to 16 bits too.
    """
    sdpa = F.scaled_dot_product_attention
    if torch.is_autocast_enabled(q.device.type):
        sdpa = _autocast_off(sdpa)
        if q.dtype == torch.float32:  # the dtype autocast casts
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if attn_mask is None and window_size is None:
        return q, k, v, None, is_causal, sdpa
    whole = slice(0, q.size(-2)), slice(0, k.size(-2))
    mask = mask_block(attn_mask, *whole, is_causal=is_causal, window_size=window_size, device=q.device)
    if mask is not None and mask.is_floating_point() and mask.dtype not in (q.dtype, torch.float32):
        mask = _finite_bias(mask, q.dtype if q.dtype.itemsize >= 4 else torch.float32)
    return q, k, v, mask, False, sdpa


def _chosen_kernel(q, k, v, mask, dropout_p, is_causal, scale):
    """The SDPA kernel these inputs get: 'flash', 'efficient', 'cudnn', 'math', or 'unknown' where torch
    cannot tell (a device other than CPU and CUDA, or no torch._fused_sdp_choice)."""
    # torch._fused_sdp_choice is the function SDPA itself consults, and it honours an enclosing
    # sdpa_kernel(...) restriction; it is private, so ask whether it is there
    if q.device.type not in ("cpu", "cuda") or not hasattr(torch, "_fused_sdp_choice"):
        return "unknown"
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale)
    except RuntimeError as e:  # every enabled kernel refuses these inputs
        raise RuntimeError(f"no enabled SDPA kernel can run these inputs: {str(e).splitlines()[0]}") from e
    if choice not in _KERNEL_NAMES:
        raise RuntimeError(f"no enabled SDPA kernel can run these inputs (SDPA chose {SDPBackend(choice)})")
    return _KERNEL_NAMES[choice]


def sdpa_kernel_name(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                     window_size=None):
    """Which SDPA kernel flash_attention would run for these inputs: 'flash', 'efficient', 'cudnn',
    'math', or 'unknown' where torch cannot tell (MPS, XPU, a torch without the kernel query)."""
    attn_mask, scale = _check_attention_args(q, k, v, attn_mask, dropout_p, scale, window_size)
    q, k, v, mask, causal, _ = _sdpa_inputs(q, k, v, attn_mask, is_causal, window_size)
    return _chosen_kernel(q, k, v, mask, dropout_p, causal, scale)


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, impl="flash",
              window_size=None, chunk_size=None):
    """Attention through one of IMPLS: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv)"""
    if impl == "naive":
        return naive_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, window_size=window_size)[0]
    if impl == "chunked":
        return chunked_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, window_size=window_size,
                                 chunk_size=chunk_size)
    if impl == "flash":
        return flash_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, window_size=window_size)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# -----------------------------------------------------------------------------
# Beyond one device: ring attention (Liu et al. 2023, "Ring Attention with Blockwise
# Transformers", https://arxiv.org/abs/2310.01889), over torch.distributed.
#
# Each of P ranks holds a shard of the sequence: its queries Q_r and keys and values K_r, V_r.
# The K/V blocks travel around the ring: at step s rank r holds block j = (r - s) mod P, runs
# the chunked path on its queries and that block, and meanwhile passes the block on to rank
# r + 1. Each step's result, normalised by its own row max m_s and sum l_s (base 2), merges
# into the running one exactly as the chunked path merges key blocks (float32):
#     m = max(m_1, m_2),   w_i = exp2(m_i + log2(l_i) - m),   l = w_1 + w_2,
#     out = (w_1 out_1 + w_2 out_2) / l.
# The backward runs the chunked backward of every step against the final m and l (so each step
# recomputes exactly its share of the probabilities), and dK, dV travel the ring with their
# block until they are home. Causal attention skips the steps that it masks entirely; with the
# zigzag layout (rank r holds chunks r and 2P-1-r of 2P) every rank does the same work a step.

RING_LAYOUTS = ("contiguous", "zigzag")


def shard_sequence(x, rank, world_size, layout="contiguous", dim=-2):
    """Rank `rank`'s shard of x along dim: positions [r*L/P, (r+1)*L/P) ("contiguous"), or chunks
    r and 2P-1-r of 2P, concatenated ("zigzag")."""
    _check_ring_layout(x.size(dim), world_size, layout)
    if layout == "contiguous":
        return x.chunk(world_size, dim)[rank]
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


@torch.compiler.disable  # point-to-point messages have no place in a compiled graph
def ring_attention(q, k, v, is_causal=False, scale=None, *, group=None, layout="contiguous"):
    """softmax(Q K^T * scale) V over a sequence sharded across the ranks of a process group.

    q (B, H, L/P, D), k (B, H, L/P, D), v (B, H, L/P, Dv): this rank's shard, in `layout`
    (shard_sequence); returns this rank's shard of the output, (B, H, L/P, Dv). group=None:
    the default process group. Differentiable; float16 and bfloat16 follow the chunked path.
    """
    scale = _check_ring_args(q, k, v, scale, group, layout)
    return _RingAttention.apply(q, k, v, is_causal, scale, group, layout)


def _ring_steps(rank, world, n, is_causal, layout):
    """For each step s, the work it computes: [(rows, cols, causal)], the local query rows and visiting
    key columns that see each other and whether causality still masks within them (the diagonal);
    [] for a step that causality masks entirely."""
    steps, whole, half = [], slice(0, n), n // 2
    for s in range(world):
        j = (rank - s) % world  # the rank whose K/V block is here
        if not is_causal or j == rank:
            steps.append([(whole, whole, is_causal)])
        elif layout == "contiguous":
            steps.append([(whole, whole, False)] if j < rank else [])
        else:  # zigzag: chunk x sees all of chunk y < x: the earlier half of j's block, or its later queries
            steps.append([(whole, slice(0, half), False) if j < rank else (slice(half, n), whole, False)])
    return steps


def _ring_pass(tensors, group):
    """Start sending `tensors` to the next rank and receiving their like from the previous one:
    (the received tensors, the requests to wait on before reading them)."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    to_global = (lambda r: r) if group is None else (lambda r: torch.distributed.get_global_rank(group, r))
    nxt, prv = to_global((rank + 1) % world), to_global((rank - 1) % world)
    received = [torch.empty_like(t) for t in tensors]
    ops = [torch.distributed.P2POp(torch.distributed.isend, t, nxt, group) for t in tensors]
    ops += [torch.distributed.P2POp(torch.distributed.irecv, t, prv, group) for t in received]
    return received, torch.distributed.batch_isend_irecv(ops)


def _wait(requests):
    """Wait for the ring's messages: the time spent here is the communication that compute did not hide
    (a profiler region, which study.py reads)."""
    with torch.profiler.record_function("ring_attention.wait"):
        for request in requests:
            request.wait()


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, group, layout):
        out, row_max, log2_sum = _ring_forward(q, k, v, is_causal, scale, group, layout)
        ctx.save_for_backward(q, k, v, out, row_max, log2_sum)
        ctx.options = is_causal, scale, group, layout
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        dq, dk, dv = _ring_backward(dout, *ctx.saved_tensors, *ctx.options)
        return dq, dk, dv, None, None, None, None


@_autocast_off
def _ring_forward(q, k, v, is_causal, scale, group, layout):
    """out (float32), row max and log2 of the normaliser, after P steps of the chunked forward's block
    update, continued from one visiting K/V block to the next."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    cq, ck = default_chunk_size(q.device)
    q = q.contiguous()
    acc = torch.promote_types(q.dtype, torch.float32)
    o = q.new_zeros(*q.shape[:-1], v.size(-1), dtype=acc)  # (B, H, n, Dv): the running output, float32
    m = q.new_full((*q.shape[:-1], 1), float("-inf"), dtype=o.dtype)  # (B, H, n, 1)
    l = torch.zeros_like(m)
    kv, steps = (k.contiguous(), v.contiguous()), _ring_steps(rank, world, q.size(-2), is_causal, layout)
    for s in range(world):
        received, requests = _ring_pass(kv, group) if s < world - 1 else (None, [])
        for rows, cols, causal in steps[s]:
            q_s, k_s, v_s = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
            options = _block_options(q_s, k_s, None, None, 0.0, causal, scale, None, ck)
            for block in _blocks(q_s.size(-2), cq):
                state = (t[:, :, rows][:, :, block] for t in (o, m, l))
                _attend(q_s, k_s, v_s, block, *state, **options)
        _wait(requests)
        kv = received or kv
    return o.div_(l), m, torch.log2(l)


@_autocast_off
def _ring_backward(dout, q, k, v, out, row_max, log2_sum, is_causal, scale, group, layout):
    """dq, dk, dv: the chunked backward's block update for every step, against the final row statistics;
    dK and dV travel with their block and arrive home after the last step."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    cq, ck = default_chunk_size(q.device)
    dout, q = dout.contiguous(), q.contiguous()
    kv = k.contiguous(), v.contiguous()  # what travels must be contiguous
    dq = torch.zeros_like(q, dtype=out.dtype)
    dkv = torch.zeros_like(kv[0], dtype=out.dtype), torch.zeros_like(kv[1], dtype=out.dtype)
    steps = _ring_steps(rank, world, q.size(-2), is_causal, layout)
    for s in range(world):
        received, requests = _ring_pass(kv, group) if s < world - 1 else (None, [])
        for rows, cols, causal in steps[s]:
            q_s, k_s, v_s = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
            grads = dq[:, :, rows], dkv[0][:, :, cols], dkv[1][:, :, cols]
            stats = out[:, :, rows], row_max[:, :, rows], log2_sum[:, :, rows]  # of the whole result
            options = _block_options(q_s, k_s, None, None, 0.0, causal, scale, None, ck)
            for block in _blocks(q_s.size(-2), cq):
                _attend_backward(dout[:, :, rows], q_s, k_s, v_s, *stats, block, *grads, None, **options)
        dkv_received, dkv_requests = _ring_pass(dkv, group) if world > 1 else (dkv, [])  # on with their block
        _wait(requests + dkv_requests)
        kv, dkv = received or kv, dkv_received
    dq.mul_(scale)
    return dq.to(q.dtype), dkv[0].mul_(scale).to(k.dtype), dkv[1].to(v.dtype)


# -----------------------------------------------------------------------------
# Multi-head attention


class MultiHeadAttention(nn.Module):
    """MultiHead(X) = Concat(head_1, ..., head_h) W^O,  head_i = Attention(X W_i^Q, X W_i^K, X W_i^V).

    x: (B, T, C) with C = d_model, batch first. The three input projections are one
    C -> 3C linear layer, its weight laid out as nn.MultiheadAttention's in_proj_weight.
    rope: an optional RotaryEmbedding applied to q and k of every head. impl="ring": x is this
    rank's shard of sequences cut across the default process group (ring_attention, ring_layout).
    """

    def __init__(self, d_model, n_heads, dropout=0.0, bias=True, impl="flash", *, chunk_size=None,
                 window_size=None, rope=None, ring_layout="contiguous"):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if impl not in IMPLS + ("ring",):
            raise ValueError(f"impl must be one of {IMPLS + ('ring',)}, got {impl!r}")
        if d_model // n_heads < 32:
            warnings.warn(f"head size d_model/n_heads = {d_model // n_heads} is below 32; "
                          "fine for small test models, weak for real ones", stacklevel=2)
        self.d_model, self.n_heads, self.dropout, self.impl = d_model, n_heads, dropout, impl
        self.chunk_size, self.window_size, self.rope = chunk_size, window_size, rope
        self.ring_layout = ring_layout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, attn_mask=None, is_causal=False, need_weights=False, positions=None):
        if x.dim() != 3 or x.size(-1) != self.d_model:
            raise ValueError(f"expected x of shape (B, T, {self.d_model}), got {tuple(x.shape)}")
        B, T, C = x.size()
        nh, hs = self.n_heads, C // self.n_heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        p = self.dropout if self.training else 0.0
        if need_weights:  # only the naive path materialises the weights
            y, weights = naive_attention(q, k, v, attn_mask, p, is_causal, window_size=self.window_size)
        elif self.impl == "ring":
            if attn_mask is not None or p > 0.0 or self.window_size is not None:
                raise ValueError("impl='ring' takes no attn_mask, no dropout and no window_size")
            y = ring_attention(q, k, v, is_causal, layout=self.ring_layout)
        else:
            y = attention(q, k, v, attn_mask, p, is_causal, impl=self.impl, window_size=self.window_size,
                          chunk_size=self.chunk_size)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        y = self.proj(y)
        return (y, weights) if need_weights else y  # weights: (B, nh, T, T)

    @classmethod
    def from_torch(cls, m, impl="flash"):
        """An equivalent module (same outputs) from an nn.MultiheadAttention with q, k, v of one size."""
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
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
        return new


# -----------------------------------------------------------------------------
# Positional encodings


class SinusoidalPositionalEncoding(nn.Module):
    """x + PE,  PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    x: (B, T, d_model), T <= max_len. Fixed, not learned; dropout after the sum as in the paper.
    """

    def __init__(self, d_model, max_len, dropout=0.0):
        super().__init__()
        self.max_len = max_len
        pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
        inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (ceil(d/2),)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * inv_freq)
        pe[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
        self.register_buffer("pe", pe.float(), persistent=False)  # recomputed, so not in the checkpoint
        self.drop = nn.Dropout(dropout)

    def forward(self, x, positions=None):
        """positions: the (T,) positions of x's rows; default 0 .. T-1."""
        _check_length(x.size(1), self.max_len)
        pos = slice(0, x.size(1)) if positions is None else positions
        return self.drop(x + self.pe[pos].to(x.dtype))


class LearnedPositionalEncoding(nn.Module):
    """x + P[pos], with P a learned (max_len, d_model) table (BERT, GPT-2). x: (B, T, d_model)."""

    def __init__(self, d_model, max_len, dropout=0.0):
        super().__init__()
        self.max_len = max_len
        self.pe = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, positions=None):
        _check_length(x.size(1), self.max_len)
        pos = slice(0, x.size(1)) if positions is None else positions
        return self.drop(x + self.pe.weight[pos])


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each pair (x_i, x_{i+hs/2}) of q and k by the angle pos * 10000^(-2i/hs).

    x: (B, nh, T, hs) -> same shape. The score q_m . k_n then depends on positions
    only through m - n, so no position is added to the token embedding.
    """

    def __init__(self, head_size, max_len, base=10000.0):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"RoPE needs an even head size, got {head_size}")
        self.max_len = max_len
        inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)  # (hs/2,)
        angle = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq  # (max_len, hs/2)
        angle = torch.cat([angle, angle], dim=-1)  # (max_len, hs): pair i and i + hs/2 share an angle
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def forward(self, x, positions=None):
        """positions: the (T,) positions of x's rows; default 0 .. T-1."""
        _check_length(x.size(-2), self.max_len)
        pos = slice(0, x.size(-2)) if positions is None else positions
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)  # (B, nh, T, hs): multiplication by i, pair by pair
        return x * self.cos[pos].to(x.dtype) + rotated * self.sin[pos].to(x.dtype)


# -----------------------------------------------------------------------------
# Encoder layer

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class EncoderLayer(nn.Module):
    """One encoder layer, as nn.TransformerEncoderLayer (batch first).

    post-LN (paper, default):  x = LN(x + SA(x));     x = LN(x + FF(x))
    pre-LN (norm_first=True):  x = x + SA(LN(x));     x = x + FF(LN(x))
    FF(x) = W2 dropout(act(W1 x + b1)) + b2. x: (B, T, d_model) -> (B, T, d_model).
    """

    def __init__(self, d_model, n_heads, d_ff, dropout=0.1, norm_first=False, activation="relu", impl="flash",
                 layer_norm_eps=1e-5, *, bias=True, chunk_size=None, window_size=None, rope=None,
                 ring_layout="contiguous"):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(_ACTIVATIONS)}, got {activation!r}")
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout, bias, impl, chunk_size=chunk_size,
                                            window_size=window_size, rope=rope, ring_layout=ring_layout)
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)  # inside the feed-forward
        self.dropout1 = nn.Dropout(dropout)  # on the attention branch
        self.dropout2 = nn.Dropout(dropout)  # on the feed-forward branch
        self.activation = _ACTIVATIONS[activation]
        self.norm_first = norm_first

    def _sa(self, x, attn_mask, is_causal, positions):
        return self.dropout1(self.self_attn(x, attn_mask, is_causal, positions=positions))

    def _ff(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x, attn_mask=None, is_causal=False, positions=None):
        d_model = self.linear1.in_features
        if x.dim() != 3 or x.size(-1) != d_model:  # before LayerNorm, whose own error is less clear
            raise ValueError(f"expected x of shape (B, T, {d_model}), got {tuple(x.shape)}")
        if self.norm_first:
            x = x + self._sa(self.norm1(x), attn_mask, is_causal, positions)
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self._sa(x, attn_mask, is_causal, positions))
        return self.norm2(x + self._ff(x))

    @classmethod
    def from_torch(cls, layer, impl="flash"):
        """An equivalent layer (same outputs) from an nn.TransformerEncoderLayer with relu or gelu."""
        act = getattr(layer, "activation_relu_or_gelu", 0)
        if act not in (1, 2):
            raise ValueError("from_torch supports nn.TransformerEncoderLayer with 'relu' or 'gelu'")
        _check_batch_first(layer.self_attn, "nn.TransformerEncoderLayer", cls.__name__)
        sa = layer.self_attn
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            new = cls(sa.embed_dim, sa.num_heads, layer.linear1.out_features, layer.dropout.p,
                      layer.norm_first, "relu" if act == 1 else "gelu", impl, layer.norm1.eps,
                      bias=layer.linear1.bias is not None)
        new = new.to(layer.linear1.weight.device, layer.linear1.weight.dtype)
        new.self_attn = MultiHeadAttention.from_torch(sa, impl)
        for name in ("linear1", "linear2", "norm1", "norm2"):
            getattr(new, name).load_state_dict(getattr(layer, name).state_dict())
        return new


# -----------------------------------------------------------------------------
# Config and encoder


@dataclass
class EncoderConfig:
    vocab_size: int = 32  # number of token ids, 0 .. vocab_size - 1
    max_len: int = 512  # longest sequence the positional encoding accepts
    d_model: int = 128  # width of the residual stream
    n_heads: int = 4  # attention heads; d_model / n_heads is the head size
    n_layers: int = 2  # encoder layers
    d_ff: int = 512  # hidden width of the feed-forward block (4 * d_model in the paper)
    dropout: float = 0.0  # dropout on attention probabilities, residual branches and embeddings
    norm_first: bool = True  # pre-LN (stable without warm-up tricks); False = post-LN as in the paper
    activation: str = "relu"  # "relu" or "gelu"
    impl: str = "flash"  # attention path: "naive", "chunked", "flash", or "ring" (a sequence across ranks)
    pos_encoding: str = "sinusoidal"  # "sinusoidal", "learned" or "rope"
    chunk_size: int | None = None  # block size of the chunked path; None = default_chunk_size(device)
    window_size: int | None = None  # local attention: keys within this distance; None = global
    ring_layout: str = "contiguous"  # impl="ring": how the sequence is cut, "contiguous" or "zigzag"
    layer_norm_eps: float = 1e-5  # epsilon of every LayerNorm

    def __post_init__(self):
        for name in ("vocab_size", "max_len", "d_model", "n_heads", "n_layers", "d_ff"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        choices = {"activation": tuple(_ACTIVATIONS), "impl": IMPLS + ("ring",),
                   "pos_encoding": POS_ENCODINGS, "ring_layout": RING_LAYOUTS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.pos_encoding == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"rope needs an even head size, got {self.d_model} / {self.n_heads} heads")
        if self.chunk_size is not None:
            _chunks(self.chunk_size)
        _check_window(self.window_size)
        if self.impl == "ring" and (self.dropout or self.window_size is not None):
            raise ValueError("impl='ring' has no dropout and no window: set dropout=0.0 and window_size=None")


class Encoder(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, d_model).

    h = PosEnc(Embed(idx) * sqrt(d_model)), then n_layers EncoderLayers, then a final
    LayerNorm for pre-LN (post-LN layers already end in one).
    """

    def __init__(self, config):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        rope = None
        if c.pos_encoding == "sinusoidal":
            self.pos = SinusoidalPositionalEncoding(c.d_model, c.max_len, c.dropout)
        elif c.pos_encoding == "learned":
            self.pos = LearnedPositionalEncoding(c.d_model, c.max_len, c.dropout)
        else:
            self.pos = nn.Dropout(c.dropout)
            rope = RotaryEmbedding(c.d_model // c.n_heads, c.max_len)
        self.layers = nn.ModuleList(
            EncoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.norm_first, c.activation, c.impl,
                         c.layer_norm_eps, chunk_size=c.chunk_size, window_size=c.window_size, rope=rope,
                         ring_layout=c.ring_layout)
            for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps) if c.norm_first else nn.Identity()
        self.apply(self._init_weights)
        for layer in self.layers:  # residual projections: variance of the sum grows with depth (GPT-2)
            for w in (layer.self_attn.proj.weight, layer.linear2.weight):
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * c.n_layers))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            # the token embedding is multiplied by sqrt(d_model): this makes the product of unit scale
            nn.init.normal_(module.weight, std=module.embedding_dim ** -0.5 if module is self.embed else 0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def _embed(self, idx):
        """Checked token ids (B, T) -> PosEnc(Embed(idx) * sqrt(d_model)), (B, T, d_model), and the
        positions of the T tokens: None (0 .. T-1), or with impl="ring" their places in the whole
        sequence, of which idx is this rank's shard."""
        c = self.config
        if idx.dim() != 2 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(f"idx must be integer token ids (B, T), got {tuple(idx.shape)} {idx.dtype}")
        T, positions = idx.size(1), None
        if c.impl == "ring":
            world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
            T *= world
            positions = shard_sequence(torch.arange(T, device=idx.device), rank, world, c.ring_layout, dim=0)
        _check_length(T, c.max_len)
        _check_range(idx, 0, c.vocab_size, "token ids")
        x = self.embed(idx) * math.sqrt(c.d_model)
        return (self.pos(x) if c.pos_encoding == "rope" else self.pos(x, positions)), positions

    def forward(self, idx, attn_mask=None, is_causal=False):
        x, positions = self._embed(idx)  # (B, T, d_model)
        for layer in self.layers:
            x = layer(x, attn_mask, is_causal, positions)
        return self.norm(x)

    def attention_weights(self, idx, attn_mask=None, is_causal=False, layer=-1):
        """Attention probabilities (B, H, T, T) of one layer, through the naive path: what a heatmap shows."""
        if self.config.impl == "ring":
            raise ValueError("attention_weights needs the whole sequence on one device: not with impl='ring'")
        layer = range(len(self.layers))[layer]  # negative indices count from the last layer
        x, _ = self._embed(idx)
        for block in self.layers[:layer]:
            x = block(x, attn_mask, is_causal)
        block = self.layers[layer]
        x = block.norm1(x) if block.norm_first else x  # the input its attention sees
        return block.self_attn(x, attn_mask, is_causal, need_weights=True)[1]


class TokenClassifier(nn.Module):
    """Encoder plus a linear head: logits (B, T, vocab_size) for one output token per position."""

    def __init__(self, config):
        super().__init__()
        self.encoder = Encoder(config)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, idx, attn_mask=None):
        return self.head(self.encoder(idx, attn_mask))


# -----------------------------------------------------------------------------
# Training: a task that needs attention, mixed precision, checkpoints, DDP

PAD = 0  # token id of padding; real tokens are 1 .. vocab_size - 1


def reverse_batch(B, min_len, max_len, vocab_size, gen):
    """A batch of the reversal task: x = t_1 .. t_L, y = t_L .. t_1, each padded to max_len.

    L varies per sequence, so output i must read input L - 1 - i, a position that
    depends on the sequence's own length: impossible without attention across
    positions, and the padding mask matters (a padded key would shift the answer).
    Returns x, y (B, max_len) and the lengths (B,), made on the generator's device.
    """
    lengths = torch.randint(min_len, max_len + 1, (B,), generator=gen, device=gen.device)
    x = torch.randint(1, vocab_size, (B, max_len), generator=gen, device=gen.device)
    pos = torch.arange(max_len, device=gen.device)
    src = (lengths[:, None] - 1 - pos[None, :]).clamp(min=0)  # (B, T): input position output i reads
    y = torch.gather(x, 1, src)
    real = pos[None, :] < lengths[:, None]  # (B, T)
    return x.masked_fill(~real, PAD), y.masked_fill(~real, PAD), lengths


def _choices(*values):
    return {"choices": values}


def _arg(default, text, **kw):
    """A TrainConfig field with its --help text: the dataclass is the one place defaults live."""
    return field(default=default, metadata={"help": text, **kw})


@dataclass
class TrainConfig:
    steps: int = _arg(1500, "optimizer steps; the learning-rate schedule spans them")
    batch_size: int = _arg(64, "sequences per step and per process")
    lr: float = _arg(2e-3, "peak learning rate of AdamW")
    weight_decay: float = _arg(0.01, "AdamW weight decay of weight matrices (never of biases or norms)")
    warmup: int = _arg(100, "steps of linear warm-up before the cosine decay")
    min_lr_ratio: float = _arg(0.1, "the cosine decays to this fraction of --lr")
    label_smoothing: float = _arg(0.1, "label smoothing of the cross-entropy (0.1 in the paper)")
    clip: float = _arg(1.0, "clip the gradient norm to this (after unscaling); 0 disables")
    amp: str = _arg("off", "mixed precision: bf16 autocast, or fp16 autocast with a gradient scaler",
                    **_choices("off", "bf16", "fp16"))
    impl: str = _arg("flash", "attention path", **_choices(*IMPLS))
    compile_model: bool = _arg(False, "torch.compile the model (on a 2-core CPU it did not pay for its "
                                      "compile time; README, Training)", flag="compile")
    pos_encoding: str = _arg("sinusoidal", "positional encoding", **_choices(*POS_ENCODINGS))
    d_model: int = _arg(64, "model width")
    n_heads: int = _arg(2, "attention heads")
    n_layers: int = _arg(2, "encoder layers")
    d_ff: int = _arg(256, "feed-forward width")
    dropout: float = _arg(0.0, "dropout (the task has unlimited data: none is needed)")
    norm_first: bool = _arg(True, "pre-LN (--no-norm-first for the paper's post-LN)")
    vocab_size: int = _arg(32, "task vocabulary, padding included")
    min_len: int = _arg(4, "shortest task sequence")
    max_len: int = _arg(32, "longest task sequence (sequences are padded to it)")
    eval_size: int = _arg(2000, "held-out sequences, drawn from a stream training never sees")
    device: str = _arg("auto", "auto, cpu, cuda or cuda:N")
    seed: int = _arg(0, "seed of the model, the data and dropout")
    log_every: int = _arg(100, "steps between progress lines")
    eval_every: int = _arg(100, "steps between held-out evaluations")
    out: str | None = _arg(None, "checkpoint path, written every --save-every steps and at the end")
    save_every: int = _arg(500, "steps between checkpoints (with --out)")
    resume: str | None = _arg(None, "continue from this checkpoint")
    stop_after: int | None = _arg(None, "stop after this step, as if interrupted (the schedule: --steps)")
    heatmap: str | None = _arg("runs/attention.png",
                               "PNG of one held-out example's attention after training ('' for none)")
    heatmap_layer: int = _arg(-1, "layer of the heatmap (-1: the last)")
    heatmap_head: int = _arg(0, "head of the heatmap")

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every", "eval_every", "save_every", "eval_size", "min_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_len < self.min_len:
            raise ValueError(f"max_len={self.max_len} must be >= min_len={self.min_len}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (padding and one token), got {self.vocab_size}")
        if not (self.lr > 0 and 0 <= self.label_smoothing < 1 and self.clip >= 0 and self.warmup >= 0):
            raise ValueError("need lr > 0, 0 <= label_smoothing < 1, clip >= 0, warmup >= 0; got "
                             f"lr={self.lr}, label_smoothing={self.label_smoothing}, clip={self.clip}, "
                             f"warmup={self.warmup}")
        for name in ("amp", "impl", "pos_encoding"):
            allowed = TrainConfig.__dataclass_fields__[name].metadata["choices"]
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def model_config(self):
        return EncoderConfig(vocab_size=self.vocab_size, max_len=self.max_len, d_model=self.d_model,
                             n_heads=self.n_heads, n_layers=self.n_layers, d_ff=self.d_ff,
                             dropout=self.dropout,
                             norm_first=self.norm_first, impl=self.impl, pos_encoding=self.pos_encoding)


def lr_factor(step, warmup, steps, min_ratio):
    """Linear warm-up to 1 over `warmup` steps, then cosine decay to `min_ratio` at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model, lr, weight_decay):
    """AdamW; weight decay on matrices only: decaying biases and LayerNorm gains only hurts.

    The fused implementation (CPU and CUDA) keeps its step counts on the device and lets
    GradScaler skip an inf/NaN step inside the kernel; the others read a value on the host
    every step (the step count, or the scaler's found-inf flag): a GPU sync per step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=fused)  # the paper's


def optimizer_step(loss, model, optimizer, scaler, clip):
    """backward, unscale, clip, step; returns the gradient norm before clipping and whether the step ran,
    both as tensors on the device: reading them on the host every step would stall a GPU.

    The order matters: with fp16 the gradients are multiplied by the loss scale, so
    they must be unscaled before their norm is clipped; clipping scaled gradients
    (the classic bug) clips almost every step to a tiny fraction of 1.0.
    """
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    scaler.step(optimizer)  # skipped by the scaler when the gradients hold inf or NaN
    scaler.update()
    # the scaler skips exactly when an unscaled gradient is inf or NaN, which makes their norm non-finite;
    # the converse fails only for finite gradients whose norm overflows (~1e19 each), which clipping zeroes
    stepped = torch.isfinite(norm) if scaler.is_enabled() else norm.new_ones((), dtype=torch.bool)
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped


_CHECKPOINT_KEYS = {"model", "optimizer", "scaler", "scheduler", "step", "rng", "model_config",
                    "train_config", "world_size"}
# options a resumed run may change: they decide where output goes and what is logged, not the run itself
RESUME_FREE = {"resume", "out", "stop_after", "log_every", "eval_every", "save_every", "heatmap",
               "heatmap_layer", "heatmap_head", "device", "compile_model"}


def check_resume(cfg, state, world):
    """A resumed run continues the saved one: the same options (but RESUME_FREE) and processes."""
    saved = {name: value for name, value in state["train_config"].items() if hasattr(cfg, name)}
    diff = [name for name in saved if name not in RESUME_FREE and saved[name] != getattr(cfg, name)]
    if diff:
        raise ValueError(f"--resume {cfg.resume}: the checkpoint's run had "
                         + ", ".join(f"{name}={saved[name]!r}" for name in diff) + "; this run asks for "
                         + ", ".join(f"{name}={getattr(cfg, name)!r}" for name in diff)
                         + ". A resumed run continues the saved one (the schedule, data and optimizer depend "
                         "on them): drop those options, or start a new run without --resume.")
    if state["world_size"] != world:
        raise ValueError(f"--resume {cfg.resume}: the checkpoint was written by {state['world_size']} "
                         "process(es), "
                         f"this run has {world}; every rank's data stream and random state are in it: resume "
                         f"with {state['world_size']} (torchrun --nproc_per_node={state['world_size']})")


def save_checkpoint(path, state):
    """Write atomically: a temporary file flushed to disk, then a rename, itself flushed to disk (the
    folder's entry), so that neither a crash of the process nor a power cut leaves half a checkpoint."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if os.name == "posix":  # a folder's entry is flushed through a descriptor of the folder (POSIX only)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path):
    """Load with weights_only=True: tensors and plain containers only, a checkpoint cannot run code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # truncated zip, garbage bytes, a pickle that wants to run code, ...
        raise ValueError(f"cannot read checkpoint {path!r}: it is corrupt, truncated or not a torch "
                         "checkpoint "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    missing = _CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else _CHECKPOINT_KEYS
    if missing:
        raise ValueError(f"{path!r} is not a minitransformer checkpoint: missing {sorted(missing)}")
    return state


def _setup_distributed(device):
    """Initialise torch.distributed under torchrun (RANK, WORLD_SIZE set); returns (rank, world_size)."""
    if "RANK" not in os.environ:
        return 0, 1
    import torch.distributed as dist
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def evaluate(model, data, amp_ctx):
    """Held-out token accuracy (real positions only) and exact-sequence accuracy."""
    model.eval()
    x, y, lengths = data
    with amp_ctx():
        pred = model(x, padding_mask(lengths, x.size(1))).argmax(-1)
    model.train()
    real = y != PAD
    correct = (pred == y) & real
    return {"accuracy": correct.sum().item() / real.sum().item(),
            "seq_accuracy": (correct.sum(1) == real.sum(1)).float().mean().item()}


def save_heatmap(model, data, cfg, path):
    """One held-out example: attention of layer cfg.heatmap_layer, head cfg.heatmap_head, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x, y, lengths = (t[:1] for t in data)
    L = int(lengths[0])
    model.eval()
    with torch.no_grad():
        w = model.encoder.attention_weights(x, padding_mask(lengths, x.size(1)), layer=cfg.heatmap_layer)
    w = w[0, cfg.heatmap_head, :L, :L].float().cpu().numpy()  # (L, L): query rows, key columns
    tokens = [str(t) for t in x[0, :L].tolist()]
    fig, ax = plt.subplots(figsize=(6, 5.4))
    im = ax.imshow(w, cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(L), tokens, fontsize=7)
    ax.set_yticks(range(L), [f"{i}->{t}" for i, t in enumerate(y[0, :L].tolist())], fontsize=7)
    ax.set_xlabel("key: input token")
    ax.set_ylabel("query: position -> target token")
    layer = range(cfg.n_layers)[cfg.heatmap_layer]
    ax.set_title(f"reversal task, layer {layer}, head {cfg.heatmap_head} ({cfg.impl}, {cfg.pos_encoding})",
                 fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(cfg, log=print):
    """Train a TokenClassifier on the reversal task; returns the final metrics (a dict).

    One process, or one of many under torchrun (DistributedDataParallel: each rank
    draws its own batches, gradients are averaged, rank 0 alone logs and saves).
    """
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if cfg.device == "auto" else cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {cfg.device}: no CUDA device is available here")
    if "LOCAL_RANK" in os.environ and device.type == "cuda":  # torchrun: one GPU per process
        local_rank, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"LOCAL_RANK={local_rank}, but this machine has {count} CUDA device(s): start "
                               "at most that many processes per node (torchrun --nproc_per_node), or pass "
                               "--device cpu")
        device = torch.device("cuda", local_rank)
    rank, world = _setup_distributed(device)
    say = log if rank == 0 else (lambda *a, **k: None)
    try:
        result = _train(cfg, device, rank, world, say)
        if world > 1:
            # DDP's reducer sits in reference cycles: collect it now, while its process group
            # lives, not at interpreter exit (where gloo's threads then abort the process)
            gc.collect()
            torch.distributed.barrier()  # no rank tears down while another still talks to it
        return result
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


def _train(cfg, device, rank, world, say):
    amp_dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp]

    def amp_ctx():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    try:  # fail now, not deep inside the first step
        with amp_ctx():
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(f"--amp {cfg.amp} is not supported on {device} by torch {torch.__version__}: {e}"
                           ) from e

    state = load_checkpoint(cfg.resume) if cfg.resume else None
    if state:
        check_resume(cfg, state, world)
    mcfg = EncoderConfig(**state["model_config"]) if state else cfg.model_config()
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = TokenClassifier(mcfg).to(device)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    start = 0
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start = state["step"]
        rng = state["rng"][rank]  # every rank's own dropout stream
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
        say(f"resumed from {cfg.resume} at step {start}")
    else:
        torch.manual_seed(cfg.seed + 1 + rank)  # dropout differs per rank, as the data does
    ddp = model
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                                  else None)
    if cfg.compile_model:  # the training forward and backward; evaluation and checkpoints use `model` itself
        ddp = torch.compile(ddp)

    held_out = reverse_batch(cfg.eval_size, cfg.min_len, cfg.max_len, mcfg.vocab_size,
                             torch.Generator(device).manual_seed(2**40 + cfg.seed))  # never drawn by training
    say(f"model: {model.encoder.num_params():,} parameters in the encoder; {mcfg}")
    say(f"training on {device} x {world} process(es), amp={cfg.amp}, impl={mcfg.impl}, "
        f"compile={cfg.compile_model}, steps {start}..{cfg.steps}")

    def checkpoint(step):
        cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        rngs = [{"cpu": torch.get_rng_state(), "cuda": cuda_rng}]
        if world > 1:
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, rngs[0])
            rngs = gathered
        if rank == 0:
            save_checkpoint(cfg.out, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                      "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict(),
                                      "step": step, "rng": rngs, "model_config": asdict(mcfg),
                                      "train_config": asdict(cfg), "world_size": world})

    t_start = time.time()
    t_log, reached = time.time(), None
    metrics = {}
    loss_value = float("nan")
    last = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    # running counts stay on the device and are read only on the steps that log, evaluate or save:
    # reading one every step (loss.item(), float(norm)) would make a GPU wait for the host each step
    zero = torch.zeros((), dtype=torch.long, device=device)
    tokens, skipped, bad_step = zero.clone(), zero.clone(), zero.clone()  # bad_step: the first non-finite one
    bad = torch.zeros(2, device=device)  # its loss and gradient norm
    for step in range(start, last):
        # the batch is a function of (seed, rank, step) alone: resuming needs no data-loader state
        # and it is made on the device: no host-to-device copy per step
        gen = torch.Generator(device).manual_seed((cfg.seed * 1_000_003 + step) * 1009 + rank)
        x, y, lengths = reverse_batch(cfg.batch_size, cfg.min_len, cfg.max_len, mcfg.vocab_size, gen)
        with amp_ctx():
            logits = ddp(x, padding_mask(lengths, x.size(1)))
            # (B*T, vocab) against (B*T,); the loss in float32 even under autocast
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), ignore_index=PAD,
                                   label_smoothing=cfg.label_smoothing)
        norm, stepped = optimizer_step(loss, ddp, optimizer, scaler, cfg.clip)
        if cfg.amp != "fp16":  # fp16: the scaler skips non-finite steps itself
            # the norm is taken after DDP's all-reduce: another rank's NaN shows here on every rank
            values = torch.stack([loss.detach(), norm.detach().float()])
            new_bad = (bad_step == 0) & ~torch.isfinite(values).all()
            bad_step = torch.where(new_bad, step + 1, bad_step)
            bad = torch.where(new_bad, values, bad)
        skipped += ~stepped
        scheduler.step()
        tokens += lengths.sum() * world
        done = step + 1
        logging = done % cfg.log_every == 0 or done == last
        evaluating = done % cfg.eval_every == 0 or done == last  # rank 0 evaluates; every rank checks for NaN
        saving = cfg.out and (done % cfg.save_every == 0 or done == last)
        if not (logging or evaluating or saving):
            continue  # no host read on this step
        if bad_step.item():  # before any checkpoint: never save weights that a non-finite step updated
            bad_loss, bad_norm = bad.tolist()
            raise FloatingPointError(f"loss is {bad_loss} (gradient norm {bad_norm}) at step "
                                     f"{bad_step.item()}: "
                                     "stopping; no checkpoint is written from this state (lower --lr, or use "
                                     "--amp bf16/off)")
        loss_value = loss.item()
        if logging:
            acc = ((logits.argmax(-1) == y) & (y != PAD)).sum().item() / (y != PAD).sum().item()
            now, n_skipped = time.time(), skipped.item()
            lr = scheduler.get_last_lr()[0]
            say(f"step {done:5d} | loss {loss_value:.4f} | acc {acc:.3f} | lr {lr:.2e} | "
                f"grad norm {norm.item():.3f} | {tokens.item() / (now - t_log):,.0f} tok/s"
                + (f" | skipped {n_skipped}" if n_skipped else ""))
            t_log = now
            tokens.zero_()
        t_pause = time.time()  # evaluation and checkpoints are not training: tokens/s leaves them out
        if evaluating and rank == 0:
            metrics = evaluate(model, held_out, amp_ctx)
            if reached is None and metrics["accuracy"] >= 0.99:
                reached = (done, time.time() - t_start)
                say(f"held-out accuracy {metrics['accuracy']:.4f} >= 0.99 at step {done}, {reached[1]:.1f} s")
        if saving:
            checkpoint(done)
        t_log += time.time() - t_pause
    seconds = time.time() - t_start
    result = {"step": last, "loss": loss_value, "skipped_steps": skipped.item(), "seconds": seconds,
              "steps_to_99": reached and reached[0], "seconds_to_99": reached and reached[1]}
    if rank == 0:
        metrics = metrics or evaluate(model, held_out, amp_ctx)
        result.update(metrics)
        if cfg.heatmap:
            save_heatmap(model, held_out, cfg, cfg.heatmap)
            say(f"attention heatmap: {cfg.heatmap}")
    if world > 1:  # DDP keeps the ranks' parameters identical: check it, do not assume it
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(gathered, flat)
        result["max_param_diff_across_ranks"] = max((g - gathered[0]).abs().max().item() for g in gathered)
        say(f"max parameter difference across {world} ranks: {result['max_param_diff_across_ranks']:.3g}")
    if rank == 0:
        say(f"accuracy={result['accuracy']:.4f} (held-out tokens; {result['seq_accuracy']:.3f} of sequences "
            f"exact; loss {loss_value:.4f}; {last} steps in {seconds:.1f} s; skipped steps {skipped.item()}; "
            f"impl={mcfg.impl}, amp={cfg.amp})")
    return result


# -----------------------------------------------------------------------------
# Command line: python minitransformer.py --help


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a small Transformer encoder to reverse variable-length "
                                            "sequences; prints held-out accuracy. Runs under torchrun too.")
    for name, f in TrainConfig.__dataclass_fields__.items():
        flag = "--" + f.metadata.get("flag", name).replace("_", "-")
        if f.type is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.metadata["help"])
            continue
        kind = {int: int, float: float, str: str, int | None: int, str | None: str}[f.type]
        p.add_argument(flag, dest=name, type=kind, default=f.default, choices=f.metadata.get("choices"),
                       help=f.metadata["help"] + " (default: %(default)s)")
    args = p.parse_args(argv)
    if args.resume:  # the saved run's options become the defaults; one given here that differs: an error
        try:
            saved = load_checkpoint(args.resume)["train_config"]
        except (OSError, ValueError) as e:
            p.error(str(e))
        known = set(TrainConfig.__dataclass_fields__) - RESUME_FREE
        p.set_defaults(**{name: value for name, value in saved.items() if name in known})
        args = p.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as e:
        p.error(str(e))


# -----------------------------------------------------------------------------
# Input checks: a clear error that names the problem, kept out of the algorithms' way


def _check_attention_args(q, k, v, attn_mask, dropout_p, scale, window_size):
    """Validate the arguments every path takes; returns (attn_mask ready for mask_block, scale)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q, k, v must share (B, H), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.size(-1) != k.size(-1):
        raise ValueError(f"q and k must share the head dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    if k.size(-2) != v.size(-2):
        raise ValueError(f"k and v must share the key length, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    _check_window(window_size)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    return _check_mask(attn_mask, q, k), scale


def _check_mask(attn_mask, q, k):
    """attn_mask as it is (bool or float, on q's device, broadcasting to (B, H, Lq, Lk)), or a clear error."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be bool (True = may attend) or floating (added to the scores), got "
                        f"{attn_mask.dtype}; for a 0/1 integer mask pass mask.bool() (1 = may attend), for "
                        "nn.MultiheadAttention's convention (1 = ignore) pass ~mask.bool()")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} and q on {q.device}: move the mask once, where "
                         "it is "
                         "made (a copy in every call would make the host wait for the device)")
    target = (q.size(0), q.size(1), q.size(2), k.size(2))
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(m not in (1, t) for m, t in zip(reversed(shape), reversed(target))):
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to (B, H, Lq, Lk) = {target}")
    if attn_mask.dim() < 2:  # (Lk,) or (): one row for every query, as broadcasting reads it
        attn_mask = attn_mask.expand(1, k.size(2))
    return attn_mask


def _check_ring_args(q, k, v, scale, group, layout):
    """ring_attention's arguments, and shards of one shape on every rank; returns the scale."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError("ring_attention needs a process group: call torch.distributed.init_process_group "
                           "first (torchrun sets up its environment)")
    world, problem = torch.distributed.get_world_size(group), None
    try:  # every rank must refuse together: one that raised alone would leave the others waiting for it
        _, scale = _check_attention_args(q, k, v, None, 0.0, scale, None)
        if q.size(-2) != k.size(-2):
            raise ValueError(f"q and k shards must be as long, got {q.size(-2)} and {k.size(-2)}")
        _check_ring_layout(q.size(-2) * world, world, layout)
    except (TypeError, ValueError) as e:
        problem = str(e)
    seen = [None] * world  # a shard of another shape or dtype would make the ring exchange fail or hang
    shard = (tuple(q.shape), tuple(v.shape), str(q.dtype), layout)
    torch.distributed.all_gather_object(seen, (problem, shard), group=group)
    refused = [f"rank {i}: {p}" for i, (p, _) in enumerate(seen) if p]
    if refused:
        raise ValueError("ring_attention refused its input on " + "; ".join(refused))
    if len({shard for _, shard in seen}) > 1:
        raise ValueError("ring_attention needs shards of one shape, dtype and layout on every rank, got "
                         f"{[shard for _, shard in seen]}")
    return scale


def _check_ring_layout(L, world, layout):
    if layout not in RING_LAYOUTS:
        raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
    parts = world if layout == "contiguous" else 2 * world
    if L % parts:
        why = " (every zigzag shard has two chunks: an even length)" if layout == "zigzag" else ""
        raise ValueError(f"a {layout} layout cuts the sequence into {parts} equal parts: its length {L} is "
                         f"not a multiple of {parts}{why}")


def _check_window(window_size):
    if window_size is not None and (not isinstance(window_size, int) or window_size < 0):
        raise ValueError(f"window_size must be a non-negative int or None, got {window_size!r}")


def _chunks(chunk_size):
    cq, ck = (chunk_size, chunk_size) if isinstance(chunk_size, int) else chunk_size
    if cq < 1 or ck < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
    return cq, ck


def _check_range(t, lo, hi, name):
    """Raise unless lo <= t < hi everywhere, without a host-device sync: on a CPU the values are read
    (tolist: no device to wait for) and named; elsewhere, and under torch.compile, a device-side assert."""
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and not torch.compiler.is_compiling():
        t_min, t_max = (x.tolist() for x in torch.aminmax(t))
        if t_min < lo or t_max >= hi:
            raise ValueError(f"{name} must lie in [{lo}, {hi}), got min {t_min} max {t_max}")
    else:
        torch._assert_async(((t >= lo) & (t < hi)).all(), f"{name} must lie in [{lo}, {hi})")


def _check_batch_first(attn, torch_name, our_name):
    """from_torch converts weights, not layouts: a (T, B, C) module would silently disagree with ours."""
    if not attn.batch_first:
        raise ValueError(f"from_torch needs batch_first=True: this {torch_name} has batch_first=False and "
                         f"takes (T, B, C), while {our_name} takes (B, T, C), so the same tensor would give "
                         "different outputs. Build it with batch_first=True (its weights do not depend on "
                         "the flag), or transpose your inputs and set batch_first = True before converting.")


def _check_length(T, max_len):
    if T > max_len:
        raise ValueError(f"sequence length {T} exceeds max_len={max_len}")


if __name__ == "__main__":
    train(parse_args())
