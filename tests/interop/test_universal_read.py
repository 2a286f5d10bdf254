"""A universal checkpoint as a source: `reshard convert|lint|inspect|verify|export` read it.

Checked with real PyTorch:

* round trips: a native fixture A (TP 2, PP 2, DP 2) exported --to universal U, then
  U -> B (another layout) equals A -> C (the same layout, straight) for four families and
  each optimizer format (BF16_Optimizer, fp16 ZeRO-1, DeepSpeed 0.6.5's BF16 shards): layer
  files (tensor by tensor; a universal checkpoint does not record their key order), optimizer
  shards bit for bit, mp_rank files but for the RNG states of ranks that have no source rank
  (U is TP 1, PP 1: they take mp_rank_00's). The vocabulary is unpadded at every TP here, so
  that nothing the universal form drops (padding rows) is compared;
* with a padded vocabulary U -> B re-pads with zero rows and `reshard verify` finds B and C
  the same model;
* universal checkpoints written by DeepSpeed's own ds_to_universal (tests/data/ds_universal,
  data only) convert to what the native checkpoint they were made from converts to;
* BigScience's older form (no zero/optimizer_state.pt): weights only, else refused;
* bad input -- a missing state file, a missing parameter folder, a parameter no rule explains,
  a tensor of the wrong shape -- is one line, exit 2, nothing written.

Run: /usr/bin/python3 tests/interop/test_universal_read.py --reshard build/reshard
"""
import json
import os
import shutil

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, differences, load, make_fixture

run = support.reshard
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'ds_universal')
UNPADDED = dict(V=128)  # 128 rows need no padding at TP 1, 2 or 4 (make_vocab_size_divisible_by 8)


def is_vocab(key):
    return key.endswith(('word_embeddings.weight', 'lm_head.weight'))


def without_rng(obj):
    """An mp_rank dict without its RNG states (MS: rng_state; BS: random_rng_state, ...)."""
    return {k: v for k, v in obj.items() if 'rng' not in k}


