"""
ring_attention: attention over a sequence cut across the ranks of a process group, built on
minitransformer's chunked path (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
https://arxiv.org/abs/2310.01889).

Each of P ranks holds a shard of the sequence: its queries Q_r and its keys and values K_r, V_r.
The K/V blocks travel around the ring: at step s rank r holds block j = (r - s) mod P, runs the
chunked forward's block update (minitransformer.attend_block) of its queries against it, and
meanwhile passes the block on to rank r + 1. Since the update carries the running row max m,
normaliser l and output o from one key block to the next, the ring is the chunked path
continued across devices: after P steps out = o / l, exactly as on one device.

The backward runs the chunked backward's block update (attend_block_backward) at every step,
against the final m and l, so that each step recomputes exactly its share of the probabilities.
dK and dV travel the ring with their block until they are home: each rank adds its own share
into the gradients that arrived, then sends them on, so that they travel while the next step
computes. Causal attention skips the steps that it masks entirely; with the zigzag layout (rank
r holds chunks r and 2P-1-r of 2P) every rank does the same work a step.

    torchrun --nproc_per_node=2 your_script.py   # a process group; then, on every rank:
    out = ring_attention(shard_sequence(q, rank, P), shard_sequence(k, rank, P), ...)
    hidden = ShardedEncoder(Encoder(config))(shard_sequence(idx, rank, P, dim=1))
"""

import functools
import struct

import torch
import torch.distributed as dist
import torch.nn as nn

import minitransformer as mt

RING_LAYOUTS = ("contiguous", "zigzag")


def shard_sequence(x, rank, world_size, layout="contiguous", dim=-2):
    """Rank `rank`'s shard of x along dim: positions [r*L/P, (r+1)*L/P) ("contiguous"), or chunks
    r and 2P-1-r of 2P, concatenated ("zigzag")."""
    _check_ring_layout(x.size(dim), world_size, layout)
    if not (type(rank) is int and 0 <= rank < world_size):  # -1: dist.get_rank(group) outside the group
        raise ValueError(f"rank must be one of 0 .. {world_size - 1}, got {rank!r}")
    if layout == "contiguous":
        return x.chunk(world_size, dim)[rank]
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


@torch.compiler.disable  # point-to-point messages have no place in a compiled graph
def ring_attention(q, k, v, *, is_causal=False, scale=None, group=None, layout="contiguous", chunk_size=None):
    """softmax(Q K^T * scale) V over a sequence sharded across the ranks of a process group.

    q (B, H, L/P, D), k (B, H, L/P, D), v (B, H, L/P, Dv): this rank's shard, in `layout`
    (shard_sequence); returns this rank's shard of the output, (B, H, L/P, Dv). group=None:
    the default process group. chunk_size: the blocks of every step, as the chunked path's (None:
    the device's default). Differentiable; float16 and bfloat16 follow the chunked path, and under
    autocast float32 inputs are computed in autocast's dtype, as by SDPA.

    Every call checks, with one small all-reduce, that all ranks pass shards of one shape, dtype
    and layout and the same is_causal and scale. On a CPU every rank then raises a ValueError
    that names the problem. On a GPU the verdict is a device-side assert, with no host sync: a
    mismatch ends the CUDA context on every rank, as a failed collective would. An error raised
    on one rank alone before this call (a bad token id, say) leaves the others waiting in it.
    """
    q, k, v, scale, (cq, ck) = _check_ring_args(q, k, v, is_causal, scale, group, layout, chunk_size)
    return _RingAttention.apply(q, k, v, is_causal, scale, group, layout, cq, ck)


# -----------------------------------------------------------------------------
# The ring's steps, forward and backward


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
        # zigzag: rank r holds chunks r and 2P-1-r of the 2P, rank j chunks j and 2P-1-j. For j < r both
        # our chunks lie after chunk j and before chunk 2P-1-j: all our queries see j's first half, none
        # its second. For j > r our chunk r lies before both of j's chunks, our chunk 2P-1-r after both:
        # only our second half sees, and it sees all of j's block.
        elif j < rank:
            steps.append([(whole, slice(0, half), False)])
        else:
            steps.append([(slice(half, n), whole, False)])
    return steps


