"""
cost_model.py: what attention costs, counted before anything runs. The FLOPs of each path, the memory model
(the bytes a call holds at its peak above its inputs, term by term), the SDPA kernel a point would run, and
what `python study.py --predict` prints. study.py measures beside it and checks the model on every point; its
manual, with the measured checks: results/README.md.

B, H: batch and heads; n (Lq, Lk): the lengths; D, Dv: head sizes of q, k and of v; e: bytes of the inputs'
dtype; (cq, ck): the chunked path's blocks of queries and keys. Scores S = Q K^T * scale, weights P =
softmax(S), dP and dS their gradients; m, l: the chunked path's running row max and normaliser, o its output.

FLOPs (FlashAttention's count): 4 * B * H * pairs * D forward, pairs = n^2 (n^2 / 2 causal, or those inside a
window or the documents, for the paths that skip the rest); forward+backward 3.5x the forward.

Peak memory above q, k, v (and dout for fwd+bwd), the heaviest phase of a call (the forward, each step of
the block loops, the backward's end); accumulators and statistics float32:

    naive     fwd:     S and P, 2 * B*H*n^2 * e, and out; with a mask S, P and P with its masked rows zeroed,
                       3 * B*H*n^2 * e (out comes after them), and the bool mask, n^2 bytes
              fwd+bwd: P, dP, dS, 3 * B*H*n^2 * e, and out, dV (and a mask's n^2 bytes)
    chunked   fwd:     out; m, log2 l, 2 * B*H*n * 4; o, B*H*cq*Dv * 4; one block of scores, B*H*cq*ck * 4
              fwd+bwd: out; dQ, dK, dV in float32, B*H*n*(2D + Dv) * 4; m, log2 l and their gradients; two blocks
    flash     fwd:     out; logsumexp, B*H*n * 4; per CPU thread a (qs, ks) block with its rows (a mask: our bool
                       mask and SDPA's bias made of it, n^2 * (1 + e))
              fwd+bwd: out, logsumexp (a mask), dQ, dK, dV, dout in the kernel's layout, per thread a P and a
                       dP block; or the forward's peak where it weighs more (a CPU's AMX packs K and V there)
    ring      per rank (n / P each): o, m, l; K/V pairs in flight; fwd+bwd: out, dQ, and dK/dV pairs in float32

The forward makes every block of scores in one buffer; the backward in two, one for S_j (then P_j, dS_j), one for dP_j.
The terms of 16-bit inputs, ALiBi, documents, SDPA's CUDA kernels and the caching allocator are in each
function's docstring.
"""

import sys

import torch

import approximate_attention as approx
import minitransformer as mt

MIB = 2**20
SDPA_SERIES = {"sdpa-flash": "flash", "sdpa-efficient": "efficient", "sdpa-cudnn": "cudnn"}  # a fused kernel forced
# FlexAttention: minitransformer's on the chunked path, torch's own eager ((B, H, n, n) scores) and compiled
FLEX_PATHS = ("flex", "torch-flex", "torch-flex-compiled")


# -----------------------------------------------------------------------------
# FLOPs: the pairs each path computes


def attention_pairs(n, causal=False, window=None):
    """The (query, key) pairs of one (batch, head): n^2, halved by causality (FlashAttention's count: n^2 / 2,
    where with the diagonal there are n (n + 1) / 2: a causal window of w >= n counts n / 2 more); with a
    window w, exactly the pairs inside it: query i sees itself, min(i, w) keys before it and (not causal)
    min(n - 1 - i, w) after, which over the queries sum to m (m + 1) / 2 + (n - 1 - m) w on each side, m =
    min(n - 1, w) (-1 for n = 0): a closed form, so that a prediction at any n makes no (n,) tensor."""
    if window is None:
        return n * n / (2 if causal else 1)
    m = min(n - 1, window)
    side = m * (m + 1) // 2 + (n - 1 - m) * window  # the keys before each query, summed (after: as many)
    return float(n + side * (1 if causal else 2))


