# -*- coding: utf-8 -*-
"""Compile fla-falcon's Triton kernels for a GPU target on a machine without a GPU (no launches).

Runs the real op wrappers on small CPU tensors with a stand-in Triton driver that reports the
target (default sm_90a, an H100/H200) and turns every kernel launch into a compile-only
``warmup``; autotuned kernels compile every config. Each compiled kernel's register use and
spills come from ``cuobjdump --dump-resource-usage`` on its cubin, and its PTX says how many global loads stayed
synchronous (``ld.global``) and how many became the pipeliner's asynchronous copies (``cp.async``). It catches
compiler crashes, register spills and shared-memory slots that an asynchronous wgmma still reads when the pipeliner's
next copy lands in them (scripts/wgmma_hazards.py) before any GPU time is spent; it cannot catch
other wrong results (miscompiles): those need the GPU tests.

Use the Triton version of the GPU machine (Triton 3.6 on our H200):

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    PYTHONPATH=/tmp/t36/lib/python3.*/site-packages python scripts/aot_check.py --rules falcon1 falcon3a
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

os.environ['TRITON_INTERPRET'] = '0'   # before fla_falcon: compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver as _driver  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from ncu_sass_summary import opcode  # noqa: E402  (scripts/ is on sys.path when run as a script)
from wgmma_hazards import war_hazards  # noqa: E402  (scripts/ is on sys.path when run as a script)

COMPILED: list[dict] = []
# shared memory a block may use (opt-in maximum, bytes) per compute capability: a kernel needing more
# compiles but raises OutOfResources at its first launch
MAX_SHARED = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
SEEN: set = set()
SASS_DIR = None   # --sass: each compiled kernel's SASS is written there and its instructions counted


class _CompileOnlyDriver:
    """The parts of Triton's active driver that compiling needs."""

    def __init__(self, arch: int):
        self.target = GPUTarget('cuda', arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device('cpu')

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise RuntimeError('no benchmarking without a GPU')


def sass_opcodes(sass: str) -> collections.Counter:
    """Static count of each opcode (without its modifiers: FMUL.FTZ -> FMUL; a predicate '@P0' skipped) in
    `cuobjdump -sass` output, whose instruction lines read '  /*0120*/   @!P0 LDGSTS.E [R1], ... ;  /* 0x... */'."""
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r'\s*/\*[0-9a-f]+\*/\s+([^;]*);', line)
        if not m or not m.group(1).strip():
            continue
        ops[opcode(m.group(1))] += 1
    return ops


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's bundled cuobjdump on a cubin: `-sass` (the raw listing sass_opcodes reads) or
    `--dump-resource-usage`."""
    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump')
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def _resources(cubin: bytes) -> dict:
    out = _cuobjdump(cubin, '--dump-resource-usage')
    regs = re.search(r'REG:(\d+)', out)
    stack = re.search(r'STACK:(\d+)', out)
    shared = re.search(r'SHARED:(\d+)', out)
    return dict(regs=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None,
                shared=int(shared.group(1)) if shared else None)


class _StopCompile(Exception):
    """Raised by the stage after --until's: the compilation ends there, the IR so far in `ir`."""

    def __init__(self, ir: str):
        super().__init__('stopped')
        self.ir = ir


def _stop_after(until: str) -> None:
    """Cut the CUDA backend's pipeline after stage `until` (ttir: Triton's frontend; ttgir: also its GPU passes).
    Neither needs ptxas: a fast check that every kernel's source compiles at all (Triton's interpreter runs code that
    its compiler refuses, e.g. a loop-carried variable whose shape the loop changes), and for ttgir the wgmma hazard
    search."""
    from triton.backends.nvidia.compiler import CUDABackend
    orig = CUDABackend.add_stages

    def add_stages(self, stages, options, language):
        orig(self, stages, options, language)
        names = list(stages)
        for name in names[names.index(until) + 1:]:
            del stages[name]

        def stop(src, metadata):
            raise _StopCompile(str(src))
        stages['stop'] = stop

    CUDABackend.add_stages = add_stages


