# -*- coding: utf-8 -*-
"""One config per autotuned launch in a GPU test run (``FLA_FALCON_TEST_CONFIGS=one``, tests/conftest.py).

On a GPU the autotuner compiles and times every config of a kernel's list for each new key, and checks only the
winner's output: our lists hold 2-8 configs (``CONFIGS_H``: 8), falcon2's sequential kernels take 23-34 s each to
compile for sm_90, and the GPU suite was compile-bound (~24 minutes at 14 workers, against a 30-minute device lease;
``tests/test_chunk.py``'s GPU tests of the rules other than falcon2 took 150 s in this mode on an H100, fifty-eighth
lease, where the fifty-seventh had finished 62 of those 99 in ~5 minutes).
In this mode each autotuning key compiles one config, chosen from a hash of the kernel's name and its key, so the
suite's many shapes, dtypes and heads spread over the whole list instead of the config that wins at small test shapes
every time: a config the benchmark picks at (4, 4096, 16, 128, 128) gets tested too. A config that does not fit
(``OutOfResources``, which the autotuner would skip) passes the turn to the next one in the list. The picks stay out
of Triton's on-disk autotune cache. With
``FLA_FALCON_CONFIG_LOG`` set, every choice is appended to that file; ``python tests/one_config.py LOG`` lists, per
kernel, which of its configs ran.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

INF = float('inf')


def _key(self, kwargs) -> str:
    # the autotuner's own key (Autotuner.run): the key arguments' values and every tensor argument's dtype
    args = {k: v for k, v in {**self.nargs, **kwargs}.items() if k in self.arg_names}
    key = [args[k] for k in self.keys if k in args] + [str(v.dtype) for v in args.values() if hasattr(v, 'dtype')]
    return f"{self.base_fn.__name__}{tuple(key)!r}"


def install(cls=None) -> None:
    """Patches ``cls`` (Triton's Autotuner) so that each new key compiles and times one config."""
    if cls is None:
        from triton.runtime.autotuner import Autotuner as cls
    if getattr(cls.prune_configs, '_fla_falcon_one', False):
        return
    prune, bench = cls.prune_configs, cls._bench

    def prune_to_rotation(self, kwargs, *args, **kw):
        configs = list(prune(self, kwargs, *args, **kw))
        key = _key(self, kwargs)
        start = zlib.crc32(key.encode()) % len(configs)
        # the list from the hashed config on: _bench times the first that compiles and skips the rest
        self._fla_falcon_one = {'key': key, 'done': False, 'configs': configs}
        # and the pick stays out of Triton's on-disk autotune cache (TRITON_CACHE_AUTOTUNING=1 on the lease machine),
        # where a benchmark later on the same machine would take it for the best config (run() reads the flag after
        # pruning)
        self.cache_results = False
        return configs[start:] + configs[:start]

    def bench_first(self, *args, config, **meta):
        state = getattr(self, '_fla_falcon_one', None)
        if state is None:   # pruned elsewhere (a subclass's own prune): leave it alone
            return bench(self, *args, config=config, **meta)
        if state['done']:
            return [INF, INF, INF]
        timing = bench(self, *args, config=config, **meta)
        t = timing[0] if isinstance(timing, (list, tuple)) else timing
        if t != INF:
            state['done'] = True
            _log(self.base_fn.__name__, state['key'], state['configs'].index(config), len(state['configs']), config)
        return timing

    prune_to_rotation._fla_falcon_one = True
    cls.prune_configs = prune_to_rotation
    cls._bench = bench_first


def _log(name, key, index, n, config):
    path = os.environ.get('FLA_FALCON_CONFIG_LOG')
    if path:
        line = json.dumps({'kernel': name, 'key': key, 'index': index, 'n': n, 'config': str(config)})
        with open(path, 'a') as f:   # one short line per write: the workers' lines do not interleave
            f.write(line + '\n')


def summary(path: str) -> str:
    """Per kernel: how many of its configs the run exercised, and how many keys it compiled."""
    seen: dict = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            s = seen.setdefault(r['kernel'], {'n': r['n'], 'ran': set(), 'keys': 0})
            s['n'] = max(s['n'], r['n'])
            s['ran'].add(r['index'])
            s['keys'] += 1
    rows = ['| kernel | configs run / listed | keys |', '|---|---:|---:|']
    for name, s in sorted(seen.items()):
        rows.append(f"| {name} | {len(s['ran'])} / {s['n']} (indices {sorted(s['ran'])}) | {s['keys']} |")
    return '\n'.join(rows)


if __name__ == '__main__':
    if len(sys.argv) != 2 or sys.argv[1] in ('-h', '--help'):
        sys.exit("usage: python tests/one_config.py LOG   (the file FLA_FALCON_CONFIG_LOG named in a GPU test run)")
    print(summary(sys.argv[1]))
