"""`export --to torch_dist`: Megatron-Core's distributed checkpoint, written from any source whose
rule set has a torch_dist section.

Checked, bit for bit:

* real Megatron-Core 0.19 / 0.14 saves (tests/data/megatron-core) exported at another TP and PP read
  back as the same model: `verify` finds them equal, and converting either to Megatron-DeepSpeed
  at the save's layout gives the same layer files;
* the output is laid out as Megatron-LM lays it out (`iter_N/` with `.metadata`, one
  `__{rank}_0.distcp` per TP x PP rank, metadata.json, latest_checkpointed_iteration.txt), with
  each TP rank's pieces as chunks of the stacked global tensors (SwiGLU's linear_fc1 as two boxes
  per rank) and the common state and extra-state items Megatron-Core's load asks for;
* real torch 2.6 (a Debian trixie chroot, torch2_chroot.py; skipped with one line when it cannot
  be built) loads the output with `dcp.load` into the global tensors, equal to the save's
  `TAG_full.pt` written by Megatron and torch;
* a Megatron-DeepSpeed checkpoint (LLaMA style: GQA, SwiGLU) exported to torch_dist and converted
  back to its layout gives its layer files again.

Run: /usr/bin/python3 tests/interop/test_export_torch_dist.py --reshard build/reshard
"""
import glob
import json
import os

import torch

import interop_support as support
from megatron_core_data import DATA, config_of, sizes
from interop_support import FAMILIES, FixtureTestCase, make_fixture
import torch2_chroot

run = support.reshard

# Run by torch 2.6 in the chroot: loads the checkpoint at FOLDER into tensors of the global shapes
# the metadata gives, and saves them (and the common state) for the host to compare.
LOAD = r'''
import pickle, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
with open(FOLDER + '/.metadata', 'rb') as f:
    meta = pickle.load(f)
state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
         if isinstance(m, TensorStorageMetadata)}
state['common_state/shard_0_1'] = None
dcp.load(state, checkpoint_id=FOLDER)  # no process group: one process
torch.save(state, FOLDER + '/../loaded.pt')
print('loaded', len(state), 'items')
'''


def other_layout(layout):
    return (1 if layout['tp'] == 2 else 2), (2 if layout['pp'] == 1 else 1)


