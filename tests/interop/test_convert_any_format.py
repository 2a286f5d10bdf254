"""`convert`, the one verb: a checkpoint written at another layout in its own format by default, or
in the one `--to` names; each layout size not given kept from the source.

Checked:

* a Megatron-DeepSpeed checkpoint converted with no sizes keeps its TP, PP and DP (before, --tp and
  --pp were required), and with --tp alone keeps its PP; verify finds the same model;
* a real Megatron-Core torch_dist save (TP 2) converted to TP 1 with no --to stays torch_dist, and
  verify finds the same model;
* a real torchtitan save at 2 ranks converted to 3 (--dp-shard 3) with no --to stays torchtitan;
* `convert --to FORMAT` writes what `export --to FORMAT` writes, byte for byte;
* refusals in one line: an option of the DeepSpeed target with another --to, an option of another
  target with deepspeed, a plain DCP folder (no format reshard writes: converted to deepspeed, which
  needs a rule set).

Run: /usr/bin/python3 tests/interop/test_convert_any_format.py --reshard build/reshard
"""
import glob
import os

import interop_support as support
from interop_support import FixtureTestCase
from megatron_core_data import DATA, config_of, sizes

run = support.reshard
TORCHTITAN = os.path.join(os.path.dirname(DATA), 'torchtitan')
PLAIN_DCP = os.path.join(os.path.dirname(DATA), 'dcp', 'world2_model_optim')


def relative_files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


class ConvertAnyFormatTest(FixtureTestCase):

    def converted(self, *args):
        p = run('convert', *args)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def assertSameModel(self, a, b, *extra):
        p = run('verify', a, b, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)

    def test_a_deepspeed_checkpoint_keeps_the_sizes_it_is_not_told(self):
        src = self.bloom(dp=2, optimizer='zero1')
        same = self.path('same')
        self.converted(src, same, '--no-update-latest')
        self.assertEqual(relative_files(same), sorted(relative_files(src) + [support.MANIFEST]))
        self.assertSameModel(src, same)
        tp1 = self.path('tp1')
        self.converted(src, tp1, '--tp', 1, '--no-update-latest')
        self.assertIn('format: deepspeed, saved at TP 1, PP 2, DP 2\n', run('inspect', tp1).stdout)
        self.assertSameModel(src, tp1)

    def test_a_torch_dist_save_stays_torch_dist(self):
        config = config_of('0.19/w2_tp2')
        src, out = os.path.join(DATA, '0.19', 'w2_tp2'), self.path('tp1')
        self.converted(src, out, '--tp', 1, '--pp', 1, *sizes(config))
        self.assertEqual(relative_files(out), ['iter_0000000/.metadata', 'iter_0000000/__0_0.distcp',
                                               'iter_0000000/metadata.json', 'latest_checkpointed_iteration.txt',
                                               support.MANIFEST])
        self.assertSameModel(src, out, *sizes(config)[:-2])
        self.assertIn('format: torch_dist', run('inspect', out, *sizes(config)[:-2]).stdout)

    def test_a_torchtitan_save_stays_torchtitan_at_another_world_size(self):
        src, out = os.path.join(TORCHTITAN, 'fsdp2_w2', 'step-1'), self.path('three')
        self.converted(src, out, '--dp-shard', 3, '--set', 'num_attention_heads=4')
        self.assertEqual(sorted(os.path.basename(f) for f in glob.glob(os.path.join(out, 'step-1', '*.distcp'))),
                         ['__0_0.distcp', '__1_0.distcp', '__2_0.distcp'])
        self.assertSameModel(src, os.path.join(out, 'step-1'), '--set', 'num_attention_heads=4')

    def test_convert_to_another_format_writes_what_export_writes(self):
        src = self.bloom(optimizer='zero1')
        for to, extra in (('consolidated', ()), ('megatron', ('--tp', 1, '--pp', 1))):
            with self.subTest(to=to):
                by_export, by_convert = self.path(to + '_export'), self.path(to + '_convert')
                p = run('export', src, by_export, '--to', to, *extra)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.converted(src, by_convert, '--to', to, *extra)
                self.assertEqual(relative_files(by_convert), relative_files(by_export))
                for name in relative_files(by_export):
                    if name == support.MANIFEST:
                        continue  # it records the command
                    with open(os.path.join(by_export, name), 'rb') as a, open(os.path.join(by_convert, name), 'rb') as b:
                        self.assertEqual(a.read(), b.read(), name)

    def test_options_of_another_target_are_refused_in_one_line(self):
        src, out = self.bloom(), self.path('refused')
        p = run('convert', src, out, '--to', 'hf', '--layers-per-stage', '2,2')
        self.assertRefused(p, '--layers-per-stage is an option of --to deepspeed; --to hf does not take it, so leave it out', out)
        p = run('convert', src, out, '--tp', 1, '--pp', 1, '--layer-spec', 'te')
        self.assertRefused(p, '--layer-spec is an option of --to megatron; --to deepspeed does not take it, so leave it out', out)
        p = run('convert', src, out, '--to', 'consolidated', '--tp', 2)
        self.assertRefused(p, '--tp sets the layout of --to deepspeed, megatron, torch_dist, torchtitan; --to consolidated '
                              'has no such size', out)
        # A format reshard does not write converts to deepspeed, which needs rules.
        p = run('convert', PLAIN_DCP, out, '--tp', 1, '--pp', 1)
        self.assertRefused(p, 'is a Distributed Checkpoint read without a rule set', out)


if __name__ == '__main__':
    support.main()
