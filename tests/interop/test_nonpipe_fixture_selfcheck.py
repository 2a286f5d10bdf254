"""Self-check of the non-pipeline DeepSpeed fixture generator and its oracle.

``fixtures.deepspeed_nonpipe`` writes HF-Trainer-style DeepSpeed checkpoints (ZeRO stage 1, 2
and 3, any DP) and reads any such checkpoint back.  This script pins the partition arithmetic to
facts written down independently of the generator (format doc 11.3's worked example, hand-computed
ZeRO-3 partitions and sub-group cuts), proves that the oracle returns the canonical state
bit-exactly for many (stage, DP, dtype, option) combinations with no structural problem, and
that it notices corrupted fragments, partitions and metadata.

Run by ctest as ``/usr/bin/python3 tests/interop/test_nonpipe_fixture_selfcheck.py --reshard BIN``
with PYTHONPATH=tests; ``--reshard`` is accepted and ignored (reshard is not needed here).
"""

import collections
import os
import subprocess
import sys
import tempfile
import time
import unittest

import torch

from fixtures import deepspeed_nonpipe as nf
from fixtures.deepspeed_nonpipe import NonPipeConfig

from interop_support import pickle_globals

PYTHON = '/usr/bin/python3'
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tmp(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix='nonpipe_selfcheck_')
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def make(self, **kw):
        cfg = NonPipeConfig(**kw)
        root = os.path.join(self.tmp, f'ck{len(os.listdir(self.tmp))}')
        return cfg, root, nf.write_nonpipe(root, cfg)

    def tag_path(self, root, name):
        return os.path.join(root, 'global_step10', name)

    def optim_name(self, cfg, d):
        return f'{"bf16_" if cfg.dtype == "bf16" else ""}zero_pp_rank_{d}_mp_rank_00_optim_states.pt'

    def mutate(self, path, fn):
        obj = nf._load(path)
        fn(obj)
        torch.save(obj, path)

    def assertFaithful(self, cfg, root):
        problems = nf.structural_problems_nonpipe(root)
        self.assertEqual(problems, [], problems[:5])
        ckpt = nf.load_nonpipe(root)
        diffs = nf.compare_nonpipe(ckpt, cfg)
        self.assertEqual(diffs, [], diffs[:5])
        self.assertEqual((ckpt.meta['zero_stage'], ckpt.meta['dp']), (cfg.zero_stage, cfg.dp))
        return ckpt


# ---------------------------------------------------------------------------------------------
# Arithmetic pinned to independent facts
# ---------------------------------------------------------------------------------------------

class ArithmeticTest(unittest.TestCase):
    def test_format_doc_11_3_worked_example(self):
        # A (10), B (7), C (5) = 22 elements, DP = 4 -> aligned 24, P = 6 (format doc 11.3).
        numels = [10, 7, 5]
        self.assertEqual(nf.zero12_layout(22, 4), (24, 6))
        table = {0: [(0, 6, 0, 0)],
                 1: [(0, 4, 0, 6), (1, 2, 4, 0)],
                 2: [(1, 5, 0, 2), (2, 1, 5, 0)],
                 3: [(2, 4, 0, 1)]}
        for d, want in table.items():
            self.assertEqual(nf.zero12_fragments(numels, 4, d), want, d)
        self.assertEqual([nf.zero12_rank_padding(22, 4, d) for d in range(4)], [0, 0, 0, 2])

    def test_padding_longer_than_a_partition(self):
        # 67 elements at DP=16: aligned to 96, P = 6; rank 11 holds 1 element, 12..15 none.
        self.assertEqual(nf.zero12_layout(67, 16), (96, 6))
        self.assertEqual([nf.zero12_rank_padding(67, 16, d) for d in range(16)], [0] * 11 + [5, 6, 6, 6, 6])
        self.assertEqual(nf.zero12_fragments([60, 7], 16, 11), [(1, 1, 0, 6)])
        self.assertEqual(nf.zero12_fragments([60, 7], 16, 12), [])

    def test_zero3_partitions(self):
        self.assertEqual([nf.zero3_partition_numel(n, 5) for n in (217, 56, 4, 5, 1)], [44, 12, 1, 1, 1])
        self.assertEqual(nf.zero3_partition_numel(64, 16), 4)
        x = torch.arange(7.0)
        self.assertEqual(nf._zero3_part(x, 3, 2, fill=-1).tolist(), [6.0, -1.0, -1.0])
        self.assertEqual(nf._zero3_part(x, 16, 9, fill=-1).tolist(), [-1.0])

    def test_zero3_sub_group_cuts(self):
        parts = [44, 12, 6, 6, 12]
        self.assertEqual(nf.zero3_sub_groups(parts, None), [[0, 1, 2, 3, 4]])
        self.assertEqual(nf.zero3_sub_groups(parts, 80), [[0, 1, 2, 3, 4]])     # >= total 80
        self.assertEqual(nf.zero3_sub_groups(parts, 40), [[0], [1, 2, 3, 4]])
        self.assertEqual(nf.zero3_sub_groups(parts, 18), [[0], [1, 2], [3, 4]])
        self.assertEqual(nf.zero3_sub_groups(parts, 45), [[0, 1], [2, 3, 4]])
        self.assertEqual(nf.zero3_sub_groups(parts, 0), [[0], [1], [2], [3], [4]])


