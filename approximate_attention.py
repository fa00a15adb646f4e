"""
approximate_attention: the other ways out of attention's O(n^2) memory that the tutorials list, each
under its equation and its paper, beside exact attention (minitransformer.py):

- strided_attention: Child et al. 2019, "Generating Long Sequences with Sparse Transformers",
  https://arxiv.org/abs/1904.10509 (their strided pattern): exact attention over a local band and every
  stride-th key;
- linear_attention: Katharopoulos et al. 2020, "Transformers are RNNs", https://arxiv.org/abs/2006.16236:
  a kernel's feature map in place of the softmax (another similarity, not an estimate of exp);
- low_rank_attention: Wang et al. 2020, "Linformer", https://arxiv.org/abs/2006.04768: keys and values
  projected along the sequence to r positions;
- memory_compressed_attention: Liu et al. 2018, "Generating Wikipedia by Summarizing Long Sequences",
  https://arxiv.org/abs/1801.10198: keys and values compressed along the sequence by a strided
  convolution.

q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv), as the module's paths; the softmax's
scale is 1/sqrt(D). Only strided_attention is exact, under its pattern; the others compute another function,
and study.py measures how far from exact attention it lies (beside uniform_attention, which knows nothing of q
and k), with its memory and time. Strided and compressed attention are exact attention over the keys they keep,
so they run through the chunked path, in memory linear in the length (strided as two calls merged by their
log-sum-exp); linear attention holds per-head sums; low-rank its (Lq, r) scores. The modules own the learned
parts and stand in for an attention function (MultiHeadAttention's impl=, or use_in(encoder)).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import minitransformer as mt
import train


def strided_attention(q, k, v, stride, is_causal=False, keys=None):
    """Exact attention under the Sparse Transformer's strided pattern: query i sees the keys

        A_i = {j : |i - j| < s}  U  {j : s divides i - j}        s = stride, with is_causal only j <= i

    (the paper's is causal, its band i - s .. i one key wider). Self-attention; keys: a key-padding mask
    (B, 1, 1, L), True where a key exists. A query whose every key in A_i is hidden gets 0.

    Two exact attentions over disjoint sets of keys, each by the chunked path, merged by their log-sum-exp
    (merge): the band |i - j| < s, a window of s - 1 (window_size w: |i - j| <= w); and the keys j = i - c s,
    c != 0, from q, k, v regrouped by offset. With n = ceil(L / s) blocks of s positions, query i = b s + t is
    row b of offset t's sequence (B s, H, n, D); at L = 12, s = 4 the offsets' sequences are positions 0 4 8,
    1 5 9, 2 6 10 and 3 7 11, and the strided keys are plain attention inside each, to the other rows c != b
    (row c = b is the query's own position, j = i, which the band holds), c < b with is_causal. So about
    L (2s + n) of the L^2 scores, and with is_causal about half of them (the time falls less: README.md).
    Memory O(B H L D) and, with padding or where s does not divide L, a (B s, 1, n, n) bool mask of the keys
    each offset's rows see: L^2 / s bools per sequence.
    """
    B, H, L, D = q.shape
    if not (type(stride) is int and stride >= 1):
        raise ValueError(f"stride must be a positive int, got {stride!r}")
    if k.size(-2) != L:
        raise ValueError(f"strided attention is self-attention: Lq must equal Lk, got {L} and {k.size(-2)}")
    s = max(1, min(stride, L))  # a stride past L: the band holds every key, as it would
    n = -(-L // s)  # n blocks: L / s rounded up
    keep = None if keys is None else keys.expand(B, 1, 1, L)
    cq = max(1, min(L, 128))  # each block of cq query rows sees exactly one key block: keys i - s < j < i + s
    band, band_lse = mt.chunked_attention(q, k, v, keep, is_causal=is_causal, window_size=s - 1, return_lse=True,
                                          chunk_size=(cq, cq + (1 if is_causal else 2) * (s - 1)))

    def by_offset(x):  # (B, H, L, d) -> (B s, H, n, d): position b s + t is row b of offset t, a view
        return _blocks(x, s).permute(0, 3, 1, 2, 4).flatten(0, 1)
    visible = ~torch.eye(n, dtype=torch.bool, device=q.device)  # (n, n): row c = b, the key j = i, is the band's
    if keys is not None or n * s != L:  # keys hidden (padding, and the last block's positions past L): (B s, 1, n, n)
        real = F.pad(torch.ones(B, L, dtype=torch.bool, device=q.device) if keep is None else keep[:, 0, 0],
                     (0, n * s - L)).view(B, n, s).transpose(1, 2).reshape(B * s, 1, 1, n)
        visible = visible & real
    # B s H sequences of n rows: small blocks keep each block's (B s, H, 32, 32) scores small
    strided, strided_lse = mt.chunked_attention(by_offset(q), by_offset(k), by_offset(v), visible,
                                                is_causal=is_causal, return_lse=True, chunk_size=max(1, min(n, 32)))
    if strided.requires_grad:  # for the peak memory only (the same result without it): the backward copies its
        strided.register_hook(torch.Tensor.contiguous)  # gradient contiguous; copied here, the strided one is freed
    # merged in the layout (B, H, n, s, .) of _blocks, where both are views
    o2 = strided.unflatten(0, (B, s)).permute(0, 2, 3, 1, 4)  # (B s, H, n, Dv) -> (B, H, n, s, Dv)
    lse2 = strided_lse.unflatten(0, (B, s)).permute(0, 2, 3, 1)  # (B s, H, n) -> (B, H, n, s)
    return merge(_blocks(band, s), _blocks(band_lse, s), o2, lse2).flatten(2, 3)[:, :, :L]  # (B, H, L, Dv)


def merge(o1, lse1, o2, lse2):
    """Attention over two disjoint sets of keys from each one's output (B, H, L, Dv) and log-sum-exp (B, H, L):

        out = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2) = o1 + (o2 - o1) sigmoid(lse2 - lse1)

    exactly, in float32 or wider: lse = log sum_j e^(s_j) is the softmax's denominator, so e^lse1 o1 is the sum
    of e^(s_j) v_j over the first set, and dividing by e^lse1 + e^lse2 gives the softmax over both. A query that
    sees no key in either (lse -inf in both) gets 0."""
    a = torch.sigmoid((lse2 - lse1).nan_to_num(0.0))[..., None]  # -inf - (-inf) is NaN: both outputs 0, so is out
    return torch.lerp(o1.to(a.dtype), o2.to(a.dtype), a).to(o1.dtype)


def _blocks(x, size, value=0.0):
    """(B, H, L, ...) -> (B, H, ceil(L / size), size, ...): position b size + t at [b, t]; the last block padded
    with value where size does not divide L, else a view."""
    pad = -x.size(2) % size
    return (F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad), value=value) if pad else x).unflatten(2, (-1, size))


def linear_attention(q, k, v, is_causal=False, chunk=64):
    """Katharopoulos et al.: the softmax's exp(q_i . k_j) replaced by phi(q_i) . phi(k_j), phi(x) = elu(x) + 1, so
    that the sums over keys come out of the product, computed once for every query:

        out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j))

    per head a (D, Dv) sum instead of L x L scores: (phi(Q) phi(K)^T) V = phi(Q) (phi(K)^T V). With is_causal
    the sums run over j <= i: per block of `chunk` positions, the sums of the blocks before it (an exclusive
    prefix sum over blocks, (L/chunk, D, Dv)) and, inside it, the (chunk, chunk) products with their causal
    mask: memory linear in L. The sums grow with L, so 16-bit inputs are summed in float32 (float16 would
    overflow past a few thousand keys), with autocast off (it would take the products back to 16 bits). A query
    with no key (phi(k) = 0 for every key, as padding) gets 0.
    """
    with mt._no_autocast(q):
        return _linear_attention(q, k, v, is_causal, chunk)


def _linear_attention(q, k, v, is_causal, chunk):
    dtype = q.dtype
    q, k, v = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (q, k, v))
    fq, fk = F.elu(q) + 1, F.elu(k) + 1  # (B, H, L, D), positive
    if not is_causal:
        kv, z = fk.transpose(-2, -1) @ v, fk.sum(-2)[..., None]  # (B, H, D, Dv), (B, H, D, 1)
        den = fq @ z  # (B, H, L, 1)
        return ((fq @ kv) / den.masked_fill(den == 0, 1.0)).to(dtype)
    B, H, L, D = q.shape
    if k.size(-2) != L:
        raise ValueError(f"causal linear attention is self-attention: Lq must equal Lk, got {L} and {k.size(-2)}")
    # (B, H, L / c, c, d), padded only where c does not divide L; padded queries see the keys before them: never 0/0
    fq, fk, v = _blocks(fq, chunk, 1.0), _blocks(fk, chunk), _blocks(v, chunk)
    kv, z = fk.transpose(-2, -1) @ v, fk.sum(-2)[..., None]  # each block's sums: (B, H, n, D, Dv), (B, H, n, D, 1)
    kv, z = kv.cumsum(2).sub_(kv), z.cumsum(2).sub_(z)  # those of the blocks before: an exclusive prefix sum
    inside = (fq @ fk.transpose(-2, -1)).tril_()  # (B, H, n, c, c): keys j <= i of the query's own block
    num = (fq @ kv).add_(inside @ v)  # (B, H, n, c, Dv)
    den = (fq @ z).add_(inside.sum(-1, keepdim=True))  # (B, H, n, c, 1)
    return (num / den.masked_fill(den == 0, 1.0)).flatten(2, 3)[:, :, :L].to(dtype)


def low_rank_attention(q, k, v, E, F_):
    """Linformer: keys and values projected along the sequence by E and F (r, Lk), r << Lk:

        softmax(Q (E K)^T / sqrt(D)) (F V)          (Lq, r) scores instead of (Lq, Lk)

    Not causal: every projected key mixes all Lk positions, later ones too.
    """
    Lk = k.size(-2)
    if E.dim() != 2 or E.shape != F_.shape or E.size(-1) != Lk:
        raise ValueError(f"E and F must both be (r, Lk) = (r, {Lk}): they project the {Lk} keys, got "
                         f"{tuple(E.shape)} and {tuple(F_.shape)}")
    k, v = E @ k, F_ @ v  # (B, H, r, D), (B, H, r, Dv)
    scale = 1 / math.sqrt(q.size(-1)) if q.size(-1) else 1.0  # D = 0: every score 0, as in SDPA
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v


def memory_compressed_attention(q, k, v, weight_k, weight_v, keys=None, is_causal=False):
    """Liu et al.: keys and values compressed along the sequence by a strided convolution, kernel size =
    stride = ratio r (weights (D, D, r) and (Dv, Dv, r)), then exact attention over the compressed n =
    ceil(Lk / r) positions (the last window padded with zeros), by the chunked path in O(Lq) memory:

        K' = conv1d(K, W_k, stride=r),   V' = conv1d(V, W_v, stride=r),   softmax(Q K'^T / sqrt(D)) V'

    keys: a key-padding mask (B, 1, 1, Lk), True where a key exists: padded keys and values are zeroed before
    the convolution, a compressed position whose window holds no key is masked, and a query that sees none
    gets 0. is_causal (self-attention): query i sees position j once its whole window lies at or before it,
    j r + r - 1 <= i (Liu et al.'s code masks j r + r - 1 > i): query a r + t of window a sees j <= a if t is
    its window's last, else j <= a - 1 (at r = 4: queries 0-2 see nothing, 3-6 window 0, 7 windows 0 and 1). So
    two causal calls: the windows' last queries against K', V'; the other r - 1 queries of each window against
    K', V' shifted down one row (row j holds j - 1, row 0 a hidden zero key), where causality gives j <= a - 1,
    those r - 1 as query heads sharing one K/V head (enable_gqa), so that K', V' are not copied. Lq n scores.
    """
    B, H, Lk, D = k.shape
    ratio = weight_k.size(-1)
    for name, w, d in (("weight_k", weight_k, D), ("weight_v", weight_v, v.size(-1))):
        if w.dim() != 3 or w.shape != (d, d, ratio):
            raise ValueError(f"{name} must be (D, D, ratio) = ({d}, {d}, {ratio}), got {tuple(w.shape)}")
    if is_causal and q.size(-2) != Lk:
        raise ValueError(f"causal memory-compressed attention is self-attention: Lq must equal Lk, got "
                         f"{q.size(-2)} and {Lk}")

    def compress(x, w):  # the convolution as one product over each window: (B, H, n, r d) @ (r d, d) -> (B, H, n, d)
        return _blocks(x, ratio).flatten(-2) @ w.permute(2, 1, 0).flatten(0, 1).to(x.dtype)  # [t d + c, o] = w[o, c, t]
    seen = None
    if keys is not None:  # padded keys and values out of the windows
        keys = keys.transpose(-2, -1)  # (B, 1, Lk, 1)
        k, v = k.masked_fill(~keys, 0.0), v.masked_fill(~keys, 0.0)
        seen = _blocks(keys, ratio).any(-2).transpose(-2, -1)  # (B, 1, 1, n): the windows that hold a key
    with mt._no_autocast(q):  # in q's dtype: under autocast chunked_attention casts q, k, v alike
        k, v = compress(k, weight_k), compress(v, weight_v)
    if not is_causal:
        return mt.chunked_attention(q, k, v, seen)
    n = k.size(-2)
    q = _blocks(q, ratio)  # (B, H, n, r, D): query a r + t at [a, t]
    last = mt.chunked_attention(q[:, :, :, -1], k, v, seen, is_causal=True)  # t = r - 1: j <= a
    if ratio == 1 or n == 0:  # every window one query, its last; or no window
        return last
    later = lambda x: F.pad(x, (0, 0, 1, -1))  # noqa: E731 (B, H, n, d) shifted down a row: a zero row on top,
    seen_later = F.pad(  # the last cut; the same for the mask, False for that row
        torch.ones(1, 1, 1, n, dtype=torch.bool, device=q.device) if seen is None else seen, (1, -1))
    rest = mt.chunked_attention(q[:, :, :, :-1].transpose(2, 3).flatten(1, 2), later(k), later(v), seen_later,
                                is_causal=True, enable_gqa=True,  # a block stacks its r - 1 heads' rows: ~256
                                chunk_size=(max(1, 256 // (ratio - 1)), 512))  # (B, H (r - 1), n, Dv): j <= a - 1
    out = torch.cat([rest.unflatten(1, (H, ratio - 1)).transpose(2, 3), last[:, :, :, None]], dim=3)
    return out.flatten(2, 3)[:, :, :Lk]  # (B, H, n, r, Dv) -> (B, H, L, Dv)


# -----------------------------------------------------------------------------
# Modules: an attention function for MultiHeadAttention (impl=), owning what a strategy learns. They take a
# key-padding mask (B, 1, 1, Lk), True where a key exists, and refuse the rest of SDPA's arguments.


class _Approximate(nn.Module):
    """The plumbing every strategy shares: the arguments it refuses, and the padding it takes."""

    takes_causal = False

    def forward(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, window_size=None,
                cu_seqlens=None, alibi_slopes=None, enable_gqa=False):
        refused = {"dropout_p": dropout_p or None, "scale": scale, "window_size": window_size,
                   "cu_seqlens": cu_seqlens, "alibi_slopes": alibi_slopes, "enable_gqa": enable_gqa or None,
                   "is_causal": is_causal if is_causal and not self.takes_causal else None}
        if q.dim() != 4 or k.shape[:2] != q.shape[:2] or k.size(-1) != q.size(-1) or v.shape[:-1] != k.shape[:-1]:
            raise ValueError(f"{type(self).__name__} takes q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv), got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if any(x is not None for x in refused.values()):
            raise ValueError(f"{type(self).__name__} takes q, k, v, a key-padding attn_mask" +
                             (" and is_causal" if self.takes_causal else "") + ", got " +
                             ", ".join(f"{name}={x!r}" for name, x in refused.items() if x is not None))
        keys = None
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1:3] != (1, 1):
                raise ValueError(f"{type(self).__name__} takes a key-padding attn_mask only, bool (B, 1, 1, Lk), "
                                 f"got {attn_mask.dtype} {tuple(attn_mask.shape)}")
            keys = attn_mask[:, :, 0, :, None]  # (B, 1, Lk, 1)
        return self.attend(q, k, v, keys, is_causal)


class StridedAttention(_Approximate):
    """strided_attention with a stride (nothing learned); padded keys are hidden."""

    takes_causal = True

    def __init__(self, stride):
        super().__init__()
        self.stride = stride

    def attend(self, q, k, v, keys, is_causal):
        return strided_attention(q, k, v, self.stride, is_causal, None if keys is None else keys.transpose(-2, -1))


class LinearAttention(_Approximate):
    """linear_attention (nothing learned); a padded key is left out of the sums."""

    takes_causal = True

    def attend(self, q, k, v, keys, is_causal):
        if keys is not None:  # phi(k_j) = 0 and v_j = 0: out of both sums
            k, v = k.masked_fill(~keys, -math.inf), v.masked_fill(~keys, 0.0)  # elu(-inf) + 1 = 0
        return linear_attention(q, k, v, is_causal)


class LowRankAttention(_Approximate):
    """low_rank_attention with learned E and F (rank, max_len), shared by every head (the paper's headwise
    sharing), drawn normal at the scale of its reference code's xavier_uniform (gain 1/sqrt(2): std
    1/sqrt(max_len + rank)), so that E K and F V keep about the scale of K and V; the paper's theorem takes
    N(0, 1/rank), which scales them by sqrt(max_len / rank). A sequence of Lk <= max_len tokens takes the first
    Lk columns, and padded keys and values are zeroed before they are projected."""

    def __init__(self, rank, max_len):
        super().__init__()
        if not (type(rank) is int and type(max_len) is int and 1 <= rank and 1 <= max_len):
            raise ValueError(f"rank and max_len must be positive ints, got rank={rank!r}, max_len={max_len!r}")
        std = 1 / math.sqrt(max_len + rank)
        self.E, self.F = (nn.Parameter(torch.randn(rank, max_len) * std) for _ in range(2))

    def attend(self, q, k, v, keys, is_causal):
        Lk = k.size(-2)
        if Lk > self.E.size(1):
            raise ValueError(f"LowRankAttention projects at most max_len={self.E.size(1)} keys, got {Lk}")
        if keys is not None:
            k, v = k.masked_fill(~keys, 0.0), v.masked_fill(~keys, 0.0)
        return low_rank_attention(q, k, v, self.E[:, :Lk].to(q.dtype), self.F[:, :Lk].to(q.dtype))


class CompressedAttention(_Approximate):
    """memory_compressed_attention with learned convolutions, (head_dim, head_dim, ratio) for keys and for
    values, one pair shared by every head, started as averages of `ratio` neighbours; padding as the function's
    keys=, and is_causal."""

    takes_causal = True

    def __init__(self, head_dim, ratio):
        super().__init__()
        if not (type(ratio) is int and ratio >= 1):
            raise ValueError(f"ratio must be a positive int, got {ratio!r}")
        mean = torch.eye(head_dim)[:, :, None].expand(head_dim, head_dim, ratio) / ratio
        self.weight_k, self.weight_v = (nn.Parameter(mean.clone()) for _ in range(2))

    def attend(self, q, k, v, keys, is_causal):
        return memory_compressed_attention(q, k, v, self.weight_k.to(q.dtype), self.weight_v.to(q.dtype),
                                           None if keys is None else keys.transpose(-2, -1), is_causal)


def use_in(encoder, make):
    """encoder (minitransformer's Encoder), every layer's attention replaced by its own module make():
    e.g. use_in(Encoder(config), lambda: LowRankAttention(64, config.max_len))."""
    for layer in encoder.layers:
        layer.self_attn.impl = make()
    return encoder


def uniform_attention(q, k, v, keys=None, is_causal=False):
    """Every key a query sees weighted alike: the average of their values (softmax of scores all 0). What a
    strategy that knew nothing of q and k would give: the error it has is the floor a strategy must beat.
    keys: a key-padding mask (B, 1, 1, Lk), True where a key exists."""
    return mt.chunked_attention(torch.zeros_like(q), k, v, keys, is_causal=is_causal)


def error_of(strategy, q, k, v, is_causal=False, keys=None):
    """||strategy(q, k, v) - attention(q, k, v)|| / ||attention(q, k, v)||: how far a strategy lies from exact
    attention on these inputs (exact: minitransformer's chunked path, in the inputs' dtype), strategy called as
    an attention path, strategy(q, k, v, keys, is_causal=is_causal). keys: a key-padding mask (B, 1, 1, L) of
    self-attention, handed to both; the rows of padded tokens are left out of the norms."""
    with torch.no_grad():
        exact = mt.chunked_attention(q, k, v, keys, is_causal=is_causal)
        real = 1.0 if keys is None else keys[:, :, 0, :, None]  # (B, 1, L, 1): the rows of real tokens
        return (((strategy(q, k, v, keys, is_causal=is_causal) - exact) * real).norm() / (exact * real).norm()).item()


def trained_inputs(checkpoint, n, device):
    """q (1, H, n, D), k, v (1, H_kv, n, D) of the last layer of a trained TokenClassifier (a minitransformer
    checkpoint, its sinusoidal table recomputed for n positions), on n random tokens: what a strategy meets in a
    model, though far past the lengths it was trained on."""
    state = train.load_checkpoint(checkpoint)
    if state["model_config"].get("pos_encoding", "sinusoidal") != "sinusoidal":
        raise ValueError(f"trained_inputs reads q and k before any rotation or bias: a sinusoidal model only, "
                         f"got pos_encoding={state['model_config']['pos_encoding']!r}")
    model = train.TokenClassifier(mt.EncoderConfig(**{**state["model_config"], "max_len": n}))
    model.load_state_dict(state["model"])
    model.eval()  # no dropout on what is read
    attn, seen = model.encoder.layers[-1].self_attn, []
    attn.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(torch.randint(1, model.encoder.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)))
        C, kv = attn.d_model, attn.n_kv_heads * (attn.d_model // attn.n_heads)
        qkv = attn.qkv(seen[0]).split([C, kv, kv], dim=-1)  # (1, n, C), (1, n, H_kv * D) twice, as the module's
    return [t.unflatten(-1, (-1, C // attn.n_heads)).transpose(1, 2).to(device) for t in qkv]  # (1, H or H_kv, n, D)


# The scores each strategy computes for n queries (about half with causality; linear attention computes none):
# what the study's TFLOP/s counts
SCORES = {"strided": lambda n, s, causal: n * (2 * s - 2 + -(-n // s)) // (1 + causal),
          "linear": lambda n, setting, causal: 0, "lowrank": lambda n, r, causal: n * r,
          "compressed": lambda n, ratio, causal: n * -(-n // ratio) // (1 + causal)}
# The strategies by name, each built for sequences of up to max_len tokens and heads of head_dim, with its
# setting (stride, rank or ratio): what study.py measures and results/train/approximate.py trains.
STRATEGIES = {"strided": lambda setting, max_len, head_dim: StridedAttention(setting),
              "linear": lambda setting, max_len, head_dim: LinearAttention(),
              "lowrank": lambda setting, max_len, head_dim: LowRankAttention(setting, max_len),
              "compressed": lambda setting, max_len, head_dim: CompressedAttention(head_dim, setting)}
