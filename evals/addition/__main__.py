# -*- coding: utf-8 -*-
"""`python -m evals.addition` / `fla-falcon-addition`: the variable-length addition comparison."""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PRESETS = {
    # CPU smoke test: every model end to end in minutes on 2 cores; not the paper's experiment
    'tiny': dict(device='cpu', seeds=[0], hidden=64, layers=2, heads=2, intermediate=192, train_min=1, train_max=3,
                 test_min=4, test_max=6, steps=1000, batch_size=64, lr=3e-3, warmup=50, weight_decay=0.01,
                 eval_samples=200, eval_batch_size=200, jobs=2, threads=1, mamba_chunk=16, curriculum=0.0,
                 cuda_graph=False, tf32=False, bf16=False),
    # the paper's protocol (SPEC section 6): train on 1-32 digit operands, test on 33-48; GPU. The paper does
    # not state its schedule or model size; ours is a guess, tuned on seed 0 only (docs/addition_attempts.md). At
    # lr 2e-3 no run learned the range; at lr 5e-4 with a 5000-step curriculum, 10000 steps reached 17 digits
    # (Falcon-1A) and 13 (GatedDeltaNet), and 20000 steps no further (GatedDeltaNet 11, Falcon-3A 10: the losses are
    # flat after the ramp). So 10000 steps, half of them the ramp. At 29.5M parameters (two probes of seed 0)
    # GatedDeltaNet's loss was lower than at this 3.7M size and Falcon-1A's higher, at ~8x the time a step; the
    # preset's 33 runs keep the small size. A Falcon run alone on an H200 steps in ~6.5 ms (~1.1 min)
    'paper': dict(device='cuda', seeds=[0, 1, 2], hidden=256, layers=4, heads=4, intermediate=768, train_min=1,
                  train_max=32, test_min=33, test_max=48, steps=10000, batch_size=128, lr=5e-4, warmup=200,
                  weight_decay=0.1, eval_samples=1000, eval_batch_size=250, jobs_per_gpu=2, threads=2,
                  mamba_chunk=64, curriculum=0.5, cuda_graph=True, tf32=True, bf16=False),
}
DEFAULT_MODELS = ('falcon1', 'falcon2', 'falcon3', 'falcon1a', 'falcon2a', 'falcon3a', 'falcon3a-noshift',
                  'gdn', 'deltanet', 'mamba2', 'transformer')
