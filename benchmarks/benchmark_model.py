# -*- coding: utf-8 -*-
"""Training throughput of a FalconNet causal LM against fla's GatedDeltaNet of the same shape.

Both models come from one FalconNetConfig (the GatedDeltaNet one through
`FalconNetConfig.to_gated_deltanet_config()`), so they differ only in the mixer. Each step is a
forward with labels (loss) and a backward, bf16 weights, timed with CUDA events after warm-up, in one
process. fla 0.6.0 refuses its gated chunk backward on Triton 3.4-3.7.0 on Hopper (fla #640: the
results may be wrong); for *timing only* this script lifts that guard inside its own process, and the
table says so. Nothing trained here is kept.

    python benchmarks/benchmark_model.py --help
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import fla_falcon  # noqa: F401  (registers the Auto classes; sets up Triton before fla)
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from fla_falcon.models import FalconNetConfig

HERE = os.path.dirname(os.path.abspath(__file__))


def lift_fla_640_guard() -> bool:
    """Lets fla's gated chunk backward run on Triton 3.6 for timing; returns whether it was active."""
    import fla.ops.common.chunk_o as chunk_o
    was = not getattr(chunk_o, 'TRITON_ABOVE_3_7_1', True)
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return was


def time_model(config, batch: int, seqlen: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (batch, seqlen), device='cuda')
    for _ in range(warmup):
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    out = dict(params=n_params, ms_per_step=ms, tokens_per_s=batch * seqlen / ms * 1e3,
               loss=loss.item(), peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30)
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--rules', nargs='+', default=['falcon1', 'falcon1a', 'falcon2', 'falcon2a', 'falcon3a'],
                   help='Falcon rules (attn_mode) to time')
    p.add_argument('--hidden-size', type=int, default=1024)
    p.add_argument('--layers', type=int, default=24)
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--seqlen', type=int, default=2048)
    p.add_argument('--steps', type=int, default=10)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--out', default=os.path.join(HERE, 'results'), help='folder for model.json and model.md')
    p.add_argument('--report-only', action='store_true',
                   help='rewrite model.md from the model.json in --out (no GPU needed)')
    args = p.parse_args(argv)
    if args.report_only:
        with open(os.path.join(args.out, 'model.json')) as f:
            d = json.load(f)
        write_markdown(args.out, d['meta'], d['results'])
        print(f"wrote {args.out}/model.md")
        return 0
    if not torch.cuda.is_available():
        print('benchmark_model.py needs a CUDA GPU (timings on the Triton interpreter mean nothing).')
        return 2
    base = dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers, vocab_size=32000,
                fuse_cross_entropy=True)
    guard = lift_fla_640_guard()
    rows = []
    configs = [('fla GatedDeltaNet', FalconNetConfig(**base).to_gated_deltanet_config())]
    configs += [(rule, FalconNetConfig(attn_mode=rule, **base)) for rule in args.rules]
    for name, config in tqdm(configs, desc='models'):
        t0 = time.time()
        r = time_model(config, args.batch, args.seqlen, args.steps, args.warmup)
        r.update(model=name, wall_s=time.time() - t0)
        rows.append(r)
        print(f"{name:18s} params={r['params'] / 1e6:.1f}M  {r['ms_per_step']:.1f} ms/step  "
              f"{r['tokens_per_s']:.0f} tok/s  loss={r['loss']:.3f}", flush=True)
        # after every model: a run stopped part way keeps what it measured
        write_report(args, rows, guard, done=len(rows) == len(configs))
    print(f"wrote {args.out}/model.json and model.md")
    return 0


def write_report(args, rows: list, guard: bool, done: bool) -> None:
    """model.json and model.md from the models timed so far (row 0 is GatedDeltaNet)."""
    ref = rows[0]['tokens_per_s']
    for r in rows:
        r['throughput_ratio_vs_gdn'] = r['tokens_per_s'] / ref
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__('triton').__version__, fla=__import__('fla').__version__,
                batch=args.batch, seqlen=args.seqlen, hidden_size=args.hidden_size, layers=args.layers,
                dtype='bf16', fla_640_guard_lifted_for_timing=guard, complete=done)
    with open(os.path.join(args.out, 'model.json'), 'w') as f:
        json.dump(dict(meta=meta, results=rows), f, indent=2)
    write_markdown(args.out, meta, rows)


def write_markdown(out: str, meta: dict, rows: list) -> None:
    with open(os.path.join(out, 'model.md'), 'w') as f:
        f.write(f"# Training throughput, forward + backward ({meta['device']}, bf16, B={meta['batch']}, "
                f"T={meta['seqlen']}, hidden {meta['hidden_size']}, {meta['layers']} layers)\n\n"
                f"torch {meta['torch']}, Triton {meta['triton']}, fla {meta['fla']}; the ratio is against the "
                "GatedDeltaNet timed in the same process.\n\n")
        if not meta['complete']:
            f.write("**Partial: the run had not finished when this was written.**\n\n")
        if meta['fla_640_guard_lifted_for_timing']:
            f.write("fla's #640 guard (gated chunk backward refused on Triton < 3.7.1 on Hopper) was lifted in this "
                    "process for timing only; GatedDeltaNet's gradients here may be wrong and were not used.\n\n")
        f.write('| model | params (M) | ms / step | tokens / s | ratio vs GatedDeltaNet | peak memory (GB) |\n'
                '|---|---:|---:|---:|---:|---:|\n')
        for r in rows:
            f.write(f"| {r['model']} | {r['params'] / 1e6:.1f} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.0f} | "
                    f"{r['throughput_ratio_vs_gdn']:.3f} | {r['peak_mem_gb']:.1f} |\n")


if __name__ == '__main__':
    sys.exit(main())
