#!/usr/bin/python3
"""reshard's cost model: time and peak memory of each command at three checkpoint sizes.

For the benchmark checkpoint at --scales (default 0.25, 1 and 4 times the 5.6 GB one; sizes from
--filled-from up, 4 by default, are written with make_checkpoint.py --filled, a pattern instead
of a model, because building a 1.5B-parameter model would take ~18 GB of memory) the script
times, once each (--runs), from a cold page cache when it can drop it:
  * convert SRC OUT --tp 1 --pp 4 --dp 4, then verify SRC OUT,
  * export --to universal, --to consolidated, --to hf and --to megatron (TP 1, PP 4),
and for ZeRO-3 checkpoints (the HF-Trainer-style fixture, bf16, DP 2) convert to DP 4, in two
series where every size is 4x the last: `zero3 dp 2->4` grows the tensors as the pipeline sizes
do (8 blocks; h=384, 768 and 1536 with a vocabulary of 16k, 32k and 64k), and `zero3 by blocks`
grows the number of parameters (h=768; 2, 8 and 32 blocks with a vocabulary of 8k, 32k and 128k),
which shows what each parameter's metadata costs.

It prints, for every command, the time, the time per GB of source, the peak RSS of the process
tree and the kernel's high-water mark at each size, and the ratios between the largest and the
smallest size: time per GB (1.00 = linear) and peak RSS (the target is flat, at most 1.2x).
A least-squares line through the sizes splits each command's time into a fixed part and a
part per GB. The fixed cost of any run, `reshard --help` (loading the binary and its
libraries), is timed with a warm and with a cold page cache.
Figures only: nothing here passes or fails.

  /usr/bin/python3 benchmarks/cost_model.py --reshard build-bench/reshard [--scales 0.25,1,4]
      [--filled-from 4] [--runs 1] [--workdir DIR] [--keep] [--warm] [--no-zero3]
      [--commands convert,universal,consolidated,hf,megatron] [--json results.json]

The 4x checkpoint is 22.5 GB and its conversion another 22.5 GB: --workdir needs ~50 GB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, 'tests'))

from run import (DEFAULT_WORKDIR, PYTHON, TARGET, drop_caches, ensure_checkpoint, folder_bytes, measure, print_results,  # noqa: E402
                 remove)

# ZeRO-3 sizes, each 4x the last: by tensor size (the hidden size doubles, so each matrix is 4x)
# and by parameter count (4x the blocks). Both series meet at the middle size.
ZERO3 = dict(zero_stage=3, dtype='bf16', dp=2, head_dim=64, hf_extras=False)


def zero3_shape(L: int, h: int, V: int) -> Dict:
    return dict(L=L, h=h, V=V, n_heads=h // 64, n_kv=h // 64, ffn=4 * h)


ZERO3_SERIES = {
    'zero3 dp 2->4': [zero3_shape(8, 384, 16000), zero3_shape(8, 768, 32000), zero3_shape(8, 1536, 64000)],
    'zero3 by blocks': [zero3_shape(2, 768, 8000), zero3_shape(8, 768, 32000), zero3_shape(32, 768, 128000)],
}
ZERO3_TARGET_DP = '4'
EXPORTS = ('universal', 'consolidated', 'hf', 'megatron')


def zero3_root(workdir: str, size: Dict) -> str:
    return os.path.join(workdir, f'zero3-L{size["L"]}-h{size["h"]}-V{size["V"]}')


def zero3_checkpoint(workdir: str, size: Dict) -> str:
    """The ZeRO-3 fixture of `size` under workdir, written once and reused."""
    root = zero3_root(workdir, size)
    done = os.path.join(root, 'written')
    if not os.path.exists(done):
        remove(root)
        code = ('import sys; from fixtures import deepspeed_nonpipe as dn; '
                f'dn.write_nonpipe(sys.argv[1], dn.NonPipeConfig(**{dict(ZERO3, **size)!r}))')
        print(f'writing the ZeRO-3 checkpoint {root}', flush=True)
        subprocess.run([PYTHON, '-c', code, root], check=True, env=dict(os.environ, PYTHONPATH=os.path.join(REPO, 'tests')))
        open(done, 'w').close()
    return root


def timed(ns, label: str, cmd: List[str], src_bytes: int, before=None) -> Dict:
    """Runs cmd --runs times (each after `before`, untimed); the median time and the peak RSS."""
    runs = []
    for _ in range(ns.runs):
        if before:
            before()
        runs.append(measure(cmd, cold=not ns.warm))
    r = {'command': label, 'src_bytes': src_bytes,
         'seconds': statistics.median(x['seconds'] for x in runs),
         'peak_tree_gib': max(x['peak_tree_kib']['VmRSS'] for x in runs) / 2**20,
         'maxrss_gib': max(x['maxrss_kib'] for x in runs) / 2**20,
         'other_cpu': max(x['other_cpu'] for x in runs)}
    print(f'  {label:14s} {src_bytes / 1e9:6.2f} GB  {r["seconds"]:7.2f} s  peak tree RSS '
          f'{r["peak_tree_gib"]:.2f} GiB  kernel max RSS {r["maxrss_gib"]:.2f} GiB  '
          f'other CPU {r["other_cpu"]:.1f} s', flush=True)
    return r


def pipeline_size(ns, scale: float) -> List[Dict]:
    info = ensure_checkpoint(ns.workdir, scale, ns.reshard, filled=scale >= ns.filled_from)
    src = info['tag_dir']
    src_bytes = folder_bytes(src)
    out_root = os.path.join(ns.workdir, 'cost-out')
    out = os.path.join(out_root, os.path.basename(src))

    def fresh():
        remove(out_root)
        os.makedirs(out_root)
    results = []
    if 'convert' in ns.commands:  # verify reads its output
        results += [timed(ns, 'convert', [ns.reshard, 'convert', src, out] + TARGET + ['-q'], src_bytes, fresh),
                    timed(ns, 'verify', [ns.reshard, 'verify', src, out], src_bytes)]
    for to in (c for c in EXPORTS if c in ns.commands):
        layout = TARGET[:4] if to == 'megatron' else []  # --tp 1 --pp 4, as convert
        results.append(timed(ns, 'export ' + to,
                             [ns.reshard, 'export', src, os.path.join(out_root, to), '--to', to] + layout + ['-q'],
                             src_bytes, fresh))
    remove(out_root)
    for r in results:
        r['size'] = f'{scale:g}x' + (' (filled)' if scale >= ns.filled_from else '')
    return results


def zero3_size(ns, command: str, size: Dict) -> Dict:
    src = zero3_checkpoint(ns.workdir, size)
    out = os.path.join(ns.workdir, 'cost-out')
    r = timed(ns, command, [ns.reshard, 'convert', src, out, '--tp', '1', '--pp', '1', '--dp', ZERO3_TARGET_DP,
                                    '-q'], folder_bytes(src), lambda: remove(out))
    remove(out)
    r['size'] = f'L={size["L"]} h={size["h"]} V={size["V"]}'
    return r


def startup(ns) -> Dict[str, float]:
    """Wall time of `reshard --help`: the median of 10 runs from a warm page cache, and the
    median of 3 after dropping it (the binary's libraries then come from the disk)."""
    def once(cold: bool) -> float:
        if cold:
            drop_caches()
        start = time.monotonic()
        subprocess.run([ns.reshard, '--help'], stdout=subprocess.DEVNULL, check=True)
        return time.monotonic() - start
    return {'warm': statistics.median(once(False) for _ in range(10)),
            'cold': statistics.median(once(True) for _ in range(3))}


def linear_fit(rs: List[Dict]):
    """Least-squares seconds = fixed + per_gb * GB over the sizes, and the largest residual."""
    xs = [r['src_bytes'] / 1e9 for r in rs]
    ys = [r['seconds'] for r in rs]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    per_gb = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - per_gb * mx
    return fixed, per_gb, max(abs(y - fixed - per_gb * x) for x, y in zip(xs, ys))


def table(results: List[Dict]) -> str:
    lines = ['| command | size | source | time (s) | s per GB | peak RSS tree | kernel max RSS |',
             '|---|---|---|---|---|---|---|']
    by_command: Dict[str, List[Dict]] = {}
    for r in results:
        by_command.setdefault(r['command'], []).append(r)
        lines.append(f'| {r["command"]} | {r["size"]} | {r["src_bytes"] / 1e9:.2f} GB | {r["seconds"]:.2f} | '
                     f'{r["seconds"] / (r["src_bytes"] / 1e9):.2f} | {r["peak_tree_gib"]:.2f} GiB | '
                     f'{r["maxrss_gib"]:.2f} GiB |')
    lines += ['', '| command | size ratio | time ratio | time per GB, largest / smallest | '
              'fit: fixed + per GB (largest residual) | peak RSS, largest / smallest |', '|---|---|---|---|---|---|']
    for command, rs in by_command.items():
        a, b = rs[0], rs[-1]
        per_gb = (b['seconds'] / b['src_bytes']) / (a['seconds'] / a['src_bytes'])
        fit = linear_fit(rs) if len(rs) > 1 else None
        fit_text = f'{fit[0]:.2f} s + {fit[1]:.2f} s/GB ({fit[2]:.2f} s)' if fit else ''
        lines.append(f'| {command} | {b["src_bytes"] / a["src_bytes"]:.1f}x | {b["seconds"] / a["seconds"]:.1f}x | '
                     f'{per_gb:.2f} | {fit_text} | {b["peak_tree_gib"] / a["peak_tree_gib"]:.2f}x |')
    return '\n'.join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--reshard', required=True, help='the reshard binary (a Release build)')
    ap.add_argument('--scales', default='0.25,1,4', help='benchmark checkpoint sizes (default 0.25,1,4)')
    ap.add_argument('--filled-from', type=float, default=4,
                    help='sizes from this one up are written --filled (default 4)')
    ap.add_argument('--runs', type=int, default=1, help='runs of each command (median; default 1)')
    ap.add_argument('--workdir', default=DEFAULT_WORKDIR,
                    help='where checkpoints and outputs go (default build-bench/work in the checkout)')
    ap.add_argument('--keep', action='store_true', help='keep the checkpoints written')
    ap.add_argument('--warm', action='store_true', help='do not drop the page cache before each run')
    ap.add_argument('--no-zero3', action='store_true', help='skip the ZeRO-3 DP changes')
    ap.add_argument('--commands', default='convert,' + ','.join(EXPORTS),
                    help='of the pipeline commands, these (default convert,universal,consolidated,hf,megatron; '
                         'convert includes the verify of its output)')
    ap.add_argument('--json', help='write the results here too')
    ns = ap.parse_args(argv)
    ns.reshard = os.path.abspath(ns.reshard)
    ns.commands = ns.commands.split(',')
    unknown = set(ns.commands) - {'convert', *EXPORTS}
    if unknown:
        ap.error(f'unknown --commands {",".join(sorted(unknown))}; use convert, {", ".join(EXPORTS)}')
    os.makedirs(ns.workdir, exist_ok=True)
    started = time.monotonic()
    fixed = startup(ns)
    print(f'reshard --help: {fixed["warm"]:.3f} s warm, {fixed["cold"]:.3f} s cold', flush=True)
    results, written = [], []
    for scale in (float(s) for s in ns.scales.split(',')):
        results += pipeline_size(ns, scale)
        written.append(os.path.join(ns.workdir, f'ckpt-scale{scale:g}' + ('-filled' if scale >= ns.filled_from else '')))
        if not ns.keep and scale >= ns.filled_from:
            remove(written[-1])  # the disk may not hold two of them
    if not ns.no_zero3:
        for command, sizes in ZERO3_SERIES.items():
            for size in sizes:
                results.append(zero3_size(ns, command, size))
                written.append(zero3_root(ns.workdir, size))
    if not ns.keep:
        for path in written:
            remove(path)
    print_results(ns, f'{ns.runs} run(s) each; cache: {"warm" if ns.warm else "cold (dropped before each run)"}; '
                      f'fixed cost (reshard --help) {fixed["warm"]:.3f} s warm, {fixed["cold"]:.3f} s cold; '
                      f'total {time.monotonic() - started:.0f} s',
                  table(results), results, startup_s=fixed)
    return 0


if __name__ == '__main__':
    sys.exit(main())
