"""Every folder a reshard command writes is a source of every command, or the refusal names the folder
to pass instead (engine/formats/folder_hint.h, engine/formats/consolidated/consolidated_source.h).

From one Megatron-DeepSpeed Llama (TP 2, PP 2, BF16 ZeRO shards), each kind of output is written:
convert's tag folder and root, `export --to consolidated` (safetensors, sharded with an index, and
torch.save), hf (and the same without its config.json), universal, megatron and torch_dist (roots
holding iter_NNNNNNN/), torchtitan (a root holding step-N/). Each, and each folder inside it, is:

* read by `inspect` (its first line naming the checkpoint folder read) and `lint` (ok, or, for a
  folder read without a rule set, the one error saying what takes it as it is), never with the
  DeepSpeed reader's "not a DeepSpeed checkpoint tag folder";
* converted (`convert --tp 1 --pp 1`) where a rule set describes it, and exported --to consolidated
  otherwise: a consolidated folder exported again gives the same bytes, an HF folder without its
  config.json the HF folder's tensors;
* a root read as the one checkpoint inside it is the same model as that folder (`verify`).

Roots that hold several checkpoints or whose latest_checkpointed_iteration.txt names none of them
(two iter_ folders and no tracker, two step- folders, a tracker naming a missing iteration or
holding no iteration, a universal checkpoint's parent) are refused in one line that names the
folder to pass, exit 2, nothing written; that folder is then read.

Run: /usr/bin/python3 tests/interop/test_read_back.py --reshard build/reshard
"""
import os
import shutil

import interop_support as support
from interop_support import FixtureTestCase, make_fixture, read_safetensors

run = support.reshard
MODEL = dict(support.FAMILIES['ms_llama'], optimizer='bf16_zero', tp=2, pp=2, dp=1)
# The torchtitan export records no model config: its heads are given as the run's.
HEADS = ('--set', 'num_attention_heads=12')
NOT_DEEPSPEED = 'not a DeepSpeed checkpoint tag folder'