def _ring_pass(tensors, group):
    """Start sending `tensors` to the next rank and receiving their like from the previous one:
    (the received tensors, the requests to wait on before reading them)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    nxt, prv = to_global((rank + 1) % world), to_global((rank - 1) % world)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests):
    """Wait for the ring's messages: the time spent here is the communication that compute did not hide
    (a profiler region, which study.py reads)."""
    with torch.profiler.record_function("ring_attention.wait"):
        for request in requests:
            request.wait()


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, group, layout, cq, ck):
        with mt._no_autocast(q):  # in the inputs' dtype: autocast would round the products to 16 bits
            out, m, log2_l = _ring_forward(q, k, v, is_causal, scale, group, layout, cq, ck)
        ctx.save_for_backward(q, k, v, out, m, log2_l)
        ctx.options = is_causal, scale, group, layout, cq, ck
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        with mt._no_autocast(dout):
            dq, dk, dv = _ring_backward(dout, *ctx.saved_tensors, *ctx.options)
        return dq, dk, dv, *[None] * 6


def _ring_forward(q, k, v, is_causal, scale, group, layout, cq, ck):
    """out (float32), row max m and log2(l), after P steps of the chunked forward's block update,
    continued from one visiting K/V block to the next, in blocks of cq queries and ck keys."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q = q.contiguous()
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    o = q.new_zeros(*q.shape[:-1], v.size(-1), dtype=acc_dtype)  # (B, H, n, Dv): the running output
    m = q.new_full((*q.shape[:-1], 1), torch.finfo(acc_dtype).min, dtype=acc_dtype)  # (B, H, n, 1)
    l = torch.zeros_like(m)
    kv = k.contiguous(), v.contiguous()  # (B, H, n, D), (B, H, n, Dv): the visiting block, first our own
    steps = _ring_steps(rank, world, q.size(-2), is_causal, layout)
    for s in range(world):
        # the next block travels while this one computes
        received, requests = _ring_pass(kv, group) if s < world - 1 else (None, [])
        for rows, cols, causal in steps[s]:
            q_s, k_s, v_s = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
            opts = mt.block_options(q_s, k_s, None, None, 0.0, causal, scale, None, ck)
            for block in mt._blocks(q_s.size(-2), cq):
                state = (t[:, :, rows][:, :, block] for t in (o, m, l))  # views: updated in place
                mt.attend_block(q_s, k_s, v_s, block, *state, opts)
        _wait(requests)
        kv = received or kv
    return o.div_(l), m, torch.log2(l)


