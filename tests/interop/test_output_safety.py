"""The input is never modified and the output appears whole, whatever the paths and the timing.

* The input's `latest` is never rewritten: a tag path with a trailing slash, `/.` or through a
  symlink is resolved before comparing, and an output beside the input is refused.
* `--vocab-size` that cannot be the checkpoint's (not positive, contradicting the recorded size,
  beyond the vocabulary rows) is refused; out-of-range `--tp`, `--pp`, `--dp`, `--threads` too.
* `--overwrite` replaces OUT in one exchange and leaves nothing beside it.
* What a killed run left beside OUT (its staging folder) is removed by the next run, and said.
* A second run writing the same OUT while one holds it is refused.
* SIGINT, SIGTERM or SIGHUP during a conversion: the process dies of the signal and leaves
  nothing beside OUT; a file-size limit (SIGXFSZ) is a clean I/O error.
* An input file that shrinks or is rewritten during the run: exit 3, a line naming it, OUT not
  published (a read past the new end is a SIGBUS, reported; other changes are found at commit).
* When `latest` cannot be replaced, the run is refused before writing anything: the root's state
  (latest_checkpointed_iteration.txt included) is unchanged and no temporary file is left.

Each refusal: exit 2 (3 for I/O), one line on stderr, nothing written, the input's bytes unchanged.

Run: /usr/bin/python3 tests/interop/test_output_safety.py --reshard build/reshard
"""
import fcntl
import hashlib
import os
import signal
import subprocess
import time

import interop_support as support
from interop_support import FixtureTestCase, make_fixture

run = support.reshard
MODEL = dict(support.FAMILIES['ms_gpt2'], optimizer='bf16_zero', tp=2, pp=2, dp=1)


def tree_digest(root):
    """sha256 over every file's path and bytes under root."""
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, 'rb') as f:
                h.update(f.read())
    return h.hexdigest()


