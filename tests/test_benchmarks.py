# -*- coding: utf-8 -*-
"""The chunk benchmark's report on any machine: its plot (--plot-only) and its tables (--report-only) rebuilt from a
results JSON, targets judged on the device time, and forward-only rules in its tables."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'benchmarks'))

import benchmark_chunk as bc  # noqa: E402


def test_plot_only_redraws_from_json(tmp_path):
    shutil.copy(ROOT / 'benchmarks' / 'results' / 'chunk.json', tmp_path / 'chunk.json')
    bc.main(['--plot-only', '--out', str(tmp_path)])
    png = tmp_path / 'chunk.png'
    assert png.exists() and png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_report_with_a_forward_only_rule(tmp_path, monkeypatch):
    data = json.loads((ROOT / 'benchmarks' / 'results' / 'chunk.json').read_text())
    row = data['results'][0]
    row['ms']['falcon3'] = {'fwd': 2.0, 'fwd+bwd': None}
    row['ratio']['falcon3'] = {'fwd': 2.0 / row['ms']['chunk_gated_delta_rule']['fwd']}
    monkeypatch.setattr(bc.torch.cuda, 'get_device_name', lambda: 'test device')

    class Args:
        out, window = str(tmp_path), 4
    text = bc.write_report(Args, data['results'], lifted=True, done=True)
    assert '| falcon3 | 2.000 | - |' in text
    assert '| falcon3 | chunk_gated_delta_rule |' in text and '(forward only)' in text
    assert (tmp_path / 'chunk.md').exists() and (tmp_path / 'chunk.png').exists()


def test_report_only_judges_targets_on_device_time(tmp_path):
    # a rule whose do_bench ratio (host time included) is under its target but whose CUDA-graph ratio is over it
    data = json.loads((ROOT / 'benchmarks' / 'results' / 'chunk.json').read_text())
    row = data['results'][0]
    base = row['ms']['chunk_simple_gla']
    row['ms']['falcon3a'] = {'fwd': base['fwd'], 'fwd+bwd': base['fwd+bwd'] * 1.1,
                             'fwd+bwd graph': base['fwd+bwd graph'] * 1.5}
    row['ratio']['falcon3a'] = {'fwd': 1.0, 'fwd+bwd': 1.1, 'fwd+bwd graph': 1.5}
    (tmp_path / 'chunk.json').write_text(json.dumps(data))
    bc.main(['--report-only', '--out', str(tmp_path)])
    md = (tmp_path / 'chunk.md').read_text()
    assert '| falcon3a | chunk_simple_gla | 1.00x | 1.10x | 1.50x | <= 1.3x (missed) |' in md
    assert (tmp_path / 'chunk.png').exists()


def test_report_shows_memory_and_which_intermediates_were_kept(tmp_path):
    # a run of the default (intermediates recomputed in the backward) with both memory measures, and one from before
    # the held measure (peak only) with the intermediates kept: each says which it was, the missing measure is '-'
    data = json.loads((ROOT / 'benchmarks' / 'results' / 'chunk.json').read_text())
    row = data['results'][0]
    row['ms']['falcon1'].update({'held MB': 123.4, 'peak MB': 933.0})
    data['meta']['falcon_intermediates'] = 'recomputed'
    (tmp_path / 'chunk.json').write_text(json.dumps(data))
    bc.main(['--report-only', '--out', str(tmp_path)])
    md = (tmp_path / 'chunk.md').read_text()
    assert 'recomputed the forward' in md and '| MB held from fwd to bwd | peak MB of fwd+bwd |' in md
    assert '| 123 | 933 |' in md.split('| falcon1 |')[1].split('\n')[0]
    del row['ms']['falcon1']['held MB']
    data['meta']['falcon_intermediates'] = 'kept'
    (tmp_path / 'chunk.json').write_text(json.dumps(data))
    bc.main(['--report-only', '--out', str(tmp_path)])
    md = (tmp_path / 'chunk.md').read_text()
    assert 'kept the forward' in md and '| - | 933 |' in md.split('| falcon1 |')[1].split('\n')[0]


def test_report_says_how_the_state_pass_was_recomputed(tmp_path):
    # one stream, two (benchmark_chunk.py --overlap on), the 'auto' default; a STATE_PROGRAMS other than the default
    # (64) noted, and a run that did not record it had 128
    data = json.loads((ROOT / 'benchmarks' / 'results' / 'chunk.json').read_text())
    data['meta']['falcon_intermediates'] = 'recomputed'
    for streams, says in ((1, 'on one CUDA stream.'), (2, 'second CUDA stream beside the state gradients (every'),
                          ('auto', "OVERLAP_RECOMPUTE = 'auto'")):
        data['meta'].update(recompute_streams=streams, state_programs=64 if streams != 'auto' else 32)
        (tmp_path / 'chunk.json').write_text(json.dumps(data))
        bc.main(['--report-only', '--out', str(tmp_path)])
        md = (tmp_path / 'chunk.md').read_text()
        assert says in md, streams
        assert ("STATE_PROGRAMS was 32 (default 64)" in md) == (streams == 'auto')
    del data['meta']['state_programs']
    (tmp_path / 'chunk.json').write_text(json.dumps(data))
    bc.main(['--report-only', '--out', str(tmp_path)])
    assert "STATE_PROGRAMS was 128 (default 64)" in (tmp_path / 'chunk.md').read_text()


def test_sweep_configs_compares_each_config_with_the_first(tmp_path):
    # on the CPU (interpreter) the launch configs give the same results, and a config that changes the kernel's
    # math (SHIFT=0: the same-step key) must show up as a difference
    import sweep_configs as sc
    rows = sc.sweep('falcon1', '_bwd_gates', (1, 80, 2, 32, 32),
                    [dict(num_warps=4), dict(num_warps=8, num_stages=3), dict(BV=16), dict(SHIFT=0)],
                    time=False, device='cpu' if not bc.torch.cuda.is_available() else 'cuda')
    assert [r['max_rel_diff'] < 1e-6 for r in rows[:2]] == [True, True], rows
    assert rows[2]['max_rel_diff'] < 1e-5, rows[2]   # another value-block width: the same sums, regrouped
    assert rows[3]['max_rel_diff'] > 1e-2, rows[3]
    assert all(r['outputs'] >= 4 for r in rows), rows
    # what a config leaves out is the autotuner's choice (not Triton's launch defaults), and the rows say so
    best = sc.find_kernel('_bwd_gates').best_config
    assert rows[0]['config'] == dict(best.kwargs, num_warps=4, num_stages=best.num_stages), rows[0]
    assert rows[2]['config']['BV'] == 16 and rows[2]['config']['num_warps'] == best.num_warps, rows[2]


def test_sweep_configs_takes_nan_garbage_for_an_untouched_buffer():
    # a buffer the kernel does not write (torch.empty: NaN garbage, copied back before each config) is not an output;
    # torch.equal alone calls it changed and makes every config's difference NaN (lease 55)
    import sweep_configs as sc
    a = bc.torch.tensor([1., float('nan'), 3.])
    assert sc._same(a, a.clone())
    assert not sc._same(a, bc.torch.tensor([1., float('nan'), 4.]))
    assert not sc._same(a, bc.torch.tensor([1., 0., 3.]))
    assert sc._same(bc.torch.arange(3), bc.torch.arange(3)) and not sc._same(bc.torch.arange(3), bc.torch.ones(3))


def test_diag_rows_locates_errors(tmp_path, capsys):
    # scripts/diag_rows.py: fp32 kernels on bf16-rounded inputs agree with the reference to rounding, bf16 kernels
    # show their rounding, spread over the rows; the JSON has every output and gradient
    sys.path.insert(0, str(ROOT / 'scripts'))
    import diag_rows
    out = tmp_path / 'diag.json'
    diag_rows.main(['--rule', 'falcon3a', '--T', '40', '--H', '1', '--K', '16', '--V', '16', '--window', '3',
                    '--cu', '0,15,40', '--chunk', '16', '--also-fp32', '--out', str(out),
                    '--device', 'cuda' if bc.torch.cuda.is_available() else 'cpu'])
    rep = json.loads(out.read_text())
    bf16, fp32 = ({r['name']: r for r in rep['runs'][k]} for k in ('bf16', 'fp32-of-bf16'))
    assert {'o', 'dq', 'dk', 'dv', 'dbeta', 'dS0', 'dtail_x'} <= set(bf16) == set(fp32)
    assert all(r['ratio'] < 5e-3 for r in fp32.values()), fp32
    assert 1e-4 < bf16['dq']['ratio'] < 2e-2 and len(bf16['dq']['worst_rows']) == 8
    assert bf16['dq']['boundary_rows'] > 0 and 'falcon3a bf16' in capsys.readouterr().out


def test_replay_launches_finds_a_differing_launch(tmp_path):
    # scripts/replay_launches.py, the interpreter against itself: every launch replays to the recorded outputs
    # exactly; a recorded output changed at one row (what a miscompiled GPU launch leaves) is named with that row
    if bc.torch.cuda.is_available():
        pytest.skip('records and replays under the interpreter (a GPU records; the replay runs where no GPU is)')
    sys.path.insert(0, str(ROOT / 'scripts'))
    import replay_launches as rl
    argv = ['--rule', 'falcon3a', '--T', '40', '--H', '1', '--K', '16', '--V', '16', '--window', '3', '--cu', '0,15,40',
            '--chunk', '16', '--out', str(tmp_path)]
    assert rl.main(argv + ['--mode', 'record', '--all-configs', '--repeat', '2']) == 0
    path = tmp_path / 'launches.pt'
    rec = bc.torch.load(path, weights_only=False)
    names = [L['name'] for L in rec['launches']]
    assert {'_prep_fwd', '_fwd_h', '_fwd_o', '_bwd_dqx', '_win_bwd_pairs'} <= set(names), names
    report = rl.replay(str(path), [])
    assert all(o['rel'] == 0 for r in report for o in r['outputs']), report
    # the recording side's comparison of the configs, and the launches kept for a replay elsewhere
    cfg = json.loads((tmp_path / 'configs.json').read_text())
    assert any(r['name'] == '_bwd_dqx' for r in cfg['configs']) and len(cfg['ratios']) == 2
    assert all(c['worst'] == 0 and not c['oob'] for r in cfg['configs'] for c in r['per_config']), cfg
    # no tensor changed between launches, in either run (the first one's launches are kept too)
    assert cfg['between'] == {'first': [], 'last': []} and len(rec['first']) == len(rec['launches'])
    kept = rl.replay(str(tmp_path / 'launches_keep.pt'), [])
    assert [r['name'] for r in kept] == ['_bwd_dqx'] and all(o['rel'] == 0 for o in kept[0]['outputs']), kept
    # each autotuned launch again under its autotuner's configs (one here: the interpreter keeps the first)
    assert all(len(r['per_config']) == 1 and r['per_config'][0]['worst'] == 0 and not r['per_config'][0]['oob']
               for r in report if r['name'] in ('_fwd_h', '_bwd_dqx')), report
    # the canaries around each per-config copy: a write just outside it is counted
    t = bc.torch.arange(6, dtype=bc.torch.float32).view(2, 3)
    base, x = rl._guarded(t, 'cpu')
    assert bc.torch.equal(x, t) and rl._guard_hits(base, x) == 0
    base[rl.GUARD - 1] = 0.
    base[rl.GUARD + 6] = 1.
    assert rl._guard_hits(base, x) == 2
    # a tensor changed between two launches (what a benchmark run's stray write would leave) is named
    kernels = rl._kernels()
    k = names.index('_fwd_h')
    rec['first'][k]['after'][kernels['_fwd_h'][1].arg_names.index('h')][0] += 1.0
    changed = rl.between_launches(rec['first'], kernels)
    assert changed and changed[0]['written_by'] == '_fwd_h.h' and changed[0]['tensor'].endswith('.h'), changed
    i = names.index('_bwd_dqx')
    j = kernels['_bwd_dqx'][1].arg_names.index('dq')
    rec['launches'][i]['after'][j][0, 23] += 1.0
    bc.torch.save(rec, path)
    report = rl.replay(str(path), ['_bwd_dqx'])
    dq = [o for o in report[0]['outputs'] if o['arg'] == 'dq'][0]
    assert dq['rel'] > 1e-2 and dq['worst_rows'][0][0] == 23, dq
    assert all(o['rel'] == 0 for o in report[0]['outputs'] if o['arg'] != 'dq'), report


def test_run_case_runs_forward_and_backward(capsys):
    # scripts/run_case.py (a compute-sanitizer target): the case's backward reaches every input, the same each call
    sys.path.insert(0, str(ROOT / 'scripts'))
    import run_case
    args = ['--rule', 'falcon3a', '--T', '20', '--H', '1', '--K', '16', '--V', '16', '--window', '2', '--cu', '0,7,20',
            '--chunk', '16']
    assert run_case.main(args + ['--repeat', '2']) == 0
    calls = [line for line in capsys.readouterr().out.splitlines() if line.startswith('call ')]
    assert len(calls) == 2 and calls[0].split(':', 1)[1] == calls[1].split(':', 1)[1], calls
    import argparse
    p = argparse.ArgumentParser()
    run_case.add_case_args(p)
    norms = run_case.run(p.parse_args(args))
    assert set(norms) == {'q', 'k', 'v', 'beta', 'lam', 'S0', 'last_k', 'tail_x', 'tail_v'}
    assert all(v > 0 for v in norms.values()), norms


# A pipelined loop as Triton 3.6 compiles it (trimmed TTGIR of falcon3a's _bwd_dqx before the fix): a 2-slot ring of
# h tiles prefetched 2 iterations ahead (two copies before the loop), an asynchronous wgmma reading the current slot
# through a transpose, and the copy of iteration i + 2 into that same slot before any wait
_PIPELINED_LOOP = """
    %b_h_532 = ttg.local_alloc : () -> !ttg.memdesc<2x128x32xbf16, #shared3, #smem, mutable>
    %b_do_534 = ttg.local_alloc : () -> !ttg.memdesc<3x64x32xbf16, #shared3, #smem, mutable>
    %b_h_0 = ttg.memdesc_index %b_h_532[%c0_i32] : !ttg.memdesc<2x128x32xbf16> -> !ttg.memdesc<128x32xbf16>
    %b_h_1 = ttg.async_copy_global_to_local %p0, %b_h_0 mask %m0 : P -> M
    %b_h_2 = ttg.memdesc_index %b_h_532[%c1_i32] : !ttg.memdesc<2x128x32xbf16> -> !ttg.memdesc<128x32xbf16>
    %b_h_3 = ttg.async_copy_global_to_local %p1, %b_h_2 mask %m0 : P -> M
    %b_do_0 = ttg.memdesc_index %b_do_534[%c0_i32] : !ttg.memdesc<3x64x32xbf16> -> !ttg.memdesc<64x32xbf16>
    %b_do_1 = ttg.async_copy_global_to_local %p2, %b_do_0 mask %m0 : P -> M
    %b_do_2 = ttg.memdesc_index %b_do_534[%c1_i32] : !ttg.memdesc<3x64x32xbf16> -> !ttg.memdesc<64x32xbf16>
    %b_do_3 = ttg.async_copy_global_to_local %p3, %b_do_2 mask %m0 : P -> M
    %r:3 = scf.for %i = %c0 to %c4 step %c1 iter_args(%arg30 = %cst, %arg44 = %c0, %s = %c0) -> (T, i32, i32) : i32 {
      %b_h_1342 = ttg.async_wait %b_h_1298 {num = 12 : i32}
      %b_h_1343 = ttg.memdesc_index %b_h_532[%arg44] : !ttg.memdesc<2x128x32xbf16> -> !ttg.memdesc<128x32xbf16>
      %b_dq_1344 = ttg.memdesc_trans %b_h_1343 {order = array<i32: 1, 0>} : !ttg.memdesc<128x32xbf16> -> M
      %b_do_1349 = ttg.memdesc_index %b_do_534[%s] : !ttg.memdesc<3x64x32xbf16> -> !ttg.memdesc<64x32xbf16>
      %b_dq_1400 = ttng.warp_group_dot %b_do_1349, %b_dq_1344, %arg30 {isAsync = true} : M * M -> T
      WAIT
      %b_do_1442 = ttg.memdesc_index %b_do_534[%n] : !ttg.memdesc<3x64x32xbf16> -> !ttg.memdesc<64x32xbf16>
      %b_do_1445 = ttg.async_copy_global_to_local %b_do_1441, %b_do_1442 mask %m other %cst_107 : P -> M
      %b_h_1436 = ttg.async_copy_global_to_local %b_h_1433, %b_h_1343 mask %b_dsr_1435 other %cst_106 : P -> M
      scf.yield %b_dq_1400, %arg44, %s : T, i32, i32
    }
    %b_dsr_734:1 = ttng.warp_group_dot_wait %r#0 {pendings = 0 : i32} : T
