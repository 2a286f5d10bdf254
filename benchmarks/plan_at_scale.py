#!/usr/bin/python3
"""Time ``reshard convert --dry-run`` (the planning alone) on a BLOOM-176B-shaped checkpoint.

The checkpoint has BLOOM-176B's structure (style bs_bloom: L=70 blocks, hidden 14336, 112
heads, ffn 4*14336, vocabulary 250880, ALiBi, embedding LayerNorm, bf16 weights with
BF16_Optimizer Adam state) in BLOOM's training layout TP 4, PP 12, DP 8, with BLOOM's pipeline
partition (``type:transformer|embedding``: 6 layers per stage, embedding and head counted).
Real files would be about 2.5 TB; the fixture's shape-only mode
(tests/fixtures/megatron_fixture.py, ``FixtureConfig(shape_only=True)``) writes the same 720
files with exactly the fixture's pickles but every tensor as a sparse run of zeros, so they take
a few MB of disk and a few seconds.  Only planning is meaningful on them: converting for real
would read and write terabytes of zeros.

For each target layout the script runs ``RESHARD convert ROOT OUT --tp T --pp P --dp D --dry-run``
and prints the wall time, the peak RSS of that process (``wait4``'s ru_maxrss), the head of its
output and its last line.  ``--cold`` drops the page cache first (root only); a dry run reads
only the pickles and zip directories of the 720 files (it does not compare replicated tensors),
so a cold run costs a few seconds more than a warm one.

Usage (Debian's python3; the script sets PYTHONPATH=<repo>/tests itself):
  /usr/bin/python3 benchmarks/plan_at_scale.py [ROOT] [--reshard build/reshard]
      [--target 8,16,4 --target 2,24,16] [--head 25] [--cold] [--regenerate]
ROOT defaults to build-bench/bloom176b-shape in the checkout; it is written only if it does not already hold this
checkpoint (ROOT/latest is written last, and mp_rank_00's args are compared).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, 'tests'))

from run import drop_caches  # noqa: E402  (benchmarks/run.py, beside this script)

import torch  # noqa: E402

from fixtures import megatron_fixture as mf  # noqa: E402

BLOOM_176B = dict(style='bs_bloom', L=70, h=14336, n=112, ffn=4 * 14336, V=250880, mvsdb=128, S=2048,
                  seq_len=2048, global_batch=2048, iteration=95000, dtype='bf16', optimizer='bf16_zero',
                  pp_method='type:transformer|embedding', tp=4, pp=12, dp=8, shape_only=True)
DEFAULT_TARGETS = ('8,16,4', '2,24,16')


def config() -> mf.FixtureConfig:
    return mf.FixtureConfig(**BLOOM_176B)


def _present(root: str, cfg: mf.FixtureConfig) -> bool:
    """ROOT holds a complete checkpoint of this configuration (``latest`` is written last)."""
    mp0 = os.path.join(root, cfg.tag, 'mp_rank_00_model_states.pt')
    if not (os.path.isfile(os.path.join(root, 'latest')) and os.path.isfile(mp0)):
        return False
    mf.install_pickle_shims()
    args = torch.load(mp0, map_location='cpu')['args']
    return all(getattr(args, k, None) == v for k, v in (
        ('num_layers', cfg.L), ('hidden_size', cfg.h), ('num_attention_heads', cfg.n),
        ('padded_vocab_size', cfg.Vp), ('tensor_model_parallel_size', cfg.tp),
        ('pipeline_model_parallel_size', cfg.pp), ('data_parallel_size', cfg.dp)))


def _du(path: str, apparent: bool) -> str:
    cmd = ['du', '-sh'] + (['--apparent-size'] if apparent else []) + [path]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.split('\t')[0]


def generate(root: str, regenerate: bool) -> None:
    cfg = config()
    if regenerate and os.path.isdir(root):
        shutil.rmtree(root)
    if _present(root, cfg):
        print(f'checkpoint present: {root}')
    else:
        if os.path.isdir(root):
            shutil.rmtree(root)  # an incomplete or different earlier run
        start = time.monotonic()
        summary = mf.write_checkpoint(root, cfg)
        print(f'generated {len(summary["files"])} files in {time.monotonic() - start:.1f} s; '
              f'blocks per stage {summary["blocks_per_stage"]}')
    params = sum(math.prod(shape) for _, shape, _ in mf._logical_inventory(cfg))
    print(f'{params / 1e9:.1f}B parameters, TP {cfg.tp} PP {cfg.pp} DP {cfg.dp}; disk {_du(root, False)}, '
          f'apparent size {_du(root, True)}')


def time_dry_run(reshard: str, root: str, target: str, head: int, cold: bool) -> None:
    tp, pp, dp = (int(x) for x in target.split(','))
    cache = 'cold' if cold and drop_caches() else 'warm'
    with tempfile.TemporaryDirectory(prefix='plan_at_scale_') as tmp:
        out_path = os.path.join(tmp, 'out', 'global_step95000')
        log_path = os.path.join(tmp, 'log')
        cmd = [reshard, 'convert', root, out_path, '--tp', str(tp), '--pp', str(pp), '--dp', str(dp), '--dry-run']
        with open(log_path, 'w') as log:
            start = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
            seconds = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        with open(log_path) as log:
            lines = log.read().splitlines()
        wrote = os.path.exists(out_path)
    print(f'\n$ {" ".join(cmd)}')
    print(f'{cache} page cache: exit {proc.returncode}, {seconds:.2f} s wall, peak RSS {usage.ru_maxrss / 1024:.0f} MB, '
          f'user {usage.ru_utime:.2f} s, sys {usage.ru_stime:.2f} s, {len(lines)} output lines'
          + (' (OUTPUT WAS WRITTEN)' if wrote else ''))
    for line in lines[:head]:
        print('  ' + line)
    if len(lines) > head:
        print(f'  ... ({len(lines) - head} more lines; last: {lines[-1]})')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('root', nargs='?', default=os.path.join(REPO, 'build-bench', 'bloom176b-shape'),
                    help='checkpoint root (default build-bench/bloom176b-shape in the checkout)')
    ap.add_argument('--reshard', default=os.path.join(REPO, 'build', 'reshard'), help='reshard binary')
    ap.add_argument('--target', action='append', metavar='TP,PP,DP',
                    help=f'target layout, repeatable (default {" and ".join(DEFAULT_TARGETS)})')
    ap.add_argument('--head', type=int, default=25, help='output lines to show per run')
    ap.add_argument('--cold', action='store_true', help='drop the page cache before each run (needs root)')
    ap.add_argument('--regenerate', action='store_true', help='rewrite the checkpoint even if present')
    ns = ap.parse_args(argv)
    generate(ns.root, ns.regenerate)
    for target in ns.target or DEFAULT_TARGETS:
        time_dry_run(ns.reshard, ns.root, target, ns.head, ns.cold)
    return 0


if __name__ == '__main__':
    sys.exit(main())
