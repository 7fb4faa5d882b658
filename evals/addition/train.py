# -*- coding: utf-8 -*-
"""One run: build a model, train it on in-distribution lengths, measure exact match per operand length."""

from __future__ import annotations

import math
import queue
import threading
import time
import traceback
import warnings

import torch
from tqdm.auto import tqdm

from evals.addition import torch_path
from evals.addition.data import answer_loss, exact_match, make_batch, train_batch
from evals.addition.models import Unavailable, build_model

EVAL_SEED = 1_000_003   # the test sets: the same examples for every model and seed
GRAPH_WARMUP = 3        # eager steps before a CUDA graph is captured (autotuning, lazy initialization)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def curriculum_max(step: int, steps: int, lo: int, hi: int, frac: float) -> int:
    """The longest operand drawn at `step`: hi without a curriculum (frac = 0), else growing linearly from
    lo to hi over the first frac * steps steps."""
    if frac <= 0:
        return hi
    return min(hi, lo + int((hi - lo + 1) * step / (frac * steps)))


def autocast(device, bf16: bool):
    """bf16 autocast of the forward pass and loss (`bf16`), or nothing. No autocast cache: a CUDA graph replays
    the captured casts, and the cache would hold weights cast before an optimizer step."""
    return torch.autocast('cuda' if str(device).startswith('cuda') else 'cpu', dtype=torch.bfloat16,
                          enabled=bool(bf16), cache_enabled=False)


@torch.no_grad()
def evaluate(model, lengths, samples: int, batch_size: int, device: str, bf16: bool = False) -> dict:
    """{n: exact-match accuracy over `samples` examples with n-digit operands} (fixed test sets). Without
    autograd: with it, each eval batch kept its activations for a backward that never came (a Mamba-2 run's
    eval peaked at 24 GB at batch 250 on the H200)."""
    model.eval()
    acc = {}
    for n in lengths:
        gen = torch.Generator().manual_seed(EVAL_SEED + n)
        correct = total = 0
        while total < samples:
            b = make_batch([n] * min(batch_size, samples - total), gen).to(device)
            with autocast(device, bf16):
                logits = model(input_ids=b.input_ids, use_cache=False).logits
            correct += int(exact_match(logits, b.targets).sum())
            total += b.input_ids.shape[0]
        acc[int(n)] = correct / total
    model.train()
    return acc


class BatchStream:
    """Training batches made ahead by a background thread: ``fn(step)`` for step = 0, 1, ... in order (the same
    batches as calling it inline, since one thread draws from the generator), at most `depth` ahead. A GPU step
    of the paper preset's small models can be shorter than making its batch on the CPU; this overlaps the two.
    An exception in `fn` is raised by the `get` that would have returned its batch."""

    def __init__(self, fn, steps: int, depth: int = 4):
        self._q = queue.Queue(maxsize=depth)
        self._stop = threading.Event()

        def work():
            for step in range(steps):
                try:
                    item = fn(step)
                except BaseException as e:  # noqa: BLE001  (handed to the consumer)
                    item = e
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set() or isinstance(item, BaseException):
                    return

        self._thread = threading.Thread(target=work, name='addition-batches', daemon=True)
        self._thread.start()

    def get(self):
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# what makes two runs of a (model, seed) the same experiment: `--resume` keeps a finished run only if these match
# (not the device, threads, eval batch size or job layout, which do not change the numbers beyond float noise)
RUN_SETTINGS = ('kernels', 'size', 'train_min', 'train_max', 'test_min', 'test_max', 'steps', 'batch_size', 'lr',
                'warmup', 'weight_decay', 'eval_samples', 'curriculum', 'cuda_graph', 'tf32', 'bf16')


def run_settings(spec: dict) -> dict:
    """The settings of `spec` that define its experiment (RUN_SETTINGS), as stored in each run's JSON."""
    return {k: spec.get(k) for k in RUN_SETTINGS}