class ExportTorchDistTest(FixtureTestCase):

    def export(self, src, out, tp, pp, *extra):
        p = run('export', src, out, '--to', 'torch_dist', '--tp', tp, '--pp', pp, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def layer_files(self, folder):
        return {os.path.basename(p): torch.load(p) for p in sorted(glob.glob(os.path.join(folder, 'layer_*')))}

    def test_real_saves_read_back_as_the_same_model_at_another_layout(self):
        for name in ('0.19/w1_tp1', '0.19/w2_tp2', '0.19/w2_pp2', '0.19/w2_tp2_swiglu', '0.19/w2_tp2_bf16',
                     '0.14/w2_tp2'):
            config = config_of(name)
            layout, folder = config['layout'], os.path.join(DATA, name)
            with self.subTest(save=name):
                tp, pp = other_layout(layout)
                out = self.path(name.replace('/', '_'))
                self.export(folder, out, tp, pp, *sizes(config))
                files = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
                # A save is written in its own Megatron-Core version's form: 0.14's has common.pt.
                want = sorted([f'iter_0000000/__{r}_0.distcp' for r in range(tp * pp)] +
                              ['iter_0000000/.metadata', 'iter_0000000/metadata.json',
                               'latest_checkpointed_iteration.txt', support.MANIFEST] +
                              (['iter_0000000/common.pt'] if name.startswith('0.14/') else []))
                self.assertEqual(files, want)
                p = run('verify', folder, out, *sizes(config)[:-2])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                direct, back = self.path(name.replace('/', '_') + '_direct'), self.path(name.replace('/', '_') + '_back')
                for src, dst in ((folder, direct), (out, back)):
                    p = run('convert', '--to', 'deepspeed', src, dst, '--tp', layout['tp'], '--pp', layout['pp'], *sizes(config),
                            '--no-update-latest')
                    self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                want, got = self.layer_files(direct), self.layer_files(back)
                self.assertEqual(sorted(got), sorted(want))
                for layer, tensors in want.items():
                    self.assertEqual(support.differences(got[layer], tensors, layer), [])

    def test_each_rank_writes_its_pieces_as_chunks_of_the_stacked_tensors(self):
        config = config_of('0.19/w2_tp2_swiglu')
        out = self.path('chunks')
        self.export(os.path.join(DATA, '0.19', 'w2_tp2_swiglu'), out, 2, 1, *sizes(config))
        p = run('inspect', out, '--rules', 'none')
        self.assertEqual(p.returncode, 0, p.stderr)
        # [all gate; all up]: rank 0 writes rows 0-15 and 32-47 of each layer, rank 1 rows 16-31 and 48-63.
        self.assertIn('decoder.layers.mlp.linear_fc1.weight float32[2, 64, 16], 8 chunks: [0, 0, 0]+[1, 16, 16] '
                      '[0, 32, 0]+[1, 16, 16] [1, 0, 0]+[1, 16, 16] [1, 32, 0]+[1, 16, 16] [0, 16, 0]+[1, 16, 16] '
                      '[0, 48, 0]+[1, 16, 16] [1, 16, 0]+[1, 16, 16] [1, 48, 0]+[1, 16, 16]', p.stdout)
        self.assertIn('decoder.layers.self_attention.linear_proj.weight float32[2, 16, 16], 4 chunks: '
                      '[0, 0, 0]+[1, 16, 8] [1, 0, 0]+[1, 16, 8] [0, 0, 8]+[1, 16, 8] [1, 0, 8]+[1, 16, 8]', p.stdout)
        self.assertIn('decoder.final_layernorm.weight float32[16], 1 chunk: [0]+[16]', p.stdout)
        for item in ('common_state/shard_0_1', 'decoder.layers.mlp.linear_fc2._extra_state/shard_1_2'):
            self.assertIn(item, p.stdout)
        with open(os.path.join(out, 'iter_0000000', 'metadata.json')) as f:
            self.assertEqual(json.load(f), {'sharded_backend': 'torch_dist', 'sharded_backend_version': 1})

    def test_torch_loads_the_export_into_the_whole_tensors(self):
        root = torch2_chroot.root_or_skip()
        for name in ('0.19/w2_tp2_swiglu', '0.19/w2_tp2_bf16', '0.19/w2_pp2'):
            config = config_of(name)
            with self.subTest(save=name):
                out = self.path(name.replace('/', '_') + '_torch')
                tp, pp = other_layout(config['layout'])
                self.export(os.path.join(DATA, name), out, tp, pp, *sizes(config))
                p = torch2_chroot.run(root, "FOLDER = '/data/iter_0000000'\n" + LOAD, {out: '/data'})
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                loaded = torch.load(os.path.join(out, 'loaded.pt'))
                full = torch.load(os.path.join(DATA, name + '_full.pt'))
                compared = 0
                for key, want in full.items():
                    if isinstance(want, torch.Tensor):
                        self.assertEqual(support.differences(loaded[key], want, key), [])
                        compared += 1
                self.assertEqual(compared, sum(isinstance(v, torch.Tensor) for v in loaded.values()))
                common = loaded['common_state/shard_0_1'][0]
                self.assertEqual((common['iteration'], common['checkpoint_version']), (0, 3.0))
                self.assertEqual((common['args'].tensor_model_parallel_size, common['args'].num_query_groups), (tp, 2))

    def test_a_megatron_deepspeed_checkpoint_goes_to_torch_dist_and_back(self):
        # LLaMA style (GQA, SwiGLU, untied) and GPT-2 style (MHA, learned positions, tied embeddings).
        for family, target in (('ms_llama', (3, 1)), ('ms_gpt2', (1, 3))):
            with self.subTest(family=family):
                src = make_fixture(self.path(family), **dict(FAMILIES[family], tp=2, pp=2, dp=1))
                out = self.path(family + '_td')
                self.export(src, out, *target)
                back = self.path(family + '_back')
                p = run('convert', '--to', 'deepspeed', out, back, '--tp', 2, '--pp', 2, '--no-update-latest')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertEqual(support.layer_file_differences(self.layer_files(src), self.layer_files(back),
                                                                FAMILIES[family]['V']), [])

    def test_a_source_without_a_torch_dist_section_is_refused(self):
        src = make_fixture(self.path('bloom'), **dict(FAMILIES['bs_bloom'], tp=1, pp=1, dp=1))
        out = self.path('refused')
        p = run('export', src, out, '--to', 'torch_dist', '--tp', 1, '--pp', 1)
        self.assertRefused(p, "rule set bigscience-bloom has none", out)


if __name__ == '__main__':
    support.main()
