"""
Training minitransformer's encoder on a task that needs attention: reversing sequences of varying
length (reverse_batch), with mixed precision (autocast, and a gradient scaler for float16), warm-up and
cosine decay, gradient clipping after unscaling, atomic checkpoints that resume exactly, and data
parallelism under torchrun.

    python minitransformer.py --help          # the command line; python train.py runs the same
    torchrun --standalone --nproc_per_node=2 minitransformer.py --steps 300 --device cpu

Where each idea lives: mixed precision in _train (autocast) and optimizer_step (GradScaler, unscale, clip);
warm-up in lr_factor; label smoothing in TrainConfig.label_smoothing; the encoder and all of attention in
minitransformer.py.

Reference: Micikevicius et al. 2018, "Mixed Precision Training": https://arxiv.org/abs/1710.03740
"""

import argparse
import contextlib
import functools
import gc
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from minitransformer import IMPLS, POS_ENCODINGS, Encoder, EncoderConfig, padding_mask


PAD = 0  # token id of padding; real tokens are 1 .. vocab_size - 1


class TokenClassifier(nn.Module):
    """The task's model: minitransformer's Encoder plus a linear head, logits (B, T, vocab_size) for one
    output token per position."""

    def __init__(self, config):
        super().__init__()
        self.encoder = Encoder(config)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, idx, attn_mask=None, cu_seqlens=None):
        return self.head(self.encoder(idx, attn_mask, cu_seqlens=cu_seqlens))


def reverse_batch(B, min_len, max_len, vocab_size, gen):
    """A batch of the reversal task: x = t_1 .. t_L, y = t_L .. t_1, each padded to max_len.

    L varies per sequence, so output i must read input L - 1 - i, a position that depends on the sequence's
    own length: impossible without attention across positions, and the padding mask matters (a padded key
    would shift the answer). Returns x, y (B, max_len) and the lengths (B,), made on the generator's device.
    """
    lengths = torch.randint(min_len, max_len + 1, (B,), generator=gen, device=gen.device)
    x = torch.randint(1, vocab_size, (B, max_len), generator=gen, device=gen.device)
    pos = torch.arange(max_len, device=gen.device)
    src = (lengths[:, None] - 1 - pos[None, :]).clamp(min=0)  # (B, T): input position output i reads
    y = torch.gather(x, 1, src)
    real = pos[None, :] < lengths[:, None]  # (B, T)
    return x.masked_fill(~real, PAD), y.masked_fill(~real, PAD), lengths


