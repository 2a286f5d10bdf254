"""run.py --xfs: a DP-only change on a file system with reflinks, against `cp -r`.

On XFS made with reflink=1, `cp -r` (coreutils 9's --reflink=auto) clones every file: it
shares the source's extents and writes no data. This part of the benchmark makes such a file
system in a loop-mounted image under --workdir, copies the benchmark checkpoint into it, and
times `cp -r` against `reshard convert SRC OUT --tp 2 --pp 2 --dp 4` (the source's TP and PP:
only DP changes, so the layer files are the source's bytes), and `cp -r --reflink=never` (a copy
of every byte, for scale), alternating as run.py does, in
each page-cache mode. It then reports how many bytes of the output's layer files, and of its
other files, share extents with another file (filefrag's `shared` flag), for reshard's
output and for cp's.

It needs root (mount), a loop device and mkfs.xfs (Debian: apt-get install xfsprogs); where
one is missing it prints one line saying which and times nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
from typing import Callable, Dict, List, Optional, Tuple

DP_ONLY_TARGET = ['--tp', '2', '--pp', '2', '--dp', '4']  # make_checkpoint.py writes TP 2 / PP 2 / DP 2

# An extent line of `filefrag -v`: "  0:  0..  255:  34816..  35071:  256:  last,shared,eof".
EXTENT_RE = re.compile(r'^\s*\d+:\s+\d+\.\.\s*\d+:\s+\d+\.\.\s*\d+:\s+(\d+):(.*)$')


def missing_requirement() -> Optional[str]:
    """Why the XFS benchmark cannot run here, or None."""
    if os.geteuid() != 0:
        return 'needs root (to mount the image)'
    for tool in ('mkfs.xfs', 'mount', 'umount', 'filefrag'):
        if shutil.which(tool) is None:
            return f'needs {tool} (Debian: apt-get install xfsprogs e2fsprogs)'
    if not os.path.exists('/dev/loop-control'):
        return 'needs a loop device (/dev/loop-control is missing)'
    return None


class XfsImage:
    """A sparse image file with an XFS file system (reflink=1), mounted while in use."""

    def __init__(self, path: str, size_bytes: int):
        self.path = path
        self.size = size_bytes
        self.mount_point = path + '.mnt'

    def __enter__(self) -> str:
        with open(self.path, 'wb') as f:
            f.truncate(self.size)
        os.makedirs(self.mount_point, exist_ok=True)
        try:
            subprocess.run(['mkfs.xfs', '-q', '-f', '-m', 'reflink=1', self.path], check=True)
            subprocess.run(['mount', '-o', 'loop', self.path, self.mount_point], check=True)
        except (OSError, subprocess.CalledProcessError):
            self._remove()
            raise
        return self.mount_point

    def __exit__(self, *exc) -> None:
        subprocess.run(['umount', self.mount_point], check=False)  # frees the loop device too
        self._remove()

    def _remove(self) -> None:
        if os.path.isdir(self.mount_point) and not os.path.ismount(self.mount_point):
            os.rmdir(self.mount_point)
        if os.path.exists(self.path):
            os.remove(self.path)


def shared_bytes(path: str) -> Tuple[int, int]:
    """(bytes in extents flagged shared, bytes in all extents) of the file, from `filefrag -v`."""
    text = subprocess.run(['filefrag', '-v', '-b4096', path], check=True, capture_output=True, text=True).stdout
    shared = total = 0
    for line in text.splitlines():
        m = EXTENT_RE.match(line)
        if m:
            n = int(m.group(1)) * 4096
            total += n
            if 'shared' in m.group(2):
                shared += n
    return shared, total


def sharing(folder: str) -> Dict[str, Tuple[int, int]]:
    """Shared and total extent bytes of the folder's layer files and of its other files."""
    out = {'layer files': (0, 0), 'other files': (0, 0)}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            kind = 'layer files' if name.startswith('layer_') else 'other files'
            s, t = shared_bytes(os.path.join(dirpath, name))
            out[kind] = (out[kind][0] + s, out[kind][1] + t)
    return out


