"""`reshard export --to consolidated`: one state dict of whole tensors under canonical names.

The source is a microsoft GPT-2 style checkpoint at TP 2, PP 2, DP 2 with BF16-optimizer shards.
The reference is the same model (same seed) written by the fixture generator at TP 1, PP 1, DP 1:
its layer files hold every weight whole (the vocabulary padded) and its optimizer shard every
fp32 master whole, found by `param_slice_mappings`. Neither is written by reshard. Checked:

* safetensors output (read here with a small parser of the format) equals the reference's fp32
  masters, vocabulary padding stripped, tied embedding once; `--weights-only` gives the weights;
  `--dtype bf16` rounds the masters;
* `--max-shard-size` splits into model-0000K-of-0000N.safetensors plus an index whose weight map
  names every tensor's file, and the union equals the single file;
* a file past 32 MiB is written as byte ranges, by one worker or two, to the same bytes, and
  `verify` finds its manifest CRC (joined from the ranges' CRCs) right;
* `--format pt` writes a torch.save file torch.load reads back to the same tensors;
* non-pipeline ZeRO-2 and ZeRO-3 folders (HF Trainer style) export under the module's own names,
  equal to the fixture oracle's fp32 masters (and buffers, where the checkpoint keeps them);
* refusals: drifted replicas under the default --replicated check, an unknown vocabulary size;
  nothing is written.

Run: /usr/bin/python3 tests/interop/test_export_consolidated.py --reshard build/reshard
"""
import glob
import json
import os
import re
import shutil

import torch

from fixtures import deepspeed_nonpipe as dn

import interop_support as support
from interop_support import FixtureTestCase, make_fixture, rewrite

run = support.reshard
read_safetensors = support.read_safetensors
MODEL = dict(support.FAMILIES['ms_gpt2'], optimizer='bf16_zero')
L = MODEL['L']
def canonical_name(layer_id, key):
    """reshard's canonical name of a key in layer file `layer_id` of the TP 1, PP 1 reference."""
    if layer_id == 1:
        return 'embedding.' + key
    if layer_id == L + 2:
        return 'final_layernorm.' + key
    return f'layers.{layer_id - 2}.{key}'


