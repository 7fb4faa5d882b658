# -*- coding: utf-8 -*-
"""The chunk benchmark's report on any machine: its plot redrawn from a results JSON (--plot-only), and forward-only
rules (falcon3) in its tables."""

import json
import shutil
import sys
from pathlib import Path

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