class OutputSafetyTest(FixtureTestCase):

    def setUp(self):
        super().setUp()
        self.tag = make_fixture(self.path('ckpt'), **MODEL)
        self.root = os.path.dirname(self.tag)
        self.before = tree_digest(self.root)

    def assertRefused(self, p, text, code=2):
        self.assertEqual(p.returncode, code, p.stdout + p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn(text, p.stderr)

    def assertInputUnchanged(self):
        self.assertEqual(tree_digest(self.root), self.before)

    def test_input_latest_is_never_rewritten(self):
        os.symlink(self.tag, self.path('link'))
        for source in (self.tag + '/', self.tag + '/.', os.path.join(self.root, '.', 'global_step10'),
                       self.path('link')):
            with self.subTest(source=source):
                p = run('convert', source, os.path.join(self.root, 'global_step20'), '--tp', 1, '--pp', 1)
                self.assertRefused(p, "whose 'latest' it would replace")
                self.assertInputUnchanged()

    def test_impossible_arguments_are_refused(self):
        out = self.path('out', 'x')
        for args, text in ((['--vocab-size', 0], 'a vocabulary has at least one token'),
                           (['--vocab-size', -3], 'a vocabulary has at least one token'),
                           (['--vocab-size', 50], 'contradicts the checkpoint, which records a vocabulary of 100'),
                           (['--vocab-size', 10 ** 6], 'contradicts the checkpoint'),
                           (['--dp', 0], '--dp'), (['--dp', 10 ** 8], '--dp'), (['--threads', 5000], '--threads')):
            with self.subTest(args=args):
                p = run('convert', self.tag, out, '--tp', 1, '--pp', 1, *args)
                self.assertRefused(p, text)
                self.assertFalse(os.path.exists(out))
        self.assertRefused(run('convert', self.tag, out, '--tp', 0, '--pp', 1), '--tp')
        self.assertInputUnchanged()

    def test_overwrite_exchanges_and_leaves_nothing(self):
        out = self.path('out', 'global_step10')
        self.assertEqual(run('convert', self.tag, out, '--tp', 1, '--pp', 1, '-q').returncode, 0)
        first = sorted(os.listdir(out))
        p = run('convert', self.tag, out, '--tp', 2, '--pp', 1, '-q')
        self.assertRefused(p, 'is not empty; pass --overwrite')
        p = run('convert', self.tag, out, '--tp', 2, '--pp', 1, '--overwrite', '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertNotEqual(sorted(os.listdir(out)), first)
        self.assertIn('layer_01-model_01-model_states.pt', os.listdir(out))
        self.assertEqual(sorted(n for n in os.listdir(self.path('out')) if 'reshard' in n), [])
        self.assertInputUnchanged()

    def test_leftovers_of_killed_runs_are_removed_and_said(self):
        out = self.path('out', 'global_step10')
        dead = self.path('out', 'global_step10.reshard-partial-999999999')
        os.makedirs(dead)
        with open(os.path.join(dead, 'layer_01-model_00-model_states.pt'), 'wb') as f:
            f.write(b'half a file')
        alive = self.path('out', f'global_step10.reshard-partial-{os.getpid()}')  # a running process
        os.makedirs(alive)
        p = run('convert', self.tag, out, '--tp', 1, '--pp', 1)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('removed global_step10.reshard-partial-999999999, left beside the output by a run '
                      'that was killed', p.stdout)
        self.assertFalse(os.path.exists(dead))
        self.assertTrue(os.path.exists(alive))

    def test_a_second_writer_of_one_output_is_refused(self):
        out = self.path('out', 'global_step10')
        os.makedirs(self.path('out'))
        with open(self.path('out', '.global_step10.reshard-lock'), 'w') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # as a running reshard holds it
            p = run('convert', self.tag, out, '--tp', 1, '--pp', 1)
            self.assertRefused(p, 'another reshard is writing')
        self.assertFalse(os.path.exists(out))
        self.assertEqual(run('convert', self.tag, out, '--tp', 1, '--pp', 1, '-q').returncode, 0)
        self.assertFalse(os.path.exists(self.path('out', '.global_step10.reshard-lock')))

    def test_latest_that_cannot_be_replaced_changes_nothing_else(self):
        out_root = self.path('out')
        os.makedirs(os.path.join(out_root, 'latest'))  # a folder where the file goes
        with open(os.path.join(out_root, 'latest_checkpointed_iteration.txt'), 'w') as f:
            f.write('5')
        p = run('convert', self.tag, os.path.join(out_root, 'global_step10'), '--tp', 1, '--pp', 1)
        self.assertRefused(p, 'it is a folder; move it away')
        self.assertFalse(os.path.exists(os.path.join(out_root, 'global_step10')))
        with open(os.path.join(out_root, 'latest_checkpointed_iteration.txt')) as f:
            self.assertEqual(f.read(), '5')
        self.assertEqual(sorted(n for n in os.listdir(out_root) if 'reshard-tmp' in n), [])

    def test_interrupted_runs_leave_nothing(self):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            with self.subTest(signal=sig.name):
                proc, out, _ = self.start_big_conversion(sig.name)
                parent = os.path.dirname(out)
                proc.send_signal(sig)
                proc.communicate(timeout=60)
                if proc.returncode == 0:
                    self.skipTest('the conversion finished before the signal')
                self.assertEqual(proc.returncode, -sig)  # it dies of the signal
                # The folder reshard made for OUT may be gone too: a worker whose staging folder
                # was removed under it can fail first, and that error path removes the folders
                # the run created before the signal ends the process.
                left = os.listdir(parent) if os.path.isdir(parent) else []
                self.assertEqual(left, [], f'{sig.name} left {left}')

    def start_big_conversion(self, name):
        """A conversion still writing when this returns: (process, OUT, the tag it reads)."""
        tag = make_fixture(self.path(name), **dict(MODEL, h=512, ffn=1024, n=8, V=8192, L=4))
        out = self.path(f'{name}_out', 'global_step10')
        proc = subprocess.Popen([support.RESHARD, 'convert', tag, out, '--tp', '1', '--pp', '1',
                                 '--threads', '1', '--max-memory', '256MiB', '-q'],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        parent = os.path.dirname(out)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                os.path.isdir(parent) and any('reshard-partial' in n for n in os.listdir(parent))):
            time.sleep(0.002)
        return proc, out, tag

    def test_an_input_changed_during_the_run_is_not_published(self):
        for change in ('shrink', 'touch'):
            with self.subTest(change=change):
                proc, out, tag = self.start_big_conversion(change)
                victim = os.path.join(tag, 'layer_01-model_01-model_states.pt')  # the embedding, read late
                if change == 'shrink':
                    os.truncate(victim, 4096)
                else:
                    os.utime(victim, ns=(time.time_ns(), time.time_ns() + 10 ** 9))
                _, err = proc.communicate(timeout=120)
                if proc.returncode == 0:
                    self.skipTest('the conversion finished before the change')
                self.assertEqual(proc.returncode, 3, err)
                self.assertIn(victim, err)
                self.assertIn('while reshard was reading it; nothing was published', err)
                self.assertFalse(os.path.exists(out))

    def test_file_size_limit_is_a_clean_error(self):
        out = self.path('out', 'global_step10')
        limit = 'ulimit -f 100 && exec "$@"'  # 100 blocks of 512 bytes: the first big file fails
        p = subprocess.run(['sh', '-c', limit, 'sh', support.RESHARD, 'convert', self.tag, out,
                            '--tp', '1', '--pp', '1', '-q'], capture_output=True, text=True, timeout=120)
        self.assertRefused(p, 'File too large', code=3)
        self.assertEqual(os.listdir(self.path('out')) if os.path.exists(self.path('out')) else [], [])


if __name__ == '__main__':
    support.main()
