"""falcon2's whole forward at (4, 4096, 16, 128, 128) bf16 with `_fwd_h_delta_col` at num_stages S (argv[1]): the
one-stage probe of dead_ends/README.md, run by col_ns1_probe.sh from the repo root (two processes compile at once,
then each times when its go-file appears, so the timings do not share the GPU)."""
import os
import sys
import time

import torch
import triton

import fla_falcon.ops.falcon.chunk_col as col
from fla_falcon.ops import chunk_falcon

S = int(sys.argv[1])
col._fwd_h_delta_col.configs = [triton.Config({'BV': 32}, num_warps=4, num_stages=S)]
B, T, H, K, V = 4, 4096, 16, 128, 128
g = torch.Generator(device='cuda').manual_seed(0)
q = torch.randn(B, T, H, K, device='cuda', generator=g).bfloat16()
k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device='cuda', generator=g), dim=-1).bfloat16()
v = torch.randn(B, T, H, V, device='cuda', generator=g).bfloat16()
beta = torch.rand(B, T, H, V, device='cuda', generator=g).bfloat16()


def forward():
    return chunk_falcon(q, k, v, beta, rule='falcon2')


o = forward()[0]
torch.cuda.synchronize()
print('ready', S, flush=True)
while not os.path.exists(f'/tmp/go_{S}'):
    time.sleep(0.5)
ms = triton.testing.do_bench(forward, warmup=50, rep=300)
print(f'ns={S} falcon2 forward {ms:.3f} ms  checksum {o.float().abs().sum().item():.6e}', flush=True)
