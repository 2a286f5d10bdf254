"""Conversion at scale, tested small: several processes, the memory budget, dry-run figures.

* ``mpirun -np 2 reshard convert`` checks the zip records the two processes read between them as one
  process does (a damaged byte is refused);
* ``mpirun -np 2 reshard convert`` writes the same files, byte for byte, as one process, and
  ``latest`` once (rank 0, after both ranks finished); rank 0 prints the one summary, the whole
  job's, and its last progress line counts the whole job's files and bytes, as one process's does;
  a dry run announces the whole job's files and bytes, once.
* ``mpirun -np 2 reshard export --to consolidated`` shares the byte ranges of one big file
  between the processes and writes what one process does, manifest included; the summary and
  the last progress line count the file once and all its bytes.
* ``mpirun -np 2 reshard verify`` shares the comparisons and prints the report one process does;
  its last progress line counts every tensor, as one process's does.
* ``--max-memory`` holds: converting a checkpoint larger than the budget keeps the process's
  peak resident memory (the kernel's high-water mark, mapped file pages included) under it.
* ``--dry-run`` announces exactly the files and tensor bytes the real run then writes, and a
  memory estimate within the budget.

Run: /usr/bin/python3 tests/interop/test_scale.py --reshard build/reshard
"""
import filecmp
import os
import re
import shutil
import subprocess
import sys
import unittest

from fixtures import deepspeed_nonpipe as dn
from fixtures import megatron_fixture as mf

import interop_support as support
from test_hostile_inputs import flip_byte_in_record