class ConfigTest(unittest.TestCase):
    def test_default_model(self):
        cfg = NonPipeConfig()
        groups = nf.param_group_names(cfg)
        canon = nf.canonical_tensors(cfg)
        numels = [sum(canon[n].numel() for n in g) for g in groups]
        self.assertEqual(numels, [1232, 67])
        self.assertTrue(all(canon[n].dim() >= 2 for n in groups[0]))
        self.assertTrue(all(canon[n].dim() == 1 for n in groups[1]))
        # The no-decay group's alignment padding exceeds a partition at DP=16 (ranks 12..15 hold
        # nothing but padding); at DP=12 it is 5 of the last rank's 6 elements.
        aligned, part = nf.zero12_layout(67, 16)
        self.assertGreater(aligned - 67, part)
        self.assertEqual([nf.zero12_rank_padding(67, 12, d) for d in (9, 10, 11)], [0, 0, 5])
        # Most parameter numels are multiples of none of the tested DP sizes.
        odd = [n for n, t in canon.items() if all(t.numel() % d for d in (3, 4, 5, 12, 16))]
        self.assertGreaterEqual(len(odd), len(canon) // 2)
        names = list(canon)
        self.assertEqual(names[:3], ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight',
                                     'model.layers.0.self_attn.q_proj.bias'])
        self.assertEqual(names[-2:], ['model.norm.weight', 'lm_head.weight'])

    def test_values_follow_the_seed_recipe(self):
        import zlib
        canon = nf.canonical_tensors(NonPipeConfig(seed=7))
        gen = torch.Generator().manual_seed(zlib.crc32(b'model.layers.1.mlp.up_proj.weight') ^ 7)
        self.assertTrue(torch.equal(canon['model.layers.1.mlp.up_proj.weight'],
                                    0.02 * torch.randn((11, 7), generator=gen)))

    def test_invalid(self):
        bad = [(dict(zero_stage=0), 'zero_stage'), (dict(dtype='fp32'), 'dtype'), (dict(dp=0), 'dp'),
               (dict(sub_group_size=5), 'ZeRO-3'), (dict(zero_stage=3, sub_group_size=-1), 'sub_group_size'),
               (dict(frozen=('nope',)), 'not parameters'), (dict(head_dim=3), 'even head_dim'),
               (dict(frozen=('lm_head.weight',), tie_word_embeddings=True), 'not parameters'),
               (dict(grouping='decay_split', qkv_bias=False, L=1,
                     frozen=('model.layers.0.input_layernorm.weight', 'model.layers.0.post_attention_layernorm.weight',
                             'model.norm.weight')), 'empties'),
               (dict(optimizer='adam'), 'optimizer')]
        for kwargs, fragment in bad:
            with self.subTest(**{k: str(v) for k, v in kwargs.items()}):
                with self.assertRaises(ValueError) as ctx:
                    NonPipeConfig(**kwargs)
                self.assertIn(fragment, str(ctx.exception))


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------