def install(arch: int, until: str = 'cubin') -> None:
    _driver.set_active(_CompileOnlyDriver(arch))
    if until != 'cubin':
        _stop_after(until)
    orig_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        name = self.fn.__name__
        cfg = {k: v for k, v in kwargs.items() if k in ('num_warps', 'num_stages', 'maxnreg') and v is not None}
        cfg.update({k: v for k, v in kwargs.items() if k.isupper() and k.startswith('B') and isinstance(v, int)})
        rec = dict(kernel=name, config=cfg)
        # constexpr flags and scalar arguments tell specializations apart (shown only via the key)
        key = (name, tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, str)))),
               tuple(a for a in args if isinstance(a, (bool, int))))
        if until != 'cubin' and key in SEEN:
            return None   # nothing was kept of the first compilation (stopped), so it would run again in full
        t0 = time.perf_counter()
        try:
            kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
            if hasattr(kernel, 'result'):
                kernel = kernel.result()
            rec['secs'] = time.perf_counter() - t0   # compile time (0 when Triton's cache has it)
            rec.update(_resources(kernel.asm['cubin']), ok=True)
            # Triton's shared memory is dynamic (cuobjdump's SHARED is the static part only)
            rec['shared'] = int(kernel.metadata.shared)
            # tensor-core instructions: Hopper's wgmma needs 64-row tiles per warp group; smaller dots fall back to
            # the older mma.sync (about half the throughput)
            ptx = kernel.asm.get('ptx', '')
            rec['mma'] = f"wgmma={ptx.count('wgmma.mma_async')} mma={ptx.count('mma.sync')}"
            # static instruction counts: a proxy for the issue slots of latency-bound loops
            if SASS_DIR and key not in SEEN:
                sass = _cuobjdump(kernel.asm['cubin'], '-sass')
                n = sum(1 for r in COMPILED if r['kernel'] == name)
                with open(os.path.join(SASS_DIR, f'{name}.{n}.sass'), 'w') as f:
                    f.write(sass)
                # and Triton's GPU IR beside it: where the layouts of a kernel's tiles are converted (through shared
                # memory, a barrier each) and which loads the pipeliner made asynchronous
                with open(os.path.join(SASS_DIR, f'{name}.{n}.ttgir'), 'w') as f:
                    f.write(kernel.asm.get('ttgir', ''))
                ops = sass_opcodes(sass)
                rec['sass'] = f"sass={sum(ops.values())} (" + ' '.join(f'{o}:{c}' for o, c in ops.most_common(4)) + ')'

            # global loads the pipeliner turned into asynchronous copies (prefetched a loop iteration ahead) against
            # those left synchronous: a loop whose loads all stay synchronous (e.g. inside a runtime branch, as in
            # falcon2's sequential kernels' `if r0 < T` blocks) waits for them on every iteration
            n_async = ptx.count('cp.async.ca') + ptx.count('cp.async.cg')
            rec['loads'] = f"ld.global={ptx.count('ld.global')} cp.async={n_async}"
            # an async wgmma's operand overwritten by the pipeliner's next copy (Triton 3.6: scripts/wgmma_hazards.py)
            hazards = war_hazards(kernel.asm.get('ttgir', ''))
            if hazards:
                rec.update(ok=False, error=f"{len(hazards)} async-wgmma WAR hazard(s): {hazards[0][:200]}",
                           hazards=hazards)
            limit = MAX_SHARED.get(arch)
            if limit is not None and rec['shared'] > limit:
                rec.update(ok=False, error=f"OutOfResources at launch: shared memory {rec['shared']} > {limit}")
        except _StopCompile as stop:   # --until ttir / ttgir: compiled that far, no binary to read
            rec.update(secs=time.perf_counter() - t0, ok=True)
            hazards = war_hazards(stop.ir) if until == 'ttgir' else []
            if hazards:
                rec.update(ok=False, error=f"{len(hazards)} async-wgmma WAR hazard(s): {hazards[0][:200]}",
                           hazards=hazards)
        except Exception as e:   # noqa: BLE001  (a compiler crash is what we are looking for)
            # a CompilationError's first line is the place ("at 55:8:"), its last the reason
            lines = [line for line in str(e).splitlines() if line.strip()] or ['']
            msg = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1].strip()}"
            rec.update(ok=False, error=f"{type(e).__name__}: {msg[:400]}", trace=traceback.format_exc()[-3000:])
        if key not in SEEN:
            SEEN.add(key)
            COMPILED.append(rec)
            status = 'ok' if rec['ok'] else 'FAILED ' + rec['error']
            print(f"  {name:28s} {str(cfg):60s} regs={rec.get('regs')} stack={rec.get('stack')} "
                  f"smem={rec.get('shared')} {rec.get('mma', '')} {rec.get('loads', '')} {rec.get('sass', '')} "
                  f"{rec.get('secs', 0):.1f}s "
                  f"{status}", flush=True)
        return None

    JITFunction.run = run

    def autotune_run(self, *args, **kwargs):
        # every config the launch would try compiles (after the autotuner's pruning, where a kernel has one);
        # nothing is timed
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs)
        for config in configs:
            full = {**kwargs, **config.all_kwargs()}
            self.fn.run(*args, **full)
        # a host wrapper that reads back the config that ran (chunk.py's _bwd_col_gates split) goes on with the
        # first: exact for one-config kernels (without it the per-column rules' wrapper stopped before _bwd_col_dqk)
        self.best_config = configs[0]
        return None

    Autotuner.run = autotune_run


