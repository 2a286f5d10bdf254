"""Faults during `reshard convert`: SIGKILL at many points, a full disk, a read-only target.

* SIGKILL: strace's fault injection (`-e inject=SYSCALL:signal=KILL:when=N`) kills the run at
  its N-th call of a system call, at points spread over a conversion with optimizer state:
  creating folders, opening, writing and flushing files, and every rename and flush of the
  commit. Half of the points convert into a fresh root, half replace an old OUT with
  --overwrite. After each kill: the input is unchanged; OUT is absent, the old OUT intact, or
  the complete new one (byte for byte the uninterrupted run's); `latest` never names a missing
  or partial folder; the same command run again completes (removing what the killed run left)
  and gives the uninterrupted run's files; run while the killed run was writing files, it reuses
  the files the killed run finished (its journal, each file's CRC checked again).
* A full disk (a small tmpfs) and a read-only file system: one line, exit 3, nothing left
  behind; with space freed the rerun succeeds.

Needs root (tmpfs) and strace, as CI has. Run:
/usr/bin/python3 tests/interop/test_faults.py --reshard build/reshard
"""
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture

run = support.reshard
LAYOUT = ('--tp', 1, '--pp', 4, '--dp', 4)
OLD_LAYOUT = ('--tp', 2, '--pp', 1, '--dp', 1)
# (system call, N): the run is killed at its N-th call (counted per thread).
KILL_POINTS = [('mkdir', 1), ('mkdir', 2)] + [('openat', n) for n in (40, 120, 200, 280, 330, 380, 410)] + \
              [('write', n) for n in (1, 3, 8, 15, 25)] + [('pwrite64', n) for n in (1, 3)] + \
              [('syncfs', 1)] + [('fsync', n) for n in range(1, 9)] + [('rename', n) for n in range(1, 5)] + \
              [('renameat2', 1), ('unlink', 1), ('unlinkat', 1)]