MiB = 1 << 20
# Runs argv[1:] and prints its output, then "peak <bytes>" (wait4's high-water mark).
LAUNCHER = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
out = p.stdout.read()
_, status, usage = os.wait4(p.pid, 0)
sys.stdout.write(out + 'peak %d' % (usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT='1', OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1',
               OMPI_MCA_rmaps_base_oversubscribe='1')
# Not on a terminal (stderr is a pipe here, as it is for every rank under mpirun), a progress line
# each time the engine reports (about once a second) and the last one, however short the run.
EVERY_LINE = ['--progress-interval', '0']


def last_progress(stderr):
    """The counts of the last progress line: '46/46 files, 1.23 MiB of 1.23 MiB'."""
    counts = re.findall(r'^(\d+/\d+ \w+, [\d.]+ \w+ of [\d.]+ \w+),.*done in', stderr, re.M)
    return counts[-1] if counts else None


def summaries(stdout):
    """The 'wrote ...' summary lines."""
    return re.findall(r'^.*wrote \d+ files.*$', stdout, re.M)


def same_tree(a, b):
    """Names in folder a or b that are not the same file in both (folders always count; a
    manifest names its run, so only its file lists must agree)."""
    def same(n):
        x, y = os.path.join(a, n), os.path.join(b, n)
        if not (os.path.isfile(x) and os.path.isfile(y)):
            return False
        if n == support.MANIFEST:
            return support.manifest_files_digest(x) == support.manifest_files_digest(y)
        return filecmp.cmp(x, y, shallow=False)
    return [n for n in sorted(set(os.listdir(a)) | set(os.listdir(b))) if not same(n)]


class ScaleTest(support.FixtureTestCase):

    @unittest.skipUnless(shutil.which('mpirun'), 'Open MPI (mpirun) is not installed')
    def test_two_processes_write_what_one_does(self):
        src = support.make_fixture(self.path('src'), optimizer='bf16_zero', tp=2, pp=2, dp=2,
                                   **support.FAMILIES['ms_gpt2'])
        target = ['--tp', 1, '--pp', 3, '--dp', 3, *EVERY_LINE]
        one = support.reshard('convert', src, self.path('one', 'out'), *target)
        self.assertEqual(one.returncode, 0, one.stderr)
        mpi = subprocess.run(['mpirun', '-np', '2', support.RESHARD, 'convert', src,
                              self.path('two', 'out'), *map(str, target)],
                             env=MPI_ENV, capture_output=True, text=True, timeout=300)
        self.assertEqual(mpi.returncode, 0, mpi.stdout + mpi.stderr)
        self.assertEqual(same_tree(self.path('one', 'out'), self.path('two', 'out')), [])
        # latest (and latest_checkpointed_iteration.txt) as one process writes them
        self.assertEqual(same_tree(self.path('one'), self.path('two')), ['out'])
        with open(self.path('two', 'latest')) as f:
            self.assertEqual(f.read().strip(), 'out')
        # One summary, the whole job's: every file, the manifest too.
        self.assertEqual(len(summaries(mpi.stdout)), 1, mpi.stdout)
        self.assertNotRegex(mpi.stdout, re.compile(r'^rank \d+: ', re.M))
        figures = lambda stdout: re.search(r'^wrote (\d+) files, .* (\d+) of tensors\)', stdout, re.M).groups()
        self.assertEqual(figures(mpi.stdout), figures(one.stdout))
        self.assertEqual(int(figures(mpi.stdout)[0]), len(os.listdir(self.path('one', 'out'))))
        # Rank 0's last progress line is the whole job's, as one process's last line.
        whole = last_progress(one.stderr)
        self.assertRegex(whole or '', r'^(\d+)/\1 files, ', one.stderr)
        self.assertEqual(int(whole.split('/')[0]), len(os.listdir(self.path('one', 'out'))) - 1)  # no manifest
        self.assertEqual(last_progress(mpi.stderr), whole, mpi.stderr)
        self.assertEqual(len(re.findall(r'done in', mpi.stderr)), 1, mpi.stderr)
        # A dry run announces the whole job's files and bytes, once.
        dry = subprocess.run(['mpirun', '-np', '2', support.RESHARD, 'convert', src, self.path('dry', 'out'),
                              '--tp', '1', '--pp', '3', '--dp', '3', '--dry-run', '-q'],
                             env=MPI_ENV, capture_output=True, text=True, timeout=300)
        self.assertEqual(dry.returncode, 0, dry.stdout + dry.stderr)
        announced = re.findall(r'^dry run: nothing written; would write (\d+) files, (\d+) bytes of tensors',
                               dry.stdout, re.M)
        self.assertEqual(announced, [figures(one.stdout)], dry.stdout)

    @unittest.skipUnless(shutil.which('mpirun'), 'Open MPI (mpirun) is not installed')
    def test_two_processes_check_the_records_they_read_between_them(self):
        """A TP split reads each split tensor's zip record in halves, one for each target rank's file,
        which the two processes write one each: the pieces they read are joined, so such a record is
        checked as one process checks it (a damaged byte is refused, nothing written), and the note
        counts the records left read in part as one process's does."""
        src = support.make_fixture(self.path('src'), optimizer='none', tp=1, pp=1, dp=1,
                                   **support.FAMILIES['ms_gpt2'])
        target = ['--tp', '2', '--pp', '1', '--dp', '1']
        partly = lambda stdout: re.findall(r'note: (\d+) zip record\(s\) were read only in part', stdout)
        one = support.reshard('convert', src, self.path('one', 'out'), *target)
        self.assertEqual(one.returncode, 0, one.stderr)
        mpi = subprocess.run(['mpirun', '-np', '2', support.RESHARD, 'convert', src, self.path('two', 'out'), *target],
                             env=MPI_ENV, capture_output=True, text=True, timeout=300)
        self.assertEqual(mpi.returncode, 0, mpi.stdout + mpi.stderr)
        self.assertEqual(len(partly(one.stdout)), 1, one.stdout)
        self.assertEqual(partly(mpi.stdout), partly(one.stdout))
        # The biggest record of a block: the MLP's first matrix, split by rows.
        record = flip_byte_in_record(os.path.join(src, 'layer_03-model_00-model_states.pt'), min_size=13824)
        bad = subprocess.run(['mpirun', '-np', '2', support.RESHARD, 'convert', src, self.path('bad', 'out'), *target],
                             env=MPI_ENV, capture_output=True, text=True, timeout=300)
        self.assertNotEqual(bad.returncode, 0, bad.stdout + bad.stderr)
        self.assertIn(f'record {record} does not have the CRC-32', bad.stderr)
        self.assertFalse(os.path.exists(self.path('bad', 'out')))

    @unittest.skipUnless(shutil.which('mpirun'), 'Open MPI (mpirun) is not installed')
    def test_two_processes_share_the_ranges_of_one_file(self):
        cfg = dn.NonPipeConfig(zero_stage=2, dtype='bf16', dp=2, L=1, n_heads=4, n_kv=2,
                               head_dim=16, ffn=64, h=512, V=10240)  # a 42 MB model.safetensors
        src = self.path('src')
        dn.write_nonpipe(src, cfg)
        one = support.reshard('export', src, self.path('one'), '--to', 'consolidated', *EVERY_LINE)
        self.assertEqual(one.returncode, 0, one.stderr)
        mpi = subprocess.run(['mpirun', '-np', '2', support.RESHARD, 'export', src, self.path('two'),
                              '--to', 'consolidated', '--threads', '1', *EVERY_LINE],
                             env=MPI_ENV, capture_output=True, text=True, timeout=300)
        self.assertEqual(mpi.returncode, 0, mpi.stdout + mpi.stderr)
        # Both processes wrote ranges of the one file: the one summary counts it once, and its
        # bytes as one process's.
        self.assertEqual(len(summaries(mpi.stdout)), 1, mpi.stdout)
        written = re.search(r'^wrote (\d+) files, .* \((\d+) bytes,', mpi.stdout, re.M)
        alone = re.search(r'wrote (\d+) files, .* \((\d+) bytes,', one.stdout)
        self.assertEqual(written.group(1), alone.group(1))
        manifest = lambda out: os.path.getsize(self.path(out, support.MANIFEST))  # names its command
        self.assertEqual(int(written.group(2)) - manifest('two'), int(alone.group(2)) - manifest('one'))
        self.assertEqual(same_tree(self.path('one'), self.path('two')), [])
        self.assertEqual(last_progress(mpi.stderr), last_progress(one.stderr), mpi.stderr)
        self.assertRegex(last_progress(one.stderr) or '', r'^1/1 files, ', one.stderr)
        self.assertEqual(support.reshard('verify', self.path('two')).returncode, 0)

    @unittest.skipUnless(shutil.which('mpirun'), 'Open MPI (mpirun) is not installed')
    def test_two_processes_verify_as_one_does(self):
        model = dict(optimizer='bf16_zero', tp=2, pp=2, dp=2, **support.FAMILIES['ms_gpt2'])
        src = support.make_fixture(self.path('src'), **model)
        other = support.make_fixture(self.path('other'), seed=99, **model)
        converted = self.path('converted', 'out')
        done = support.reshard('convert', src, converted, '--tp', 1, '--pp', 3, '--dp', 3, '-q')
        self.assertEqual(done.returncode, 0, done.stderr)
        for b, code in ((converted, 0), (other, 1)):
            with self.subTest(b=os.path.basename(os.path.dirname(b))):
                one = support.reshard('verify', src, b, *EVERY_LINE)
                self.assertEqual(one.returncode, code, one.stdout + one.stderr)
                mpi = subprocess.run(['mpirun', '-np', '2', support.RESHARD, 'verify', src, b, *EVERY_LINE],
                                     env=MPI_ENV, capture_output=True, text=True, timeout=300)
                self.assertEqual(mpi.returncode, code, mpi.stdout + mpi.stderr)
                # Rank 0 alone prints the whole report, every difference in one process's order,
                # and its last progress line counts every tensor compared.
                self.assertEqual(mpi.stdout, one.stdout)
                self.assertRegex(last_progress(one.stderr) or '', r'^(\d+)/\1 tensors, ', one.stderr)
                self.assertEqual(last_progress(mpi.stderr), last_progress(one.stderr), mpi.stderr)
                if code:
                    self.assertGreater(one.stdout.count('differs: '), 10)


class MemoryBudgetTest(support.FixtureTestCase):
    """One checkpoint of ~400 MB (a 32k vocabulary at hidden 512 with Adam state)."""
    BUDGET = 320 * MiB
    MODEL = dict(style='ms_gpt2', L=4, h=512, n=8, ffn=2048, V=32000, mvsdb=128, dtype='bf16',
                 optimizer='bf16_zero')

    def setUp(self):
        super().setUp()
        self.src = support.make_fixture(self.path('src'), tp=2, pp=2, dp=2, **self.MODEL)
        self.size = sum(os.path.getsize(os.path.join(self.src, n)) for n in os.listdir(self.src))

    def convert(self, out, *extra):
        """Runs the conversion; returns its output and its peak resident memory in bytes."""
        args = [support.RESHARD, 'convert', self.src, out, '--tp', 1, '--pp', 4, '--dp', 4,
                '--max-memory', self.BUDGET, '-q', *extra]
        # A small launcher: a forked child's ru_maxrss includes the parent's memory at the fork
        # (this test process holds torch), the launcher's is a few MiB.
        p = subprocess.run([sys.executable, '-c', LAUNCHER, *map(str, args)], capture_output=True,
                           text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        output, peak = p.stdout.rsplit('peak ', 1)
        return output, int(peak)

    def test_budget_holds_and_dry_run_figures_match(self):
        self.assertGreater(self.size, self.BUDGET)  # holding the checkpoint would not fit
        plan, _ = self.convert(self.path('dry'), '--dry-run')
        planned = re.search(r'would write (\d+) files, (\d+) bytes of tensors.*memory about '
                            r'([\d.]+) MiB', plan)
        self.assertIsNotNone(planned, plan)
        self.assertLessEqual(float(planned.group(3)) * MiB, self.BUDGET)
        self.assertFalse(os.path.exists(self.path('dry')))

        summary, peak = self.convert(self.path('out'))
        self.assertLessEqual(peak, self.BUDGET, summary)
        wrote = re.search(r'wrote (\d+) files, .* \(\d+ bytes, (\d+) of tensors\)', summary)
        self.assertIsNotNone(wrote, summary)
        self.assertEqual(wrote.groups(), planned.groups()[:2])
        names = os.listdir(self.path('out'))
        self.assertEqual(len(names), int(wrote.group(1)))
        on_disk = sum(os.path.getsize(self.path('out', n)) for n in names)
        self.assertGreaterEqual(on_disk, int(wrote.group(2)))
        self.assertLess(on_disk, int(wrote.group(2)) * 1.01 + MiB)
        # The result is the same model and optimizer state.
        cfg = mf.FixtureConfig(tp=1, pp=4, dp=4, **self.MODEL)
        self.assertEqual(mf.compare_with_canonical(mf.load_logical(self.path('out'), cfg), cfg), [])


if __name__ == '__main__':
    support.main()