class ExportConsolidatedTest(FixtureTestCase):

    def setUp(self):
        super().setUp()
        self.src = make_fixture(self.path('src'), tp=2, pp=2, dp=2, **MODEL)
        self.ref = make_fixture(self.path('ref'), tp=1, pp=1, dp=1, **MODEL)

    def reference(self):
        """(weights, masters) of the reference by canonical name, vocabulary rows stripped."""
        weights, shapes = {}, {}
        for layer_id in range(1, L + 3):
            sd = support.load(support.layer_file(self.ref, layer_id, 0))
            for key, value in sd.items():
                name = canonical_name(layer_id, key)
                weights[name] = value[:MODEL['V']] if key == 'word_embeddings.weight' else value
                shapes[name] = (layer_id, key, value.shape)
        osd = support.load(os.path.join(self.ref, 'bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt'))
        osd = osd['optimizer_state_dict']
        masters = {}
        for flat, mapping in zip(osd['single_partition_of_fp32_groups'], osd['param_slice_mappings']):
            for param, fragment in mapping.items():
                layer, key = param.split('.', 1)
                layer_id = 1 if layer == 'tied_modules' else int(layer)
                if layer == 'tied_modules':
                    key = key.split('.', 1)[1]  # tied_modules.embed.<key>
                name = canonical_name(layer_id, key)
                value = flat[fragment.start:fragment.start + fragment.numel].reshape(shapes[name][2])
                masters[name] = value[:MODEL['V']] if key == 'word_embeddings.weight' else value
        return weights, masters

    def export(self, out, *options, code=0):
        p = run('export', self.src, out, '--to', 'consolidated', *options)
        self.assertEqual(p.returncode, code, p.stdout + p.stderr)
        return p

    def assertSameTensors(self, got, want):
        self.assertEqual(sorted(got), sorted(want))
        for name, value in want.items():
            self.assertEqual(got[name].dtype, value.dtype, name)
            self.assertEqual(tuple(got[name].shape), tuple(value.shape), name)
            self.assertTrue(torch.equal(got[name], value), name)

    def test_masters_weights_and_dtype(self):
        weights, masters = self.reference()
        self.assertEqual(len(masters), len(weights))  # every weight has a master; embedding tied once
        for options, want in (((), masters), (('--weights-only',), weights),
                              (('--dtype', 'bf16'), {n: t.to(torch.bfloat16) for n, t in masters.items()})):
            with self.subTest(options=options):
                out = self.path('out_' + '_'.join(o.strip('-') for o in options))
                self.export(out, *options)
                self.assertEqual(sorted(os.listdir(out)), ['model.safetensors', support.MANIFEST])
                got, meta = read_safetensors(os.path.join(out, 'model.safetensors'))
                self.assertEqual(meta, {'format': 'pt'})
                self.assertSameTensors(got, want)

    def test_shards_and_index(self):
        _, masters = self.reference()
        out = self.path('sharded')
        self.export(out, '--max-shard-size', '40KB')
        files = sorted(f for f in os.listdir(out) if f.endswith('.safetensors'))
        self.assertGreater(len(files), 2)
        self.assertEqual(files, [f'model-{i + 1:05d}-of-{len(files):05d}.safetensors' for i in range(len(files))])
        with open(os.path.join(out, 'model.safetensors.index.json')) as f:
            index = json.load(f)
        union = {}
        for name in files:
            tensors, _ = read_safetensors(os.path.join(out, name))
            for t in tensors:
                self.assertEqual(index['weight_map'][t], name)
            union.update(tensors)
        self.assertSameTensors(union, masters)
        self.assertEqual(index['metadata']['total_size'], sum(t.numel() * 4 for t in masters.values()))

    def test_torch_format(self):
        _, masters = self.reference()
        out = self.path('pt')
        self.export(out, '--format', 'pt')
        self.assertEqual(sorted(os.listdir(out)), sorted(['pytorch_model.bin', support.MANIFEST]))
        got = torch.load(os.path.join(out, 'pytorch_model.bin'))
        self.assertSameTensors(dict(got), masters)

    def test_non_pipeline_and_zero3_under_module_names(self):
        """HF-Trainer-style folders: the module's own names, masters from the oracle's model."""
        for stage in (2, 3):
            with self.subTest(zero_stage=stage):
                cfg = dn.NonPipeConfig(zero_stage=stage, dtype='bf16', dp=2, L=2, n_heads=4, n_kv=2,
                                       head_dim=16, ffn=64, h=64, V=128)
                src = self.path(f'z{stage}')
                dn.write_nonpipe(src, cfg)
                out = self.path(f'z{stage}_out')
                p = run('export', src, out, '--to', 'consolidated')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got, _ = read_safetensors(os.path.join(out, 'model.safetensors'))
                want = dn.expected_nonpipe_state(cfg)
                expected = dict(want['fp32'])
                if stage == 3:
                    self.assertIn('lists its fp32 masters only', p.stdout)
                else:
                    expected.update(want['buffers'])  # stored in the training dtype, as saved
                self.assertSameTensors(got, expected)

    def test_a_big_file_is_written_as_ranges_by_several_workers(self):
        """A safetensors file past 32 MiB is cut into ranges that the workers write at once."""
        cfg = dn.NonPipeConfig(zero_stage=2, dtype='bf16', dp=2, L=1, n_heads=4, n_kv=2,
                               head_dim=16, ffn=64, h=512, V=10240)  # embedding and head 20 MiB each
        src = self.path('big')
        dn.write_nonpipe(src, cfg)
        out = self.path('big_out')
        plan = run('export', src, out, '--to', 'consolidated', '--dry-run')
        self.assertEqual(plan.returncode, 0, plan.stdout + plan.stderr)
        ranges = re.search(r'model\.safetensors  written as (\d+) ranges', plan.stdout)
        self.assertIsNotNone(ranges, plan.stdout)
        self.assertGreaterEqual(int(ranges.group(1)), 2)
        for threads in (1, 2):
            with self.subTest(threads=threads):
                shutil.rmtree(out, ignore_errors=True)
                p = run('export', src, out, '--to', 'consolidated', '--threads', threads)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got, _ = read_safetensors(os.path.join(out, 'model.safetensors'))
                want = dn.expected_nonpipe_state(cfg)
                self.assertSameTensors(got, dict(want['fp32'], **want['buffers']))
                self.assertEqual(run('verify', out).returncode, 0)  # the manifest's CRC, joined from the ranges

    def test_refusals_write_nothing(self):
        drifted = make_fixture(self.path('drifted'), tp=2, pp=2, dp=2, tp_drift_eps=0.01, **MODEL)
        out = self.path('refused')
        p = run('export', drifted, out, '--to', 'consolidated')
        self.assertEqual(p.returncode, 2)
        self.assertIn('replicated tensor(s) differ across TP ranks', p.stderr)
        self.assertIn('--replicated average', p.stderr)

        def forget_vocab(sd):
            sd.pop('universal_checkpoint_info', None)
        for path in glob.glob(os.path.join(self.src, 'mp_rank_*_model_states.pt')):
            rewrite(path, forget_vocab)
        p = run('export', self.src, out, '--to', 'consolidated', '--rules', 'megatron-gpt2')
        self.assertEqual(p.returncode, 2)
        self.assertIn('the true vocabulary size (the padding rows are stripped to it); give it as the run was '
                      'trained: --vocab-size N', p.stderr)
        self.assertFalse(os.path.exists(out))
        # Told the size, it exports.
        self.export(out, '--rules', 'megatron-gpt2', '--vocab-size', MODEL['V'])


if __name__ == '__main__':
    support.main()
