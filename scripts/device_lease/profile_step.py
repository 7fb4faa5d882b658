# -*- coding: utf-8 -*-
"""GPU time of one training step of the addition harness's models at the paper preset's size, by kernel.

    python3 scripts/device_lease/profile_step.py falcon1a gdn mamba2 [--batch 128] [--digits 32]

The harness's training step (train.GraphedStep), eager (no CUDA graph), under torch.profiler: the per-step sum of
device time is what a CUDA-graph step costs at best; the table names the kernels that take it."""
import argparse
import time

import torch

import fla_falcon  # noqa: F401
from evals.addition.data import make_batch
from evals.addition.models import build_model
from evals.addition.train import GraphedStep

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument('models', nargs='+')
p.add_argument('--batch', type=int, default=128)
p.add_argument('--digits', type=int, default=32, help='operand digits of every example (the padded length)')
p.add_argument('--steps', type=int, default=5)
p.add_argument('--top', type=int, default=15)
p.add_argument('--bf16', action='store_true', help='forward and loss under bf16 autocast (the harness\'s --bf16)')
p.add_argument('--device', default='cuda', help='cuda (cpu: a smoke test of this script, torch routes)')
a = p.parse_args()
torch.backends.cuda.matmul.allow_tf32 = True
size = dict(hidden=256, layers=4, heads=4, intermediate=768, mamba_chunk=64, max_len=256)
gen = torch.Generator().manual_seed(0)
batch = make_batch([a.digits] * a.batch, gen).to(a.device)
cuda = a.device.startswith('cuda')
sync = torch.cuda.synchronize if cuda else (lambda: None)
for name in a.models:
    model, info = build_model(name, size, device=a.device, kernels='auto')
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    # the harness's own step (forward, loss, backward, clipping, AdamW), run eagerly on one fixed batch
    gstep = GraphedStep(model, opt, a.batch, batch.input_ids.shape[1], a.device, bf16=a.bf16)
    gstep.load(batch)
    step = gstep.eager
    for _ in range(3):   # compile, autotune
        step()
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    wall = (time.perf_counter() - t) / a.steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if cuda
                                            else torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
        sync()
    ev = [e for e in prof.key_averages()
          if e.device_type == (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU)]
    total = sum(e.self_device_time_total for e in ev) / a.steps / 1e3
    print(f"\n== {name} (route {info['route']}{', bf16 autocast' if a.bf16 else ''}): "
          f"eager step {wall:.2f} ms wall, {total:.2f} ms of kernels, "
          f"{sum(e.count for e in ev) // a.steps} kernels a step")
    for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:a.top]:
        print(f"  {e.self_device_time_total / a.steps / 1e3:7.3f} ms  x{e.count // a.steps:<4d} {e.key[:100]}")
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