def attention_flops(B, H, n, D, causal=False, window=None, mode="fwd"):
    """FLOPs of attention as FlashAttention's benchmarks count them.

    Forward: two matmuls of 2 * n * n * D each per head: 4 * B * H * n^2 * D; causal
    halves it; forward+backward is 3.5x forward (backward = 2.5x forward: five
    matmuls instead of two). With a window, only the (i, j) pairs inside it count:
    pass window=None for a kernel that computes every pair and masks the rest.
    """
    return 4 * B * H * attention_pairs(n, causal, window) * D * (3.5 if mode == "fwd+bwd" else 1.0)


def packed_offsets(n, docs, seed=0):
    """cu_seqlens of `docs` documents packed to n: docs - 1 distinct cuts drawn uniformly (a fixed seed), so
    that the lengths are random, average n / docs, and vary widely, as real documents do."""
    if not 1 <= docs <= n:
        raise ValueError(f"cannot pack {docs} non-empty documents into n={n} tokens")
    cuts = torch.randperm(n - 1, generator=torch.Generator().manual_seed(seed))[:docs - 1] + 1
    return [0] + sorted(cuts.tolist()) + [n]


def chunk_sizes(point):
    """(query block, key block) of a chunked or ring point: its own, else the device's default."""
    return mt._chunks(point.get("chunk_size") or mt.default_chunk_size(point["device"].split(":")[0]))