class RoundTripTest(Tmp):
    DPS = (1, 3, 4, 5, 12, 16)

    def test_every_stage_and_dp(self):
        for stage in (1, 2, 3):
            for dp in self.DPS:
                with self.subTest(stage=stage, dp=dp):
                    cfg, root, _ = self.make(zero_stage=stage, dp=dp)
                    self.assertFaithful(cfg, root)

    def test_variants(self):
        variants = [
            dict(zero_stage=1, dp=5, dtype='fp16'),
            dict(zero_stage=2, dp=12, dtype='fp16', optimizer='ds_fused_adam'),
            dict(zero_stage=3, dp=7, dtype='fp16', zero3_pad_fill=-7.5),
            dict(zero_stage=3, dp=5, sub_group_size=40),
            dict(zero_stage=3, dp=16, sub_group_size=3, optimizer='ds_fused_adam', grouping='decay_split'),
            dict(zero_stage=3, dp=4, sub_group_size=0, tie_word_embeddings=True),
            dict(zero_stage=2, dp=3, tie_word_embeddings=True, frozen=('model.embed_tokens.weight',)),
            dict(zero_stage=1, dp=4, frozen=('model.layers.1.mlp.down_proj.weight',)),
            dict(zero_stage=3, dp=6, frozen=('model.embed_tokens.weight', 'model.layers.0.self_attn.k_proj.bias'),
                 zero3_pad_fill=3.0),
            dict(zero_stage=2, dp=10, qkv_bias=False, rotary_buffer=False, hf_extras=False, L=3, V=50),
            dict(zero_stage=3, dp=13, grouping='single', iteration=123),
            dict(zero_stage=0, dp=3, dtype='fp32'),                        # no ZeRO: the torch state in mp_rank_00
            dict(zero_stage=0, dp=1, dtype='fp32', tie_word_embeddings=True),
        ]
        for kw in variants:
            with self.subTest(**{k: str(v) for k, v in kw.items()}):
                cfg, root, summary = self.make(**kw)
                ckpt = self.assertFaithful(cfg, root)
                if cfg.zero_stage == 3:
                    self.assertEqual(ckpt.meta['sub_groups'], summary['sub_groups'])

    def test_sub_groups(self):
        cfg, root, summary = self.make(zero_stage=3, dp=5, sub_group_size=40)
        # embed 217 -> 44 >= 40 closes sub-group 0; then q 12 + k 6 + v 6 + o 12 + gate 16 = 52;
        # up 16 + down 16 + q 12 = 44; k 6 + v 6 + o 12 + gate 16 = 40; up + down + lm_head 44 (last).
        self.assertEqual([len(s) for s in summary['sub_groups']], [1, 5, 3, 4, 3, 11])
        self.assertEqual(summary['sub_group_to_group'], [0, 0, 0, 0, 0, 1])
        osd = nf._load(self.tag_path(root, 'bf16_zero_pp_rank_4_mp_rank_00_optim_states.pt'))['optimizer_state_dict']
        self.assertEqual([t.numel() for t in osd['fp32_flat_groups']], [44, 52, 44, 40, 76, 18])
        self.assertEqual([g['params'] for g in osd['optimizer_state_dict']['param_groups']], [[0, 1, 2, 3, 4], [5]])
        self.assertEqual(sorted(osd['optimizer_state_dict']['state']), list(range(6)))
        model = nf._load(self.tag_path(root, 'zero_pp_rank_2_mp_rank_00_model_states.pt'))
        self.assertEqual([list(s) for s in model['param_shapes']], summary['sub_groups'])
        self.assertEqual(model['param_shapes'][0]['model.embed_tokens.weight'], torch.Size([31, 7]))

    def test_zero3_sub_group_flat_by_hand(self):
        # Rank 2 of DP=5, sub-group 5 (no-decay): each param contributes ceil(n/5) elements.
        cfg, root, summary = self.make(zero_stage=3, dp=5, sub_group_size=40, zero3_pad_fill=9.0)
        canon = nf.canonical_tensors(cfg)
        osd = nf._load(self.tag_path(root, 'bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt'))['optimizer_state_dict']
        flat = osd['fp32_flat_groups'][5]
        q_bias = canon['model.layers.0.self_attn.q_proj.bias']           # 8 -> 2 per rank, rank 2: [4:6]
        k_bias = canon['model.layers.0.self_attn.k_proj.bias']           # 4 -> 1 per rank, rank 2: [2]
        ln = canon['model.layers.0.input_layernorm.weight']              # 7 -> 2 per rank, rank 2: [4:6]
        self.assertTrue(torch.equal(flat[0:2], q_bias[4:6]))
        self.assertTrue(torch.equal(flat[2:3], k_bias[2:3]))
        self.assertTrue(torch.equal(flat[4:6], ln[4:6]))
        last = nf._load(self.tag_path(root, 'bf16_zero_pp_rank_4_mp_rank_00_optim_states.pt'))['optimizer_state_dict']
        # rank 4 of k_proj.bias (4 elements, 1 per rank) is pure padding.
        self.assertEqual(last['fp32_flat_groups'][5][2].item(), 9.0)
        self.assertEqual(last['optimizer_state_dict']['state'][5]['exp_avg'][2].item(), 0.0)

    def test_zero0_contents_by_hand(self):
        """No ZeRO: mp_rank_00 alone, fp32 module, the torch state indexing the groups in order."""
        cfg, root, _ = self.make(zero_stage=0, dp=4, dtype='fp32')
        self.assertEqual(os.listdir(os.path.join(root, 'global_step10')), ['mp_rank_00_model_states.pt'])
        self.assertFalse(os.path.exists(os.path.join(root, 'zero_to_fp32.py')))
        sd = nf._load(self.tag_path(root, 'mp_rank_00_model_states.pt'))
        self.assertEqual((sd['param_shapes'], sd['shared_params'], sd['dp_world_size']), (None, None, 4))
        groups = nf.param_group_names(cfg)
        opt = sd['optimizer']
        self.assertEqual([pg['params'] for pg in opt['param_groups']],
                         [list(range(len(groups[0]))), list(range(len(groups[0]), len(groups[0]) + len(groups[1])))])
        name = groups[1][2]
        state = opt['state'][len(groups[0]) + 2]
        self.assertEqual(list(state), ['step', 'exp_avg', 'exp_avg_sq'])
        self.assertTrue(torch.equal(state['exp_avg'], 0.1 * sd['module'][name]))

    def test_zero12_contents_by_hand(self):
        cfg, root, _ = self.make(zero_stage=1, dp=16)
        osd = nf._load(self.tag_path(root, self.optim_name(cfg, 15)))['optimizer_state_dict']
        self.assertEqual(list(osd), ['loss_scaler', 'dynamic_loss_scale', 'overflow', 'clip_grad',
                                     'base_optimizer_state', 'single_partition_of_fp32_groups', 'zero_stage',
                                     'group_paddings', 'partition_count', 'ds_version', 'param_slice_mappings'])
        self.assertEqual(osd['group_paddings'], [16, 6])         # 1232 -> 1248, P = 78; 67 -> 96, P = 6
        self.assertEqual([t.numel() for t in osd['single_partition_of_fp32_groups']], [62, 0])
        self.assertEqual([osd['base_optimizer_state']['state'][g]['exp_avg'].numel() for g in (0, 1)], [78, 6])
        self.assertEqual(osd['partition_count'], [16, 16])
        self.assertEqual(int(osd['zero_stage']), 1)
        frag = osd['param_slice_mappings'][0]['lm_head.weight']
        self.assertEqual((frag.numel, frag.start), (62, 0))
        canon = nf.canonical_tensors(cfg)
        self.assertTrue(torch.equal(osd['single_partition_of_fp32_groups'][0],
                                    canon['lm_head.weight'].reshape(-1)[-62:]))
        step = osd['base_optimizer_state']['state'][0]['step']
        self.assertTrue(torch.is_tensor(step) and step.item() == 10.0)
        self.assertEqual(osd['base_optimizer_state']['param_groups'][1]['weight_decay'], 0.0)

    def test_model_states(self):
        cfg, root, _ = self.make(zero_stage=2, dp=3, tie_word_embeddings=True)
        m = nf._load(self.tag_path(root, 'mp_rank_00_model_states.pt'))
        self.assertEqual(list(m)[:7], ['module', 'buffer_names', 'optimizer', 'param_shapes', 'frozen_param_shapes',
                                       'shared_params', 'frozen_param_fragments'])
        self.assertIsInstance(m['module'], collections.OrderedDict)
        self.assertEqual(m['shared_params'], {'lm_head.weight': 'model.embed_tokens.weight'})
        self.assertEqual((m['frozen_param_shapes'], m['frozen_param_fragments']), ({}, {}))
        self.assertEqual((m['dp_world_size'], m['mp_world_size'], m['global_steps'], m['global_samples']),
                         (3, 1, 10, 60))
        self.assertEqual(m['buffer_names'], ['model.layers.0.self_attn.rotary_emb.inv_freq',
                                             'model.layers.1.self_attn.rotary_emb.inv_freq'])
        self.assertEqual(m['module']['lm_head.weight'].data_ptr(), m['module']['model.embed_tokens.weight'].data_ptr())
        self.assertNotIn('lm_head.weight', [n for g in m['param_shapes'] for n in g])
        self.assertTrue(all(t.dtype == torch.bfloat16 for t in m['module'].values()))
        cfg1, root1, _ = self.make(zero_stage=1, dp=2)
        m1 = nf._load(self.tag_path(root1, 'mp_rank_00_model_states.pt'))
        self.assertIsNone(m1['frozen_param_shapes'])
        self.assertIsNone(m1['frozen_param_fragments'])

    def test_zero3_model_states(self):
        cfg, root, _ = self.make(zero_stage=3, dp=4, dtype='fp16', tie_word_embeddings=True,
                                 frozen=('model.layers.0.mlp.up_proj.weight',))
        for d in range(4):
            m = nf._load(self.tag_path(root, f'zero_pp_rank_{d}_mp_rank_00_model_states.pt'))
            for name, t in m['module'].items():
                self.assertEqual(t.dtype, torch.float16)
                if name.endswith('inv_freq'):
                    self.assertEqual(tuple(t.shape), (2,))
                else:
                    self.assertEqual(tuple(t.shape), (0,), name)
            self.assertEqual(m['shared_params'], {'lm_head.weight': 'model.embed_tokens.weight'} if d == 0 else {})
            self.assertEqual(m['frozen_param_shapes'], {'model.layers.0.mlp.up_proj.weight': torch.Size([11, 7])})
            self.assertEqual(m['frozen_param_fragments']['model.layers.0.mlp.up_proj.weight'].shape, (20,))
            self.assertEqual(m['dp_world_size'], 4)
        osd = nf._load(self.tag_path(root, 'zero_pp_rank_0_mp_rank_00_optim_states.pt'))
        self.assertEqual(list(osd), ['optimizer_state_dict', 'ds_config', 'ds_version'])
        self.assertEqual(list(osd['optimizer_state_dict']), ['zero_stage', 'loss_scaler', 'dynamic_loss_scale',
                                                             'overflow', 'partition_count', 'optimizer_state_dict',
                                                             'fp32_flat_groups'])
        self.assertEqual(osd['optimizer_state_dict']['partition_count'], 4)
        self.assertTrue(osd['optimizer_state_dict']['dynamic_loss_scale'])
        self.assertEqual(osd['optimizer_state_dict']['loss_scaler'].cur_scale, 65536.0)


