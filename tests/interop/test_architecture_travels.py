"""The architecture travels: after the first conversion no `--set` at any step, and every step the
same model (verify).

Checked:

* a Megatron-Core torch_dist save (its unrecorded values given once) -> torch_dist -> hf -> torch_dist
  -> hf: each output records the values (HF config.json, torch_dist's common state args) and each
  reader reads them back; the value filled from a default (the vocabulary's padding divisor, which
  an HF folder does not record) is named in a note;
* hf -> torchtitan -> hf (reshard-model.json beside the step);
* a bf16 Megatron-DeepSpeed run -> torch_dist -> Megatron-DeepSpeed: every tensor and optimizer
  state equal; what torch_dist does not carry (the scheduler, the sample counters) is the only
  difference;
* a bf16 Megatron-DeepSpeed run -> torchtitan -> hf;
* a layout size the source does not record: a source saved whole (an HF folder) is written at 1,
  with one note naming the options; a size its chunks show is kept (a torch_dist TP 2 save to
  torchtitan: TP 2, its DP size 1 as dp_shard); a size neither records nor shows (the PP of a
  torch_dist save whose ranks each wrote one layer) is refused, naming the flag.

Run: /usr/bin/python3 tests/interop/test_architecture_travels.py --reshard build/reshard
"""
import json
import os

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
from megatron_core_data import DATA

run = support.reshard
TORCH_DIST = os.path.join(DATA, '0.19', 'w2_tp2_swiglu_optim_fully_reshardable')
TORCH_DIST_VALUES = ('--set', 'args.num_attention_heads=4', '--set', 'args.num_key_value_heads=2',
                     '--set', 'max_position_embeddings=8', '--set', 'layernorm_epsilon=1e-5', '--vocab-size', 64)


class ArchitectureTravelsTest(FixtureTestCase):

    def step(self, src, to, *extra):
        """`src` converted --to `to` with no --set; the output folder (a torchtitan root's step)."""
        out = self.path(f'{len(os.listdir(self.tmp))}_{to}')
        p = run('convert', src, out, '--to', to, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.notes = p.stdout + p.stderr
        steps = [d for d in os.listdir(out) if d.startswith('step-')] if to == 'torchtitan' else []
        return os.path.join(out, steps[0]) if steps else out

    def assertSameModel(self, a, b):
        p = run('verify', a, b)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)

    def chain(self, src, *targets):
        """`src` through each (format, extra args) of `targets`, each step verified against the one
        before; the folders."""
        folders = [src]
        for to, *extra in targets:
            folders.append(self.step(folders[-1], to, *extra))
            self.assertSameModel(folders[-2], folders[-1])
        return folders

    def test_torch_dist_hf_torch_dist_hf(self):
        first = self.path('first')
        # TP 2 -> 1 pads the vocabulary for TP 1, by a divisor the save does not record; it travels on.
        p = run('convert', TORCH_DIST, first, '--to', 'torch_dist', '--tp', 1, '--pp', 1, *TORCH_DIST_VALUES,
                '--set', 'make_vocab_size_divisible_by=16')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        _, hf1, td2, hf2 = self.chain(first, ('hf',), ('torch_dist', '--tp', 1, '--pp', 1), ('hf',))
        with open(os.path.join(hf1, 'config.json')) as f:
            config = json.load(f)
        self.assertEqual((config['num_attention_heads'], config['num_key_value_heads'], config['vocab_size'],
                          config['max_position_embeddings'], config['rms_norm_eps']), (4, 2, 64, 8, 1e-5))
        self.assertSameModel(hf1, hf2)
        # hf -> torch_dist: the padding divisor an HF folder does not record comes from a default, said
        p = run('convert', hf1, self.path('again'), '--to', 'torch_dist')
        self.assertIn("the vocabulary is padded to a multiple of 128 x TP, Megatron's default", p.stdout + p.stderr)

    def test_hf_torchtitan_hf(self):
        hf = self.path('hf')
        p = run('convert', TORCH_DIST, hf, '--to', 'hf', *TORCH_DIST_VALUES)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        _, step, back = self.chain(hf, ('torchtitan',), ('hf',))
        self.assertTrue(os.path.exists(os.path.join(step, 'reshard-model.json')))
        self.assertSameModel(hf, back)

    def test_megatron_deepspeed_torch_dist_megatron_deepspeed(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        _, td, back = self.chain(src, ('torch_dist', '--tp', 1, '--pp', 1), ('deepspeed', '--tp', 2, '--pp', 2))
        p = run('verify', src, back)
        differences = [line for line in p.stdout.splitlines() if line.startswith('differs')]
        # every weight, optimizer state, step and the scheduler equal; torch_dist keeps no sample counters
        self.assertEqual(differences, ['differs: global_samples differs'], p.stdout)
        self.assertIn('156 tensors', p.stdout)

    def test_megatron_deepspeed_torchtitan_hf(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        _, step, hf = self.chain(src, ('torchtitan', '--dp-shard', 2), ('hf',))
        self.assertSameModel(src, hf)

    def test_a_source_saved_whole_is_written_at_size_1_with_a_note(self):
        hf = self.path('hf')
        p = run('convert', TORCH_DIST, hf, '--to', 'hf', *TORCH_DIST_VALUES)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.step(hf, 'torchtitan')
        self.assertIn('torchtitan: --tp 1, --dp-shard 1, as the hf source is saved whole; give them to shard it',
                      self.notes)
        self.step(hf, 'torch_dist')
        self.assertIn('torch_dist: --tp 1, --pp 1, --dp 1, as the hf source is saved whole', self.notes)
        self.step(hf, 'deepspeed')
        self.assertIn('deepspeed: --tp 1, --pp 1, --dp 1, as the hf source is saved whole', self.notes)
        # sizes given are not noted
        self.step(hf, 'torchtitan', '--dp-shard', 2, '--tp', 1)
        self.assertNotIn('saved whole', self.notes)

    def test_a_layout_the_chunks_show_is_kept(self):
        step = self.step(TORCH_DIST, 'torchtitan', *TORCH_DIST_VALUES)
        self.assertNotIn('saved whole', self.notes)
        p = run('inspect', step, '--set', 'num_attention_heads=4')
        self.assertIn('  mesh: dp_shard 1, tp 2 (the chunks; 2 ranks wrote it)\n', p.stdout)

    def test_a_source_whose_layout_is_unrecorded_still_refuses(self):
        out = self.path('pp')
        p = run('convert', os.path.join(DATA, '0.19', 'w2_pp2'), out, '--set', 'num_attention_heads=4',
                '--set', 'num_key_value_heads=2', '--set', 'make_vocab_size_divisible_by=16', '--vocab-size', 64)
        self.assertRefused(p, 'needs the target layout: --tp N and --pp N', out)


if __name__ == '__main__':
    support.main()
