"""The input is never modified and the output appears whole, whatever the paths and the timing.

* The input's `latest` is never rewritten: a tag path with a trailing slash, `/.` or through a
  symlink is resolved before comparing, and an output beside the input is refused.
* `--vocab-size` that cannot be the checkpoint's (not positive, contradicting the recorded size,
  beyond the vocabulary rows) is refused; out-of-range `--tp`, `--pp`, `--dp`, `--threads` too.
* `--overwrite` replaces OUT in one exchange and leaves nothing beside it.
* What a killed run left beside OUT (its staging folder) is removed by the next run, and said.
* A second run writing the same OUT while one holds it is refused.
* SIGINT, SIGTERM or SIGHUP during a conversion: the process says which output it did not write,
  dies of the signal and leaves nothing beside OUT; a file-size limit (SIGXFSZ) is a clean I/O error.
* An input file that shrinks or is rewritten during the run: exit 3, a line naming it, OUT not
  published (a read past the new end is a SIGBUS, reported; other changes are found at commit).
* When `latest` cannot be replaced, the run is refused before writing anything: the root's state
  (latest_checkpointed_iteration.txt included) is unchanged and no temporary file is left.

Where reshard writes (WhereReshardWritesTest), for convert and every export:

* `--overwrite` over a folder holding a user's files is refused in one line naming the first of
  them, every file left; over reshard's own earlier output it replaces it.
* A bare OUT name run from an empty folder leaves only OUT there: no `latest`,
  `latest_checkpointed_iteration.txt`, `zero_to_fp32.py` or `latest_universal` (DeepSpeed, HF,
  torch_dist and torchtitan sources alike), and a note says so.
* Another run's `latest` (or `latest_universal`, or iteration file) is not replaced: the refusal
  says what it names; `--overwrite` replaces it. A Megatron-LM, torch_dist or torchtitan root
  holding another run's iterations is refused even with `--overwrite`, naming the iteration.
* A root in with OUT named as its tag writes that tag folder (no OUT/<tag>/<tag>), `latest` beside
  it, and `verify` reads it back (the README's MoE examples).

Each refusal: exit 2 (3 for I/O), one line on stderr, nothing written, the input's bytes unchanged.

Run: /usr/bin/python3 tests/interop/test_output_safety.py --reshard build/reshard
"""
import fcntl
import hashlib
import os
import re
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
                _, stderr = proc.communicate(timeout=60)
                if proc.returncode == 0 or (os.path.isdir(out) and 'interrupted' not in stderr):
                    self.skipTest('the conversion published its output before the signal')
                self.assertEqual(proc.returncode, -sig)  # it dies of the signal
                self.assertIn(f'reshard: interrupted: nothing was written to {out} ', stderr)
                self.assertEqual(stderr.count('interrupted'), 1, stderr)  # OUT, not its lock file
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


LLAMA = dict(support.FAMILIES['ms_llama'], optimizer='bf16_zero', tp=2, pp=2, dp=1)
HEADS = ('--set', 'num_attention_heads=12')
# Each writing command: the output's `--to` and layout options (convert's target layout).
COMMANDS = {
    'convert': ('convert', '--tp', 1, '--pp', 1),
    'consolidated': ('export', '--to', 'consolidated'),
    'hf': ('export', '--to', 'hf', *HEADS),
    'universal': ('export', '--to', 'universal'),
    'torch_dist': ('export', '--to', 'torch_dist', '--tp', 1, '--pp', 1),
    'torchtitan': ('export', '--to', 'torchtitan', '--dp-shard', 1, *HEADS),
    'megatron': ('export', '--to', 'megatron', '--tp', 1, '--pp', 1),
}
MOE = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'deepspeed_moe')


def command(name, src, out, *extra):
    verb, *options = COMMANDS[name]
    return [verb, src, out, *options, *extra]


