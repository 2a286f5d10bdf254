"""NVIDIA Megatron-LM's `torch` checkpoint as a source: `export --to megatron` output read back.

A Megatron-DeepSpeed fixture (tests/fixtures/megatron_fixture.py) is exported at TP 2, PP 2 with
each layer spec (Megatron-Core's local and Transformer Engine keys, the legacy GPTModel's) and at
TP 1, PP 1; the export is then the source. Checked, for ms_gpt2 (tied embedding: the last stage
holds its replica) and ms_llama (GQA, SwiGLU, untied head):

* `verify SRC MLM` finds every tensor equal (the torch format, like torch_dist, carries no
  learning-rate scheduler or sample counter, which verify reports), and `verify MLM BACK` the
  same model;
* `convert MLM back --tp 2 --pp 2` gives layer files bit-equal to the source's (the vocabulary's
  true rows: padding rows are re-made where the TP changes);
* `inspect MLM` names the format, its layout and keys, and says it reads the weights only; the
  `_extra_state` entries and the tied replica are noted;
* damaged inputs are refused with one line, exit 2 and nothing written: a rank file missing, a
  TP rank's piece of a key with another shape.

Run: /usr/bin/python3 tests/interop/test_megatron_torch_source.py --reshard build/reshard
"""
import glob
import os
import re
import shutil

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture

run = support.reshard
SPECS = ('local', 'te')


def tensors_compared(verify_output):
    return int(re.search(r'verify: (\d+) tensors', verify_output).group(1))


class MegatronTorchSourceTest(FixtureTestCase):

    def source(self, family):
        return make_fixture(self.path(family), **dict(FAMILIES[family], tp=2, pp=2, dp=1))

    def export(self, src, out, tp, pp, spec):
        p = run('export', src, out, '--to', 'megatron', '--tp', tp, '--pp', pp, '--layer-spec', spec)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return out

    def layer_files(self, folder):
        return {os.path.basename(p): torch.load(p) for p in sorted(glob.glob(os.path.join(folder, 'layer_*')))}

    def assertSameLayerFiles(self, family, src, back):
        want = self.layer_files(src)
        self.assertEqual(support.layer_file_differences(want, self.layer_files(back), FAMILIES[family]['V']), [])
        return sum(len(tensors) for tensors in want.values())

    def test_the_export_reads_back_as_the_same_model(self):
        compared = 0
        for family in ('ms_gpt2', 'ms_llama'):
            src = self.source(family)
            for spec in SPECS:
                for tp, pp in ((2, 2), (1, 1)):
                    with self.subTest(family=family, spec=spec, tp=tp, pp=pp):
                        mlm = self.export(src, self.path(f'{family}_{spec}_{tp}{pp}'), tp, pp, spec)
                        # Every tensor is equal; the torch format does not carry the learning-rate
                        # scheduler and the sample counters (as torch_dist does not): left out, said.
                        p = run('verify', src, mlm)
                        self.assertIn('same model', p.stdout, p.stdout + p.stderr)
                        self.assertIn('lr_scheduler, global_samples, skipped_steps not compared: only A records them '
                                      '(megatron does not)', p.stdout)
                        self.assertEqual(tensors_compared(p.stdout), tensors_compared(run('verify', src, src).stdout))
                        back = self.path(f'{family}_{spec}_{tp}{pp}_back')
                        # Megatron-LM's args record the padded vocabulary only: the true size is given.
                        p = run('convert', '--to', 'deepspeed', mlm, back, '--tp', 2, '--pp', 2, '--vocab-size', FAMILIES[family]['V'])
                        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                        compared += self.assertSameLayerFiles(family, src, back)
                        p = run('verify', mlm, back)
                        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                        self.assertIn('same model', p.stdout)
        print(f'compared {compared} tensors')
        self.assertGreater(compared, 100)

    def test_inspect_names_the_format_and_what_it_leaves_out(self):
        src = self.source('ms_gpt2')
        mlm = self.export(src, self.path('gpt2_te'), 2, 2, 'te')
        p = run('inspect', mlm)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('Megatron-LM torch checkpoint (Megatron-Core keys, Transformer Engine layer spec): TP 2, PP 2',
                      p.stdout)
        self.assertIn('iteration 10', p.stdout)
        self.assertIn('weights only', p.stdout)
        self.assertIn('rule set megatron-gpt2', p.stdout)
        self.assertIn('word_embeddings.weight  bfloat16[112, 48]  vocab', p.stdout)  # 100 rows padded for TP 2
        # In Megatron-LM's terms, not DeepSpeed's.
        self.assertIn('\nmegatron:\n  keys: Megatron-Core keys, Transformer Engine layer spec\n  saved at: TP 2, PP 2, DP ',
                      p.stdout)
        self.assertNotIn('metadata (mp_rank_00)', p.stdout)
        self.assertNotIn('layer_01', p.stdout)
        # What the reading leaves out, as convert says it.
        p = run('convert', '--to', 'deepspeed', mlm, self.path('plan'), '--tp', 1, '--pp', 1, '--vocab-size', 100, '--dry-run')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("output_layer.weight is the tied word embedding's replica (2 TP pieces); it is dropped", p.stdout)
        self.assertIn('_extra_state (', p.stdout)
        self.assertFalse(os.path.exists(self.path('plan')))
        # The root and its iteration folder are the same checkpoint.
        p2 = run('inspect', os.path.join(mlm, 'iter_0000010'))
        self.assertEqual(p2.returncode, 0, p2.stdout + p2.stderr)

    def test_damaged_inputs_are_refused_with_one_line(self):
        src = self.source('ms_llama')
        mlm = self.export(src, self.path('llama'), 2, 2, 'local')
        missing = self.path('missing')
        shutil.copytree(mlm, missing)
        os.remove(os.path.join(missing, 'iter_0000010', 'mp_rank_01_001', 'model_optim_rng.pt'))
        out = self.path('out_missing')
        self.assertRefused(run('convert', '--to', 'deepspeed', missing, out, '--tp', 1, '--pp', 1), 'lacks mp_rank_01_001/model_optim_rng.pt',
                           out)

        wrong = self.path('wrong')
        shutil.copytree(mlm, wrong)
        path = os.path.join(wrong, 'iter_0000010', 'mp_rank_01_000', 'model_optim_rng.pt')
        state = support.load(path)
        key = 'decoder.layers.0.self_attention.linear_qkv.weight'
        state['model'][key] = state['model'][key][:-1].clone()
        torch.save(state, path)
        out = self.path('out_wrong')
        p = run('convert', '--to', 'deepspeed', wrong, out, '--tp', 1, '--pp', 1)
        self.assertRefused(p, "mp_rank_01_000's " + key, out)
        # The input is never modified.
        self.assertEqual(len(glob.glob(os.path.join(wrong, '**', '*'), recursive=True)),
                         len(glob.glob(os.path.join(mlm, '**', '*'), recursive=True)))


if __name__ == '__main__':
    support.main()
