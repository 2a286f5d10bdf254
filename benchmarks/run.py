#!/usr/bin/python3
"""reshard's conversion benchmark: `reshard convert` against `cp -r` of the same folder.

For each checkpoint size (the full ~355M-parameter GPT-2-style checkpoint, ~5.6 GB, and one
about 4x smaller) this script
  * writes the checkpoint with benchmarks/make_checkpoint.py (or reuses one it wrote before),
  * alternates `cp -r SRC DST` and `reshard convert SRC OUT --tp 1 --pp 4 --dp 4 -q`
    (the order flips every run), each after `sync`, in both page-cache modes (--modes): cold,
    the cache dropped before every command (root: `echo 3 > /proc/sys/vm/drop_caches`), and
    warm, SRC read into the cache first, as right after training saved it (the time "with
    sync" is the fair figure there: both commands then have really written their bytes),
  * takes the median wall time of --runs runs of each, the peak resident memory of the
    process tree (sampled from /proc every 20 ms, split into anonymous and file-backed
    pages, plus the kernel's high-water mark from wait4), and the bytes the process read from
    and wrote to storage (/proc io accounting) against the on-disk size of SRC and OUT,
  * optionally times reshard with other write sizes (--buffer-sizes), `mpirun -np N` with the
    same total thread count (--mpi N; its output is compared with one process's, byte for
    byte), another reshard binary (--baseline) and the exports (--exports: `export
    --to universal`, `--to consolidated`, `--to hf` and `--to torch_dist` (the target layout with
    the optimizer state as `dp_reshardable`), `convert` to the same target from the universal
    checkpoint of SRC, and `export --to torch_dist` to the same target from a `torch_dist`
    checkpoint of SRC at its own layout (a TP and PP change, `dp_reshardable` with the optimizer
    state)) in the same alternation, each against cp -r,
  * optionally times DeepSpeed's ds_to_universal.py on the same input (--deepspeed-src, a
    DeepSpeed source tree fetched separately; it is never part of this repository),
  * or, with --xfs, instead times a DP-only change against `cp -r` on a loop-mounted XFS image
    with reflinks, and reports which output files share the source's extents
    (benchmarks/reflink_bench.py),
and prints one table, with the ratio reshard / cp that the throughput target is about
(at most 1.2).  Figures only: nothing here passes or fails.

  /usr/bin/python3 benchmarks/run.py --reshard build-bench/reshard [--runs 5] [--threads N]
      [--scales 1,0.25] [--modes cold,warm] [--workdir DIR] [--keep] [--verify]
      [--exports] [--buffer-sizes 128KiB,4MiB] [--crc-cost] [--mpi 2] [--baseline OTHER_RESHARD]
      [--deepspeed-src DIR] [--xfs] [--json results.json]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import reflink_bench

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# Where checkpoints and outputs go unless --workdir says: inside the checkout, as `make bench` has it.
DEFAULT_WORKDIR = os.path.join(REPO, 'build-bench', 'work')
PYTHON = '/usr/bin/python3'
TARGET = ['--tp', '1', '--pp', '4', '--dp', '4']
SOURCE_LAYOUT = ['--tp', '2', '--pp', '2', '--dp', '2']  # what make_checkpoint.py writes
# reshard's summary (under mpirun, the first process's: "rank 0: wrote ...").
WROTE = re.compile(r'wrote (\d+) files, .* \((\d+) bytes, \d+ of tensors\) to .* in ([\d.]+) s .*\n'
                   r'(?:rank \d+: )?read .* \((\d+) bytes, .*peak memory ([\d.]+ \w+)')
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT='1', OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1',
               OMPI_MCA_rmaps_base_oversubscribe='1')


# ---------------------------------------------------------------------------------------------
# Measuring one command
# ---------------------------------------------------------------------------------------------

def _self_io() -> Dict[str, int]:
    """This process's /proc io counters; a reaped child's are added to them by the kernel."""
    out = {}
    with open('/proc/self/io') as f:
        for line in f:
            key, value = line.split(':')
            out[key] = int(value)
    return out


def _tree(pid: int) -> List[int]:
    """pid and all its descendants (through /proc/PID/task/*/children)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f'/proc/{p}/task'):
                with open(f'/proc/{p}/task/{task}/children') as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return pids


def _rss_kib(pid: int) -> Dict[str, int]:
    out = {'VmRSS': 0, 'RssAnon': 0, 'RssFile': 0, 'RssShmem': 0}
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                key = line.split(':')[0]
                if key in out:
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


class Sampler(threading.Thread):
    """Samples the summed RSS of a process tree until stopped; keeps the peaks (KiB)."""

    def __init__(self, pid: int, interval: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak = {'VmRSS': 0, 'RssAnon': 0, 'RssFile': 0}
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            total = {'VmRSS': 0, 'RssAnon': 0, 'RssFile': 0}
            for p in _tree(self.pid):
                r = _rss_kib(p)
                for k in total:
                    total[k] += r[k]
            for k in total:
                self.peak[k] = max(self.peak[k], total[k])
            self.stop.wait(self.interval)


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores; idle and iowait excluded)."""
    with open('/proc/stat') as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf('SC_CLK_TCK')


def drop_caches() -> bool:
    """sync, then drop the page cache if we may; returns whether it was dropped."""
    subprocess.run(['sync'], check=True)
    try:
        with open('/proc/sys/vm/drop_caches', 'w') as f:
            f.write('3\n')
        return True
    except OSError:
        return False


def measure(cmd: List[str], env: Optional[dict] = None, cold: bool = True) -> Dict:
    """Runs cmd once: wall time, time including the `sync` after it, memory, I/O, output."""
    if cold:
        dropped = drop_caches()
    else:
        subprocess.run(['sync'], check=True)
        dropped = False
    io0 = _self_io()
    busy0 = _busy_seconds()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    sampler = Sampler(proc.pid)
    sampler.start()
    # Read the pipes in threads so a chatty child cannot block on a full pipe before wait4.
    captured = {}

    def drain(name, stream):
        captured[name] = stream.read()
    readers = [threading.Thread(target=drain, args=(n, s)) for n, s in (('out', proc.stdout), ('err', proc.stderr))]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - start
    sampler.stop.set()
    sampler.join()
    for r in readers:
        r.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    io1 = _self_io()
    # CPU time spent by anything else on the machine while the command ran (other jobs disturb
    # the timing; the sampler itself costs a little).
    other_cpu = max(0.0, _busy_seconds() - busy0 - usage.ru_utime - usage.ru_stime)
    subprocess.run(['sync'], check=True)
    with_sync = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f'{" ".join(cmd)} exited {proc.returncode}:\n{captured["err"][-4000:]}')
    return {'seconds': seconds, 'seconds_with_sync': with_sync, 'cache_dropped': dropped,
            'user': usage.ru_utime, 'sys': usage.ru_stime, 'other_cpu': other_cpu,
            'maxrss_kib': usage.ru_maxrss, 'peak_tree_kib': sampler.peak,
            'read_bytes': io1['read_bytes'] - io0['read_bytes'],
            'write_bytes': io1['write_bytes'] - io0['write_bytes'],
            'stdout': captured['out'], 'stderr': captured['err']}


# ---------------------------------------------------------------------------------------------
# Checkpoints and folders
# ---------------------------------------------------------------------------------------------

def folder_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def ensure_checkpoint(workdir: str, scale: float, reshard: str, filled: bool = False,
                      style: str = 'ms_gpt2') -> Dict:
    """The benchmark checkpoint of `scale` under workdir, written once and reused; `filled`:
    make_checkpoint.py --filled (a pattern, not a model); `style`: its --style."""
    root = os.path.join(workdir, f'ckpt-scale{scale:g}' + ('-filled' if filled else '') +
                        ('' if style == 'ms_gpt2' else '-' + style))
    info_path = os.path.join(root, 'benchmark-checkpoint.json')
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
        info['reused'] = True
        return info
    if os.path.exists(root):
        shutil.rmtree(root)
    cmd = ([PYTHON, os.path.join(HERE, 'make_checkpoint.py'), root, '--scale', str(scale), '--style', style] +
           (['--filled'] if filled else []))
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, 'tests'))
    print(f'writing the scale-{scale:g} checkpoint: {" ".join(cmd)}', flush=True)
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    info = json.loads(out)
    lint = subprocess.run([reshard, 'lint', info['tag_dir']], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if lint.returncode != 0:
        raise RuntimeError(f'reshard lint refused the benchmark checkpoint:\n{lint.stdout}')
    info['lint'] = lint.stdout.strip().splitlines()[-1]
    with open(info_path, 'w') as f:
        json.dump(info, f, indent=1)
    info['reused'] = False
    return info


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


# ---------------------------------------------------------------------------------------------
# One checkpoint size
# ---------------------------------------------------------------------------------------------

def read_through(path: str) -> None:
    """Reads every file under path once, so that the page cache holds it."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), 'rb') as f:
                while f.read(8 << 20):
                    pass


def same_output(a: str, b: str) -> bool:
    """The two output folders hold the same files, byte for byte (the manifests, which name their
    command, only the same file list)."""
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    for name in names:
        if name == 'reshard-manifest.json':
            with open(os.path.join(a, name)) as fa, open(os.path.join(b, name)) as fb:
                if json.load(fa)['files'] != json.load(fb)['files']:
                    return False
        elif not filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False):
            return False
    return True


def bench_scale(ns, scale: float, mode: str) -> Dict:
    info = ensure_checkpoint(ns.workdir, scale, ns.reshard, style=ns.style)
    src = info['tag_dir']
    src_bytes = folder_bytes(src)
    cp_dst = os.path.join(ns.workdir, 'cp-out')
    out_root = os.path.join(ns.workdir, 'reshard-out')
    out = os.path.join(out_root, os.path.basename(src))
    mpi_out = os.path.join(ns.workdir, 'mpi-out', os.path.basename(src))
    threads = ns.threads or os.cpu_count() or 1
    reshard_cmd = [ns.reshard, 'convert', src, out] + TARGET + ['-q']
    if ns.threads:
        reshard_cmd += ['--threads', str(ns.threads)]
    commands = {'cp': ['cp', '-r', src, cp_dst], 'reshard': reshard_cmd}
    if ns.baseline:
        commands['baseline'] = [ns.baseline] + reshard_cmd[1:]
    for size in filter(None, ns.buffer_sizes.split(',')):
        commands[f'buffer {size}'] = reshard_cmd + ['--buffer-size', size]
    if ns.crc_cost:
        # What checking the CRC-32 of every record read whole (the default) costs.
        commands['no CRC check'] = reshard_cmd + ['--no-check-crc']
    if ns.mpi:
        # The same total thread count as the one process.
        commands[f'mpirun -np {ns.mpi}'] = (['mpirun', '-np', str(ns.mpi), ns.reshard, 'convert', src, mpi_out] + TARGET
                                            + ['-q', '--threads', str(max(1, threads // ns.mpi))])
    if ns.exports:
        for to, name in (('universal', os.path.basename(src) + '_universal'), ('consolidated', 'model'),
                         ('hf', 'hf-model')):
            commands[to] = [ns.reshard, 'export', src, os.path.join(out_root, name), '--to', to, '-q']
        # The same conversion read from the universal checkpoint of SRC (made once, untimed).
        universal = src + '_universal'
        if not os.path.isdir(universal):
            subprocess.run([ns.reshard, 'export', src, universal, '--to', 'universal', '-q'], check=True,
                           stdout=subprocess.DEVNULL)
        commands['from-universal'] = [ns.reshard, 'convert', universal, out] + TARGET + ['-q']
        dp_reshardable = ['--optimizer-layout', 'dp_reshardable', '-q']
        commands['torch_dist'] = ([ns.reshard, 'export', src, os.path.join(out_root, 'torch_dist'), '--to', 'torch_dist']
                                  + TARGET + dp_reshardable)
        # Megatron-Core to Megatron-Core: from SRC at its own layout (made once, untimed) to the target.
        torch_dist = src + '_torch_dist'
        if not os.path.isdir(torch_dist):
            subprocess.run([ns.reshard, 'export', src, torch_dist, '--to', 'torch_dist'] + SOURCE_LAYOUT +
                           dp_reshardable, check=True, stdout=subprocess.DEVNULL)
        commands['torch_dist→torch_dist'] = ([ns.reshard, 'export', torch_dist, os.path.join(out_root, 'torch_dist'),
                                             '--to', 'torch_dist'] + TARGET + dp_reshardable)
        if ns.style == 'ms_llama':
            # An FSDP2 run on 8 ranks (the vocabulary, 50257 rows, rules out torchtitan's TP, which
            # shares it evenly).
            commands['torchtitan'] = [ns.reshard, 'export', src, os.path.join(out_root, 'torchtitan'),
                                      '--to', 'torchtitan', '--dp-shard', '8', '-q']
    if ns.only:
        wanted = ns.only.split(',')
        unknown = sorted(set(wanted) - set(commands))
        if unknown:
            raise SystemExit(f'--only: no command {", ".join(unknown)}; these run: {", ".join(commands)}')
        commands = {what: cmd for what, cmd in commands.items() if what in ('cp', 'reshard') or what in wanted}
    runs = {what: [] for what in commands}
    out_bytes = 0
    if mode == 'warm':
        read_through(src)
        if 'torch_dist→torch_dist' in commands:
            read_through(src + '_torch_dist')
    for i in range(ns.runs):
        # Each command goes first, second, ... in turn.
        names = list(commands)
        order = names[i % len(names):] + names[:i % len(names)]
        for what in order:
            remove(cp_dst)
            remove(out_root)
            remove(os.path.dirname(mpi_out))
            if what != 'cp':
                os.makedirs(out_root, exist_ok=True)
                os.makedirs(os.path.dirname(mpi_out), exist_ok=True)
            r = measure(commands[what], env=MPI_ENV if what.startswith('mpirun') else None, cold=mode == 'cold')
            if what != 'cp':
                m = WROTE.search(r['stdout'])
                if m is None:
                    raise RuntimeError(f'unexpected reshard output:\n{r["stdout"]}')
                r.update(files=int(m.group(1)), reported_written_mb=int(m.group(2)) / 1e6,
                         reported_seconds=float(m.group(3)), reported_read_mb=int(m.group(4)) / 1e6,
                         reported_peak=m.group(5))
                if what == 'reshard':
                    out_bytes = folder_bytes(out)
            runs[what].append(r)
            print(f'  scale {scale:g} run {i + 1}/{ns.runs} {what:8s} {r["seconds"]:7.2f} s '
                  f'(+sync {r["seconds_with_sync"]:6.2f} s)  peak tree RSS '
                  f'{r["peak_tree_kib"]["VmRSS"] / 2**20:5.2f} GiB  read {r["read_bytes"] / 1e9:5.2f} GB  '
                  f'written {r["write_bytes"] / 1e9:5.2f} GB  other CPU {r["other_cpu"]:4.1f} s', flush=True)
    mpi_same = None
    if ns.mpi:  # the outputs of both, made again (untimed) and compared
        for folder in (out_root, os.path.dirname(mpi_out)):
            remove(folder)
            os.makedirs(folder)
        for what in ('reshard', f'mpirun -np {ns.mpi}'):
            subprocess.run(commands[what], check=True, stdout=subprocess.DEVNULL,
                           env=MPI_ENV if what.startswith('mpirun') else None)
        mpi_same = same_output(out, mpi_out)
        print(f'  mpirun -np {ns.mpi} output {"is" if mpi_same else "is NOT"} byte-identical to one process\'s', flush=True)
        remove(os.path.dirname(mpi_out))
    verify = None
    if ns.verify:
        remove(out_root)
        os.makedirs(out_root, exist_ok=True)
        subprocess.run(reshard_cmd, check=True, stdout=subprocess.DEVNULL)
        v = subprocess.run([ns.reshard, 'verify', src, out], stdout=subprocess.PIPE, text=True)
        verify = v.stdout.strip().splitlines()[-1] if v.stdout.strip() else f'exit {v.returncode}'
        print(f'  verify: {verify}', flush=True)
    peer = None
    if ns.deepspeed_src:
        peer = bench_deepspeed(ns, src, mode)
    if not ns.keep:
        remove(cp_dst)
        remove(out_root)
    result = summarize(scale, info, src_bytes, out_bytes, runs, verify, peer)
    result.update(mode=mode, mpi_same=mpi_same)
    return result


def bench_deepspeed(ns, src: str, mode: str) -> Dict:
    """DeepSpeed's ds_to_universal.py on the same input, through ds_to_universal_launcher.py.

    It does another job: it writes the universal checkpoint (one folder per parameter with
    its fp32 master and moments), not a TP 1 / PP 4 / DP 4 DeepSpeed checkpoint.
    """
    script = os.path.join(ns.deepspeed_src, 'deepspeed', 'checkpoint', 'ds_to_universal.py')
    if not os.path.exists(script):
        return {'error': f'{script} not found'}
    dst = os.path.join(ns.workdir, 'ds-universal-out')
    workers = str(ns.threads or os.cpu_count() or 1)
    cmd = [PYTHON, os.path.join(HERE, 'ds_to_universal_launcher.py'), ns.deepspeed_src,
           '--input_folder', src, '--output_folder', dst,
           '--num_extract_workers', workers, '--num_merge_workers', workers]
    times = []
    out_bytes = 0
    try:
        for i in range(ns.runs):
            remove(dst)
            r = measure(cmd, cold=mode == 'cold')
            times.append(r)
            out_bytes = folder_bytes(dst)
            print(f'  ds_to_universal run {i + 1}/{ns.runs} {r["seconds"]:7.2f} s  peak tree RSS '
                  f'{r["peak_tree_kib"]["VmRSS"] / 2**20:5.2f} GiB  read {r["read_bytes"] / 1e9:5.2f} GB  '
                  f'written {r["write_bytes"] / 1e9:5.2f} GB  other CPU {r["other_cpu"]:4.1f} s', flush=True)
    except RuntimeError as e:
        lines = [l for l in str(e).splitlines() if l.strip()]
        return {'error': lines[-1][:300] if lines else 'failed'}
    finally:
        if not ns.keep:
            remove(dst)
    return {'seconds': statistics.median(r['seconds'] for r in times),
            'seconds_with_sync': statistics.median(r['seconds_with_sync'] for r in times),
            'peak_tree_gib': max(r['peak_tree_kib']['VmRSS'] for r in times) / 2**20,
            'io_read_bytes': statistics.median(r['read_bytes'] for r in times),
            'io_write_bytes': statistics.median(r['write_bytes'] for r in times),
            'out_bytes': out_bytes, 'runs': [round(r['seconds'], 2) for r in times]}


def summarize(scale, info, src_bytes, out_bytes, runs, verify, peer) -> Dict:
    med = {k: statistics.median(r['seconds'] for r in v) for k, v in runs.items()}
    med_sync = {k: statistics.median(r['seconds_with_sync'] for r in v) for k, v in runs.items()}
    rs = runs['reshard']
    peak = max(rs, key=lambda r: r['peak_tree_kib']['VmRSS'])['peak_tree_kib']
    return {
        'scale': scale, 'config': info['config'], 'parameters': info['parameters'],
        'src_bytes': src_bytes, 'out_bytes': out_bytes,
        'cache': 'cold (page cache dropped before each run)' if all(
            r['cache_dropped'] for v in runs.values() for r in v) else 'warm (page cache not dropped)',
        'cp_s': med['cp'], 'reshard_s': med['reshard'], 'ratio': med['reshard'] / med['cp'],
        'cp_sync_s': med_sync['cp'], 'reshard_sync_s': med_sync['reshard'],
        'ratio_sync': med_sync['reshard'] / med_sync['cp'],
        'reshard_gbps': src_bytes / med['reshard'] / 1e9, 'cp_gbps': src_bytes / med['cp'] / 1e9,
        'reshard_user_s': statistics.median(r['user'] for r in rs),
        'reshard_sys_s': statistics.median(r['sys'] for r in rs),
        'peak_rss_gib': peak['VmRSS'] / 2**20, 'peak_anon_gib': peak['RssAnon'] / 2**20,
        'peak_file_gib': peak['RssFile'] / 2**20,
        'maxrss_gib': max(r['maxrss_kib'] for r in rs) / 2**20,
        'reported_read_mb': statistics.median(r['reported_read_mb'] for r in rs),
        'reported_written_mb': statistics.median(r['reported_written_mb'] for r in rs),
        'io_read_bytes': statistics.median(r['read_bytes'] for r in rs),
        'io_write_bytes': statistics.median(r['write_bytes'] for r in rs),
        'cp_io_read_bytes': statistics.median(r['read_bytes'] for r in runs['cp']),
        'cp_io_write_bytes': statistics.median(r['write_bytes'] for r in runs['cp']),
        'runs_cp': [round(r['seconds'], 2) for r in runs['cp']],
        'runs_reshard': [round(r['seconds'], 2) for r in rs],
        'verify': verify, 'deepspeed': peer,
        # CPU seconds (user + sys) per GB written, which the noise of a shared host moves far less than
        # wall time: cp -r's output is SRC's size, reshard's what it reports writing.
        'cpu_per_gb': {what: statistics.median(
            (r['user'] + r['sys']) / ((src_bytes if what == 'cp' else r['reported_written_mb'] * 1e6) / 1e9)
            for r in v) for what, v in runs.items()},
        # Every other command of the alternation (--baseline, --exports), against cp -r.
        'others': {what: {
            'seconds': med[what], 'seconds_with_sync': med_sync[what],
            'ratio': med[what] / med['cp'], 'ratio_sync': med_sync[what] / med_sync['cp'],
            'written_mb': statistics.median(r['reported_written_mb'] for r in runs[what]),
            'cpu_s': statistics.median(r['user'] + r['sys'] for r in runs[what]),
            'peak_tree_gib': max(r['peak_tree_kib']['VmRSS'] for r in runs[what]) / 2**20,
            'runs': [round(r['seconds'], 2) for r in runs[what]]}
            for what in runs if what not in ('cp', 'reshard')},
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def machine(workdir: str) -> str:
    """The CPU, memory, kernel and the file system `workdir` lies on."""
    cpu = 'unknown CPU'
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next(l.split(':', 1)[1].strip() for l in f if l.startswith('model name'))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30
    where = os.path.abspath(workdir)
    while not os.path.exists(where):  # the workdir is removed after the runs unless kept
        where = os.path.dirname(where)
    fs = subprocess.run(['findmnt', '-n', '-o', 'FSTYPE,SOURCE', '-T', where], stdout=subprocess.PIPE,
                        text=True).stdout.strip()
    fs = ' '.join(fs.split())
    return f'{os.cpu_count()} x {cpu}, {mem:.1f} GiB RAM, workdir on {fs or "?"}, kernel {os.uname().release}'


def source_version() -> str:
    """The commit the benchmark scripts sit in, and whether the work tree differs from it."""
    def git(*args):
        return subprocess.run(['git', '-C', REPO] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True).stdout.strip()
    head = git('rev-parse', '--short', 'HEAD') or 'unknown commit'
    dirty = git('status', '--porcelain', '--untracked-files=no')
    return head + (' with uncommitted changes' if dirty else '')


def print_results(ns, what: str, table_text: str, results, **extra) -> None:
    """The run's header (machine, source, what was run), its table, and --json."""
    print()
    print(f'machine: {machine(ns.workdir)}')
    print(f'source: {source_version()} ({ns.reshard})')
    print(what)
    print(table_text)
    if ns.json:
        with open(ns.json, 'w') as f:
            json.dump(dict({'machine': machine(ns.workdir), 'source': source_version(), 'results': results}, **extra), f,
                      indent=1)


def table(results: List[Dict]) -> str:
    gb = 1e9
    head = ('| checkpoint | size | cp -r (s) | reshard (s) | ratio | reshard GB/s | cp GB/s | '
            'peak RSS tree (anon + file) | read / written (reshard output) | storage I/O read / written |')
    lines = [head, '|' + '---|' * (head.count('|') - 1)]
    for r in results:
        c = r['config']
        name = f'h={c["h"]}, {r["parameters"] / 1e6:.0f}M params, {r["mode"]}'
        lines.append(
            f'| {name} | {r["src_bytes"] / gb:.2f} GB | {r["cp_s"]:.2f} | {r["reshard_s"]:.2f} | '
            f'{r["ratio"]:.2f}x | {r["reshard_gbps"]:.2f} | {r["cp_gbps"]:.2f} | '
            f'{r["peak_rss_gib"]:.2f} GiB ({r["peak_anon_gib"]:.2f} + {r["peak_file_gib"]:.2f}) | '
            f'{r["reported_read_mb"] / 1e3:.2f} / {r["reported_written_mb"] / 1e3:.2f} GB '
            f'({r["reported_read_mb"] * 1e6 / r["src_bytes"]:.2f}x / {r["out_bytes"] / r["src_bytes"]:.2f}x of SRC) | '
            f'{r["io_read_bytes"] / gb:.2f} / {r["io_write_bytes"] / gb:.2f} GB |')
    lines.append('')
    lines.append('| checkpoint | cp -r + sync (s) | reshard + sync (s) | ratio with sync | reshard user / sys CPU (s) | '
                 'kernel max RSS | OUT size | runs cp | runs reshard |')
    lines.append('|---|---|---|---|---|---|---|---|---|')
    for r in results:
        c = r['config']
        lines.append(
            f'| h={c["h"]} {r["mode"]} | {r["cp_sync_s"]:.2f} | {r["reshard_sync_s"]:.2f} | {r["ratio_sync"]:.2f}x | '
            f'{r["reshard_user_s"]:.1f} / {r["reshard_sys_s"]:.1f} | {r["maxrss_gib"]:.2f} GiB | '
            f'{r["out_bytes"] / gb:.2f} GB | {r["runs_cp"]} | {r["runs_reshard"]} |')
    others = [r for r in results if r.get('others')]
    if others:
        lines.append('')
        lines.append('| checkpoint | command | time (s) | vs cp -r | + sync (s) | vs cp -r + sync | written | '
                     'peak RSS tree | CPU user + sys (s) | vs reshard convert (+ sync) | runs |')
        lines.append('|---|---|---|---|---|---|---|---|---|---|---|')
        for r in others:
            for what, o in r['others'].items():
                lines.append(f'| h={r["config"]["h"]} {r["mode"]} | {what} | {o["seconds"]:.2f} | {o["ratio"]:.2f}x | '
                             f'{o["seconds_with_sync"]:.2f} | {o["ratio_sync"]:.2f}x | '
                             f'{o["written_mb"] / 1e3:.2f} GB | {o["peak_tree_gib"]:.2f} GiB | {o["cpu_s"]:.2f} | '
                             f'{o["seconds"] / r["reshard_s"]:.2f}x ({o["seconds_with_sync"] / r["reshard_sync_s"]:.2f}x) | '
                             f'{o["runs"]} |')
    lines.append('')
    lines.append('| checkpoint | command | CPU user + sys per GB written (s) | vs cp -r |')
    lines.append('|---|---|---|---|')
    for r in results:
        cpu = r['cpu_per_gb']
        for what, per_gb in cpu.items():
            lines.append(f'| h={r["config"]["h"]} {r["mode"]} | {what} | {per_gb:.3f} | {per_gb / cpu["cp"]:.2f}x |')
    peers = [r for r in results if r.get('deepspeed')]
    if peers:
        lines.append('')
        lines.append('| checkpoint | ds_to_universal (s) | vs reshard | vs cp -r | peak RSS tree | '
                     'storage I/O read / written | output | runs |')
        lines.append('|---|---|---|---|---|---|---|---|')
        for r in peers:
            d = r['deepspeed']
            if 'error' in d:
                lines.append(f'| h={r["config"]["h"]} {r["mode"]} | failed: {d["error"]} | | | | | | |')
            else:
                lines.append(f'| h={r["config"]["h"]} {r["mode"]} | {d["seconds"]:.2f} | {d["seconds"] / r["reshard_s"]:.2f}x | '
                             f'{d["seconds"] / r["cp_s"]:.2f}x | {d["peak_tree_gib"]:.2f} GiB | '
                             f'{d["io_read_bytes"] / gb:.2f} / {d["io_write_bytes"] / gb:.2f} GB | '
                             f'{d["out_bytes"] / gb:.2f} GB | {d["runs"]} |')
    for r in results:
        if r.get('mpi_same') is not None:
            lines.append('')
            lines.append(f'h={r["config"]["h"]} {r["mode"]}: the mpirun output is '
                         f'{"byte-identical to" if r["mpi_same"] else "DIFFERENT from"} one process\'s')
    same_mode = [r for r in results if r['mode'] == results[0]['mode']]
    if len(same_mode) >= 2:
        a, b = same_mode[0], same_mode[-1]
        lines.append('')
        lines.append(f'size ratio {a["src_bytes"] / b["src_bytes"]:.2f}x -> reshard peak RSS ratio '
                     f'{a["peak_rss_gib"] / b["peak_rss_gib"]:.2f}x (anonymous memory '
                     f'{a["peak_anon_gib"] / max(b["peak_anon_gib"], 1e-9):.2f}x)')
    return '\n'.join(lines)


def bench_xfs(ns) -> int:
    """--xfs: the reflink benchmark on the first checkpoint size."""
    info = ensure_checkpoint(ns.workdir, float(ns.scales.split(',')[0]), ns.reshard, style=ns.style)
    src = info['tag_dir']
    xfs = reflink_bench.bench_reflink(ns, src, folder_bytes(src), measure, remove, read_through)
    if ns.json:
        with open(ns.json, 'w') as f:
            json.dump({'machine': machine(ns.workdir), 'source': source_version(), 'xfs': xfs}, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--reshard', required=True, help='the reshard binary (a Release build)')
    ap.add_argument('--runs', type=int, default=5, help='timed runs of each command (median; default 5)')
    ap.add_argument('--threads', type=int, default=0, help='reshard --threads (default: reshard\'s own)')
    ap.add_argument('--scales', default='1,0.25',
                    help='checkpoint sizes relative to the full one (default 1,0.25)')
    ap.add_argument('--workdir', default=DEFAULT_WORKDIR,
                    help='where checkpoints and outputs go (default build-bench/work in the checkout; needs ~20 GB)')
    ap.add_argument('--keep', action='store_true',
                    help='keep the checkpoints and the last outputs (default: delete everything written)')
    ap.add_argument('--keep-checkpoints', action='store_true',
                    help='keep the checkpoints only (for cost_model.py to reuse), delete the outputs')
    ap.add_argument('--exports', action='store_true',
                    help='also time `export --to universal`, `--to consolidated` and `--to hf` of SRC, and '
                         '`convert` from its universal checkpoint, in the same alternation')
    ap.add_argument('--style', choices=('ms_gpt2', 'ms_llama'), default='ms_gpt2',
                    help='the benchmark checkpoint\'s model (make_checkpoint.py --style); with ms_llama, '
                         '--exports also times `export --to torchtitan --dp-shard 8`')
    ap.add_argument('--baseline', help='another reshard binary (e.g. a build of an earlier commit): '
                    'timed in the same alternation, ratios against cp -r and reshard')
    ap.add_argument('--modes', default='cold,warm',
                    help='page-cache modes, each a full alternation (default cold,warm): cold drops the cache '
                         'before every command; warm reads SRC into it first and never drops it')
    ap.add_argument('--buffer-sizes', default='',
                    help='also time reshard convert with these --buffer-size values, e.g. 128KiB,4MiB,16MiB')
    ap.add_argument('--crc-cost', action='store_true',
                    help='also time convert with --no-check-crc: the cost of the default CRC check')
    ap.add_argument('--mpi', type=int, default=0, metavar='N',
                    help='also time `mpirun -np N reshard convert` with the same total thread count, and '
                         'check that its output is byte-identical')
    ap.add_argument('--only', default='',
                    help='time only these commands (comma-separated names of the tables\' rows) beside cp and '
                         'reshard convert')
    ap.add_argument('--verify', action='store_true', help='also run `reshard verify SRC OUT` once (untimed)')
    ap.add_argument('--deepspeed-src', help='a DeepSpeed source tree: also time ds_to_universal.py')
    ap.add_argument('--xfs', action='store_true',
                    help='instead: time `convert --tp 2 --pp 2 --dp 4` (a DP-only change) against cp -r on a '
                         'loop-mounted XFS image with reflinks (root, xfsprogs), and report shared extents')
    ap.add_argument('--json', help='write the results here too')
    ns = ap.parse_args(argv)
    ns.reshard = os.path.abspath(ns.reshard)
    if ns.baseline:
        ns.baseline = os.path.abspath(ns.baseline)
    os.makedirs(ns.workdir, exist_ok=True)
    results = []
    started = time.monotonic()
    if ns.xfs:
        return bench_xfs(ns)
    try:
        for mode in ns.modes.split(','):
            for scale in (float(s) for s in ns.scales.split(',')):
                results.append(bench_scale(ns, scale, mode))
    finally:
        if not ns.keep:
            # Only what this script writes: --workdir may be a folder with other things in it.
            for name in os.listdir(ns.workdir):
                if (name.startswith('ckpt-scale') and not ns.keep_checkpoints) or name in ('cp-out', 'reshard-out', 'mpi-out', 'ds-universal-out',
                                                             'latest_universal'):
                    remove(os.path.join(ns.workdir, name))
            if not os.listdir(ns.workdir):
                os.rmdir(ns.workdir)
    print_results(ns, f'reshard convert SRC OUT {" ".join(TARGET)} -q'
                      f'{" --threads " + str(ns.threads) if ns.threads else ""}; {ns.runs} alternating runs, '
                      f'medians; modes: {ns.modes}; total {time.monotonic() - started:.0f} s',
                  table(results), results)
    return 0


if __name__ == '__main__':
    sys.exit(main())