class FilesTest(Tmp):
    def test_names_zero2_bf16(self):
        cfg, root, summary = self.make(zero_stage=2, dp=3)
        self.assertEqual(sorted(os.listdir(os.path.join(root, 'global_step10'))),
                         ['bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt', 'bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt',
                          'bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt', 'mp_rank_00_model_states.pt'])
        self.assertEqual(sorted(os.listdir(root)),
                         ['config.json', 'global_step10', 'latest', 'rng_state_0.pth', 'rng_state_1.pth',
                          'rng_state_2.pth', 'trainer_state.json', 'zero_to_fp32.py'])
        with open(os.path.join(root, 'latest')) as f:
            self.assertEqual(f.read(), 'global_step10')
        rng = nf._load(os.path.join(root, 'rng_state_1.pth'))
        self.assertEqual(list(rng), ['python', 'numpy', 'cpu', 'cuda'])

    def test_names_zero3_fp16_dp12(self):
        cfg, root, _ = self.make(zero_stage=3, dp=12, dtype='fp16')
        names = set(os.listdir(os.path.join(root, 'global_step10')))
        want = {f'zero_pp_rank_{d}_mp_rank_00_{kind}_states.pt' for d in range(12) for kind in ('model', 'optim')}
        self.assertEqual(names, want)

    def test_dp1_single_rng_file(self):
        cfg, root, _ = self.make(zero_stage=3, dp=1)
        self.assertIn('rng_state.pth', os.listdir(root))
        self.assertNotIn('rng_state_0.pth', os.listdir(root))
        self.assertEqual(nf.structural_problems_nonpipe(root), [])

    def test_pickled_globals_name_deepspeed(self):
        cfg, root, _ = self.make(zero_stage=2, dp=2, dtype='fp16')
        g = pickle_globals(self.tag_path(root, 'zero_pp_rank_0_mp_rank_00_optim_states.pt'))
        for want in [('deepspeed.runtime.fp16.loss_scaler', 'DynamicLossScaler'),
                     ('deepspeed.runtime.zero.config', 'ZeroStageEnum'),
                     ('deepspeed.utils.tensor_fragment', 'fragment_address')]:
            self.assertIn(want, g)
        cfg3, root3, _ = self.make(zero_stage=3, dp=2)
        g3 = pickle_globals(self.tag_path(root3, 'bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt'))
        self.assertIn(('deepspeed.runtime.fp16.loss_scaler', 'LossScaler'), g3)
        self.assertNotIn(('deepspeed.utils.tensor_fragment', 'fragment_address'), g3)
        self.assertTrue(all(mod.split('.')[0] in ('torch', 'collections', 'deepspeed', '__builtin__')
                            for mod, _ in g | g3), g | g3)