def digest(folder):
    """{relative path: sha256} of every file under `folder` ({} when it is absent); of the
    manifest, of its file list (its command line names the output folder)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            if name == support.MANIFEST:
                out[os.path.relpath(path, folder)] = support.manifest_files_digest(path)
                continue
            with open(path, 'rb') as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def read_text(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


class FaultTest(FixtureTestCase):

    def setUp(self):
        super().setUp()
        self.src = make_fixture(self.path('in'), tp=2, pp=2, dp=2, **dict(FAMILIES['ms_gpt2'], optimizer='bf16_zero'))
        self.src_digest = digest(self.path('in'))
        ref = self.path('ref', 'global_step10')
        self.assertEqual(run('convert', self.src, ref, *LAYOUT, '-q').returncode, 0)
        self.new = digest(ref)
        old = self.path('old', 'global_step10')
        self.assertEqual(run('convert', self.src, old, *OLD_LAYOUT, '-q').returncode, 0)
        self.old = digest(old)

    def killed_run(self, syscall, n, root, overwrite):
        args = [support.RESHARD, 'convert', self.src, os.path.join(root, 'global_step10'), *map(str, LAYOUT)]
        if overwrite:
            args.append('--overwrite')
        p = subprocess.run(['strace', '-f', '-qq', '-o', '/dev/null', '-e', f'trace={syscall}',
                            '-e', f'inject={syscall}:signal=KILL:when={n}', *args],
                           capture_output=True, text=True, timeout=300)
        return p.returncode

    def assert_consistent(self, root, overwrite, where):
        out = digest(os.path.join(root, 'global_step10'))
        states = [self.new] + ([self.old] if overwrite else [{}])
        self.assertIn(out, states, f'{where}: OUT is neither absent/old nor the complete new folder')
        latest = read_text(os.path.join(root, 'latest'))
        if latest is not None:
            self.assertEqual(latest, 'global_step10', where)
            self.assertTrue(out, f'{where}: latest names a missing folder')
        self.assertEqual(digest(self.path('in')), self.src_digest, f'{where}: the input changed')

    def test_sigkill_at_every_point_leaves_a_consistent_state(self):
        killed = resumed = 0
        for i, (syscall, n) in enumerate(KILL_POINTS):
            overwrite = i % 2 == 1
            where = f'{syscall} #{n} ({"--overwrite" if overwrite else "fresh"})'
            with self.subTest(point=where):
                root = self.path(f'kill{i}')
                if overwrite:
                    shutil.copytree(self.path('old'), root)
                rc = self.killed_run(syscall, n, root, overwrite)
                self.assertIn(rc, (0, -9, 137), where)
                killed += rc != 0
                self.assert_consistent(root, overwrite, where)
                out = os.path.join(root, 'global_step10')
                again = ['convert', self.src, out, *LAYOUT]
                if overwrite or (os.path.isdir(out) and os.listdir(out)):  # killed after the commit
                    again.append('--overwrite')
                p = run(*again)
                self.assertEqual(p.returncode, 0, f'{where}: rerun: {p.stderr}')
                resumed += 'resumed the killed run' in p.stdout
                self.assertEqual(digest(os.path.join(root, 'global_step10')), self.new, where)
                self.assertEqual(read_text(os.path.join(root, 'latest')), 'global_step10', where)
                left = sorted(n for n in os.listdir(root) if 'reshard' in n)
                self.assertEqual(left, [], f'{where}: left behind after the rerun')
        print(f'\n{killed} of {len(KILL_POINTS)} kill points reached; {resumed} reruns resumed the killed '
              'run\'s output', flush=True)
        self.assertGreaterEqual(killed, 20)
        self.assertGreaterEqual(resumed, 3)  # the same command after a kill while files were written

    def test_a_rerun_reuses_what_the_killed_run_finished(self):
        root = self.path('resume')
        self.assertEqual(self.killed_run('write', 20, root, overwrite=False), -9)
        out = os.path.join(root, 'global_step10')
        p = run('convert', self.src, out, *LAYOUT)
        self.assertEqual(p.returncode, 0, p.stderr)
        reused = re.search(r'resumed the killed run\'s output \(global_step10\.reshard-partial-\d+\): '
                           r'(\d+) of (\d+) jobs reused', p.stdout)
        self.assertIsNotNone(reused, p.stdout)
        self.assertGreater(int(reused.group(1)), 0)
        self.assertLess(int(reused.group(1)), int(reused.group(2)))
        self.assertEqual(digest(out), self.new)  # byte for byte the uninterrupted run's
        self.assertEqual(sorted(n for n in os.listdir(root) if 'reshard' in n), [])
        self.assertEqual(run('verify', out).returncode, 0)


@unittest.skipUnless(os.geteuid() == 0, 'mounting a tmpfs needs root')
class FullAndReadOnlyDiskTest(FixtureTestCase):

    def mount(self, *options):
        point = tempfile.mkdtemp(prefix='reshard-tmpfs-')
        subprocess.run(['mount', '-t', 'tmpfs', '-o', ','.join(options), 'tmpfs', point], check=True)
        self.addCleanup(os.rmdir, point)
        self.addCleanup(subprocess.run, ['umount', point], check=True)
        return point

    def test_full_disk_is_one_line_and_leaves_nothing(self):
        src = make_fixture(self.path('in'), tp=2, pp=2, dp=2, **dict(FAMILIES['ms_gpt2'], optimizer='bf16_zero'))
        disk = self.mount('size=3m')
        filler = os.path.join(disk, 'filler')
        with open(filler, 'wb') as f:
            f.write(b'\0' * 2_000_000)
        out = os.path.join(disk, 'ckpt', 'global_step10')
        p = run('convert', src, out, *LAYOUT)
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn('No space left on device', p.stderr)
        self.assertEqual(os.listdir(disk), ['filler'])  # not even the folders it made
        os.remove(filler)
        p = run('convert', src, out, *LAYOUT)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(read_text(os.path.join(disk, 'ckpt', 'latest')), 'global_step10')

    def test_read_only_target_is_one_line(self):
        src = make_fixture(self.path('in'), tp=2, pp=2, dp=2, **dict(FAMILIES['ms_gpt2'], optimizer='bf16_zero'))
        disk = self.mount('ro', 'size=3m')
        p = run('convert', src, os.path.join(disk, 'ckpt', 'global_step10'), *LAYOUT)
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn('Read-only file system', p.stderr)
        self.assertEqual(os.listdir(disk), [])


if __name__ == '__main__':
    support.main()