def packed_reverse_batch(T, min_len, max_len, vocab_size, gen, host_gen):
    """The reversal task packed (--pack), as FlashAttention's varlen API takes a batch: one row x, y (1, T) on
    gen's device of whole sequences side by side, each reversed in place, and their boundaries cu_seqlens
    (int32, CPU). Lengths are drawn as reverse_batch draws them, on the host, while they fit; the rest of the
    row is one more sequence if at least min_len long, else padding, a document of its own that no real token
    sees. Empty documents fill cu_seqlens up to T // min_len + 2 entries (at most T // min_len sequences and
    the padding): no shape changes from step to step, so torch.compile does not recompile."""
    offsets = [0]
    while True:
        length = int(torch.randint(min_len, max_len + 1, (), generator=host_gen))
        if offsets[-1] + length > T:
            break
        offsets.append(offsets[-1] + length)
    real = T if T - offsets[-1] >= min_len else offsets[-1]  # the rest: a sequence, or padding
    offsets += [T] * (T // min_len + 2 - len(offsets))
    src = torch.cat([torch.arange(end - 1, start - 1, -1, device=gen.device)  # (T,): position output i reads
                     for start, end in zip(offsets, offsets[1:])])
    x = torch.randint(1, vocab_size, (1, T), generator=gen, device=gen.device)
    x[:, real:] = PAD
    return x, x[:, src], torch.tensor(offsets, dtype=torch.int32)


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
                    choices=("off", "bf16", "fp16"))
    impl: str = _arg("flash", "attention path", choices=IMPLS)
    compile_model: bool = _arg(False, "torch.compile the model (on a 2-core CPU it did not pay for its "
                                      "compile time; README, Training)", flag="compile")
    pos_encoding: str = _arg("sinusoidal", "positional encoding", choices=POS_ENCODINGS)
    d_model: int = _arg(64, "model width")
    n_heads: int = _arg(2, "attention heads")
    n_layers: int = _arg(2, "encoder layers")
    d_ff: int = _arg(256, "feed-forward width")
    dropout: float = _arg(0.0, "dropout (the task has unlimited data: none is needed)")
    norm_first: bool = _arg(True, "pre-LN (--no-norm-first for the paper's post-LN)")
    vocab_size: int = _arg(32, "task vocabulary, padding included")
    min_len: int = _arg(4, "shortest task sequence")
    max_len: int = _arg(32, "longest task sequence (sequences are padded to it)")
    pack: bool = _arg(False, "pack each step's --batch-size x --max-len tokens into one row of whole "
                             "sequences (cu_seqlens); only its end can be padding, shorter than --min-len")
    eval_size: int = _arg(2000, "held-out sequences, drawn from a stream training never sees")
    device: str = _arg("auto", "auto, cpu, cuda or cuda:N")
    seed: int = _arg(0, "seed of the model, the data and dropout")
    log_every: int = _arg(100, "steps between progress lines")
    eval_every: int = _arg(100, "steps between held-out evaluations")
    out: str | None = _arg(None, "checkpoint path, written every --save-every steps and at the end")
    save_every: int = _arg(500, "steps between checkpoints (with --out)")
    resume: str | None = _arg(None, "continue from this checkpoint, its run's options the defaults (but "
                                    "--stop-after and --device: this machine's)")
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
        if not (self.lr > 0 and 0 <= self.label_smoothing < 1 and self.clip >= 0 and self.warmup >= 0
                and 0 <= self.min_lr_ratio <= 1 and self.weight_decay >= 0):
            raise ValueError("need lr > 0, 0 <= label_smoothing < 1, clip >= 0, warmup >= 0, 0 <= "
                             "min_lr_ratio <= 1, weight_decay >= 0; got "
                             f"lr={self.lr}, label_smoothing={self.label_smoothing}, clip={self.clip}, "
                             f"warmup={self.warmup}, min_lr_ratio={self.min_lr_ratio}, "
                             f"weight_decay={self.weight_decay}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1, got {self.stop_after}")
        if self.out and os.path.isdir(self.out):  # found now, not at the first checkpoint
            raise ValueError(f"--out {self.out} is a folder: give the checkpoint's file path")
        if self.heatmap and not (-self.n_layers <= self.heatmap_layer < self.n_layers
                                 and -self.n_heads <= self.heatmap_head < self.n_heads):
            raise ValueError(f"the heatmap's layer {self.heatmap_layer} and head {self.heatmap_head} must "
                             f"exist in {self.n_layers} layers of {self.n_heads} heads")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(f"--device {self.device}: {e}") from None
        for name, f in TrainConfig.__dataclass_fields__.items():
            if "choices" in f.metadata and getattr(self, name) not in f.metadata["choices"]:
                raise ValueError(f"{name} must be one of {f.metadata['choices']}, "
                                 f"got {getattr(self, name)!r}")

    def model_config(self):
        names = ("vocab_size", "max_len", "d_model", "n_heads", "n_layers", "d_ff", "dropout", "norm_first",
                 "impl", "pos_encoding")
        return EncoderConfig(**{name: getattr(self, name) for name in names})