def run_in(cwd, *args):
    return subprocess.run([support.RESHARD, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd)


def snapshot(root):
    """{relative path: bytes (None for a folder)} of everything under root."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(folder, name), root)] = None
        for name in files:
            with open(os.path.join(folder, name), 'rb') as f:
                out[os.path.relpath(os.path.join(folder, name), root)] = f.read()
    return out


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        f.write(text)


def read(path):
    with open(path) as f:
        return f.read().strip()


class WhereReshardWritesTest(FixtureTestCase):

    def setUp(self):
        super().setUp()
        self.tag = make_fixture(self.path('ckpt'), **LLAMA)
        self.root = os.path.dirname(self.tag)

    def assertRefusedOneLine(self, p, text):
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn(text, p.stderr)

    def assertRan(self, p):
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p.stdout + p.stderr

    def user_folder(self, name):
        home = self.path(name)
        write(os.path.join(home, 'notes.txt'), 'precious')
        write(os.path.join(home, 'projects', 'plan.md'), 'mine')
        return home

    def test_overwrite_never_removes_a_users_files(self):
        for name in COMMANDS:
            with self.subTest(command=name):
                home = self.user_folder('home_' + name)
                before = snapshot(home)
                p = run(*command(name, self.tag, home, '--overwrite'))
                self.assertRefusedOneLine(p, f'will not overwrite {home}: it holds notes.txt, which no reshard run '
                                             'wrote (it has no reshard-manifest.json')
                self.assertEqual(snapshot(home), before)

    def test_overwrite_replaces_reshards_own_output_and_only_it(self):
        for name in COMMANDS:
            with self.subTest(command=name):
                out = self.path('again_' + name, 'global_step10')
                self.assertRan(run(*command(name, self.tag, out)))
                self.assertRan(run(*command(name, self.tag, out, '--overwrite')))
                self.assertIn(support.MANIFEST, os.listdir(out))
                write(os.path.join(out, 'mine', 'notes.txt'), 'precious')
                before = snapshot(out)
                p = run(*command(name, self.tag, out, '--overwrite'))
                self.assertRefusedOneLine(p, f'will not overwrite {out}: it holds mine/, which no reshard run wrote '
                                             '(its reshard-manifest.json does not list it)')
                self.assertEqual(snapshot(out), before)

    def sources(self):
        """{name: a checkpoint of each source kind that convert writes DeepSpeed files from, and the options}."""
        hf, td, tt = self.path('src_hf'), self.path('src_td'), self.path('src_tt')
        for name, out in (('hf', hf), ('torch_dist', td), ('torchtitan', tt)):
            self.assertRan(run(*command(name, self.tag, out)))
        return {'deepspeed': (self.tag, ()), 'hf': (hf, ()), 'torch_dist': (td, ()),
                'torchtitan': (os.path.join(tt, 'step-10'), (*HEADS, '--set', 'make_vocab_size_divisible_by=8'))}

    def test_a_bare_out_name_writes_nothing_into_the_current_folder(self):
        empty = self.path('empty')
        os.makedirs(empty)
        wrote = []
        for name, (src, extra) in self.sources().items():
            with self.subTest(source=name):
                out = 'out_' + name
                said = self.assertRan(run_in(empty, 'convert', src, out, '--to', 'deepspeed', '--tp', 1, '--pp', 1, *extra))
                wrote.append(out)
                self.assertRegex(said, r'note: (.*, )?latest(, .*)? not written into ' + re.escape(os.path.realpath(empty)) +
                                 r' \(the current folder\)')
                self.assertIn('mp_rank_00_model_states.pt', os.listdir(os.path.join(empty, out)))
                self.assertEqual(sorted(os.listdir(empty)), sorted(wrote))
        said = self.assertRan(run_in(empty, 'export', self.tag, 'universal_out', '--to', 'universal'))
        self.assertIn('latest_universal not written into', said)
        self.assertEqual(sorted(os.listdir(empty)), sorted(wrote + ['universal_out']))

    def test_another_runs_latest_is_kept_unless_overwrite(self):
        run2 = self.path('run2')
        write(os.path.join(run2, 'latest'), 'global_step5000')
        write(os.path.join(run2, 'latest_checkpointed_iteration.txt'), '5000')
        write(os.path.join(run2, 'global_step5000', 'mp_rank_00_model_states.pt'), 'the run')
        before = snapshot(run2)
        out = os.path.join(run2, 'global_step10')
        p = run('convert', self.tag, out, '--tp', 1, '--pp', 1)
        self.assertRefusedOneLine(p, os.path.join(run2, 'latest') + " names 'global_step5000', not this output's "
                                     "'global_step10'")
        self.assertEqual(snapshot(run2), before)
        self.assertRan(run('convert', self.tag, out, '--tp', 1, '--pp', 1, '--overwrite'))
        self.assertEqual(read(os.path.join(run2, 'latest')), 'global_step10')
        self.assertEqual(read(os.path.join(run2, 'latest_checkpointed_iteration.txt')), '10')
        self.assertEqual(snapshot(os.path.join(run2, 'global_step5000')), {'mp_rank_00_model_states.pt': b'the run'})
        # The iteration file alone naming another iteration is refused the same way.
        run4 = self.path('run4')
        write(os.path.join(run4, 'latest'), 'global_step10')
        write(os.path.join(run4, 'latest_checkpointed_iteration.txt'), '5000')
        p = run('convert', self.tag, os.path.join(run4, 'global_step10'), '--tp', 1, '--pp', 1)
        self.assertRefusedOneLine(p, "latest_checkpointed_iteration.txt names '5000', not this output's '10'")
        self.assertEqual(sorted(os.listdir(run4)), ['latest', 'latest_checkpointed_iteration.txt'])

    def test_another_runs_latest_universal_is_kept_unless_overwrite(self):
        write(os.path.join(self.root, 'latest_universal'), 'global_step5000_universal')
        out = os.path.join(self.root, 'global_step10_universal')
        p = run('export', self.tag, out, '--to', 'universal')
        self.assertRefusedOneLine(p, "latest_universal names 'global_step5000_universal', not this output's "
                                     "'global_step10_universal'")
        self.assertFalse(os.path.exists(out))
        self.assertRan(run('export', self.tag, out, '--to', 'universal', '--overwrite'))
        self.assertEqual(read(os.path.join(self.root, 'latest_universal')), 'global_step10_universal')
        self.assertEqual(read(os.path.join(self.root, 'latest')), 'global_step10')

    def test_an_hf_source_keeps_another_runs_latest(self):
        hf = self.path('src_hf')
        self.assertRan(run(*command('hf', self.tag, hf)))
        write(self.path('run3', 'latest'), 'global_step5000')
        p = run('convert', hf, self.path('run3', 'global_step0'), '--tp', 1, '--pp', 1)
        self.assertRefusedOneLine(p, "latest names 'global_step5000', not this output's 'global_step0'")
        self.assertEqual(os.listdir(self.path('run3')), ['latest'])

    def test_a_root_of_another_runs_iterations_is_kept_even_with_overwrite(self):
        for name, iteration in (('megatron', 'iter_0005000'), ('torch_dist', 'iter_0005000'),
                                ('torchtitan', 'step-5000')):
            with self.subTest(command=name):
                out = self.path('trained_' + name)
                write(os.path.join(out, iteration, 'model'), 'the run')
                if name != 'torchtitan':
                    write(os.path.join(out, 'latest_checkpointed_iteration.txt'), '5000')
                before = snapshot(out)
                self.assertRefusedOneLine(run(*command(name, self.tag, out)), 'is not empty; pass --overwrite')
                p = run(*command(name, self.tag, out, '--overwrite'))
                self.assertRefusedOneLine(p, f'it holds {iteration}/, which no reshard run wrote')
                self.assertEqual(snapshot(out), before)

    def test_a_root_in_with_out_named_as_its_tag_is_that_tag_folder(self):
        parent = self.path('t', 'r1')
        said = self.assertRan(run('convert', self.root, os.path.join(parent, 'global_step10'), '--tp', 1, '--pp', 1))
        self.assertIn(os.path.join(parent, 'global_step10') + " is named as the source's tag", said)
        self.assertFalse(os.path.exists(os.path.join(parent, 'global_step10', 'global_step10')))
        self.assertIn('mp_rank_00_model_states.pt', os.listdir(os.path.join(parent, 'global_step10')))
        self.assertEqual(read(os.path.join(parent, 'latest')), 'global_step10')
        self.assertIn('same model', run('verify', self.root, parent).stdout)
        # A root in with OUT of another name stays a root out.
        self.assertRan(run('convert', self.root, self.path('r2'), '--tp', 1, '--pp', 1))
        self.assertEqual(sorted(os.listdir(self.path('r2'))),
                         ['global_step10', 'latest', 'latest_checkpointed_iteration.txt', 'zero_to_fp32.py'])

    def test_the_readmes_moe_examples_verify(self):
        for src, rules, layout in (('zero1_fp32_ep2_dp4', 'toy-moe-nonpipe.yaml', ('--ep', 4, '--dp', 8)),
                                   ('pipe_pp2_ep2_dp2', 'toy-moe-pipe.yaml', ('--ep', 1, '--dp', 2))):
            with self.subTest(source=src):
                out = self.path('moe_' + src)
                rules = ('--rules', os.path.join(MOE, rules))
                self.assertRan(run('convert', os.path.join(MOE, src), os.path.join(out, 'global_step2'),
                                   '--tp', 1, '--pp', 1, *layout, *rules, '-q'))
                p = run('verify', os.path.join(MOE, src), out, *rules)
                self.assertIn('same model', p.stdout, p.stdout + p.stderr)


if __name__ == '__main__':
    support.main()
