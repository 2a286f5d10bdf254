"""`reshard export --to universal`: DeepSpeed's universal checkpoint, written from the shards.

The source is written by the fixture generator at TP 2, PP 2, DP 2 with BF16-optimizer shards;
the reference is the same model (same seed) at TP 1, PP 1, DP 1, whose single optimizer shard
holds every parameter's fp32 master and Adam moments whole (found by `param_slice_mappings`,
under the engine's parameter names). Neither is written by reshard. Checked, for GPT-2 style
and LLaMA style (GQA, SwiGLU) models:

* one folder per parameter of the reference, each with fp32.pt, exp_avg.pt, exp_avg_sq.pt and
  step.pt; every state tensor equals the reference's bit for bit, vocabulary padding stripped;
* the layout keys DeepSpeed's loader cuts by: cat_dim 0 for column-parallel and vocabulary
  tensors (with vocab_tensor), cat_dim 1 for row-parallel ones, param_n_sub_params 2 for the
  SwiGLU pair, none for replicated tensors -- from a TP 1 source too;
* the mp_rank files are copied byte for byte; zero/optimizer_state.pt holds the hyperparameters
  (param_groups) and none of the partitions; latest_universal names the folder and `latest`
  is untouched;
* refusals: a checkpoint without optimizer state, drifted replicas under --replicated check;
* non-pipeline ZeRO-2 sources (tests/data/ds_universal/nonpipe_zero2_*, DeepSpeed's own
  ds_to_universal output): the same files as DeepSpeed's, every state tensor, step.pt,
  zero/optimizer_state.pt and the copied mp_rank file equal to DeepSpeed's.  DeepSpeed also
  writes `cat_dim: 0` into every state file (no layout patterns at TP 1), reshard no layout
  key; its loader reads a missing cat_dim as 0, so that difference is not checked.

Run: /usr/bin/python3 tests/interop/test_export_universal.py --reshard build/reshard
"""
import filecmp
import json
import os

import torch

from fixtures import deepspeed_nonpipe as dn

import interop_support as support
from interop_support import FixtureTestCase, make_fixture

run = support.reshard
STATES = ('fp32', 'exp_avg', 'exp_avg_sq')
DS_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'ds_universal')
FAMILIES = {
    'ms_gpt2': dict(support.FAMILIES['ms_gpt2'], optimizer='bf16_zero'),
    'ms_llama': dict(support.FAMILIES['ms_llama'], optimizer='bf16_zero'),
}


def is_vocab(key):
    """Vocabulary tensors: the word embeddings and an untied head."""
    return key.endswith(('word_embeddings.weight', 'lm_head.weight'))


def reference_states(tag, vocab):
    """{param: {state: whole tensor}} of a TP 1, PP 1, DP 1 fixture, vocabulary rows stripped."""
    shapes = {}
    for name in os.listdir(tag):
        if name.startswith('layer_'):
            layer_id = int(name[6:8])
            for key, value in support.load(os.path.join(tag, name)).items():
                shapes[(layer_id, key)] = value.shape
    osd = support.load(os.path.join(tag, 'bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt'))['optimizer_state_dict']
    out = {}
    for g, mapping in enumerate(osd['param_slice_mappings']):
        flats = {'fp32': osd['single_partition_of_fp32_groups'][g],
                 'exp_avg': osd['base_optimizer_state']['state'][g]['exp_avg'],
                 'exp_avg_sq': osd['base_optimizer_state']['state'][g]['exp_avg_sq']}
        for param, fragment in mapping.items():
            layer, key = param.split('.', 1)
            layer_id = 1 if layer == 'tied_modules' else int(layer)
            key = key.split('.', 1)[1] if layer == 'tied_modules' else key
            shape = shapes[(layer_id, key)]
            out[param] = {}
            for state, flat in flats.items():
                value = flat[fragment.start:fragment.start + fragment.numel].reshape(shape)
                out[param][state] = value[:vocab] if is_vocab(key) else value
    return out


def expected_layout(param, family):
    """The layout keys DeepSpeed's loader needs for `param`."""
    key = param.split('.', 1)[1]
    if is_vocab(key):
        return {'cat_dim': 0, 'vocab_tensor': True}
    if key.endswith(('self_attention.dense.weight', 'dense_4h_to_h.weight')):
        return {'cat_dim': 1}
    if key.endswith('dense_h_to_4h.weight') and family == 'ms_llama':
        return {'cat_dim': 0, 'param_n_sub_params': 2}
    if key.endswith(('query_key_value.weight', 'query_key_value.bias', 'dense_h_to_4h.weight',
                     'dense_h_to_4h.bias')):
        return {'cat_dim': 0}
    return {}