class ReadBackTest(FixtureTestCase):

    @classmethod
    def setUpClass(cls):
        cls.case = FixtureTestCase('run')
        cls.case.setUp()
        cls.out = {}
        tag = make_fixture(cls.case.path('src'), **MODEL)
        writes = {
            'convert_tag': ('convert', tag, 'tag/global_step10', '--tp', 1, '--pp', 1),
            'convert_root': ('convert', os.path.dirname(tag), 'root', '--tp', 1, '--pp', 1),
            'consolidated': ('export', tag, 'consolidated', '--to', 'consolidated'),
            'consolidated_shards': ('export', tag, 'shards', '--to', 'consolidated', '--max-shard-size', '100kb'),
            'consolidated_pt': ('export', tag, 'pt', '--to', 'consolidated', '--format', 'pt'),
            'hf': ('export', tag, 'hf', '--to', 'hf'),
            'universal': ('export', tag, 'universal/global_step10_universal', '--to', 'universal'),
            'megatron': ('export', tag, 'megatron', '--to', 'megatron', '--tp', 1, '--pp', 1),
            'torch_dist': ('export', tag, 'torch_dist', '--to', 'torch_dist', '--tp', 1, '--pp', 1),
            'torchtitan': ('export', tag, 'torchtitan', '--to', 'torchtitan', '--dp-shard', 2),
        }
        for kind, (command, source, out, *options) in writes.items():
            cls.out[kind] = cls.case.path(out)
            p = run(command, source, cls.out[kind], *options, '-q')
            assert p.returncode == 0, (kind, p.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.case.doCleanups()

    def copy(self, kind, name):
        """A copy of an output to change, in this test's own folder."""
        shutil.copytree(self.out[kind], self.path(name), symlinks=True)
        return self.path(name)

    def assertRead(self, path, folder, *options):
        """inspect reads `path` as the checkpoint in `folder`; lint reads it too (ok, or says that no rule
        set describes it and what takes it as it is). Returns whether a rule set describes it."""
        p = run('inspect', path, *options)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.splitlines()[0], 'checkpoint: ' + folder)
        p = run('lint', path, *options)
        self.assertNotIn(NOT_DEEPSPEED, p.stdout + p.stderr)
        self.assertEqual(p.stderr, '')
        if p.returncode == 0:
            self.assertIn('lint: ok', p.stdout)
            return True
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn('read without a rule set', p.stdout)
        self.assertIn('export --to consolidated', p.stdout)
        return False

    def assertReadBack(self, path, folder, *options):
        """Read, and converted (with a rule set) or exported --to consolidated (without); returns the
        consolidated export's folder, or None."""
        self.outputs = getattr(self, 'outputs', 0) + 1
        if self.assertRead(path, folder, *options):
            out = self.path(f'converted{self.outputs}', os.path.basename(folder))
            p = run('convert', '--to', 'deepspeed', path, out, '--tp', 1, '--pp', 1, *options, '-q')
            self.assertEqual(p.returncode, 0, p.stderr)
            return None
        out = self.path(f'reexported{self.outputs}', os.path.basename(folder))
        p = run('export', path, out, '--to', 'consolidated', *options, '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        return out

    def assertRefusedNaming(self, path, folder):
        """Every command refuses `path` in one line naming `folder` to pass; which is then read."""
        for command in (('inspect', path), ('lint', path), ('export', path, self.path('x'), '--to', 'consolidated'),
                        ('convert', '--to', 'deepspeed', path, self.path('x'), '--tp', 1, '--pp', 1)):
            with self.subTest(command=command[0]):
                p = run(*command)
                self.assertRefused(p, 'pass ' + folder, self.path('x'))
                self.assertNotIn(NOT_DEEPSPEED, p.stderr)
        p = run('inspect', folder)
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_every_output_and_its_folders_are_read_back(self):
        o = self.out
        cases = [
            (o['convert_tag'], o['convert_tag'], ()),
            (os.path.dirname(o['convert_tag']), o['convert_tag'], ()),
            (o['convert_root'], os.path.join(o['convert_root'], 'global_step10'), ()),
            (o['hf'], o['hf'], ()),
            (o['universal'], o['universal'], ()),
            (o['megatron'], os.path.join(o['megatron'], 'iter_0000010'), ()),
            (os.path.join(o['megatron'], 'iter_0000010'), os.path.join(o['megatron'], 'iter_0000010'), ()),
            (o['torch_dist'], os.path.join(o['torch_dist'], 'iter_0000010'), ()),
            (os.path.join(o['torch_dist'], 'iter_0000010'), os.path.join(o['torch_dist'], 'iter_0000010'), ()),
            (o['torchtitan'], os.path.join(o['torchtitan'], 'step-10'), HEADS),
            (os.path.join(o['torchtitan'], 'step-10'), os.path.join(o['torchtitan'], 'step-10'), HEADS),
            (o['torchtitan'], os.path.join(o['torchtitan'], 'step-10'), ()),  # no rule set: read as DCP
        ]
        for path, folder, options in cases:
            with self.subTest(path=os.path.relpath(path, self.case.tmp), options=options):
                self.assertReadBack(path, os.path.realpath(folder) if 'global_step' in folder else folder, *options)

    def test_a_root_is_the_checkpoint_it_holds(self):
        for kind, inside, options in (('torchtitan', 'step-10', HEADS), ('megatron', 'iter_0000010', ()),
                                      ('torch_dist', 'iter_0000010', ())):
            with self.subTest(kind=kind):
                root = self.out[kind]
                p = run('verify', root, os.path.join(root, inside), *options)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)

    def test_consolidated_exports_are_state_dicts(self):
        """Exported again, each gives the same file: the shards joined give the one-file export's bytes."""
        for kind, name, fmt in (('consolidated', 'model.safetensors', ()),
                                ('consolidated_shards', 'model.safetensors', ()),
                                ('consolidated_pt', 'pytorch_model.bin', ('--format', 'pt'))):
            with self.subTest(kind=kind):
                folder = self.out[kind]
                p = run('inspect', folder)
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertIn('state dict without config.json; 39 tensors', p.stdout)
                self.assertReadBack(folder, folder)
                out = self.path('again_' + kind)
                self.assertEqual(run('export', folder, out, '--to', 'consolidated', *fmt, '-q').returncode, 0)
                want = os.path.join(self.out['consolidated' if kind == 'consolidated_shards' else kind], name)
                with open(want, 'rb') as a, open(os.path.join(out, name), 'rb') as b:
                    self.assertEqual(a.read(), b.read(), name)
        p = run('verify', self.out['consolidated'], self.out['consolidated_shards'])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_hf_without_config_is_its_state_dict(self):
        folder = self.copy('hf', 'hf_without_config')
        os.remove(os.path.join(folder, 'config.json'))
        out = self.assertReadBack(folder, folder)
        got, _ = read_safetensors(os.path.join(out, 'model.safetensors'))
        want, _ = read_safetensors(os.path.join(self.out['hf'], 'model.safetensors'))
        self.assertEqual(list(got), list(want))
        self.assertEqual(support.differences(got, want), [])
        p = run('convert', '--to', 'deepspeed', folder, self.path('x'), '--tp', 1, '--pp', 1)
        self.assertRefused(p, "it has no config.json; with the model's config.json beside the weights it is read "
                              "as a Hugging Face model", self.path('x'))

    def test_roots_of_several_checkpoints_name_the_folder_to_pass(self):
        megatron = self.copy('megatron', 'two_iterations')
        os.remove(os.path.join(megatron, 'latest_checkpointed_iteration.txt'))
        shutil.copytree(os.path.join(megatron, 'iter_0000010'), os.path.join(megatron, 'iter_0000020'))
        self.assertRefusedNaming(megatron, os.path.join(megatron, 'iter_0000020'))

        titan = self.copy('torchtitan', 'two_steps')
        shutil.copytree(os.path.join(titan, 'step-10'), os.path.join(titan, 'step-9'))
        os.makedirs(os.path.join(titan, 'step-30'))  # no checkpoint in it
        self.assertRefusedNaming(titan, os.path.join(titan, 'step-10'))

        self.assertRefusedNaming(os.path.dirname(self.out['universal']), self.out['universal'])

    def test_a_tracker_naming_no_checkpoint_names_the_folder_to_pass(self):
        for kind in ('megatron', 'torch_dist'):
            for text in ('200', 'release', '-1', '../../../etc', '1' * 40, ''):
                with self.subTest(kind=kind, text=text):
                    root = self.copy(kind, f'{kind}_{len(text)}_{text[:2].strip("./")}')
                    with open(os.path.join(root, 'latest_checkpointed_iteration.txt'), 'w') as f:
                        f.write(text + '\n')
                    self.assertRefusedNaming(root, os.path.join(root, 'iter_0000010'))
                    shutil.rmtree(root)
        root = self.copy('megatron', 'no_tracker')
        os.remove(os.path.join(root, 'latest_checkpointed_iteration.txt'))
        self.assertReadBack(root, os.path.join(root, 'iter_0000010'))


if __name__ == '__main__':
    support.main()