# ---------------------------------------------------------------------------------------------
# The oracle and the checker notice corruption
# ---------------------------------------------------------------------------------------------

class MutationTest(Tmp):
    def read_diffs(self, cfg, root):
        try:
            return nf.compare_nonpipe(nf.load_nonpipe(root), cfg)
        except nf.NonPipeFormatError as e:
            return [f'unreadable: {e}']

    def test_zero2_wrong_partition_value(self):
        cfg, root, _ = self.make(zero_stage=2, dp=5)

        def poke(obj):
            obj['optimizer_state_dict']['single_partition_of_fp32_groups'][0][3] += 1.0
        self.mutate(self.tag_path(root, self.optim_name(cfg, 2)), poke)
        self.assertTrue(any('optimizer fp32' in d for d in self.read_diffs(cfg, root)))
        self.assertTrue(any('fp32 master' in p for p in nf.structural_problems_nonpipe(root)))

    def test_zero2_wrong_fragment_address(self):
        cfg, root, _ = self.make(zero_stage=2, dp=4)
        fragment = nf.install_pickle_shims()['fragment_address']

        def shift(obj):
            maps = obj['optimizer_state_dict']['param_slice_mappings'][0]
            name = next(iter(maps))
            maps[name] = fragment(numel=maps[name].numel - 1, start=maps[name].start + 1)
        self.mutate(self.tag_path(root, self.optim_name(cfg, 1)), shift)
        self.assertTrue(self.read_diffs(cfg, root))
        self.assertTrue(any('param_slice_mappings' in p for p in nf.structural_problems_nonpipe(root)))

    def test_zero1_swapped_ranks(self):
        cfg, root, _ = self.make(zero_stage=1, dp=3, dtype='fp16')
        a, b = self.tag_path(root, self.optim_name(cfg, 0)), self.tag_path(root, self.optim_name(cfg, 1))
        tmp = a + '.tmp'
        os.rename(a, tmp)
        os.rename(b, a)
        os.rename(tmp, b)
        self.assertTrue(self.read_diffs(cfg, root))
        self.assertTrue(nf.structural_problems_nonpipe(root))

    def test_zero2_wrong_moment_and_padding(self):
        cfg, root, _ = self.make(zero_stage=2, dp=16)

        def poke(obj):
            obj['optimizer_state_dict']['base_optimizer_state']['state'][1]['exp_avg_sq'][0] = 5.0
            obj['optimizer_state_dict']['group_paddings'][1] = 0
        self.mutate(self.tag_path(root, self.optim_name(cfg, 11)), poke)
        self.assertTrue(any('exp_avg_sq' in d for d in self.read_diffs(cfg, root)))
        self.assertTrue(any('group_paddings' in p for p in nf.structural_problems_nonpipe(root)))

    def test_zero3_short_partition(self):
        cfg, root, _ = self.make(zero_stage=3, dp=4, sub_group_size=40)

        def cut(obj):
            obj['optimizer_state_dict']['fp32_flat_groups'][1] = obj['optimizer_state_dict']['fp32_flat_groups'][1][:-1]
        self.mutate(self.tag_path(root, self.optim_name(cfg, 3)), cut)
        self.assertTrue(any('unreadable' in d for d in self.read_diffs(cfg, root)))
        self.assertTrue(any('sum of ceil' in p for p in nf.structural_problems_nonpipe(root)))

    def test_zero3_swapped_ranks_and_wrong_value(self):
        cfg, root, _ = self.make(zero_stage=3, dp=5)
        a, b = self.tag_path(root, self.optim_name(cfg, 1)), self.tag_path(root, self.optim_name(cfg, 3))
        os.rename(a, a + '.tmp')
        os.rename(b, a)
        os.rename(a + '.tmp', b)
        self.assertTrue(any('fp32' in d for d in self.read_diffs(cfg, root)))
        cfg2, root2, _ = self.make(zero_stage=3, dp=3)

        def poke(obj):
            obj['optimizer_state_dict']['optimizer_state_dict']['state'][0]['exp_avg'][0] += 1.0
        self.mutate(self.tag_path(root2, self.optim_name(cfg2, 0)), poke)
        self.assertTrue(any('exp_avg' in d for d in self.read_diffs(cfg2, root2)))

    def test_zero3_sub_group_cut_inconsistent(self):
        cfg, root, _ = self.make(zero_stage=3, dp=4, sub_group_size=40)
        for name in os.listdir(os.path.join(root, 'global_step10')):
            def drop(obj):
                obj['ds_config']['zero_optimization']['sub_group_size'] = 1e9
            self.mutate(self.tag_path(root, name), drop)
        self.assertEqual(self.read_diffs(cfg, root), [])   # the data are still readable ...
        problems = nf.structural_problems_nonpipe(root)    # ... but the cuts contradict ds_config
        self.assertTrue(any('sub_group_size' in p for p in problems), problems)

    def test_zero3_missing_model_file_and_bad_dp(self):
        cfg, root, _ = self.make(zero_stage=3, dp=3)
        os.remove(self.tag_path(root, 'zero_pp_rank_2_mp_rank_00_model_states.pt'))
        self.assertTrue(any('unreadable' in d for d in self.read_diffs(cfg, root)))
        self.assertTrue(any('model-state files' in p for p in nf.structural_problems_nonpipe(root)))
        cfg2, root2, _ = self.make(zero_stage=2, dp=3)

        def lie(obj):
            obj['dp_world_size'] = 4
        self.mutate(self.tag_path(root2, 'mp_rank_00_model_states.pt'), lie)
        self.assertTrue(any('dp_world_size' in p for p in nf.structural_problems_nonpipe(root2)))

    def test_zero3_placeholder_and_prefix(self):
        cfg, root, _ = self.make(zero_stage=3, dp=2)

        def fill(obj):
            obj['module']['model.norm.weight'] = torch.ones(7, dtype=torch.bfloat16)
        self.mutate(self.tag_path(root, 'zero_pp_rank_1_mp_rank_00_model_states.pt'), fill)
        os.rename(self.tag_path(root, 'bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt'),
                  self.tag_path(root, 'zero_pp_rank_0_mp_rank_00_optim_states.pt'))
        problems = nf.structural_problems_nonpipe(root)
        self.assertTrue(any('placeholder' in p for p in problems), problems)
        self.assertTrue(any('prefixes' in p for p in problems), problems)

    def test_pipeline_checkpoint_is_refused(self):
        from fixtures import megatron_fixture as mf
        root = os.path.join(self.tmp, 'pipe')
        mf.write_checkpoint(root, mf.FixtureConfig(style='ms_llama', dp=2))
        with self.assertRaises(nf.NonPipeFormatError):
            nf.load_nonpipe(root)
        self.assertTrue(any('layer files' in p for p in nf.structural_problems_nonpipe(root)))

    def test_missing_rng_file(self):
        cfg, root, _ = self.make(zero_stage=1, dp=4)
        os.remove(os.path.join(root, 'rng_state_3.pth'))
        self.assertTrue(any('rng_state' in p for p in nf.structural_problems_nonpipe(root)))