class UniversalReadTest(FixtureTestCase):

    def universal(self, name, **model):
        """(native A, its universal export U)."""
        src = make_fixture(self.path(name, 'a'), tp=2, pp=2, dp=2, **model)
        out = self.path(name, 'a', 'global_step10_universal')
        p = run('export', src, out, '--to', 'universal', '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        return src, out

    def assert_same_conversion(self, b, c, ranks_with_source):
        """B (from a universal checkpoint) equals C (converted straight)."""
        self.assertEqual(sorted(os.listdir(b)), sorted(os.listdir(c)))
        for name in sorted(os.listdir(b)):
            if name == support.MANIFEST:
                continue  # names other files (mp_rank RNG) and another source
            x, y = load(os.path.join(b, name)), load(os.path.join(c, name))
            if name.startswith('layer_'):
                # In module order, as DeepSpeed writes layer files (the universal tag lists them by group).
                self.assertEqual(list(x), list(y), name)
                diff = differences(x, y, name)
            elif name.startswith('mp_rank_'):
                rank = int(name[8:10])
                diff = differences(x if rank in ranks_with_source else without_rng(x),
                                   y if rank in ranks_with_source else without_rng(y), name)
            else:
                diff = differences(x, y, name)
            self.assertEqual(diff, [], name)

    def assert_same_true_rows(self, b, c, vocab):
        """The layer files of B and C hold the same tensors, vocabulary padding rows aside."""
        for name in sorted(os.listdir(c)):
            if not name.startswith('layer_'):
                continue
            x, y = load(os.path.join(b, name)), load(os.path.join(c, name))
            self.assertEqual(list(x), list(y), name)  # the keys in module order
            tp_rank = int(name.split('-model_')[1][:2])
            for key in y:
                got, want = x[key], y[key]
                if is_vocab(key):  # this rank's rows of the true vocabulary
                    rows = max(0, min(want.shape[0], vocab - tp_rank * want.shape[0]))
                    got, want = got[:rows], want[:rows]
                self.assertEqual(differences(got, want, f'{name}/{key}'), [])

    def assert_verify_same(self, a, b):
        """`reshard verify`: every weight and optimizer state equal (on the rows both sides have)."""
        p = run('verify', a, b)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)

    def test_round_trip_equals_the_straight_conversion(self):
        families = ('ms_gpt2', 'ms_llama', 'bs_bloom', 'bs_gpt_glu')
        # BF16_Optimizer; fp16 ZeRO-1; DeepSpeed 0.6.5's BF16 shards (no param_slice_mappings).
        optimizers = {'bf16': dict(optimizer='bf16_zero'), 'fp16': dict(optimizer='zero1', dtype='fp16'),
                      'v065': dict(optimizer='bf16_zero', legacy_v065=True)}
        for family in families:
            for optimizer, kind in optimizers.items():
                if family != 'ms_gpt2' and optimizer == 'v065':
                    continue  # the format does not depend on the family
                with self.subTest(family=family, optimizer=optimizer):
                    model = dict(FAMILIES[family], **kind, **UNPADDED)
                    src, uni = self.universal(f'{family}-{optimizer}', **model)
                    for tp, pp, dp in ((1, 4, 4), (3, 1, 1)):
                        b = self.path(f'{family}-{optimizer}', f'b{tp}{pp}{dp}', 'global_step10')
                        c = self.path(f'{family}-{optimizer}', f'c{tp}{pp}{dp}', 'global_step10')
                        layout = ('--tp', tp, '--pp', pp, '--dp', dp)
                        p = run('convert', uni, b, *layout, '-q')
                        self.assertEqual(p.returncode, 0, p.stderr)
                        self.assertEqual(run('convert', src, c, *layout, '-q').returncode, 0)
                        # C's rank (p, t) has A's rank at the same position where A has one; B's only rank 0.
                        self.assert_same_conversion(b, c, ranks_with_source={0})

    def test_lint_inspect_and_verify(self):
        src, uni = self.universal('gpt2', **dict(FAMILIES['ms_gpt2'], optimizer='bf16_zero'))
        p = run('lint', uni)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('universal checkpoint of DP 2', p.stdout)
        self.assertIn('universal per-parameter files (2 groups, states fp32, exp_avg, exp_avg_sq)', p.stdout)
        p = run('inspect', uni)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('word_embeddings.weight  bfloat16[100, 48]  vocab', p.stdout)
        self.assert_verify_same(uni, src)

    def test_padded_vocabulary_is_padded_again(self):
        src, uni = self.universal('gpt2', **dict(FAMILIES['ms_gpt2'], optimizer='bf16_zero'))
        b, c = self.path('b', 'global_step10'), self.path('c', 'global_step10')
        self.assertEqual(run('convert', uni, b, '--tp', 1, '--pp', 1, '-q').returncode, 0)
        self.assertEqual(run('convert', src, c, '--tp', 1, '--pp', 1, '-q').returncode, 0)
        emb = load(support.layer_file(b, 1, 0))['word_embeddings.weight']
        self.assertEqual(tuple(emb.shape), (104, 48))  # 100 rows padded to a multiple of 8
        self.assertTrue(torch.equal(emb[100:], torch.zeros(4, 48, dtype=emb.dtype)))
        self.assert_same_true_rows(b, c, 100)
        self.assert_verify_same(uni, b)

    def test_deepspeed_written_universal_checkpoints(self):
        for case in sorted(os.listdir(DATA)):
            if not os.path.isdir(os.path.join(DATA, case)):
                continue
            with self.subTest(case=case):
                with open(os.path.join(DATA, case, 'case.json')) as f:
                    spec = json.load(f)
                if spec.get('kind') == 'nonpipe':
                    continue  # non-pipeline names are not read back (test_export_universal compares them)
                fixture = dict(spec['fixture'])
                if spec['dtype'] == 'fp16':
                    fixture['dtype'] = 'fp16'
                src = make_fixture(self.path(case, 'native'), **fixture)
                uni = os.path.join(DATA, case, spec['universal_folder'])
                self.assertEqual(run('lint', uni).returncode, 0, run('lint', uni).stdout)
                for tp, pp, dp in ((1, 1, 1), (2, 2, 1)):
                    b = self.path(case, f'b{tp}{pp}{dp}', 'global_step10')
                    c = self.path(case, f'c{tp}{pp}{dp}', 'global_step10')
                    layout = ('--tp', tp, '--pp', pp, '--dp', dp)
                    p = run('convert', uni, b, *layout, '-q')
                    self.assertEqual(p.returncode, 0, p.stderr)
                    self.assertEqual(run('convert', src, c, *layout, '-q').returncode, 0)
                    self.assert_same_true_rows(b, c, spec['sizes']['V'])
                    self.assert_verify_same(uni, b)  # the optimizer state too
                # DeepSpeed's converter read the native checkpoint right, and so did reshard.
                self.assert_verify_same(uni, src)

    def test_bigscience_older_form_converts_weights_only(self):
        src, uni = self.universal('bloom', **dict(FAMILIES['bs_bloom'], optimizer='bf16_zero', **UNPADDED))
        os.remove(os.path.join(uni, 'zero', 'optimizer_state.pt'))
        for folder in os.listdir(os.path.join(uni, 'zero')):
            os.remove(os.path.join(uni, 'zero', folder, 'step.pt'))
        out = self.path('out', 'global_step10')
        p = run('convert', uni, out, '--tp', 1, '--pp', 1)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn('no zero/optimizer_state.pt', p.stderr)
        self.assertIn('--weights-only', p.stderr)
        self.assertFalse(os.path.exists(out))
        p = run('convert', uni, out, '--tp', 1, '--pp', 1, '--weights-only', '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        ref = self.path('ref', 'global_step10')
        self.assertEqual(run('convert', src, ref, '--tp', 1, '--pp', 1, '--weights-only', '-q').returncode, 0)
        for name in os.listdir(ref):
            if name.startswith('layer_'):
                got, want = load(os.path.join(out, name)), load(os.path.join(ref, name))
                self.assertEqual(list(got), list(want), name)
                self.assertEqual(differences(got, want, name), [])

    def test_bad_universal_checkpoints_are_refused(self):
        def missing_state(uni):
            os.remove(os.path.join(uni, 'zero', '3.mlp.dense_h_to_4h.weight', 'exp_avg.pt'))

        def missing_param(uni):
            shutil.rmtree(os.path.join(uni, 'zero', '3.mlp.dense_h_to_4h.bias'))

        def unexplained(uni):
            shutil.copytree(os.path.join(uni, 'zero', '3.mlp.dense_h_to_4h.bias'),
                            os.path.join(uni, 'zero', '3.mlp.extra.bias'))

        def wrong_shape(uni):
            for state in ('fp32', 'exp_avg', 'exp_avg_sq'):
                path = os.path.join(uni, 'zero', '3.mlp.dense_h_to_4h.weight', state + '.pt')
                support.rewrite(path, lambda d: d.update(param=d['param'][:-2].clone()))

        cases = {
            missing_state: 'has no exp_avg.pt',
            missing_param: 'zero/3.mlp.dense_h_to_4h.bias is missing',
            unexplained: 'unknown key zero/3/mlp.extra.bias',
            wrong_shape: 'zero/3.mlp.dense_h_to_4h.weight is [94, 48] but the mp_rank files record [48, 48]',
        }
        for damage, message in cases.items():
            with self.subTest(damage=damage.__name__):
                src, uni = self.universal(damage.__name__, **dict(FAMILIES['ms_gpt2'], optimizer='bf16_zero'))
                damage(uni)
                out = self.path(damage.__name__, 'out', 'global_step10')
                p = run('convert', uni, out, '--tp', 1, '--pp', 1)
                self.assertRefused(p, message, out)


if __name__ == '__main__':
    support.main()