# the paper preset trains every model (all six rules' chunk kernels passed their GPU tests, falcon3's on 2026-12-01)
PRESET_MODELS = {'paper': DEFAULT_MODELS}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog='fla-falcon-addition',
        description="Variable-length addition (length extrapolation): trains each model on operands of "
                    "train-min..train-max digits, reports exact-match accuracy per operand length up to test-max. "
                    "Writes results.json, results.md and accuracy_vs_length.png to --out. Presets: 'tiny' (CPU "
                    "smoke test, minutes) and 'paper' (GPU, train 1-32 / test 33-48, 3 seeds). Any flag given "
                    "overrides the preset.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--preset', choices=sorted(PRESETS), default='tiny')
    p.add_argument('--models', nargs='+', default=None, metavar='MODEL',
                   help="falcon1 falcon2 falcon3 falcon1a falcon2a falcon3a, <rule>-noshift, gdn, deltanet, mamba2, "
                        "transformer (None: all)")
    p.add_argument('--seeds', nargs='+', type=int, default=None, help="seeds (preset: tiny 0; paper 0 1 2)")
    p.add_argument('--steps', type=int, default=None, help="training steps per run")
    p.add_argument('--batch-size', type=int, default=None)
    p.add_argument('--lr', type=float, default=None)
    p.add_argument('--hidden', type=int, default=None, help="model width (all models)")
    p.add_argument('--layers', type=int, default=None, help="layers (Mamba-2 gets twice as many: no MLP blocks)")
    p.add_argument('--heads', type=int, default=None)
    p.add_argument('--train-lengths', nargs=2, type=int, default=None, metavar=('MIN', 'MAX'),
                   help="operand digit counts seen in training")
    p.add_argument('--test-lengths', nargs=2, type=int, default=None, metavar=('MIN', 'MAX'),
                   help="operand digit counts of the OOD test")
    p.add_argument('--curriculum', type=float, default=None, metavar='FRAC',
                   help="grow the longest training operand linearly from train MIN to train MAX over this fraction "
                        "of the steps (0: off, every step draws from the whole range; preset: 0)")
    p.add_argument('--cuda-graph', action=argparse.BooleanOptionalAction, default=None,
                   help="capture each training step once as a CUDA graph and replay it (single-GPU runs; batches "
                        "padded to the longest training example; falls back to eager steps, with the reason in "
                        "the run's JSON, if capture fails) (preset: tiny off, paper on)")
    p.add_argument('--tf32', action=argparse.BooleanOptionalAction, default=None,
                   help="PyTorch's fp32 matmuls on a GPU in TF32 (tensor cores; Triton's fp32 tl.dot already is), "
                        "for every model alike (preset: tiny off, paper on)")
    p.add_argument('--bf16', action=argparse.BooleanOptionalAction, default=None,
                   help="forward pass and loss under bf16 autocast (weights, gradients and AdamW stay fp32), for "
                        "every model alike (preset: off)")
    p.add_argument('--eval-samples', type=int, default=None, help="test examples per operand length")
    p.add_argument('--eval-batch-size', type=int, default=None,
                   help="test examples per forward pass (lower it when several runs share a GPU's memory)")
    p.add_argument('--device', default=None, help="cpu, cuda, cuda:1 ... (preset: tiny cpu, paper cuda)")
    p.add_argument('--kernels', choices=['auto', 'fla', 'torch'], default='auto',
                   help="auto: PyTorch reference path on CPU, Triton kernels on GPU (where fla refuses its gated "
                        "chunk backward, GatedDeltaNet and Mamba-2 run fla's kernels with that one kernel in PyTorch: "
                        "route fla+dqkwg); fla: the same, Triton kernels only (unavailable models are skipped); "
                        "torch: PyTorch reference path everywhere")
    p.add_argument('--jobs', type=int, default=None,
                   help="runs in flight at once, each its own process; on GPUs spread round-robin over the visible "
                        "GPUs, several per GPU (preset: tiny 2; paper 2 per visible GPU); 1 runs in this process")
    p.add_argument('--threads', type=int, default=None, help="torch CPU threads per run")
    p.add_argument('--out', default=None, help="results folder (default results/addition/<preset>)")
    p.add_argument('--time-budget', type=float, default=None, metavar='MINUTES',
                   help="start no run that is not expected to finish within MINUTES of wall time from now (a GPU "
                        "lease's end: a run cut short is lost); the runs left out are reported as not run yet. "
                        "Expected time: the same model's finished runs in this invocation, else the paper preset's "
                        "measured pace on an H200 (PACE_MS) times the runs in flight")
    p.add_argument('--resume', action='store_true', help="keep finished runs found in <out>/runs")
    p.add_argument('--report-only', action='store_true', help="rebuild the report from <out>/runs")
    p.add_argument('--no-progress', action='store_true', help="no tqdm bars")
    p.add_argument('--worker', nargs=2, metavar=('SPEC', 'RESULT'), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_specs(args) -> tuple[list[dict], dict]:
    from evals.addition.models import check_model_name
    cfg = dict(PRESETS[args.preset])
    for key in ('seeds', 'steps', 'batch_size', 'lr', 'hidden', 'layers', 'heads', 'eval_samples', 'eval_batch_size',
                'device', 'jobs', 'threads', 'curriculum', 'cuda_graph', 'tf32', 'bf16'):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.hidden is not None and args.preset in PRESETS:
        cfg['intermediate'] = 3 * cfg['hidden']
    if args.train_lengths:
        cfg['train_min'], cfg['train_max'] = args.train_lengths
    if args.test_lengths:
        cfg['test_min'], cfg['test_max'] = args.test_lengths
    if not 1 <= cfg['train_min'] <= cfg['train_max'] < cfg['test_min'] <= cfg['test_max']:
        raise SystemExit("error: need 1 <= train MIN <= train MAX < test MIN <= test MAX")
    if not 0 <= cfg['curriculum'] <= 1:
        raise SystemExit(f"error: --curriculum must be in [0, 1], got {cfg['curriculum']}")
    if cfg['hidden'] % cfg['heads']:
        raise SystemExit(f"error: --hidden {cfg['hidden']} must be a multiple of --heads {cfg['heads']}")
    if args.models is None:
        args.models = list(PRESET_MODELS.get(args.preset, DEFAULT_MODELS))
    for m in args.models:
        try:
            check_model_name(m)
        except ValueError as e:
            raise SystemExit(f"error: {e}")
    size = dict(hidden=cfg['hidden'], layers=cfg['layers'], heads=cfg['heads'], intermediate=cfg['intermediate'],
                mamba_chunk=cfg['mamba_chunk'])
    keys = ('train_min', 'train_max', 'test_min', 'test_max', 'steps', 'batch_size', 'lr', 'warmup', 'weight_decay',
            'eval_samples', 'eval_batch_size', 'threads', 'curriculum', 'cuda_graph', 'tf32', 'bf16')
    specs = [dict(model=m, seed=s, device=cfg['device'], kernels=args.kernels, size=size, **{k: cfg[k] for k in keys})
             for s in cfg['seeds'] for m in args.models]
    meta = dict(preset=args.preset, train_lengths=[cfg['train_min'], cfg['train_max']],
                test_lengths=[cfg['test_min'], cfg['test_max']], config=cfg, models=args.models, kernels=args.kernels)
    return specs, meta


# ms per training step of one run alone on an H200 with the paper preset's model size and batch (step captured as
# a CUDA graph; docs/addition_attempts.md): Falcon rules ~6.2-6.5 and the Transformer 7.2 measured alone;
# GatedDeltaNet 27.6 and Mamba-2 57 measured with one other run beside them (halved here), DeltaNet ~33 with
# four beside it (a fifth here). falcon2 and falcon3 have not trained in this preset yet: their chunk kernels take
# ~6x and ~4x falcon1's device time at the benchmark's shapes (benchmarks/results); at this size a step is mostly
# launches, so a guess of 3x falcon1's pace until a run of theirs has finished (then its own time is used)
PACE_MS = {'falcon': 6.5, 'falcon2': 20.0, 'falcon3': 20.0, 'transformer': 7.2, 'gdn': 14.0, 'mamba2': 29.0,
           'deltanet': 8.0}
FIRST_RUN_S = 180   # a model's first run on a fresh machine: compiling and autotuning its kernels, eval included
EVAL_S = 45


def expected_seconds(spec: dict, finished: list[dict], in_flight: int) -> float | None:
    """How long the run of `spec` is expected to take with `in_flight` runs sharing its GPU (time slicing);
    None when unknown (then it is started anyway)."""
    same = [r for r in finished if r.get('model') == spec['model'] and r.get('status') == 'ok']
    if same:
        return max(r.get('train_time_s', 0) + r.get('eval_time_s', 0) for r in same)
    if not str(spec['device']).startswith('cuda'):
        return None
    family = spec['model'] if spec['model'] in PACE_MS else 'falcon'
    return PACE_MS[family] * spec['steps'] / 1000 * max(1, in_flight) + EVAL_S + FIRST_RUN_S


def _fits(need: float | None, left: float) -> bool:
    """A run fits the time left if expected to end within it; one of unknown length while any time is left."""
    return left > 0 and (need is None or need <= left)


def _expect_str(need: float | None) -> str:
    return 'expected length unknown' if need is None else f"expected {need:.0f} s"


def _environment(device: str) -> dict:
    import fla
    import torch
    import transformers
    import triton
    env = dict(python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__,
               fla=getattr(fla, '__version__', '?'), transformers=transformers.__version__, device=device,
               triton_interpret=os.environ.get('TRITON_INTERPRET'))
    if str(device).startswith('cuda') and torch.cuda.is_available():
        env['gpu'] = torch.cuda.get_device_name()
        env['gpus'] = torch.cuda.device_count()
    return env


def _run_name(spec) -> str:
    return f"{spec['model']}-s{spec['seed']}"


def run_parallel(specs, run_dir: Path, jobs: int, progress: bool, deadline: float | None = None) -> list[dict]:
    """Each run in its own process (`--worker`), at most `jobs` at a time; CUDA runs spread over the
    visible GPUs round-robin by slot (several runs packed per GPU). With a `deadline` (time.time()), a run
    expected to end after it is not started (`expected_seconds`); a later, shorter one may be."""
    import torch
    from tqdm.auto import tqdm
    ngpu = torch.cuda.device_count() if any(str(s['device']).startswith('cuda') for s in specs) else 0
    # seed by seed, and within a seed slowest first (measured on CPU: Mamba-2's torch SSD path ~3x a Falcon
    # run, the Transformer ~1/3; on GPUs GatedDeltaNet takes a PyTorch chunked form, see models.py). Seed-major:
    # the first wave compiles each model's kernels once and later seeds find them in Triton's cache (autotune
    # results too, with TRITON_CACHE_AUTOTUNING=1), and a run cut short still leaves whole seeds of every model
    cost = {'mamba2': 3.0, 'gdn': 3.0, 'falcon3': 1.3, 'falcon3a': 1.3, 'transformer': 0.4}
    seeds = list(dict.fromkeys(sp['seed'] for sp in specs))
    pending = sorted(specs, key=lambda sp: (seeds.index(sp['seed']),
                                            -cost.get(sp['model'].replace('-noshift', ''), 1.0)))
    active, results = {}, []
    free_slots = list(range(jobs))
    bar = tqdm(total=len(specs), desc='runs', position=0, disable=not progress, dynamic_ncols=True)
    while pending or active:
        while pending and free_slots:
            if deadline is not None:
                left = deadline - time.time()
                # runs sharing the new one's GPU (slots go round-robin over the GPUs)
                sharing = -(-(len(active) + 1) // max(1, ngpu))
                need = {_run_name(sp): expected_seconds(sp, results, sharing) for sp in pending}
                for sp in [sp for sp in pending if not _fits(need[_run_name(sp)], left)]:
                    print(f"  {_run_name(sp)}: not started ({_expect_str(need[_run_name(sp)])}, {left:.0f} s "
                          f"left of --time-budget)", flush=True)
                    pending.remove(sp)
                if not pending:
                    break
            spec, slot = pending.pop(0), free_slots.pop(0)
            spec_path, res_path = run_dir / f"{_run_name(spec)}.spec.json", run_dir / f"{_run_name(spec)}.json"
            spec_path.write_text(json.dumps(spec))
            res_path.unlink(missing_ok=True)   # a stale result must not stand in for a crashed worker
            env = dict(os.environ)
            env.setdefault('TRITON_CACHE_AUTOTUNING', '1')   # later runs reuse the first run's autotune timings
            if ngpu and str(spec['device']).startswith('cuda'):
                # the worker sees one GPU (as cuda:0): the (slot mod #GPUs)-th of those visible here
                visible = os.environ.get('CUDA_VISIBLE_DEVICES')
                ids = visible.split(',') if visible else [str(i) for i in range(ngpu)]
                env['CUDA_VISIBLE_DEVICES'] = ids[slot % ngpu].strip()
            cmd = [sys.executable, '-m', 'evals.addition', '--worker', str(spec_path), str(res_path)]
            if not progress:
                cmd.append('--no-progress')
            env['EVALS_ADDITION_POSITION'] = str(slot + 1)
            proc = subprocess.Popen(cmd, env=env, cwd=str(Path(__file__).resolve().parents[2]))
            active[slot] = (proc, spec, res_path, spec_path)
        time.sleep(0.5)
        for slot, (proc, spec, res_path, spec_path) in list(active.items()):
            if proc.poll() is None:
                continue
            del active[slot]
            spec_path.unlink(missing_ok=True)
            free_slots.append(slot)
            if res_path.exists():
                results.append(json.loads(res_path.read_text()))
            else:
                results.append(dict(model=spec['model'], seed=spec['seed'], status='failed',
                                    reason=f"worker exited with code {proc.returncode}"))
            _print_status(results[-1])
            bar.update(1)
    bar.close()
    return results


def _quiet() -> None:
    # fla's notices through transformers-style loggers ('fla.*'): fast path missing, conv backend (the
    # torch path uses nn.Conv1d), CPU device; they are not about the results
    import logging

    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger('fla').setLevel(logging.ERROR)


def _write_trained(result_path: Path, rec: dict) -> None:
    """The record of a finished training, beside where the run's result will go (<run>.trained.json): a lease that
    ends during the evaluation still leaves the loss curve. Neither the report nor --resume reads it."""
    result_path.with_name(result_path.stem + '.trained.json').write_text(json.dumps(rec, default=str))


def worker(spec_path: str, result_path: str, progress: bool) -> int:
    _quiet()
    from evals.addition.train import run
    spec = json.loads(Path(spec_path).read_text())
    if str(spec['device']).startswith('cuda'):
        spec['device'] = 'cuda'   # CUDA_VISIBLE_DEVICES already picked the GPU
    rec = run(spec, position=int(os.environ.get('EVALS_ADDITION_POSITION', 0)), progress=progress,
              on_trained=functools.partial(_write_trained, Path(result_path)))
    rec['environment'] = _environment(spec['device'])
    Path(result_path).write_text(json.dumps(rec, default=str))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(*args.worker, progress=not args.no_progress)
    import fla_falcon  # noqa: F401  (before fla: Triton interpreter on CPU-only machines)
    _quiet()
    from evals.addition.report import write_report

    specs, meta = build_specs(args)
    rank, world = _init_distributed(meta['config']['device'])
    if world > 1:
        # torchrun: each run in turn, data parallel over the ranks; rank 0 writes the results
        meta['config']['jobs'] = 1
        meta['data_parallel_ranks'] = world
        for spec in specs:
            spec['device'] = meta['config']['device'] = _rank_device(spec['device'])
    out = Path(args.out or f"results/addition/{args.preset}")
    run_dir = out / 'runs'
    run_dir.mkdir(parents=True, exist_ok=True)
    device = meta['config']['device']
    if str(device).startswith('cuda') and not args.report_only:   # a report is rebuilt anywhere
        import torch
        if not torch.cuda.is_available():
            raise SystemExit(f"error: --device {device} but no CUDA GPU is visible (use --preset tiny or --device cpu)")
        if args.jobs is None and 'jobs_per_gpu' in meta['config'] and world == 1:
            meta['config']['jobs'] = meta['config']['jobs_per_gpu'] * torch.cuda.device_count()
    # where the runs ran: each run records its own environment (below); a report rebuilt elsewhere
    # (--report-only) lists theirs instead of this machine's
    meta['environment'] = None if args.report_only else _environment(device)
    progress = not args.no_progress
    start = time.perf_counter()

    done = {}
    if args.resume or args.report_only:
        from evals.addition.train import run_settings
        for s in specs:
            p = run_dir / f"{_run_name(s)}.json"
            if p.exists():
                rec = json.loads(p.read_text())
                # a run made with other settings (steps, sizes, lengths, ...) is another experiment: redo it
                if json.loads(json.dumps(run_settings(s))) != rec.get('spec'):
                    if rank == 0:
                        print(f"  {_run_name(s)}: the run in {p} has other settings; "
                              + ("left out of the report" if args.report_only else "it is run again"), flush=True)
                    continue
                done[_run_name(s)] = rec
    todo = [s for s in specs if _run_name(s) not in done] if not args.report_only else []
    if rank == 0:
        print(f"addition/{args.preset}: {len(specs)} runs ({len(done)} already done), device {device}, "
              f"train {meta['train_lengths']} test {meta['test_lengths']} digits, out {out}"
              + (f", data parallel over {world} ranks" if world > 1 else ''), flush=True)
    jobs = meta['config'].get('jobs', 1)
    deadline = time.time() + 60 * args.time_budget if args.time_budget is not None else None
    if deadline is not None:
        meta['time_budget_min'] = args.time_budget
    if jobs <= 1 or len(todo) <= 1:
        from evals.addition.train import run
        for spec in todo:
            if deadline is not None:
                need, left = expected_seconds(spec, list(done.values()), 1), deadline - time.time()
                if not _fits(need, left):
                    print(f"  {_run_name(spec)}: not started ({_expect_str(need)}, {left:.0f} s left of "
                          f"--time-budget)", flush=True)
                    continue
            rec = run(spec, progress=progress, on_trained=functools.partial(
                _write_trained, run_dir / f"{_run_name(spec)}.json"))
            rec['environment'] = meta['environment'] or _environment(spec['device'])
            if rank == 0:
                (run_dir / f"{_run_name(spec)}.json").write_text(json.dumps(rec, default=str))
                _print_status(rec)
            done[_run_name(spec)] = rec
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
            if rank > 0:
                return 0
    else:
        for rec in run_parallel(todo, run_dir, jobs, progress, deadline):
            done[f"{rec['model']}-s{rec['seed']}"] = rec
    runs = [done[_run_name(s)] for s in specs if _run_name(s) in done]
    if meta['environment'] is None:
        envs = [json.dumps(r['environment'], sort_keys=True) for r in runs if r.get('environment')]
        meta['environment'] = [json.loads(e) for e in dict.fromkeys(envs)] or 'not recorded in the runs'
    meta['wall_time_s'] = time.perf_counter() - start
    if args.report_only and (out / 'results.json').exists():   # keep the wall time of the runs themselves
        meta['wall_time_s'] = json.loads((out / 'results.json').read_text())['meta'].get('wall_time_s')
    paths = write_report(out, runs, meta)
    print('\n' + paths.pop('table'))
    print(f"wall time {time.perf_counter() - start:.0f} s; wrote " + ', '.join(paths.values()))
    return 0 if all(r.get('status') in ('ok', 'unavailable') for r in runs) else 1


def _init_distributed(device: str) -> tuple[int, int]:
    """(rank, world size): a process group when started by torchrun with several processes, else (0, 1)."""
    if int(os.environ.get('WORLD_SIZE', '1')) <= 1:
        return 0, 1
    import torch
    import torch.distributed as dist
    cuda = str(device).startswith('cuda')
    if cuda:
        torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', '0')))
    dist.init_process_group(backend='nccl' if cuda else 'gloo')
    return dist.get_rank(), dist.get_world_size()


def _rank_device(device: str) -> str:
    """This rank's device: its own GPU under torchrun (LOCAL_RANK), the CPU otherwise."""
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if str(device).startswith('cuda') else device


def _print_status(rec: dict) -> None:
    if rec.get('status') == 'ok':
        acc = rec['accuracy']
        print(f"  {rec['model']} seed {rec['seed']}: ok, {rec['params']:,} params, {rec['train_time_s']:.0f} s, "
              f"loss {rec['final_loss']:.3f}, acc " + ' '.join(f"{k}:{100 * v:.0f}" for k, v in acc.items()),
              flush=True)
    else:
        print(f"  {rec['model']} seed {rec['seed']}: SKIPPED ({rec.get('status')}): {rec.get('reason')}", flush=True)


if __name__ == '__main__':
    sys.exit(main())