def _baselines(B, T, H, K, V, dt) -> None:
    """The kernels the addition harness's GatedDeltaNet and Mamba-2 train on (route 'fla+dqkwg'): fla's gated-delta
    and simple-GLA chunk ops forward and backward (fla's own chunk_bwd_dqkwg among them, which the route replaces),
    and the route's stand-in for it. fla built its config lists at import with the device seen as a CPU."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla

    from evals.addition.dqkwg import chunk_bwd_dqkwg_triton
    print(f"baselines (K={K}, V={V}, {dt})", flush=True)
    q, k = (torch.randn(B, T, H, K, dtype=dt, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, dtype=dt, requires_grad=True)
    g = torch.randn(B, T, H, requires_grad=True)
    beta = torch.rand(B, T, H, dtype=dt, requires_grad=True)
    h, dh = (torch.randn(B, -(-T // 64), H, K, V, dtype=dt) for _ in range(2))   # chunk states, 64-row chunks
    for run in (lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0], lambda: chunk_simple_gla(q, k, v, g)[0],
                lambda: chunk_bwd_dqkwg_triton(q, k, v, torch.randn_like(v), h, dh, g=g)):
        try:
            out = run()
            if isinstance(out, torch.Tensor):
                out.sum().backward()
        except Exception as e:   # noqa: BLE001  (the wrappers' own tensor code may trip on garbage)
            print(f"  (wrapper stopped: {type(e).__name__}: {str(e).splitlines()[0][:200]})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rules', nargs='+', default=None, help='rules (default: all)')
    p.add_argument('--ops', nargs='+', default=['chunk', 'fused_recurrent'],
                   choices=['chunk', 'fused_recurrent', 'baselines'],
                   help="'baselines': fla's gated-delta and simple-GLA chunk kernels (forward and backward) and the "
                        "addition harness's stand-in for fla's chunk_bwd_dqkwg, at --dims and --dtype")
    p.add_argument('--arch', type=int, default=90, help='compute capability x10 (90: H100/H200)')
    p.add_argument('--dims', default='128,128', help='K,V')
    p.add_argument('--window', type=int, default=4)
    p.add_argument('--dtype', default='bf16', choices=['bf16', 'fp32'])
    p.add_argument('--seqlen', type=int, default=130, help='T (multiples of 16 specialize differently)')
    p.add_argument('--heads', type=int, default=2)
    p.add_argument('--chunk-size', type=int, default=64, help='chunk_falcon chunk size')
    p.add_argument('--band-form', choices=['fold', 'gather'], default=None,
                   help="falcon3a's band in the backward (fla_falcon.ops.falcon.chunk.BAND_FORM; default: its value)")
    p.add_argument('--decode', action='store_true',
                   help='only the decode step: T = 1 with a full-window initial state and the final state, no grad')
    p.add_argument('--until', choices=['ttir', 'ttgir', 'cubin'], default='cubin',
                   help="compile up to this stage only (ttir: Triton's frontend; ttgir: and its GPU passes, with the "
                        "wgmma hazard search; neither runs ptxas, so no registers or spills: a fast check that every "
                        "kernel compiles at all)")
    p.add_argument('--sass', metavar='DIR', default=None,
                   help="write each compiled kernel's SASS and Triton GPU IR into DIR (<kernel>.<n>.sass, .ttgir) and "
                        "print its instruction count and most common opcodes")
    args = p.parse_args(argv)
    if args.sass:
        global SASS_DIR
        os.makedirs(args.sass, exist_ok=True)
        SASS_DIR = args.sass
    import fla_falcon  # noqa: F401  (fla sees no GPU: its CPU code paths; the kernels compile for the target)
    from fla_falcon.ops.falcon import RULES, chunk_falcon, fused_recurrent_falcon
    from fla_falcon.ops.falcon.utils import FalconState, rule_info
    if args.band_form:
        import fla_falcon.ops.falcon.chunk as ch
        ch.BAND_FORM = args.band_form
    if 'baselines' in args.ops:   # before the stand-in driver: fla asks torch.cuda for the device's name on import
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.simple_gla  # noqa: F401
    if args.sass and args.until != 'cubin':
        p.error('--sass needs --until cubin')
    install(args.arch, args.until)

    print(f"Triton {triton.__version__}, target sm_{args.arch}")
    K, V = (int(x) for x in args.dims.split(','))
    dt = torch.bfloat16 if args.dtype == 'bf16' else torch.float32
    B, T, H = 1, (1 if args.decode else args.seqlen), args.heads
    for rule in args.rules or RULES:
        _, per_column, windowed = rule_info(rule)
        W = args.window if windowed else 1
        for op_name in (o for o in args.ops if o != 'baselines'):
            op = (functools.partial(chunk_falcon, chunk_size=args.chunk_size) if op_name == 'chunk'
                  else fused_recurrent_falcon)
            forward_only = rule in getattr(chunk_falcon, 'forward_only_rules', ())
            if op_name == 'chunk' and rule not in getattr(chunk_falcon, 'supported_rules', ()) and not forward_only:
                continue
            print(f"{op_name} {rule} (W={W}, K={K}, V={V}, {args.dtype})", flush=True)
            q, k = (torch.randn(B, T, H, K, dtype=dt, requires_grad=True) for _ in range(2))
            v = torch.randn(B, T, H, V, dtype=dt, requires_grad=True)
            beta = torch.rand(B, T, H, V, dtype=dt) if per_column else torch.rand(B, T, H, dtype=dt)
            lam = torch.rand(B, T, H, dtype=dt)
            beta.requires_grad_()
            lam.requires_grad_()
            try:
                if args.decode:
                    state = FalconState(torch.randn(B, H, K, V), torch.randn(B, H, K),
                                        torch.randn(B, H, W - 1, K), torch.randn(B, H, W - 1, V),
                                        torch.full((B,), W, dtype=torch.int32))
                    with torch.no_grad():
                        op(q, k, v, beta, lam, rule=rule, window=W, initial_state=state, output_final_state=True)
                    continue
                with torch.no_grad():   # inference: no final state, no saved tensors
                    op(q, k, v, beta, lam, rule=rule, window=W)
                if op_name == 'chunk' and forward_only:
                    with torch.no_grad():
                        op(q, k, v, beta, lam, rule=rule, window=W, output_final_state=True)
                    continue
                o, _ = op(q, k, v, beta, lam, rule=rule, window=W, output_final_state=True)
                o.sum().backward()
                # the variants with a carried state (initial state, last key and window tail): their branches
                # compile only here
                state = FalconState(torch.randn(B, H, K, V), torch.randn(B, H, K), torch.randn(B, H, W - 1, K),
                                    torch.randn(B, H, W - 1, V), torch.full((B,), W, dtype=torch.int32))
                o, _ = op(q, k, v, beta, lam, rule=rule, window=W, initial_state=state, output_final_state=True)
                o.sum().backward()
            except Exception as e:   # noqa: BLE001  (the wrappers' own tensor code may trip on garbage)
                print(f"  (wrapper stopped: {type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if 'baselines' in args.ops:
        _baselines(B, T, H, K, V, dt)
    bad = [r for r in COMPILED if not r['ok']]
    spills = [r for r in COMPILED if r['ok'] and r.get('stack')]
    if args.until != 'cubin':
        print(f"(compiled up to {args.until} only)")
    print(f"\n{len(COMPILED)} kernel configs compiled in {sum(r.get('secs', 0) for r in COMPILED):.0f} s (single "
          f"thread, Triton's cache cold or not), {len(bad)} failed, {len(spills)} with local-memory stack (spills)")
    for r in bad:
        print(f"FAILED {r['kernel']} {r['config']}: {r['error']}")
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