class CliTest(Tmp):
    def run_cli(self, *args):
        env = dict(os.environ, PYTHONPATH=TESTS_DIR, PYTHONDONTWRITEBYTECODE='1')
        return subprocess.run([PYTHON, '-m', 'fixtures.deepspeed_nonpipe', *args],
                              env=env, capture_output=True, text=True, timeout=120)

    def test_write_and_check(self):
        out = os.path.join(self.tmp, 'cli')
        res = self.run_cli('--zero-stage', '3', '--dp', '6', '--dtype', 'fp16', '--sub-group-size', '30', out)
        self.assertEqual(res.returncode, 0, res.stderr)
        self.assertTrue(os.path.isfile(os.path.join(out, 'global_step10', 'zero_pp_rank_5_mp_rank_00_model_states.pt')))
        res = self.run_cli('--dtype', 'fp16', '--check', out)
        self.assertEqual(res.returncode, 0, res.stdout + res.stderr)
        res = self.run_cli('--dtype', 'fp16', '--h', '9', '--check', out)   # other sizes: differences
        self.assertEqual(res.returncode, 1, res.stdout)
        res = self.run_cli('--zero-stage', '2', '--sub-group-size', '3', os.path.join(self.tmp, 'bad'))
        self.assertEqual(res.returncode, 2)
        self.assertIn('ZeRO-3', res.stderr)


def main(argv):
    argv = [a for a in argv if not a.startswith('--reshard=')]
    if '--reshard' in argv:  # accepted for ctest symmetry; this self-check does not run reshard
        i = argv.index('--reshard')
        del argv[i:i + 2]
    start = time.time()
    program = unittest.main(argv=[argv[0]] + argv[1:], exit=False, verbosity=1)
    print(f'non-pipeline fixture self-check took {time.time() - start:.1f} s', file=sys.stderr)
    return 0 if program.result.wasSuccessful() else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv))