def bench_reflink(ns, src: str, src_bytes: int, measure: Callable, remove: Callable[[str], None],
                  read_through: Callable[[str], None]) -> Dict:
    """Times cp -r and the DP-only change on XFS; returns the figures (or why it did not run)."""
    why = missing_requirement()
    if why:
        print(f'xfs: skipped: {why}', flush=True)
        return {'skipped': why}
    image = os.path.join(ns.workdir, 'xfs.img')
    # The source, reshard's output (its optimizer files are new bytes) and room to spare.
    with XfsImage(image, 3 * src_bytes + (4 << 30)) as mnt:
        xsrc = os.path.join(mnt, 'src', os.path.basename(src))
        os.makedirs(os.path.dirname(xsrc))
        subprocess.run(['cp', '-r', '--reflink=never', src, xsrc], check=True)
        cp_dst, out = os.path.join(mnt, 'cp-out'), os.path.join(mnt, 'reshard-out', os.path.basename(src))
        copy_dst = os.path.join(mnt, 'copy-out')
        # What each command writes (removed before it runs again), and the command.
        commands = {'cp': (cp_dst, ['cp', '-r', xsrc, cp_dst]),
                    'reshard': (os.path.dirname(out), [ns.reshard, 'convert', xsrc, out] + DP_ONLY_TARGET + ['-q']),
                    # A copy of every byte on the same image, for scale.
                    'cp --reflink=never': (copy_dst, ['cp', '-r', '--reflink=never', xsrc, copy_dst])}
        results = {}
        for mode in ns.modes.split(','):
            runs: Dict[str, List[Dict]] = {what: [] for what in commands}
            if mode == 'warm':
                read_through(xsrc)
            for i in range(ns.runs):
                names = list(commands)
                order = names[i % len(names):] + names[:i % len(names)]  # each goes first in turn
                for what in order:
                    written, cmd = commands[what]
                    remove(written)
                    runs[what].append(measure(cmd, cold=mode == 'cold'))
                    print(f'  xfs {mode} run {i + 1}/{ns.runs} {what:8s} {runs[what][-1]["seconds"]:6.2f} s '
                          f'(+sync {runs[what][-1]["seconds_with_sync"]:6.2f} s)', flush=True)
            results[mode] = {what: summarize(r, src_bytes) for what, r in runs.items()}
        # The last run of each is still there.
        results['sharing'] = {'reshard': sharing(out), 'cp': sharing(cp_dst)}
        remove(copy_dst)  # its blocks are the image's: the next runs need the room
    print_reflink(ns, results)
    return results


def summarize(runs: List[Dict], src_bytes: int) -> Dict:
    cpu = statistics.median(r['user'] + r['sys'] for r in runs)
    return {'seconds': statistics.median(r['seconds'] for r in runs),
            'seconds_with_sync': statistics.median(r['seconds_with_sync'] for r in runs),
            'cpu': cpu, 'cpu_per_gb': cpu / (src_bytes / 1e9),
            'runs': [round(r['seconds_with_sync'], 2) for r in runs]}


def print_reflink(ns, results: Dict) -> None:
    print(f'\nxfs (reflink=1, loop image): reshard convert SRC OUT {" ".join(DP_ONLY_TARGET)} -q against cp -r '
          f'(which clones) and cp -r --reflink=never; '
          f'{ns.runs} alternating runs, medians')
    print('| mode | command | time (s) | + sync (s) | vs cp -r (+ sync) | CPU user + sys (s) | CPU per GB of SRC | '
          'runs (+ sync) |')
    print('|---|---|---|---|---|---|---|---|')
    for mode in ns.modes.split(','):
        cp = results[mode]['cp']
        for what, r in results[mode].items():
            print(f'| {mode} | {what} | {r["seconds"]:.2f} | {r["seconds_with_sync"]:.2f} | '
                  f'{r["seconds_with_sync"] / cp["seconds_with_sync"]:.2f}x | {r["cpu"]:.2f} | '
                  f'{r["cpu_per_gb"]:.3f} | {r["runs"]} |')
    print('\n| output | files | shared extents / all (GB) |')
    print('|---|---|---|')
    for what, kinds in results['sharing'].items():
        for kind, (shared, total) in kinds.items():
            print(f'| {what} | {kind} | {shared / 1e9:.3f} / {total / 1e9:.3f} |')