def computed_pairs(point):
    """The pairs one (batch, head) of a series computes: chunked skips what causality and a window hide (counted
    as the visible pairs, FlashAttention's convention, though it computes the whole key blocks it visits), and
    with documents the key blocks outside them (counted as the blocks it visits, which cover the keys each
    block of queries sees; the flex paths count the blocks of their BlockMask's grid that meet those keys,
    torch's compiled one at its 128; study's BlockMask holds the documents and causality, no window); the
    fused kernels skip causal pairs only when causality reaches them as a flag; naive, torch's eager flex, and
    SDPA given a window or documents (only as an (n, n) mask), compute every pair and mask the rest."""
    p, n = point, point["n"]
    if p["path"] in approx.STRATEGIES:
        return approx.SCORES[p["path"]](n, p["setting"], p["causal"])
    if p.get("docs") and p["path"] in ("chunked", "flex", "torch-flex-compiled"):
        cq, ck = (128, 128) if p["path"] == "torch-flex-compiled" else chunk_sizes(p)
        grid = p["path"] != "chunked"  # the BlockMask's grid: whole blocks, where some query sees some key
        docs = torch.tensor(packed_offsets(n, p["docs"]))
        visibility = mt.Visibility(mt.named_rules(p["causal"], None if grid else p["window"], docs, L=n))
        pairs = 0
        for rows in mt._blocks(n, cq):  # the keys [lo, hi) that some query of rows sees: key_blocks with one
            for keys in visibility.key_blocks(rows, n, n):  # block of n keys gives them as one slice (or none)
                lo, hi = keys.start, keys.stop  # chunked's blocks cover them; the grid's blocks that meet them:
                lo, hi = (lo // ck * ck, min(n, -(-hi // ck) * ck)) if grid else (lo, hi)  # rounded out to ck
                pairs += (rows.stop - rows.start) * (hi - lo)
        return pairs
    dense = p["path"] in ("naive", "torch-flex") or (p["path"] not in ("chunked", "ring") and (
        p["window"] or p.get("docs") or str(p.get("alibi")) == "True"))
    return attention_pairs(n, p["causal"] and not dense, None if dense else p["window"])


def computed_flops(point):
    """FLOPs of the pairs a series computes: attention_flops of all n^2 pairs, scaled to computed_pairs."""
    p = point
    return attention_flops(p["B"], p["H"], p["n"], p["D"], mode=p["mode"]) * computed_pairs(p) / p["n"] ** 2


# -----------------------------------------------------------------------------
# The memory model: {term: bytes} of each path's heaviest phase (the notation of the docstring above; itemsize
# is e, and accumulators are float64 for float64). Sizes from the code (minitransformer.py, ring_attention.py)
# and, for SDPA's kernels, from what PyTorch's source allocates.


def _heaviest(*phases):
    """The phase whose live tensors weigh most: its {term: bytes}."""
    return max(phases, key=lambda terms: sum(terms.values()))


def naive_memory(B, H, Lq, Lk, D, Dv, itemsize, mode, masked):
    """naive_attention: its (Lq, Lk) matrices exist whole.

    fwd: S = Q K^T * scale and P = softmax(S) alive together, then out = P V. With a mask (causal,
    window, documents): the bool mask, and P with its fully masked rows zeroed, a third (Lq, Lk) matrix.
    fwd+bwd: P (saved for softmax's backward), dP = dO V^T and dS alive together, beside out and dV.
    """
    square, out = B * H * Lq * Lk * itemsize, B * H * Lq * Dv * itemsize
    if mode == "fwd+bwd":
        terms = {"P, dP, dS (B, H, Lq, Lk)": 3 * square, "out, dV (B, H, L, Dv)": out + B * H * Lk * Dv * itemsize}
    elif masked:  # out = P V comes after, when S and the first P are gone
        terms = {"S, P, P with masked rows zeroed (B, H, Lq, Lk)": 3 * square}
    else:
        terms = {"S, P (B, H, Lq, Lk)": 2 * square, "out (B, H, Lq, Dv)": out}
    return {**terms, "mask (Lq, Lk) bool": Lq * Lk} if masked else terms


# CPython 3.11 on hands a call's arguments over to the callee, which frees one when it rebinds its name
# (_matmul's a, b = a.float(), b.float()); before 3.11 the caller keeps it alive until the call returns.
_ARGS_HANDED_OVER = sys.version_info >= (3, 11)


def _block_memory(B, H, cq, ck, D, Dv, itemsize, mode, keys, copies, alibi=0, Hkv=None):
    """The blocks of one block of query rows at its heaviest moment (attend_block, attend_block_backward).

    (cq, ck) blocks of scores in float32: the forward makes S_j and P_j in one buffer, reused for every j; the
    backward makes S_j (then P_j, and dS_j in place) and dP_j in two, reused alike. 16-bit inputs add blocks
    rounded to their dtype (P_j and dS_j, for the products), which a CPU multiplies as float32 copies
    (`copies`: _matmul), beside float32 copies of the operands (rows of q or dout, key blocks of k or v) and
    the products; the rounded dS_j lives until its name is rebound, so with several key blocks step j - 1's is
    still alive while step j computes. Each phase: (float32 blocks, 16-bit blocks, bytes of copies and
    products). alibi: ALiBi's bias, added to S_j in place from the distances (cq, ck), made beside it after the
    copies its product took. Hkv: the heads of K and V (grouped-query attention), which key blocks have. keys:
    how many keys a block of query rows visits; where they end inside the second key block, step j's 16-bit
    blocks, copies and products are that narrow (and step 0, with no step j - 1 beside it, is counted apart).
    """
    several = keys > ck
    acc = max(itemsize, 4)
    block, low = B * H * cq * ck * acc, B * H * cq * ck * itemsize * (itemsize < 4)
    rows, cols = B * H * cq * acc, B * (Hkv or H) * ck * acc  # bytes of one column of a row block, a key block
    kept = 0 if _ARGS_HANDED_OVER else 1  # a 16-bit argument of _matmul still alive during its product
    if mode == "fwd" and copies:  # S_j = Q K_j^T from float32 copies; P_j V_j: P_j low and back in float32
        phases = [(1, 0, rows * D + cols * D), (2, 1, cols * Dv)]
    elif mode == "fwd":  # P_j V_j, P_j low if 16-bit, its product added to o (CUDA: made first)
        phases = [(1, 1, rows * Dv * (itemsize < 4))]
    else:  # S_j = Q K_j^T, dP_j = dO V_j^T, P_j^T dO (P_j rounded), dS_j rounded, dS_j K_j and dS_j^T Q
        def step(now, then):  # step j's blocks `now` key blocks wide, beside `then` (0 or 1) of step j - 1's dS_j
            if not copies:  # P_j^T dO beside P_j rounded; dS_j rounded; dS_j K_j or dS_j^T Q, the larger
                return [(2, then + now, cols * Dv * now), (2, then + now, 0), (2, now, max(rows * D, cols * D * now))]
            return [(2, then, rows * D + cols * D * now), (2, then, rows * Dv + cols * Dv * now),
                    (2 + now, then + now, rows * Dv), (2 + now, then + kept * now, rows * Dv + cols * Dv * now),
                    (2, then + now, 0), (2 + now, now, rows * D + cols * D * now)]
        phases = step(1, 0) + (step(min(ck, keys - ck) / ck, 1) if several else [])  # step 0, then the second
    if alibi:  # S_j (and dP_j, beside step j - 1's dS_j, backward)
        bwd = mode != "fwd"
        phases.append((1 + bwd, several * bwd, cq * ck * acc))
    blocks, lows, extra = max(phases, key=lambda ph: ph[0] * block + ph[1] * low + ph[2])
    terms = {f"{blocks:.3g} blocks of scores (B, H, cq, ck) float32": blocks * block,
             "products (and float32 copies of 16-bit operands), ALiBi's distances": extra}
    if low:
        terms[f"{lows} blocks in the inputs' dtype"] = lows * low
    return terms


def chunked_memory(B, H, Lq, Lk, D, Dv, itemsize, mode, cq, ck, docs=False, copies=False, alibi=0, Hkv=None):
    """chunked_attention: linear in the lengths, plus a few (cq, ck) blocks (_block_memory).

    fwd: out, per query m and log2(l), and the running output o of one block of query rows. fwd+bwd:
    out, dQ, dK, dV accumulated in float32, m and log2(l) with the zero gradients autograd gives them;
    16-bit inputs end with dQ, dK, dV in float32 and rounded to their dtype at once. Documents add
    their ids and positions (documents()). copies: 16-bit products through float32 copies (CPU). alibi:
    ALiBi's bias, added block by block (_block_memory). Hkv: K and V's heads (grouped-query attention): dK, dV
    have as many, and a block of query rows (and of dout) is copied to stack each K/V head's queries.
    """
    acc, cq, ck, Hkv = max(itemsize, 4), min(cq, Lq), min(ck, Lk), Hkv or H
    stats = B * H * Lq * acc
    terms = {"out (B, H, Lq, Dv)": B * H * Lq * Dv * itemsize}
    if docs:
        terms["document ids and positions (2, L) int64"] = 2 * Lq * 8
    if Hkv != H and cq < Lq:  # _per_kv_head's copies of a block of rows
        terms["q (and dout) rows of a block, per K/V head"] = B * H * cq * (D + Dv * (mode != "fwd")) * itemsize
    blocks = _block_memory(B, H, cq, ck, D, Dv, itemsize, mode, Lk, copies, alibi, Hkv)
    if mode == "fwd":
        return {**terms, "m, log2(l) (B, H, Lq)": 2 * stats, "o (B, H, cq, Dv) float32": B * H * cq * Dv * acc,
                **blocks}
    grads = B * (H * Lq * D + Hkv * Lk * (D + Dv))
    terms.update({"dQ, dK, dV float32": grads * acc, "m, log2(l) and their gradients (B, H, Lq)": 4 * stats})
    end = {**terms, "dQ, dK, dV in the inputs' dtype": grads * itemsize} if itemsize < 4 else {}
    return _heaviest({**terms, **blocks}, end)


def _r(x, multiple):
    return -(-x // multiple) * multiple


def flash_memory(B, H, Lq, Lk, D, Dv, itemsize, mode, kernel, masked, threads=1, alibi=0, packs=False, Hkv=None):
    """SDPA's fused kernels (kernel: "cpu", or on CUDA "flash", "efficient", "cudnn"), from what their
    source allocates (PyTorch's aten/src/ATen/native/, transformers/ and cpu/):

    - every kernel: out, a logsumexp (B, H, Lq) float32, and in the backward dQ, dK, dV; a window or
      documents reach SDPA as our bool (Lq, Lk) mask, which SDPA converts to a bias in the inputs' dtype.
    - CPU (cpu/FlashAttentionKernel.cpp): `threads` buffers of a (qs, ks) block of scores with its row
      max, sum and output rows, float32 (qs = 32, 64 or 256 query rows as Lq grows, ks = 512 keys), and
      for 16-bit inputs the block in their dtype; the backward holds a P and a dP block per thread and
      copies dout into the (B, Lq, H, Dv) layout it computes in. `packs`: a CPU whose AMX computes the
      dtype (bfloat16 from Sapphire Rapids on, float16 from Granite Rapids on) packs K and V for it in the
      forward when Lq and Lk reach 64 (measured on an Intel Xeon with AMX-BF16): copies of their size, and per thread a
      (ks, Dv) block in the dtype. The 16-bit backward's scratch there (some hundred KiB a thread) is not modelled.
    - CUDA, read from the source and not yet checked on a GPU. flash (cuda/flash_attn/flash_api.cpp):
      the backward copies dout into its layout and accumulates dQ in float32 (B, Lq rounded to 128, H, D
      rounded to 32) beside softmax_d. efficient (cuda/mem_eff_attention): the logsumexp padded to 32
      rows (training only), a float32 output accumulator for 16-bit outputs with D > 128; the backward
      copies dout and holds delta (B, H, Lq) and a float32 workspace for dQ, about (B, H, Lq, D) rounded
      to its blocks. cuDNN (cudnn/MHA.cpp): softmax statistics (B, H, Lq) float32 (training only), and a
      workspace of cuDNN's own choice that is not modelled.
    - alibi (the heads of ALiBi's slopes): SDPA gets our float32 bias (alibi, Lq, Lk) instead of a mask it
      converts; the forward builds it beside the (Lq, Lk) distances (and a bool mask, masked). On CUDA the
      bias is also copied in the inputs' dtype, which is not modelled.
    """
    out, lse, low = B * H * Lq * Dv * itemsize, B * H * Lq * 4, itemsize < 4
    Hkv = Hkv or H  # K and V's heads: the CPU kernel takes grouped-query attention without repeating them
    grads = {"dQ, dK, dV": B * (H * Lq * D + Hkv * Lk * (D + Dv)) * itemsize, "dout in the kernel's layout": out}
    mask = {"mask as a bias (Lq, Lk)": Lq * Lk * itemsize} if masked else {}
    if alibi:
        mask = {"ALiBi's bias (alibi, Lq, Lk) float32": alibi * Lq * Lk * max(itemsize, 4)}
    if kernel == "cpu":
        qs, ks = min(Lq, 32 if Lq < 192 else 64 if Lq < 768 else 256), min(Lk, 512)
        per_thread = (qs * ks + 2 * qs + qs * Dv) * 4 + low * qs * ks * itemsize
        fwd = {"out (B, H, Lq, Dv)": out, "logsumexp (B, H, Lq) float32": lse, **mask,
               "per-thread blocks (qs, ks) and rows": threads * per_thread}
        if packs and min(Lq, Lk) >= 64:
            packed = B * Hkv * Lk * (D + Dv) + threads * ks * Dv
            fwd["K, V packed for AMX, and a (ks, Dv) block per thread"] = packed * itemsize
        bwd = {"out (B, H, Lq, Dv)": out, "logsumexp (B, H, Lq) float32": lse, **mask, **grads,
               "per-thread P and dP blocks": threads * 2 * qs * ks * (4 + low * itemsize)}
    else:
        training = mode == "fwd+bwd"
        stats = {"flash": lse, "efficient": B * H * _r(Lq, 32) * 4 * training, "cudnn": lse * training}[kernel]
        fwd = {"out (B, H, Lq, Dv)": out, "logsumexp (B, H, Lq) float32": stats, **mask}
        if kernel == "efficient" and low and Dv > 128:
            fwd["output accumulator float32"] = B * H * Lq * Dv * 4
        bwd = {**fwd, **grads}
        if kernel == "flash":
            bwd["dQ accumulator float32, softmax_d"] = B * _r(Lq, 128) * H * (_r(D, 32) + 1) * 4
        elif kernel == "efficient":
            block = 64 if D <= 64 else 128
            bwd["delta, dQ workspace float32"] = B * H * (Lq + _r(Lq, block) * _r(D, block)) * 4
    if masked and not alibi:
        fwd["mask (Lq, Lk) bool"] = Lq * Lk
    if alibi:  # the bias being built, beside its distances
        fwd = _heaviest(fwd, {**mask, "distances (Lq, Lk) and a bool mask": Lq * Lk * (max(itemsize, 4) + masked)})
    return fwd if mode == "fwd" else _heaviest(fwd, bwd)


def ring_memory(B, H, n, D, Dv, itemsize, mode, P, cq, ck, copies=False):
    """ring_attention on one of P ranks, each holding n / P of the queries, keys and values.

    K/V blocks: the one being computed on and the one arriving, and while a pass starts also the one
    the previous step's send request still references (at most P - 1 pairs; the rank's own inputs not
    counted). fwd: the running output o, m and l, and the blocks of scores (_block_memory). fwd+bwd: out
    (float32, saved), dQ, m and log2(l); dK/dV pairs in float32: this step's share, those that arrived
    and those being sent, and while a pass starts also the share before, which views of it still hold.
    """
    acc, shard = max(itemsize, 4), n // P
    cq, ck = min(cq, shard), min(ck, shard)
    kv, dkv = B * H * shard * (D + Dv) * itemsize, B * H * shard * (D + Dv) * acc
    base = {"o or out (B, H, n/P, Dv) float32": B * H * shard * Dv * acc, "m, l (B, H, n/P)": 2 * B * H * shard * acc}
    blocks = _block_memory(B, H, cq, ck, D, Dv, itemsize, mode, shard, copies)
    if mode == "fwd":
        passing = {**base, "K, V blocks": min(P - 1, 3) * kv}
        return _heaviest(passing, {**base, "K, V blocks": min(P - 1, 2) * kv, **blocks})
    base["dQ (B, H, n/P, D) float32"] = B * H * shard * D * acc
    if itemsize < 4:
        base["out in the inputs' dtype"] = B * H * shard * Dv * itemsize
    passing = {**base, "K, V blocks": min(P - 1, 3) * kv, "dK, dV blocks float32": 4 * dkv}
    return _heaviest(passing, {**base, "K, V blocks": min(P - 1, 2) * kv, "dK, dV blocks float32": 3 * dkv, **blocks})


def amx_packs(dtype):
    """Whether this machine's CPU has AMX for dtype, with which SDPA's CPU kernel packs K and V (flash_memory)."""
    check = {"bfloat16": "_is_amx_tile_supported", "float16": "_is_amx_fp16_supported"}.get(dtype)
    return bool(check and getattr(torch.cpu, check, lambda: False)())


def _masked(point):
    """Whether a point's mask reaches the paths as an (n, n) tensor: documents, causality for naive (and beside
    ALiBi's bias), or a window, which builds its mask (with causality in it) unless it hides nothing (mask_block)."""
    p = point
    window = p["window"] is not None and (p["window"] < p["n"] - 1 or p["causal"])
    return bool(p.get("docs") or window or (p["causal"] and (p["path"] == "naive" or str(p.get("alibi")) == "True")))


def sdpa_kernel(point):
    """The fused kernel a flash point runs: the one measured or forced, "cpu" on a CPU, else a guess at
    what SDPA picks on CUDA (FlashAttention takes no mask, 16-bit only, D <= 256; SDPA's own choice also
    depends on the GPU and the torch version). None where no model applies: the math kernel, a forced
    FlashAttention kernel in float32, or a kernel torch could not name."""
    p = point
    if p["path"] in SDPA_SERIES:
        forced = SDPA_SERIES[p["path"]]
        return None if forced == "flash" and p["dtype"] == "float32" else forced
    if p.get("kernel"):
        return {"flash": "cpu" if p["device"].startswith("cpu") else "flash"}.get(
            p["kernel"], p["kernel"] if p["kernel"] in ("efficient", "cudnn") else None)
    if p["device"].startswith("cpu"):
        return "cpu"
    return "efficient" if _masked(p) or p["dtype"] == "float32" or p["D"] > 256 else "flash"


def predicted_terms(point, threads=None):
    """{term: bytes} of a point's peak above its inputs, or None where no model applies (sdpa_kernel). A
    study point: path, device, dtype, mode, B, H, n, D, causal, window, docs, world (and the measured
    kernel, if any). threads: a CPU's (default: this process's). On CUDA each term is rounded up to the
    caching allocator's 512-byte blocks; one over 1 MiB may also be counted whole when the allocator does
    not split it, up to 1 MiB more per block, which is not predicted."""
    p, cpu = point, point["device"].startswith("cpu")
    B, H, n, D, mode = p["B"], p["H"], p["n"], p["D"], p["mode"]
    Hkv = int(p.get("kv_heads") or H)  # grouped-query attention: fewer K/V heads
    alibi = H if str(p.get("alibi")) == "True" else 0  # its slopes: one per head
    itemsize = getattr(torch, p["dtype"]).itemsize
    copies = itemsize < 4 and (cpu or not mt._BMM_OUT_DTYPE)  # 16-bit products through float32 copies
    if p["path"] == "naive":
        terms = naive_memory(B, H, n, n, D, D, itemsize, mode, _masked(p))
    elif p["path"] == "chunked":
        terms = chunked_memory(B, H, n, n, D, D, itemsize, mode, *chunk_sizes(p), bool(p.get("docs")), copies, alibi,
                               Hkv)
    elif p["path"] == "ring":  # its blocks are always the device's default
        terms = ring_memory(B, H, n, D, D, itemsize, mode, p["world"], *chunk_sizes({**p, "chunk_size": None}), copies)
    elif p["path"] in ("flash", *SDPA_SERIES) and (kernel := sdpa_kernel(p)) and (cpu or Hkv == H):  # CUDA GQA: not
        terms = flash_memory(B, H, n, n, D, D, itemsize, mode, kernel, _masked(p), threads or torch.get_num_threads(),
                             alibi, cpu and amx_packs(p["dtype"]), Hkv)  # modelled (its kernels' copies unread)
    else:
        return None
    return terms if cpu else {name: _r(size, 512) for name, size in terms.items()}


def input_bytes(point):
    """q, k, v, and dout for fwd+bwd: what a point holds before its call (a ring's rank: its shard; k and v have
    kv_heads heads)."""
    p = point
    heads = (2 if p["mode"] == "fwd+bwd" else 1) * p["H"] + 2 * int(p.get("kv_heads") or p["H"])
    return heads * p["B"] * (p["n"] // p.get("world", 1)) * p["D"] * getattr(torch, p["dtype"]).itemsize


CHECKED_MIB, BAND = 16.0, (0.85, 1.15)  # the model holds within BAND at every CPU point of CHECKED_MIB or more


def predicted_mib(point, threads=None):
    """The model's peak above the inputs in MiB, or None where no model applies."""
    terms = predicted_terms(point, threads)
    return None if terms is None else sum(terms.values()) / MIB


# -----------------------------------------------------------------------------
# What `python study.py --predict` prints


def _size(nbytes):
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / MIB:.1f} MiB"


def predict(points, device, dtype, budget, rate=None, causal=False):
    """What `python study.py --predict` prints: for every point (a series, mode and n) the model's peak, its
    FLOPs, whether it fits `budget` GiB (the peak and the inputs) and, given `rate` (TFLOP/s: the matmul rate
    of this machine's `device`, measured), a time lower bound: the matmuls the path does at that rate (naive's
    backward recomputes nothing: 3x its forward, not 3.5x). On a GPU here torch names SDPA's kernel itself."""
    bound = (f"time >= the path's matmuls at {rate:.3f} TFLOP/s, this {device}'s {dtype} rate measured now (FLOPs: "
             "FlashAttention's count, fwd+bwd 3.5x fwd; naive's backward does 3x)" if rate else
             f"no time bound: no {device} here to measure")
    ask = device == "cuda" and torch.cuda.is_available()  # a GPU here: torch names SDPA's kernel itself
    kernels = ("SDPA's kernel: the CPU's fused kernel" if device == "cpu" else
               "SDPA's kernel: torch's own choice on inputs of each shape" if ask else
               "SDPA's kernel assumed (no GPU here to ask torch): FlashAttention without a mask in 16 bits, else "
               "the efficient kernel; on sm90 or newer torch 2.11 and later may choose cuDNN, whose workspace the "
               "model does not cover")
    first = points[0]
    print(f"predicted for {device} (the memory model: nothing measured), {dtype}, H={first['H']}, D={first['D']}"
          f"{', causal' if causal else ''}: peak above the inputs "
          f"q, k, v (and dout for fwd+bwd); fits: with the inputs, within "
          f"{f'{budget:g} GiB' if budget else 'no budget given'}; {bound}; {kernels}")
    for p in points:
        line = f"{p['series']:<17} {p['mode']:<7} n={p['n']:<6} B={p['B']:<3}"
        kernel = ""
        if p["path"] in ("flash", *SDPA_SERIES):
            asked = ask and _asked_kernel(p)
            p = {**p, "kernel": asked} if asked else p
            name = sdpa_kernel(p)
            kernel = (f"; kernel {name}" + (" (assumed)" if p["path"] == "flash" and not asked and device == "cuda"
                                             else "") + (", its workspace not modelled" if name == "cudnn" else ""))
        if (terms := predicted_terms(p)) is None:
            gqa = int(p.get("kv_heads") or p["H"]) != p["H"]  # only CUDA's kernels, unread, are left out
            print(f"{line} not modelled: " + ("grouped K/V heads on CUDA, whose kernels' copies it leaves out" if gqa
                                              else "no kernel that the model covers can run it"))
            continue
        peak, largest, flops = sum(terms.values()), max(terms, key=terms.get), computed_flops(p)
        fits = "-" if not budget else "yes" if peak + input_bytes(p) <= budget * 2**30 else "no"
        time_ = ""
        if rate:  # a ring's ranks share this CPU, or take one GPU each
            ways = 1 if device == "cpu" else min(p["world"], torch.cuda.device_count())
            matmuls = flops * (3 / 3.5 if p["path"] == "naive" and p["mode"] == "fwd+bwd" else 1)
            time_ = f"  time >= {matmuls / ways / rate / 1e12:.3g} s"
        print(f"{line} peak {_size(peak):>10}  fits {fits:<3}  {flops:9.3g} FLOPs{time_}  "
              f"largest: {largest} ({terms[largest] / peak:.0%}){kernel}")


def _asked_kernel(point):
    """The kernel torch picks for a flash point on this GPU, asked on empty inputs of its shape (None: no room)."""
    p, dtype = point, getattr(torch, point["dtype"])
    try:
        q, k, v = (torch.empty(p["B"], p["H"], p["n"], p["D"], device="cuda", dtype=dtype) for _ in range(3))
        if p["path"] in SDPA_SERIES:
            with torch.nn.attention.sdpa_kernel(mt._KERNELS[SDPA_SERIES[p["path"]]]):
                return mt._chosen_kernel(q, k, v, None, 0.0, p["causal"], None)
        cu_seqlens = torch.tensor(packed_offsets(p["n"], p["docs"])) if p.get("docs") else None
        alibi = mt.alibi_slopes(p["H"]).cuda() if str(p.get("alibi")) == "True" else None
        return mt.sdpa_kernel_name(q, k, v, is_causal=p["causal"], window_size=p["window"], cu_seqlens=cu_seqlens,
                                   alibi_slopes=alibi)
    except torch.cuda.OutOfMemoryError:
        return None
    except RuntimeError:  # no enabled kernel takes these inputs
        return "math"
    finally:
        torch.cuda.empty_cache()