def loss_curve(losses: torch.Tensor, points: int = 100) -> dict:
    """The training loss as `points` means over consecutive equal spans of steps (the last span takes the
    remainder): {'every': span, 'mean': [...]}, for the report's loss plot (where a run plateaus or diverges)."""
    n = losses.numel()
    every = max(1, n // points)
    full = (n // every) * every
    means = losses[:full].float().reshape(-1, every).mean(1).tolist() if full else []
    if n > full:
        means[-1:] = [float(losses[full - every if full else 0:].float().mean())]
    return dict(every=every, mean=[round(m, 5) for m in means])


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class GraphedStep:
    """A training step (forward, loss, backward, gradient clipping, AdamW) captured once as a CUDA graph
    and replayed: the paper preset's models are small, so an eager step is mostly kernel-launch time.

    Shapes must not change between replays: every batch is right-padded to `seq_len` (the longest
    training example; the models are causal and the loss ignores padding, so the loss is unchanged) and
    copied into static buffers. The optimizer must be built with ``capturable=True`` and tensor learning
    rates (set with `set_lr`). The caller runs a few eager steps on a side stream first (autotuning,
    lazy initialization), as CUDA graph capture requires.

    One run per process (the harness's workers): on the H200 (torch 2.11) the first torch.manual_seed after a run
    that captured a graph, in the same process, faulted with an illegal memory access, also with the graph kept
    alive."""

    def __init__(self, model, opt, batch_size: int, seq_len: int, device, clip: float = 1.0, bf16: bool = False):
        from evals.addition.data import IGNORE
        self.model, self.opt, self.clip, self.seq_len = model, opt, clip, seq_len
        self.device, self.bf16 = device, bf16
        self.ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        self.tgt = torch.full((batch_size, seq_len), IGNORE, dtype=torch.long, device=device)
        self.graph = None
        self.loss = None

    def load(self, batch) -> None:
        from evals.addition.data import IGNORE
        T = batch.input_ids.shape[1]
        if T > self.seq_len:
            raise ValueError(f"batch of length {T} > the captured length {self.seq_len}")
        self.ids.zero_()   # <pad> = 0
        self.tgt.fill_(IGNORE)
        self.ids[:, :T].copy_(batch.input_ids, non_blocking=True)
        self.tgt[:, :T].copy_(batch.targets, non_blocking=True)

    def _step(self) -> torch.Tensor:
        with autocast(self.device, self.bf16):
            loss = answer_loss(self.model(input_ids=self.ids, use_cache=False).logits, self.tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.opt.step()
        return loss

    def eager(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        return self._step()

    def capture(self) -> None:
        # as in PyTorch's whole-network capture: with the grads unset, the captured backward allocates them
        # from the graph's pool and every replay overwrites them (no accumulation across steps)
        self.opt.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.loss = self._step()
        self.graph = graph

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.loss


def _failing_kernel(e: BaseException) -> dict | None:
    """The Triton kernel (and the autotuner's config being benchmarked, if any) on whose launch an error surfaced:
    the innermost traceback frame whose `self` is a JITFunction or an Autotuner. With CUDA_LAUNCH_BLOCKING=1 that is
    the kernel that faulted; without, only the one that noticed."""
    found = None
    tb = e.__traceback__
    while tb is not None:
        loc = tb.tb_frame.f_locals
        obj = loc.get('self')
        if type(obj).__name__ in ('JITFunction', 'Autotuner', 'Heuristics'):
            fn = getattr(obj, 'fn', None)
            name = getattr(obj, '__name__', None) or getattr(fn, '__name__', None) or repr(obj)
            # (an inner JITFunction frame keeps the config its Autotuner frame named)
            found = dict(found or {}, name=name,
                         module=getattr(fn, '__module__', None) or getattr(obj, '__module__', None))
            if 'config' in loc:
                found['config'] = str(loc['config'])
        tb = tb.tb_next
    return found


def _set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        if torch.is_tensor(g['lr']):
            g['lr'].fill_(lr)
        else:
            g['lr'] = lr


def run(spec: dict, position: int = 0, progress: bool = True, on_trained=None) -> dict:
    """Trains and evaluates one (model, seed). `spec`: model, seed, device, kernels, size (dict), train_min,
    train_max, test_min, test_max, steps, batch_size, lr, warmup, weight_decay, eval_samples,
    eval_batch_size, threads. Returns a JSON-able record (status 'ok', 'unavailable' or 'failed').
    `on_trained(record)`, if given, gets the record of the finished training (status 'trained': loss curve, final
    loss, times) before the evaluation starts, on rank 0: what a run cut short during its evaluation keeps.
    Under an initialized process group (torchrun) the run is data parallel: every rank draws
    batch_size / world examples a step, DDP averages the gradients, rank 0 evaluates."""
    device = spec['device']
    # data parallel under torchrun (see __main__): every rank trains on its share of each batch
    rank, world = _dist_rank_world()
    if spec['batch_size'] % world:
        raise ValueError(f"batch_size {spec['batch_size']} is not a multiple of the {world} data-parallel ranks")
    record = dict(model=spec['model'], seed=spec['seed'], device=device, kernels=spec['kernels'], world_size=world,
                  spec=run_settings(spec))
    if spec.get('threads'):
        torch.set_num_threads(int(spec['threads']))
    if str(device).startswith('cuda'):
        # these models train in fp32; TF32 puts PyTorch's matmuls on tensor cores (Triton's fp32 dots already are)
        torch.backends.cuda.matmul.allow_tf32 = bool(spec.get('tf32', False))
        record_tf32 = torch.backends.cuda.matmul.allow_tf32
    else:
        record_tf32 = False
    torch.manual_seed(spec['seed'])   # the same initial weights on every rank
    size = dict(spec['size'], max_len=3 * spec['test_max'] + 8)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')   # kernel fallbacks, fla's CPU notices
            model, info = build_model(spec['model'], size, device=device, kernels=spec['kernels'])
    except Unavailable as e:
        return dict(record, status='unavailable', reason=str(e))
    bf16 = bool(spec.get('bf16'))
    record.update(status='ok', route=info['route'], model_class=info['model_class'], params=info['params'],
                  config=info['config'], tf32=record_tf32, bf16=bf16)
    # weight decay on matrices only (not norms, biases, gate biases marked _no_weight_decay)
    decayed = {id(p) for p in model.parameters() if p.dim() >= 2 and not getattr(p, '_no_weight_decay', False)}
    groups = [dict(params=[p for p in model.parameters() if id(p) in decayed], weight_decay=spec['weight_decay']),
              dict(params=[p for p in model.parameters() if id(p) not in decayed], weight_decay=0.0)]
    # one CUDA graph per step (GraphedStep) on a single GPU; eager otherwise or when capture fails
    graphed = bool(spec.get('cuda_graph')) and str(device).startswith('cuda') and world == 1
    if graphed:
        for g in groups:
            g['lr'] = torch.tensor(spec['lr'], dtype=torch.float32, device=device)
        opt = torch.optim.AdamW(groups, lr=spec['lr'], betas=(0.9, 0.98), capturable=True, foreach=True)
    else:
        opt = torch.optim.AdamW(groups, lr=spec['lr'], betas=(0.9, 0.98))
    record['step_mode'] = 'eager'
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel
        net = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device.startswith('cuda')
                                      else None, find_unused_parameters=True)
    # one stream of examples per rank (rank 0 draws the single-process stream)
    gen = torch.Generator().manual_seed(spec['seed'] + 7919 * rank)
    local_batch = spec['batch_size'] // world
    steps = spec['steps']
    log_every = max(1, steps // 10)
    # per-step losses stay on the device: reading each one would synchronize every step and keep the CPU
    # (next batch, next launch) from running ahead of the GPU; they are read every 20 steps
    losses = torch.zeros(steps, dtype=torch.float32, device=device)
    start = time.perf_counter()
    progress = progress and rank == 0
    bar = tqdm(range(steps), desc=f"{spec['model']} s{spec['seed']}", position=position, leave=True,
               disable=not progress, dynamic_ncols=True, mininterval=1.0)
    model.train()
    batches = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            gstep = (GraphedStep(model, opt, local_batch, 3 * spec['train_max'] + 5, device, bf16=bf16)
                     if graphed else None)
            side = torch.cuda.Stream() if graphed else None
            batches = BatchStream(lambda i: train_batch(
                local_batch, spec['train_min'],
                curriculum_max(i, steps, spec['train_min'], spec['train_max'], spec.get('curriculum', 0.0)), gen),
                steps)
            for step in bar:
                _set_lr(opt, lr_at(step, steps, spec['lr'], spec['warmup']))
                b = batches.get().to(device)
                if gstep is not None:
                    gstep.load(b)
                    if step < GRAPH_WARMUP:   # eager steps on a side stream before the capture
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            loss = gstep.eager()
                        torch.cuda.current_stream().wait_stream(side)
                    else:
                        if gstep.graph is None:
                            try:
                                gstep.capture()
                                record['step_mode'] = 'cuda_graph'
                            except Exception as e:   # noqa: BLE001  (some op cannot be captured: go eager)
                                record['step_mode'] = (
                                    f"eager (CUDA graph capture failed: {type(e).__name__}: {e})"[:300])
                                gstep = None
                                torch.cuda.synchronize()
                        if gstep is not None:
                            loss = gstep.replay()
                if gstep is None:
                    with autocast(device, bf16):
                        loss = answer_loss(net(input_ids=b.input_ids, use_cache=False).logits, b.targets)
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"non-finite loss at step {step}")
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                losses[step] = loss.detach()
                if step + 1 == max(1, steps // 2):   # the pace of the second half: no compilation, no capture
                    if str(device).startswith('cuda'):
                        torch.cuda.synchronize()
                    mid = (step + 1, time.perf_counter())
                logline = not progress and rank == 0 and (step + 1) % log_every == 0
                if (step + 1) % 20 == 0 or step == steps - 1 or logline:
                    recent = losses[max(0, step - 19):step + 1]
                    if not bool(torch.isfinite(recent).all()):
                        raise FloatingPointError(f"non-finite loss between steps {max(0, step - 19)} and {step}")
                    mean = float(recent.mean())
                    bar.set_postfix(loss=f"{mean:.3f}")
                    if logline:   # without bars (logs of packed GPU runs): one line per tenth, to see the pace
                        el = time.perf_counter() - start
                        print(f"  {spec['model']} s{spec['seed']}: step {step + 1}/{steps}, loss {mean:.3f}, "
                              f"{el:.0f} s ({1e3 * el / (step + 1):.0f} ms/step)", flush=True)
            batches.close()
            end = time.perf_counter()   # the last step's loss was read: the device is done
            train_time = end - start
            record['ms_per_step'] = 1e3 * (end - mid[1]) / max(1, steps - mid[0])
            if on_trained is not None and rank == 0:
                on_trained(dict(record, status='trained', train_time_s=train_time,
                                final_loss=float(losses[-max(1, steps // 20):].mean()), loss_curve=loss_curve(losses)))
            cuda = str(device).startswith('cuda')
            if cuda:   # what training held at its peak (several runs share a GPU), then the eval starts clean
                record['train_peak_mem_gb'] = torch.cuda.max_memory_allocated() / 2**30
                del gstep
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            lengths = list(range(spec['train_min'], spec['test_max'] + 1))
            # the fixed test sets on rank 0 (the weights are the same on every rank)
            acc = (evaluate(model, lengths, spec['eval_samples'], spec['eval_batch_size'], device, bf16)
                   if rank == 0 else {})
            if cuda:
                record['eval_peak_mem_gb'] = torch.cuda.max_memory_allocated() / 2**30
            if world > 1:
                torch.distributed.barrier()
    except (FloatingPointError, RuntimeError) as e:
        bar.close()
        if batches is not None:
            batches.close()
        # where it failed: an asynchronous CUDA error ("illegal memory access") names only the call that noticed it;
        # CUDA_LAUNCH_BLOCKING=1 in the worker's environment makes that the faulting op
        where = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                 for f in traceback.extract_tb(e.__traceback__)[-12:]]
        return dict(record, status='failed', reason=f"{type(e).__name__}: {e}", where=where,
                    kernel=_failing_kernel(e), train_time_s=time.perf_counter() - start)
    bar.close()
    if torch_path.DQKWG_CHECKS:   # which chunk_bwd_dqkwg the route ran, per kind of call, and its check
        record['dqkwg'] = dict(torch_path.DQKWG_CHECKS)
    return dict(record, train_time_s=train_time, eval_time_s=time.perf_counter() - start - train_time,
                final_loss=float(losses[-max(1, steps // 20):].mean()), loss_curve=loss_curve(losses),
                accuracy={str(n): a for n, a in acc.items()},
                train_lengths=[spec['train_min'], spec['train_max']], test_lengths=[spec['test_min'], spec['test_max']])