"""


def test_wgmma_hazards_finds_a_slot_overwritten_under_an_async_dot():
    """scripts/wgmma_hazards.py (also run by scripts/aot_check.py on every compiled kernel): the copy into the slot
    the pending wgmma reads is reported; a wait before it, or a ring one slot longer, clears it; the copy into the
    3-slot ring of do (another slot) is never reported."""
    sys.path.insert(0, str(ROOT / 'scripts'))
    from wgmma_hazards import war_hazards

    found = war_hazards(_PIPELINED_LOOP.replace('WAIT', ''))
    assert len(found) == 1 and 'into %b_h_532' in found[0] and '%b_dq_1400' in found[0], found
    waited = "%w:1 = ttng.warp_group_dot_wait %b_dq_1400 {pendings = 0 : i32} : T"
    assert war_hazards(_PIPELINED_LOOP.replace('WAIT', waited)) == []
    longer = _PIPELINED_LOOP.replace('WAIT', '').replace('memdesc<2x128x32xbf16', 'memdesc<3x128x32xbf16')
    assert war_hazards(longer) == []
    # a wgmma left in flight at the end of an iteration meets the next iteration's copies
    late = _PIPELINED_LOOP.replace('WAIT', '')
    late = late.replace("%b_h_1433, %b_h_1343", "%b_h_1433, %b_h_other")   # no copy after the dot any more,
    late = late.replace("      %b_h_1342 = ttg.async_wait",                 # but one at the top of the next iteration
                        "      %b_h_9 = ttg.async_copy_global_to_local %p, %b_h_1343 mask %m : P -> M\n"
                        "      %b_h_1342 = ttg.async_wait")
    assert len(war_hazards(late)) == 1


def test_ablate_col_seq_variants_apply_to_the_kernels():
    """scripts/ablate_col_seq.py edits chunk_col.py's text: every variant's edits must still find their code once (a
    refactor of the sequential kernels breaks them silently otherwise), the autotune list must become its one config,
    and each edit must change the source."""
    sys.path.insert(0, str(ROOT / 'scripts'))
    import ablate_col_seq as ab
    src = (ROOT / 'fla_falcon' / 'ops' / 'falcon' / 'chunk_col.py').read_text()
    base = ab.variant_source('base', [], src)
    assert base.count('CONFIGS_COL_H = [') == 1 and ab.ONE_CONFIG in base
    compile(base, 'chunk_col_base.py', 'exec')
    for name, edits in ab.VARIANTS.items():
        if edits:
            out = ab.variant_source(name, edits, src)
            assert out != base, name
            compile(out, 'chunk_col_variant.py', 'exec')
    with pytest.raises(SystemExit, match='occurs 0 times'):
        ab.variant_source('missing', [('no such code in the kernels', '')], src)


def test_ncu_sass_summary_reads_the_committed_profile(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / 'scripts'))
    import ncu_sass_summary as ns
    out = tmp_path / 'summary.md'
    assert ns.main([str(ROOT / 'benchmarks' / 'results' / 'ncu_seq' / 'seq_sass.csv.xz'), '--slice', '1000',
                    '--out', str(out)]) == 0
    text = out.read_text()
    assert '## _fwd_h_delta_col' in text and '## _bwd_dhu_delta_col' in text
    assert '| short_sb |' in text and '| SHFL |' in text and '| 0-999 |' in text
    # a table without the per-instruction sampling columns is refused by name
    bad = tmp_path / 'bad.csv'
    bad.write_text('"Kernel Name","k",\n"Address","Source"\n"0x0","NOP"\n')
    with pytest.raises(SystemExit):
        ns.main([str(bad)])
    assert 'Warp Stall Sampling' in capsys.readouterr().err


def test_ncu_kernels_config_names_a_kernel_and_its_settings():
    sys.path.insert(0, str(ROOT / 'scripts'))
    import ncu_kernels as nk
    kernel, cfg = nk._fix_config('_bwd_col_dqk:BV=32,num_warps=8,num_stages=1,maxnreg=128')
    assert kernel.fn.__name__ == '_bwd_col_dqk'
    assert cfg.kwargs == {'BV': 32} and (cfg.num_warps, cfg.num_stages, cfg.maxnreg) == (8, 1, 128)
    for bad in ('_bwd_col_dqk', '_bwd_col_dqk:', '_bwd_col_dqk:BV', 'no_such_kernel:BV=32'):
        with pytest.raises(SystemExit):
            nk._fix_config(bad)


def test_aot_check_counts_sass_opcodes(monkeypatch):
    sys.path.insert(0, str(ROOT / 'scripts'))
    # aot_check sets TRITON_INTERPRET=0 on import (it compiles): monkeypatch puts this process's value back afterwards
    monkeypatch.setenv('TRITON_INTERPRET', os.environ.get('TRITON_INTERPRET', '1'))
    from aot_check import sass_opcodes
    sass = '\n'.join([
        '        Function : _fwd_h_delta_col',
        '        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */',
        '        /*0010*/              @!P0 LDGSTS.E [R173+0xd840], desc[UR18][R82.64+0x180], P3 ;  /* 0x0d8 */',
        '        /*0020*/                   FMUL R88, R85, R98 ;                          /* 0x0000006255587220 */',
        '        /*0030*/                   FMUL.FTZ R89, R85, R98 ;                      /* 0x0000006255597220 */',
        '                                                                                 /* 0x000fe20000400000 */',
        '        /*0040*/                   SHFL.BFLY PT, R97, R88, 0x10, 0x1f ;          /* 0x0e20000000000000 */',
    ])
    assert sass_opcodes(sass) == {'LDC': 1, 'LDGSTS': 1, 'FMUL': 2, 'SHFL': 1}


def test_falcon3_step_form_is_exact():
    """scripts/falcon3_step_form.py (docs/falcon3_step_form.md): the chunk form with values per step and per pair
    (both coefficient routes) and its written-out backward reproduce falcon3's step loop and autograd through it in
    fp64, carried and missing pairs included (main() exits 1 otherwise), and a coefficient that is off shows."""
    sys.path.insert(0, str(ROOT / 'scripts'))
    import falcon3_step_form as sf
    assert sf.main(['--windows', '1', '3', '4', '--lengths', '5', '20', '--seeds', '1']) == 0
    X, Y, Q, S0, g, c = sf.make_chunk(20, 4, missing=2, seed=1)
    o_ref, S_ref = sf.step_loop(X, Y, Q, S0, g, c, 4)
    coefs = sf.coefficients_blocked(X, Q, g, c, 4)
    o, S = sf.apply_coefficients(coefs, X, Y, Q, S0, g, c)
    assert sf.rel(o, o_ref) < 1e-12 and sf.rel(S, S_ref) < 1e-12
    for i in range(4):   # each coefficient matrix, perturbed by 1e-3, moves o or S (weak decay: S0 still counts)
        X, Y, Q, S0, g, c = sf.make_chunk(20, 4, lam_scale=1e-3, seed=1)
        o_ref, S_ref = sf.step_loop(X, Y, Q, S0, g, c, 4)
        bad = list(sf.coefficients_blocked(X, Q, g, c, 4))
        bad[i] = bad[i] * (1 + 1e-3)
        o, S = sf.apply_coefficients(bad, X, Y, Q, S0, g, c)
        assert max(sf.rel(o, o_ref), sf.rel(S, S_ref)) > 1e-6, i


def test_model_report_only_rebuilds_the_table_from_json(tmp_path, capsys):
    # the committed results: every model's row with its peak memory, the guard's note; a partial run says so
    import benchmark_model as bm
    data = json.loads((ROOT / 'benchmarks' / 'results' / 'model.json').read_text())
    (tmp_path / 'model.json').write_text(json.dumps(data))
    assert bm.main(['--report-only', '--out', str(tmp_path)]) == 0
    md = (tmp_path / 'model.md').read_text()
    for r in data['results']:
        assert f"| {r['model']} | {r['params'] / 1e6:.1f} |" in md and f"| {r['peak_mem_gb']:.1f} |\n" in md
    assert ('guard' in md) == data['meta']['fla_640_guard_lifted_for_timing'] and 'Partial' not in md
    data['meta']['complete'] = False
    (tmp_path / 'model.json').write_text(json.dumps(data))
    bm.main(['--report-only', '--out', str(tmp_path)])
    assert 'Partial' in (tmp_path / 'model.md').read_text()
