"""Every Triton kernel compiles for sm_90 (H100/H200) under the GPU machine's Triton, checked without a GPU.

The CPU tests run the kernels under Triton's interpreter, which runs code that Triton's compiler refuses: a variable
that a loop assigns at another shape than it had before the loop was interpreted fine and compiled under Triton 3.9,
and Triton 3.6, the GPU machine's, refused it (the forty-second lease's merge; `scripts/aot_check.py` caught it).
`scripts/aot_check.py --until ttir` runs Triton's frontend on every kernel and config that the op wrappers launch (no
ptxas: about 30 s), with the Triton of `.venv/triton-gpu` (installed there by scripts/test.sh: the GPU machine's
version) or of $FLA_FALCON_GPU_TRITON, else the Triton installed (on the GPU machine, the one that counts anyway).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TRITON = Path(os.environ.get('FLA_FALCON_GPU_TRITON', ROOT / '.venv' / 'triton-gpu'))


def _run(args, timeout=900):
    env = dict(os.environ)
    env.pop('TRITON_INTERPRET', None)   # aot_check compiles (it sets 0 itself)
    paths = ([str(GPU_TRITON)] if (GPU_TRITON / 'triton').is_dir() else []) + [str(ROOT)]
    env['PYTHONPATH'] = os.pathsep.join(paths + [p for p in [env.get('PYTHONPATH')] if p])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_kernel_compiles_for_sm90():
    res = _run(['scripts/aot_check.py', '--until', 'ttir'])
    out = res.stdout + res.stderr
    failed = [line for line in out.splitlines() if 'FAILED' in line]
    assert res.returncode == 0 and not failed, '\n'.join(failed[:20]) or out[-3000:]
    n = int(re.search(r'(\d+) kernel configs compiled', out).group(1))
    assert n >= 300, out[-3000:]   # every rule's chunk and fused_recurrent kernels (419 configs on 2026-12-05)
    if (GPU_TRITON / 'triton').is_dir():
        assert 'Triton 3.6.0' in out, out[:2000]


def test_compile_check_reports_a_kernel_that_does_not_compile(tmp_path):
    # the check itself: a kernel that no Triton compiles (a non-power-of-two arange) is reported, a correct one passes
    script = tmp_path / 'probe.py'
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / 'scripts')!r})
import aot_check as ac
import torch
import triton
import triton.language as tl


@triton.jit
def probe(x, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(x + o, o.to(tl.float32))


ac.install(90, 'ttir')
for n in (4, 3):
    probe[(1,)](torch.empty(4), N=n)
print('RESULT', [r['ok'] for r in ac.COMPILED])
""")
    res = _run([str(script)], timeout=300)
    assert 'RESULT [True, False]' in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