def _ring_backward(dout, q, k, v, out, m, log2_l, is_causal, scale, group, layout, cq, ck):
    """dq, dk, dv: the chunked backward's block update at every step, against the final row statistics.
    The visiting block's dK and dV arrive from the previous rank while this step computes its own share;
    the share is added into them and they go on, to arrive home after the last step."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dout, q = dout.contiguous(), q.contiguous()
    kv = k.contiguous(), v.contiguous()  # what travels must be contiguous
    dq = torch.zeros_like(q, dtype=out.dtype)
    steps = _ring_steps(rank, world, q.size(-2), is_causal, layout)
    arrived, sent, dkv_requests = None, None, []  # the visiting block's dK, dV from the ranks before
    for s in range(world):
        received, requests = _ring_pass(kv, group) if s < world - 1 else (None, [])
        # this rank's share of the visiting block's dK, dV: (B, H, n, D), (B, H, n, Dv), float32 or wider;
        # a step that causality masks entirely (never step 0) adds nothing: what arrived goes on
        own = [torch.zeros_like(t, dtype=out.dtype) for t in kv] if steps[s] else arrived
        for rows, cols, causal in steps[s]:
            q_s, k_s, v_s = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
            grads = dq[:, :, rows], own[0][:, :, cols], own[1][:, :, cols]
            stats = out[:, :, rows], m[:, :, rows], log2_l[:, :, rows]  # of the whole result
            opts = mt.block_options(q_s, k_s, None, None, 0.0, causal, scale, None, ck)
            for block in mt._blocks(q_s.size(-2), cq):
                mt.attend_block_backward(dout[:, :, rows], q_s, k_s, v_s, *stats, block, *grads, None, opts)
        _wait(dkv_requests)  # the block's dK, dV from the ranks before: they travelled during this step
        if arrived is not None and steps[s]:
            own = [a.add_(share) for a, share in zip(arrived, own)]
        sent = own  # kept alive until its messages are done
        arrived, dkv_requests = _ring_pass(sent, group) if world > 1 else (sent, [])
        _wait(requests)
        kv = received or kv
    _wait(dkv_requests)  # home: this rank's own block's dK, dV
    return dq.mul_(scale).to(q.dtype), arrived[0].mul_(scale).to(k.dtype), arrived[1].to(v.dtype)


# -----------------------------------------------------------------------------
# An encoder on a sharded sequence


def ring_impl(group=None, layout="contiguous", chunk_size=None):
    """ring_attention as a MultiHeadAttention impl (minitransformer.attention's impl=): it refuses
    what the ring does not do, a mask, dropout, a window, packed documents and ALiBi, with a clear error."""
    return functools.partial(_ring_impl, group=group, layout=layout, chunk_size=chunk_size)


def _ring_impl(q, k, v, attn_mask, dropout_p, is_causal, scale, *, window_size=None, cu_seqlens=None, alibi_slopes=None,
               enable_gqa=False, group, layout, chunk_size):
    if any(x is not None for x in (attn_mask, window_size, cu_seqlens, alibi_slopes)) or dropout_p > 0.0 or enable_gqa:
        raise ValueError(f"ring attention takes no attn_mask, no dropout, no window_size, no cu_seqlens, no "
                         f"enable_gqa and no alibi_slopes, got attn_mask="
                         f"{None if attn_mask is None else tuple(attn_mask.shape)}, dropout_p={dropout_p}, "
                         f"window_size={window_size}, cu_seqlens={cu_seqlens}, alibi_slopes="
                         f"{None if alibi_slopes is None else tuple(alibi_slopes.shape)}, enable_gqa={enable_gqa}")
    return ring_attention(q, k, v, is_causal=is_causal, scale=scale, group=group, layout=layout,
                          chunk_size=chunk_size)


class ShardedEncoder(nn.Module):
    """A minitransformer Encoder run on this rank's shard of every sequence, its attention the ring.

    forward(idx, is_causal): idx (B, T/P), this rank's shard of token ids (shard_sequence, dim=1,
    in `layout`) -> this rank's shard of the hidden states, (B, T/P, d_model). Positions are the
    tokens' places in the whole sequence. The encoder's config needs dropout=0.0, window_size=None, n_kv_heads=None
    and a pos_encoding other than ALiBi. Its weights are the encoder's own, and its layers attend through the ring
    only inside this forward: the encoder itself still runs unsharded. So nothing may recompute a
    layer outside it (reentrant torch.utils.checkpoint would recompute it without the ring).
    chunk_size: the ring's blocks (ring_attention).
    """

    def __init__(self, encoder, group=None, layout="contiguous", chunk_size=None):
        super().__init__()
        c = encoder.config
        grouped = c.n_kv_heads not in (None, c.n_heads)
        if c.dropout or c.window_size is not None or c.pos_encoding == "alibi" or grouped:
            raise ValueError(f"the ring has no dropout, no window, no ALiBi and no grouped K/V heads: build the "
                             f"encoder with dropout=0.0, window_size=None, another pos_encoding and "
                             f"n_kv_heads=None, got dropout={c.dropout}, window_size={c.window_size}, "
                             f"pos_encoding={c.pos_encoding!r}, n_kv_heads={c.n_kv_heads}")
        if layout not in RING_LAYOUTS:
            raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
        self.encoder, self.group, self.layout, self.chunk_size = encoder, group, layout, chunk_size

    def attention_weights(self, *args, **kwargs):
        raise ValueError("attention_weights needs the whole sequence on one device: call it on the unsharded "
                         "encoder with the whole sequence (ShardedEncoder(...).encoder)")

    def forward(self, idx, is_causal=False):
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        T = idx.size(1) * world
        if T > self.encoder.config.max_len:
            raise ValueError(f"the whole sequence, {world} shards of {idx.size(1)} tokens, exceeds max_len="
                             f"{self.encoder.config.max_len}")
        positions = shard_sequence(torch.arange(T, device=idx.device), rank, world, self.layout, dim=0)
        attns = [layer.self_attn for layer in self.encoder.layers]
        impls = [attn.impl for attn in attns]
        try:
            for attn in attns:
                attn.impl = ring_impl(self.group, self.layout, self.chunk_size)
            return self.encoder(idx, is_causal=is_causal, positions=positions)
        finally:
            for attn, impl in zip(attns, impls):
                attn.impl = impl


# -----------------------------------------------------------------------------
# Input checks: every rank refuses together (one that raised alone would leave the others waiting)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_ring_args(q, k, v, is_causal, scale, group, layout, chunk_size=None):
    """(q, k, v, scale, blocks) checked on this rank, and the same shard shape, dtype, layout, is_causal and scale on
    every rank, compared by one all-reduce of a description of fixed length: on a CPU the verdict is read and
    named, on a GPU it is a device-side assert (no host sync)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention needs a process group: call torch.distributed.init_process_group "
                           "first (torchrun sets up its environment)")
    world, rank, problem = dist.get_world_size(group), dist.get_rank(group), None
    # (B, H, n, D, Dv, dtype, layout, is_causal, scale's bits in two halves): one length on every rank, and
    # whatever the error, this rank still takes part in the all-reduce below
    shard, blocks = [0] * 10, None
    try:
        heads = [t.size(1) for t in (q, k, v) if torch.is_tensor(t) and t.dim() == 4]
        if len(set(heads)) > 1:  # said here: _attention_args's message offers enable_gqa, which the ring lacks
            raise ValueError(f"the ring takes k and v with q's heads (no grouped-query attention): got {heads}")
        q, k, v, *_, scale = mt._attention_args(q, k, v, None, 0.0, False, scale, None)
        blocks = mt._chunks(mt.default_chunk_size(q.device) if chunk_size is None else chunk_size)
        if q.size(-2) != k.size(-2):
            raise ValueError(f"q and k shards must be as long, got {q.size(-2)} and {k.size(-2)}")
        _check_ring_layout(q.size(-2) * world, world, layout)
        bits = struct.unpack("<Q", struct.pack("<d", scale))[0]  # two halves of 32 bits: -x cannot overflow
        shard = [*q.shape, v.size(-1), _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1,
                 RING_LAYOUTS.index(layout), int(bool(is_causal)), bits >> 32, bits & 0xFFFFFFFF]
    except Exception as e:
        problem = str(e) if isinstance(e, (TypeError, ValueError)) else f"{type(e).__name__}: {e}"
    refused = [int(r == rank and problem is not None) for r in range(world)]
    # max(x) and max(-x) = -min(x): all ranks agree where they meet. Pinned and non-blocking: no sync
    device = q.device if torch.is_tensor(q) else torch.device("cpu")
    seen = torch.tensor(shard + [-x for x in shard] + refused, pin_memory=device.type == "cuda")
    seen = seen.to(device, non_blocking=True)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    n = len(shard)
    if device.type != "cpu":
        agree = (seen[:n] == -seen[n:2 * n]).all() & (seen[2 * n:] == 0).all()
        torch._assert_async(agree, "ring_attention: a rank refused its input, or the ranks disagree")
        if problem:
            raise ValueError(f"ring_attention refused its input on rank {rank}: {problem}")
        return q, k, v, scale, blocks
    seen = seen.tolist()
    if any(seen[2 * n:]):
        refusing = [r for r in range(world) if seen[2 * n + r]]
        raise ValueError("ring_attention refused its input on " + "; ".join(
            f"rank {r}: {problem if r == rank else 'see its own error'}" for r in refusing))
    if seen[:n] != [-x for x in seen[n:2 * n]]:
        low, high = [-x for x in seen[n:2 * n]], seen[:n]
        names = ("B", "H", "n", "D", "Dv", "dtype", "layout", "is_causal")
        shown = {"dtype": lambda i: _DTYPES[i] if 0 <= i < len(_DTYPES) else "another dtype",
                 "layout": RING_LAYOUTS.__getitem__}
        differ = [f"{name} from {shown.get(name, int)(a)} to {shown.get(name, int)(b)}"
                  for name, a, b in zip(names, low, high) if a != b]
        if low[8:] != high[8:]:
            differ.append("scale")
        raise ValueError("ring_attention needs shards of one shape, dtype and layout, and one is_causal and "
                         f"scale, on every rank; across the ranks these differ: {', '.join(differ)}")
    return q, k, v, scale, blocks


def _check_ring_layout(L, world, layout):
    if layout not in RING_LAYOUTS:
        raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
    parts = world if layout == "contiguous" else 2 * world
    if L % parts:
        why = " (every zigzag shard has two chunks: an even length)" if layout == "zigzag" else ""
        raise ValueError(f"a {layout} layout cuts the sequence into {parts} equal parts: its length {L} is "
                         f"not a multiple of {parts}{why}")