class ExportUniversalTest(FixtureTestCase):

    def test_every_state_whole_with_its_layout(self):
        for family, model in FAMILIES.items():
            with self.subTest(family=family):
                src = make_fixture(self.path(family, 'ckpt'), tp=2, pp=2, dp=2, **model)
                ref = make_fixture(self.path(family, 'ref'), tp=1, pp=1, dp=1, **model)
                out = self.path(family, 'ckpt', 'global_step10_universal')
                p = run('export', src, out, '--to', 'universal')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                want = reference_states(ref, model['V'])
                self.assertEqual(sorted(os.listdir(os.path.join(out, 'zero'))), sorted(list(want) + ['optimizer_state.pt']))
                for param, states in want.items():
                    folder = os.path.join(out, 'zero', param)
                    self.assertEqual(sorted(os.listdir(folder)), sorted([s + '.pt' for s in STATES] + ['step.pt']))
                    for state, value in states.items():
                        saved = torch.load(os.path.join(folder, state + '.pt'))
                        got = saved.pop('param')
                        self.assertEqual(got.dtype, torch.float32, param)
                        self.assertEqual(tuple(got.shape), tuple(value.shape), f'{param} {state}')
                        self.assertTrue(torch.equal(got, value), f'{param} {state}')
                        self.assertEqual(saved, expected_layout(param, family), f'{param} {state}')
                    self.assertEqual(torch.load(os.path.join(folder, 'step.pt')), 10)
                for name in os.listdir(src):
                    if name.startswith('mp_rank_'):
                        self.assertTrue(filecmp.cmp(os.path.join(src, name), os.path.join(out, name), shallow=False))
                optimizer_state = torch.load(os.path.join(out, 'zero', 'optimizer_state.pt'))
                self.assertIn('param_groups', optimizer_state)
                for gone in ('base_optimizer_state', 'single_partition_of_fp32_groups', 'param_slice_mappings'):
                    self.assertNotIn(gone, optimizer_state)
                # A TP 1 source records no split, yet its row-parallel tensors get cat_dim 1 from
                # the rules (DeepSpeed's converter tags them 0, and its loader then cuts the wrong dim).
                ref_out = self.path(family, 'ref_universal')
                self.assertEqual(run('export', ref, ref_out, '--to', 'universal', '-q').returncode, 0)
                for param in want:
                    saved = torch.load(os.path.join(ref_out, 'zero', param, 'fp32.pt'))
                    saved.pop('param')
                    self.assertEqual(saved, expected_layout(param, family), f'TP 1 source: {param}')
                root = os.path.dirname(out)
                with open(os.path.join(root, 'latest_universal')) as f:
                    self.assertEqual(f.read().strip(), 'global_step10_universal')
                with open(os.path.join(root, 'latest')) as f:
                    self.assertEqual(f.read().strip(), 'global_step10')

    def test_non_pipeline_under_module_names(self):
        """An HF-Trainer-style ZeRO-2 folder at TP 1: every trainable parameter's states whole,
        under the module's names, shaped as param_shapes records, no layout keys (nothing split).
        Reading such a universal checkpoint back is refused with one line (pipeline models only)."""
        cfg = dn.NonPipeConfig(zero_stage=2, dtype='bf16', dp=2, L=2, n_heads=4, n_kv=2, head_dim=16, ffn=64,
                               h=64, V=128)
        src = self.path('hf')
        dn.write_nonpipe(src, cfg)
        out = self.path('hf_universal')
        p = run('export', src, out, '--to', 'universal')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        want = dn.expected_nonpipe_state(cfg)
        self.assertEqual(sorted(os.listdir(os.path.join(out, 'zero'))), sorted(list(want['fp32']) + ['optimizer_state.pt']))
        for param in want['fp32']:
            for state in STATES:
                saved = torch.load(os.path.join(out, 'zero', param, state + '.pt'))
                self.assertEqual(list(saved), ['param'], f'{param} {state}')
                self.assertTrue(torch.equal(saved['param'], want[state][param]), f'{param} {state}')
        p = run('export', os.path.join(out), self.path('again'), '--to', 'universal')
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)  # not a pipeline model: not read back yet
        self.assertIn('not a pipeline parameter name', p.stderr)

    def test_non_pipeline_matches_deepspeed(self):
        """reshard's export of HF-Trainer-style ZeRO-2 and ZeRO-3 sources against ds_to_universal's
        (ZeRO-3: DeepSpeed's bare flat tensors, no step.pt, rank 0's optimizer state)."""
        cases = sorted(c for c in os.listdir(DS_DATA) if c.startswith('nonpipe_'))
        self.assertTrue(cases)
        for case in cases:
            with open(os.path.join(DS_DATA, case, 'case.json')) as f:
                spec = json.load(f)
            with self.subTest(case=case):
                src = self.path(case, 'src')
                dn.write_nonpipe(src, dn.NonPipeConfig(**spec['nonpipe_config']))
                root = self.path(case, 'out')
                p = run('export', src, os.path.join(root, spec['universal_folder']), '--to', 'universal', '-q')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                ds_root = os.path.join(DS_DATA, case)

                def files(top):
                    return sorted(os.path.relpath(os.path.join(r, x), top) for r, _, fs in os.walk(top)
                                  for x in fs if x not in ('case.json', 'reshard-manifest.json'))
                self.assertEqual(files(root), files(ds_root))
                for rel in files(ds_root):
                    if not rel.endswith('.pt'):
                        same = filecmp.cmp(os.path.join(root, rel), os.path.join(ds_root, rel), shallow=False)
                        self.assertTrue(same, rel)
                        continue
                    ours, theirs = (support.load(os.path.join(top, rel)) for top in (root, ds_root))
                    if isinstance(theirs, dict) and rel.endswith(tuple(f'/{s}.pt' for s in STATES)):
                        self.assertEqual(theirs.pop('cat_dim'), 0, rel)  # see the module docstring
                    self.assertEqual(support.differences(ours, theirs, rel), [])

    def test_refusals_write_nothing(self):
        weights_only = make_fixture(self.path('weights'), tp=2, pp=2, dp=1, **dict(FAMILIES['ms_gpt2'], optimizer='none'))
        out = self.path('out')
        p = run('export', weights_only, out, '--to', 'universal')
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn('export --to consolidated writes its weights', p.stderr)
        drifted = make_fixture(self.path('drifted'), tp=2, pp=2, dp=2, tp_drift_eps=0.01, **FAMILIES['ms_gpt2'])
        p = run('export', drifted, out, '--to', 'universal')
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn('--replicated average', p.stderr)
        self.assertFalse(os.path.exists(out))


if __name__ == '__main__':
    support.main()