def lr_factor(step, warmup, steps, min_ratio):
    """Linear warm-up to 1 over `warmup` steps, then cosine decay to `min_ratio` at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model, lr, weight_decay):
    """AdamW; weight decay on matrices only: decaying biases and LayerNorm gains only hurts.

    The fused implementation (CPU and CUDA) keeps its step counts on the device and lets GradScaler skip an
    inf/NaN step inside the kernel; the others read a value on the host every step (the step count, or the
    scaler's found-inf flag): a GPU sync per step."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=fused)  # the paper's


def optimizer_step(loss, model, optimizer, scaler, clip):
    """backward, unscale, clip, step; returns the gradient norm before clipping and whether the step ran,
    both as tensors on the device: reading them on the host every step would stall a GPU.

    The order matters: with fp16 the gradients are multiplied by the loss scale, so they must be unscaled
    before their norm is clipped; clipping scaled gradients (the classic bug) clips almost every step to a
    tiny fraction of 1.0."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
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
                         f"process(es), this run has {world}; every rank's data stream and random state are "
                         f"in it: resume with {state['world_size']} (torchrun --nproc_per_node)")


def save_checkpoint(path, state):
    """Write atomically: a temporary file flushed to disk, then a rename, itself flushed to disk (the
    folder's entry), so that neither a crash of the process nor a power cut leaves half a checkpoint."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    try:
        with open(f"{path}.tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f"{path}.tmp", path)
    except BaseException:  # the last checkpoint stays as it was, and no half-written file beside it
        with contextlib.suppress(OSError):
            os.remove(f"{path}.tmp")
        raise
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
                         f"checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    missing = _CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else _CHECKPOINT_KEYS
    if missing:
        raise ValueError(f"{path!r} is not a minitransformer checkpoint: missing {sorted(missing)}")
    return state


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
    """One held-out example: attention of layer cfg.heatmap_layer, head cfg.heatmap_head, as a PNG;
    returns the (L, L) weights it drew (query rows, key columns)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x, y, lengths = (t[:1] for t in data)
    L = int(lengths[0])
    model.eval()
    with torch.no_grad():
        w = model.encoder.attention_weights(x, padding_mask(lengths, x.size(1)), layer=cfg.heatmap_layer)
    w = w[0, cfg.heatmap_head, :L, :L].float().cpu().numpy()  # (L, L): query rows, key columns
    fig, ax = plt.subplots(figsize=(6, 5.4))
    im = ax.imshow(w, cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(L), [str(t) for t in x[0, :L].tolist()], fontsize=7)
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
    return w


def _setup_device(cfg):
    """(device, rank, world): torchrun (RANK set) starts a process group, gloo on CPU, NCCL on CUDA,
    one GPU per process."""
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if cfg.device == "auto" else cfg.device)
    if "LOCAL_RANK" in os.environ and device.type == "cuda":
        local_rank, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"LOCAL_RANK={local_rank}, but this machine has {count} CUDA device(s): start "
                               "at most that many processes per node (torchrun --nproc_per_node), or pass "
                               "--device cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    try:  # a device torch names but this machine or this build of torch lacks: said now, by name
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        why = str(e).splitlines()[0][:150]
        raise ValueError(f"--device {cfg.device} is not available here: {why}") from None
    if "RANK" not in os.environ:
        return device, 0, 1
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, torch.distributed.get_rank(), torch.distributed.get_world_size()


def train(cfg, log=print):
    """Train a TokenClassifier on the reversal task; returns the final metrics (a dict).

    One process, or one of many under torchrun (DistributedDataParallel: each rank draws its
    own batches, gradients are averaged, rank 0 alone logs and saves).
    """
    device, rank, world = _setup_device(cfg)
    say = log if rank == 0 else (lambda *a, **k: None)
    failed = True
    try:
        result, failed = _train(cfg, device, rank, world, say), False
        return result
    finally:
        if world > 1:
            # DDP's reducer sits in reference cycles: collect it while its process group lives, not at
            # interpreter exit (where gloo's threads then abort the process); no rank leaves early, but
            # one that raised leaves at once: the others may wait in a collective it never reaches
            gc.collect()
            if not failed:
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _train(cfg, device, rank, world, say):
    amp_dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp]
    amp_ctx = functools.partial(torch.autocast, device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    try:  # fail now, not deep inside the first step
        with amp_ctx():
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(f"--amp {cfg.amp} is not supported on {device} by torch {torch.__version__}: "
                           f"{e}") from e
    state = load_checkpoint(cfg.resume) if cfg.resume else None
    if state:
        check_resume(cfg, state, world)
    mcfg = EncoderConfig(**state["model_config"]) if state else cfg.model_config()
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = TokenClassifier(mcfg).to(device)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    start = state["step"] if state else 0
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    if last <= start:
        raise ValueError(f"nothing to train: the checkpoint's run is finished (step {start} of --steps "
                         f"{cfg.steps})" if start >= cfg.steps else f"nothing to train: the run is at step "
                         f"{start} and would stop at step {last} (--stop-after {cfg.stop_after})")
    if state:
        for name, part in dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler).items():
            part.load_state_dict(state[name])
        torch.set_rng_state(state["rng"][rank]["cpu"])  # every rank's own dropout stream
        if state["rng"][rank]["cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"][rank]["cuda"], device)
        say(f"resumed from {cfg.resume} at step {start}")
    else:
        torch.manual_seed(cfg.seed + 1 + rank)  # dropout differs per rank, as the data does
    ddp = model
    if world > 1:
        # no device_ids: DDP would then copy every input to the GPU, cu_seqlens too, which stays on the CPU
        ddp = nn.parallel.DistributedDataParallel(model)
    if cfg.compile_model:  # the training forward and backward; evaluation and checkpoints use `model` itself
        ddp = torch.compile(ddp)
    held_out = reverse_batch(cfg.eval_size, cfg.min_len, cfg.max_len, mcfg.vocab_size,
                             torch.Generator(device).manual_seed(2**40 + cfg.seed))  # never drawn by training
    say(f"model: {model.encoder.num_params():,} parameters in the encoder; {mcfg}")
    say(f"training on {device} x {world} process(es), amp={cfg.amp}, impl={mcfg.impl}, pack={cfg.pack}, "
        f"compile={cfg.compile_model}, steps {start}..{cfg.steps}"
        + (f", checkpoints to {cfg.out}" if cfg.out else ""))

    t_start = t_log = time.time()
    reached, metrics, loss_value = None, {}, float("nan")
    # running counts stay on the device and are read only on the steps that log, evaluate or save:
    # reading one every step (loss.item(), float(norm)) would make a GPU wait for the host each step
    tokens, skipped, bad_step = (torch.zeros((), dtype=torch.long, device=device) for _ in range(3))
    bad = torch.zeros(2, device=device)  # the loss and gradient norm of bad_step, the first non-finite step
    for step in range(start, last):
        # the batch is a function of (seed, rank, step) alone: resuming needs no data-loader state,
        # and it is made on the device (with --pack its cu_seqlens live on the CPU, and the paths copy the
        # document ids they derive from them to the device, pinned and non-blocking)
        batch_seed = (cfg.seed * 1_000_003 + step) * 1009 + rank
        gen = torch.Generator(device).manual_seed(batch_seed)
        if cfg.pack:  # documents drawn on the host, where the chunked path reads their boundaries
            host_gen = torch.Generator().manual_seed(batch_seed)
            x, y, cu_seqlens = packed_reverse_batch(cfg.batch_size * cfg.max_len, cfg.min_len, cfg.max_len,
                                                    mcfg.vocab_size, gen, host_gen)
            mask = None
        else:
            x, y, lengths = reverse_batch(cfg.batch_size, cfg.min_len, cfg.max_len, mcfg.vocab_size, gen)
            mask, cu_seqlens = padding_mask(lengths, x.size(1)), None
        with amp_ctx():
            logits = ddp(x, mask, cu_seqlens)
            # (B*T, vocab) against (B*T,); the loss in float32 even under autocast
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), ignore_index=PAD,
                                   label_smoothing=cfg.label_smoothing)
        norm, stepped = optimizer_step(loss, ddp, optimizer, scaler, cfg.clip)
        if cfg.amp != "fp16":  # fp16: the scaler skips non-finite steps itself
            # the norm is taken after DDP's all-reduce: another rank's NaN shows here on every rank
            values = torch.stack([loss.detach(), norm.detach().float()])
            new_bad = (bad_step == 0) & ~torch.isfinite(values).all()
            bad_step, bad = torch.where(new_bad, step + 1, bad_step), torch.where(new_bad, values, bad)
        skipped += ~stepped
        scheduler.step()
        tokens += (y != PAD).sum() * world  # real tokens
        done = step + 1
        logging = done % cfg.log_every == 0 or done == last
        evaluating = done % cfg.eval_every == 0 or done == last  # rank 0 evaluates; every rank checks for NaN
        saving = cfg.out and (done % cfg.save_every == 0 or done == last)
        if not (logging or evaluating or saving):
            continue  # no host read on this step
        advice = "lower --lr" + (", or use --amp off" if cfg.amp != "off" else "")
        if bad_step.item():  # before any checkpoint: never save weights that a non-finite step updated
            raise FloatingPointError(f"loss is {bad[0].item()} (gradient norm {bad[1].item()}) at step "
                                     f"{bad_step.item()}: stopping; no checkpoint is written from this state "
                                     f"({advice})")
        if saving and not all(torch.isfinite(p).all() for p in model.parameters()):  # read at a save only
            raise FloatingPointError(f"the weights hold inf or NaN at step {done}: stopping; no checkpoint "
                                     f"is written from this state ({advice})")
        loss_value = loss.item()
        if logging:
            batch_acc = ((logits.argmax(-1) == y) & (y != PAD)).sum().item() / (y != PAD).sum().item()
            now, n_skipped = time.time(), skipped.item()
            say(f"step {done:5d} | loss {loss_value:.4f} | acc {batch_acc:.3f} | "
                f"lr {cfg.lr * lr_factor(step, cfg.warmup, cfg.steps, cfg.min_lr_ratio):.2e} | "
                f"grad norm {norm.item():.3f} | "
                f"{tokens.item() / (now - t_log):,.0f} tok/s"
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
            rngs = [{"cpu": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}] * world
            if world > 1:
                torch.distributed.all_gather_object(rngs, rngs[0])
            if rank == 0:
                save_checkpoint(cfg.out, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                          "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict(),
                                          "step": done, "rng": rngs, "model_config": asdict(mcfg),
                                          "train_config": asdict(cfg), "world_size": world})
        t_log += time.time() - t_pause
    seconds = time.time() - t_start
    if skipped.item() == last - start:  # fp16's scaler skipped every step: the weights are the first ones
        raise FloatingPointError(f"every one of the {last - start} steps was skipped by fp16's gradient "
                                 "scaler (inf or NaN gradients): nothing was trained (lower --lr, or use "
                                 "--amp bf16)")
    result = {"step": last, "loss": loss_value, "skipped_steps": skipped.item(), "seconds": seconds,
              "steps_to_99": reached and reached[0], "seconds_to_99": reached and reached[1]}
    if rank == 0:
        result.update(metrics or evaluate(model, held_out, amp_ctx))
        if cfg.heatmap:
            save_heatmap(model, held_out, cfg, cfg.heatmap)
            say(f"attention heatmap: {cfg.heatmap}")
    if world > 1:  # DDP keeps the ranks' parameters identical: check it, do not assume it
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(gathered, flat)
        result["max_param_diff_across_ranks"] = max((g - gathered[0]).abs().max().item() for g in gathered)
        say(f"max parameter difference across {world} ranks: {result['max_param_diff_across_ranks']:.3g}")
    say(f"accuracy={result.get('accuracy', float('nan')):.4f} (held-out tokens; "
        f"{result.get('seq_accuracy', float('nan')):.3f} of sequences exact; loss {loss_value:.4f}; "
        f"{last} steps in {seconds:.1f} s; skipped steps {result['skipped_steps']}; impl={mcfg.impl}, "
        f"amp={cfg.amp})")
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
        inherited = set(TrainConfig.__dataclass_fields__) - {"resume", "stop_after", "device"}  # output too
        p.set_defaults(**{name: value for name, value in saved.items() if name in inherited})
        args = p.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    train(parse_args())
