"""Self-check of the Megatron-DeepSpeed fixture generator and its oracle (format doc section 18.10).

The interop tests trust ``fixtures.megatron_fixture`` twice: to write faithful source
checkpoints and to read reshard's outputs back.  This script proves both against facts written
down independently of the generator (file names of the worked examples, key orders of 18.5,
hand-computed local shards, DeepSpeed's partition examples) and against the generator's own
canonical model.

Run by ctest as ``/usr/bin/python3 tests/interop/test_fixture_selfcheck.py --reshard BIN`` with
PYTHONPATH=tests; ``--reshard`` is optional: only the shape-only test that runs ``reshard lint``
needs it (and is skipped without it).
"""

import collections
import filecmp
import os
import subprocess
import sys
import tempfile
import time
import unittest
import zipfile
import zlib

import torch

from fixtures import megatron_fixture as mf
from fixtures.megatron_fixture import FixtureConfig

from interop_support import pickle_globals

PYTHON = '/usr/bin/python3'
RESHARD = None  # the binary given with --reshard, if any (only ShapeOnlyTest uses it)
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (style, extra options) x layouts: every style, several (tp, pp, dp), all optimizer kinds.
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2), (2, 4, 1), (1, 3, 3)]
CASES = [
    ('bs_bloom', {}),
    ('bs_gpt', {}),
    ('bs_gpt', {'glu': True, 'rotary': True}),
    ('ms_gpt2', {}),
    ('ms_llama', {}),
]
EXTRA_CASES = [  # (style, options, (tp, pp, dp))
    ('bs_bloom', {'tp_drift_eps': 0.0, 'V': 70}, (4, 1, 2)),          # padding spans two TP ranks
    ('bs_gpt', {'optimizer': 'zero1'}, (2, 2, 3)),
    ('ms_gpt2', {'optimizer': 'nozero_fp16'}, (2, 2, 2)),
    ('ms_llama', {'optimizer': 'none'}, (2, 2, 2)),
    ('ms_llama', {'qkv_layout': 'gqa_split_pre291'}, (2, 2, 1)),
    ('ms_llama', {'qkv_layout': 'fpdt_blockwise'}, (2, 1, 2)),
    ('ms_gpt2', {'numbering': 'bs'}, (1, 2, 2)),
    ('ms_llama', {'optimizer': 'zero1', 'dtype': 'bf16'}, (2, 2, 2)),
    ('bs_bloom', {'pp_method': 'type:transformer|embedding', 'L': 6}, (1, 3, 1)),
    ('bs_gpt', {'pp_method': 'parameters', 'partition_algo': 'lprobe_legacy'}, (2, 2, 1)),
    ('bs_bloom', {'pp_method': 'uniform', 'L': 8}, (1, 2, 1)),
    ('bs_bloom', {'legacy_v065': True}, (2, 2, 3)),                  # mappings rebuilt by readers
    ('ms_llama', {'optimizer': 'torch_adamw'}, (2, 2, 2)),           # fp32, torch state in mp_rank
    ('bs_gpt', {'optimizer': 'torch_adamw', 'glu': True}, (2, 3, 1)),
]


def make(tmp, style, layout, **opts):
    tp, pp, dp = layout
    cfg = FixtureConfig(style=style, tp=tp, pp=pp, dp=dp, **opts)
    root = os.path.join(tmp, f'{style}_{tp}{pp}{dp}_{len(os.listdir(tmp))}')
    summary = mf.write_checkpoint(root, cfg)
    return cfg, root, summary


class Timed(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix='fixture_selfcheck_')
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()


class PartitionTest(unittest.TestCase):
    """DeepSpeed pipeline partitioning, section 8.2 worked examples."""

    def blocks(self, **kw):
        return mf.blocks_per_stage(FixtureConfig(style='bs_bloom', **kw))

    def test_type_transformer_l30(self):
        self.assertEqual(self.blocks(L=30, pp=4), [8, 8, 7, 7])
        self.assertEqual(self.blocks(L=30, pp=4, partition_algo='lprobe_legacy'), [8, 8, 8, 6])

    def test_uniform_l24(self):
        cfg = FixtureConfig(style='bs_bloom', L=24, pp=4, pp_method='uniform')
        self.assertEqual(len(mf.spec_list(cfg)), 31)
        self.assertEqual(mf.blocks_per_stage(cfg), [5, 8, 8, 3])
        self.assertEqual(mf.stage_bounds(cfg), [0, 8, 16, 24, 31])
        old = FixtureConfig(style='bs_bloom', L=24, pp=4, pp_method='uniform', partition_algo='lprobe_legacy')
        self.assertEqual(mf.blocks_per_stage(old), [4, 7, 7, 6])
        self.assertEqual(mf.stage_bounds(old), [0, 7, 14, 21, 31])

    def test_fixture_bounds(self):
        self.assertEqual(mf.stage_bounds(FixtureConfig(style='bs_bloom', pp=2)), [0, 5, 11])
        self.assertEqual(mf.stage_bounds(FixtureConfig(style='ms_gpt2', pp=2)), [0, 4, 9])
        self.assertEqual(mf.stage_bounds(FixtureConfig(style='ms_llama', pp=2)), [0, 4, 9])

    def test_bloom_split_both_algorithms(self):
        for algo in mf.PARTITION_ALGOS:
            cfg = FixtureConfig(style='bs_bloom', L=70, pp=12, pp_method='type:transformer|embedding',
                                partition_algo=algo)
            self.assertEqual(mf.blocks_per_stage(cfg), [5] + [6] * 10 + [5], algo)
            specs, parts = mf.spec_list(cfg), mf.stage_bounds(cfg)
            self.assertIn('embed', [s.kind for s in specs[parts[0]:parts[1]]])
            self.assertEqual({'norm', 'head'} & {s.kind for s in specs[parts[11]:]}, {'norm', 'head'})

    def test_fp32_spec_list_ends_with_the_head(self):
        """float16_to_fp32 is appended only with fp16/bf16 (section 4.1): `uniform` counts one spec less."""
        for style in ('bs_bloom', 'ms_gpt2'):
            fp32 = mf.spec_list(FixtureConfig(style=style, optimizer='torch_adamw'))
            half = mf.spec_list(FixtureConfig(style=style))
            self.assertEqual(fp32, half[:-1], style)
            self.assertEqual(half[-1].typename, 'float16_to_fp32')

    def test_small_cases(self):
        self.assertEqual(mf.partition_uniform(3, 5), [0, 1, 2, 3, 3, 3])
        self.assertEqual(mf.partition_uniform(10, 3), [0, 4, 7, 10])
        self.assertEqual(mf.partition_uniform(10, 3, 'lprobe_legacy'), [0, 3, 6, 10])
        self.assertEqual(mf.partition_balanced([1, 1, 1, 1], 4), [0, 1, 2, 3, 4])
        self.assertIn(mf.partition_balanced([1, 1, 1, 1, 1], 4), ([0, 1, 2, 3, 5], [0, 2, 3, 4, 5]))


class ConfigTest(unittest.TestCase):
    def test_defaults(self):
        bloom = FixtureConfig()
        self.assertEqual((bloom.L, bloom.h, bloom.n, bloom.hd, bloom.ffn, bloom.V, bloom.mvsdb, bloom.S),
                         (4, 16, 4, 4, 64, 100, 8, 32))
        self.assertTrue(bloom.embed_layernorm)
        llama = FixtureConfig(style='ms_llama')
        self.assertEqual((llama.nkv, llama.ffn, llama.qkv_layout, llama.numbering), (2, 24, 'gqa_grouped', 'ms'))
        self.assertEqual(FixtureConfig(optimizer='zero1').dtype, 'fp16')

    def test_padded_vocab(self):
        self.assertEqual(mf.padded_vocab(FixtureConfig(tp=2)), 112)
        self.assertEqual(mf.padded_vocab(FixtureConfig(V=250680, mvsdb=128), 4), 250880)
        self.assertEqual(mf.vocab_padding(FixtureConfig(), 2).shape, (12, 16))

    def test_invalid(self):
        bad = [
            (dict(style='gpt'), 'style'),
            (dict(tp=3), 'not divisible by tp'),
            (dict(style='ms_llama', tp=4), 'nkv=2'),
            (dict(pp=5), 'cannot fill'),
            (dict(style='bs_gpt', nkv=2), 'nkv must equal n'),
            (dict(glu=True), 'glu'),
            (dict(style='ms_gpt2', rotary=True), 'rotary'),
            (dict(style='ms_gpt2', embed_layernorm=True), 'embed_layernorm'),
            (dict(optimizer='bf16_zero', dtype='fp16'), 'requires dtype bf16'),
            (dict(optimizer='nozero_fp16', dtype='bf16'), 'requires dtype fp16'),
            (dict(optimizer='torch_adamw', dtype='bf16'), 'requires dtype fp32'),
            (dict(optimizer='zero1', dtype='fp32'), 'dtype fp32'),
            (dict(qkv_layout='gqa_grouped'), 'BS styles'),
            (dict(style='ms_llama', qkv_layout='mha_interleaved'), 'mha_interleaved'),
            (dict(numbering='ms'), 'bs layer numbering'),
            (dict(dp=3, global_batch=16), 'divisible by dp'),
            (dict(pp_method='interleaved'), 'pp_method'),
            (dict(L=4, pp=4, pp_method='uniform'), 'without a transformer block'),
            (dict(tp_drift_eps=-1.0), 'tp_drift_eps'),
        ]
        for kwargs, fragment in bad:
            with self.subTest(**{k: str(v) for k, v in kwargs.items()}):
                with self.assertRaises(ValueError) as ctx:
                    FixtureConfig(**kwargs)
                self.assertIn(fragment, str(ctx.exception))


class WorkedExampleTest(Timed):
    """File names of section 18.4 / 2.1 worked examples."""

    def tag_files(self, root):
        return sorted(os.listdir(os.path.join(root, 'global_step10')))

    def test_bs_bloom_222(self):
        cfg, root, summary = make(self.tmp, 'bs_bloom', (2, 2, 2))
        want = [f'layer_{i:02d}-model_{t:02d}-model_states.pt' for i in (1, 3, 4, 5, 6, 8) for t in (0, 1)]
        want += [f'mp_rank_{m:02d}_model_states.pt' for m in range(4)]
        want += [f'bf16_zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt' for d in (0, 1) for m in range(4)]
        self.assertEqual(self.tag_files(root), sorted(want))
        self.assertEqual(summary['Vp'], 112)
        self.assertEqual(summary['parts'], [0, 5, 11])
        with open(os.path.join(root, 'latest')) as f:
            self.assertEqual(f.read(), 'global_step10')
        self.assertFalse(os.path.exists(os.path.join(root, 'latest_checkpointed_iteration.txt')))

    def test_ms_llama_222(self):
        cfg, root, summary = make(self.tmp, 'ms_llama', (2, 2, 2))
        layer_files = [f for f in self.tag_files(root) if f.startswith('layer_')]
        self.assertEqual(layer_files, [f'layer_{i:02d}-model_{t:02d}-model_states.pt'
                                       for i in range(1, 8) for t in (0, 1)])
        self.assertEqual(summary['layer_ids'], {'embed': 1, 'blocks': [2, 3, 4, 5], 'norm': 6, 'head': 7})
        self.assertEqual(len([f for f in self.tag_files(root) if f.startswith('bf16_zero_pp_rank_')]), 8)
        with open(os.path.join(root, 'latest_checkpointed_iteration.txt')) as f:
            self.assertEqual(f.read(), '10')

    def test_zero1_fp16_names(self):
        cfg, root, _ = make(self.tmp, 'bs_gpt', (1, 1, 2), optimizer='zero1')
        self.assertEqual([f for f in self.tag_files(root) if 'optim' in f],
                         ['zero_pp_rank_0_mp_rank_00_optim_states.pt', 'zero_pp_rank_1_mp_rank_00_optim_states.pt'])

    def test_no_zero_files(self):
        for opt in ('none', 'nozero_fp16', 'torch_adamw'):
            cfg, root, _ = make(self.tmp, 'ms_gpt2', (1, 2, 2), optimizer=opt)
            self.assertFalse([f for f in self.tag_files(root) if 'optim' in f], opt)


# -- section 18.5 key orders, written out by hand ------------------------------------------------

LN_BLOCK = ['input_layernorm.weight', 'input_layernorm.bias',
            'self_attention.query_key_value.weight', 'self_attention.query_key_value.bias',
            'self_attention.dense.weight', 'self_attention.dense.bias',
            'post_attention_layernorm.weight', 'post_attention_layernorm.bias',
            'mlp.dense_h_to_4h.weight', 'mlp.dense_h_to_4h.bias',
            'mlp.dense_4h_to_h.weight', 'mlp.dense_4h_to_h.bias']
EXPECTED_KEYS = {
    'bs_bloom': {1: ['word_embeddings.weight', 'word_embeddings.norm.weight', 'word_embeddings.norm.bias'],
                 3: LN_BLOCK, 8: ['weight', 'bias']},
    'bs_gpt': {1: ['word_embeddings.weight', 'position_embeddings.weight'], 3: LN_BLOCK, 8: ['weight', 'bias']},
    'bs_gpt_rotary': {1: ['word_embeddings.weight'],
                      3: LN_BLOCK[:6] + ['self_attention.rotary_emb.inv_freq'] + LN_BLOCK[6:]},
    'ms_gpt2': {1: ['word_embeddings.weight', 'position_embeddings.weight'], 2: LN_BLOCK, 6: ['weight', 'bias']},
    'ms_llama': {1: ['word_embeddings.weight'],
                 2: ['input_layernorm.weight', 'self_attention.query_key_value.weight',
                     'self_attention.dense.weight', 'post_attention_layernorm.weight',
                     'mlp.dense_h_to_4h.weight', 'mlp.dense_4h_to_h.weight'],
                 6: ['weight'], 7: ['lm_head.weight']},
}


class LayerFileTest(Timed):
    """Key order, dtype, compact storage and hand-computed local shards."""

    def layer(self, root, idx, t):
        return torch.load(os.path.join(root, 'global_step10', f'layer_{idx:02d}-model_{t:02d}-model_states.pt'))

    def test_key_orders(self):
        for name, (style, opts) in {'bs_bloom': ('bs_bloom', {}), 'bs_gpt': ('bs_gpt', {}),
                                    'bs_gpt_rotary': ('bs_gpt', {'rotary': True}),
                                    'ms_gpt2': ('ms_gpt2', {}), 'ms_llama': ('ms_llama', {})}.items():
            cfg, root, _ = make(self.tmp, style, (2, 1, 1), **opts)
            for idx, keys in EXPECTED_KEYS[name].items():
                for t in (0, 1):
                    sd = self.layer(root, idx, t)
                    self.assertIsInstance(sd, collections.OrderedDict)
                    self.assertEqual(list(sd), keys, f'{name} layer {idx}')
                    for key, x in sd.items():
                        self.assertEqual(x.dtype, torch.bfloat16, key)
                        self.assertEqual(x.storage().size(), x.numel(), f'{name} {key} not compact')

    def test_hand_computed_shards_mha_vocab_row(self):
        cfg, root, _ = make(self.tmp, 'bs_bloom', (2, 1, 1))
        c = mf.canonical_tensors(cfg)
        hd, bf = cfg.hd, torch.bfloat16
        sd1 = self.layer(root, 3, 1)
        # rank 1 owns heads 2 and 3; each head contributes q, k, v rows in that order
        rows = []
        for head in (2, 3):
            for part in ('q', 'k', 'v'):
                rows.append(c[f'layers.0.attn.{part}.weight'][head * hd:(head + 1) * hd])
        self.assertTrue(torch.equal(sd1['self_attention.query_key_value.weight'], torch.cat(rows).to(bf)))
        self.assertTrue(torch.equal(sd1['self_attention.dense.weight'], c['layers.0.attn.o.weight'][:, 8:].to(bf)))
        self.assertTrue(torch.equal(sd1['mlp.dense_h_to_4h.weight'], c['layers.0.mlp.fc.weight'][32:].to(bf)))
        self.assertTrue(torch.equal(sd1['mlp.dense_4h_to_h.bias'], c['layers.0.mlp.down.bias'].to(bf)))
        emb1 = self.layer(root, 1, 1)['word_embeddings.weight']
        self.assertEqual(emb1.shape, (56, 16))  # Vp = 112: rows 56..111, padding rows 100..111
        self.assertTrue(torch.equal(emb1[:44], c['embedding.word_embeddings.weight'][56:].to(bf)))
        self.assertTrue(torch.all(emb1[44:] == cfg.pad_fill))

    def test_hand_computed_shards_gqa_swiglu(self):
        cfg, root, _ = make(self.tmp, 'ms_llama', (2, 1, 1))
        c = mf.canonical_tensors(cfg)
        hd, bf = cfg.hd, torch.bfloat16
        sd1 = self.layer(root, 2, 1)
        # g = 2: KV group 1 (rank 1) = query heads 2, 3, then key head 1, then value head 1
        want = torch.cat([c['layers.0.attn.q.weight'][2 * hd:4 * hd],
                          c['layers.0.attn.k.weight'][hd:2 * hd], c['layers.0.attn.v.weight'][hd:2 * hd]])
        self.assertTrue(torch.equal(sd1['self_attention.query_key_value.weight'], want.to(bf)))
        self.assertEqual(sd1['self_attention.query_key_value.weight'].shape, (16, 16))  # (n+2nkv)hd/TP
        # SwiGLU: local = [gate chunk; up chunk], gate first (MS)
        want = torch.cat([c['layers.0.mlp.gate.weight'][12:], c['layers.0.mlp.up.weight'][12:]])
        self.assertTrue(torch.equal(sd1['mlp.dense_h_to_4h.weight'], want.to(bf)))
        self.assertEqual(self.layer(root, 7, 0)['lm_head.weight'].shape, (56, 16))

    def test_hand_computed_bs_glu_and_rotary(self):
        cfg, root, _ = make(self.tmp, 'bs_gpt', (2, 1, 1), glu=True, rotary=True)
        c = mf.canonical_tensors(cfg)
        sd0 = self.layer(root, 3, 0)
        # BS GLU: gate is the *second* half of every local slice
        want = torch.cat([c['layers.0.mlp.up.weight'][:32], c['layers.0.mlp.gate.weight'][:32]])
        self.assertTrue(torch.equal(sd0['mlp.dense_h_to_4h.weight'], want.to(torch.bfloat16)))
        inv = 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))
        self.assertTrue(torch.equal(sd0['self_attention.rotary_emb.inv_freq'], inv.to(torch.bfloat16)))

    def test_hand_computed_pre291_and_fpdt(self):
        hd, bf = 4, torch.bfloat16
        cfg, root, _ = make(self.tmp, 'ms_llama', (2, 1, 1), qkv_layout='gqa_split_pre291')
        c = mf.canonical_tensors(cfg)
        sd1 = self.layer(root, 2, 1)
        self.assertEqual(list(sd1)[1:3], ['self_attention.query.weight', 'self_attention.key_value.weight'])
        self.assertTrue(torch.equal(sd1['self_attention.query.weight'], c['layers.0.attn.q.weight'][8:].to(bf)))
        want = torch.cat([c['layers.0.attn.k.weight'][hd:], c['layers.0.attn.v.weight'][hd:]])
        self.assertTrue(torch.equal(sd1['self_attention.key_value.weight'], want.to(bf)))
        cfg, root, _ = make(self.tmp, 'ms_llama', (2, 1, 1), qkv_layout='fpdt_blockwise')
        sd0 = self.layer(root, 2, 0)
        want = torch.cat([c['layers.0.attn.q.weight'][:8], c['layers.0.attn.k.weight'][:hd],
                          c['layers.0.attn.v.weight'][:hd]])
        self.assertTrue(torch.equal(sd0['self_attention.query_key_value.weight'], want.to(bf)))


class MetadataTest(Timed):
    def load(self, root, name):
        return torch.load(os.path.join(root, 'global_step10', name), weights_only=False)

    def test_mp_rank_and_pickled_classes(self):
        cfg, root, _ = make(self.tmp, 'bs_bloom', (2, 2, 2))
        mps = [self.load(root, f'mp_rank_{m:02d}_model_states.pt') for m in range(4)]
        for sd in mps:
            for key in mf.MP_RANK_KEYS + mf.BS_RNG_KEYS + ('checkpoint_info',):
                self.assertIn(key, sd)
            self.assertEqual((sd['mp_world_size'], sd['dp_world_size']), (4, 2))
            self.assertEqual(sd['args'].world_size, 8)
            self.assertEqual(sd['args'].padded_vocab_size, 112)
            self.assertEqual(sd['checkpoint_info'], {'padded_vocab_size': 112, 'original_vocab_size': 100})
            self.assertEqual(sd['lr_scheduler']['num_steps'], 10 * cfg.global_batch)
            self.assertEqual(type(sd['args'].position_embedding_type).__module__, 'megatron.enums')
            self.assertTrue(all(isinstance(s, torch.Size) for g in sd['param_shapes'] for s in g.values()))
        self.assertEqual(len(mps[0]['param_shapes']), 3)  # BS: wd halves + no-wd
        # RNG states differ per (p, t) tracker seed
        self.assertFalse(torch.equal(mps[0]['rng_tracker_states']['model-parallel-rng'],
                                     mps[1]['rng_tracker_states']['model-parallel-rng']))
        tag = os.path.join(root, 'global_step10')
        self.assertIn(('deepspeed.utils.tensor_fragment', 'fragment_address'),
                      pickle_globals(os.path.join(tag, 'bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt')))
        self.assertIn(('megatron.enums', 'PositionEmbeddingType'),
                      pickle_globals(os.path.join(tag, 'mp_rank_00_model_states.pt')))
        self.assertIn(('argparse', 'Namespace'), pickle_globals(os.path.join(tag, 'mp_rank_00_model_states.pt')))

    def test_ms_metadata(self):
        cfg, root, _ = make(self.tmp, 'ms_llama', (2, 2, 1))
        sd = self.load(root, 'mp_rank_03_model_states.pt')
        info = sd['universal_checkpoint_info']
        self.assertEqual((info['original_vocab_size'], info['padded_vocab_size']), (100, 112))
        self.assertEqual(info['vocabulary_parameter_patterns'], [r'\d+.word_embeddings.weight', r'\d+.lm_head.weight'])
        self.assertIn(r'\d+.mlp.dense_h_to_4h.weight', info['parameter_with_2_sub_params_cat_dim_0'])
        self.assertIn(r'\d+.self_attention.dense.weight', info['parameter_with_row_parallelism_patterns'])
        self.assertIsInstance(sd['rng_state'], list)
        self.assertEqual([g.get('name') for g in self.load(root, 'bf16_zero_pp_rank_0_mp_rank_03_optim_states.pt')
                          ['optimizer_state_dict']['base_optimizer_state']['param_groups']],
                         ['wd_no_scale_lr', 'no_wd_no_scale_lr'])
        self.assertEqual(list(sd['param_shapes'][0])[-1], '7.lm_head.weight')
        self.assertEqual(sd['args'].num_key_value_heads, 2)
        tp1 = mf.write_checkpoint(os.path.join(self.tmp, 'tp1'), FixtureConfig(style='ms_llama'))
        sd1 = torch.load(os.path.join(tp1['tag_dir'], 'mp_rank_00_model_states.pt'), weights_only=False)
        self.assertNotIn('tp_replicated_parameter_patterns', sd1['universal_checkpoint_info'])

    def test_zero1_objects(self):
        cfg, root, _ = make(self.tmp, 'bs_gpt', (1, 1, 3), optimizer='zero1', global_batch=12)
        tag = os.path.join(root, 'global_step10')
        last = self.load(root, 'zero_pp_rank_2_mp_rank_00_optim_states.pt')['optimizer_state_dict']
        self.assertEqual(type(last['zero_stage']).__name__, 'ZeroStageEnum')
        self.assertEqual(int(last['zero_stage']), 1)
        self.assertEqual(type(last['loss_scaler']).__name__, 'DynamicLossScaler')
        for g, pad in enumerate(last['group_paddings']):
            exp_avg = last['base_optimizer_state']['state'][g]['exp_avg']
            self.assertEqual(last['single_partition_of_fp32_groups'][g].numel(), exp_avg.numel() - pad)
        globs = pickle_globals(os.path.join(tag, 'zero_pp_rank_2_mp_rank_00_optim_states.pt'))
        self.assertIn(('deepspeed.runtime.zero.config', 'ZeroStageEnum'), globs)
        self.assertIn(('deepspeed.runtime.fp16.loss_scaler', 'DynamicLossScaler'), globs)

    def test_torch_adamw_state(self):
        """fp32 without ZeRO: every mp_rank file holds torch AdamW's own state_dict for its stage."""
        cfg, root, _ = make(self.tmp, 'ms_gpt2', (2, 2, 1), optimizer='torch_adamw')
        sd = self.load(root, 'mp_rank_02_model_states.pt')
        self.assertIsNone(sd['param_shapes'])
        self.assertIsNone(sd['shared_params'])
        self.assertEqual(sd['ds_config']['zero_optimization'], {'stage': 0})
        self.assertNotIn('bf16', sd['ds_config'])
        self.assertNotIn('fp16', sd['ds_config'])
        self.assertEqual((sd['args'].fp16, sd['args'].bf16, sd['args'].params_dtype), (False, False, torch.float32))
        opt = sd['optimizer']
        self.assertEqual(list(opt), ['state', 'param_groups'])
        self.assertEqual([list(pg) for pg in opt['param_groups']],
                         [['name', 'wd_mult', 'lr_mult', 'lr', 'betas', 'eps', 'weight_decay', 'amsgrad', 'foreach',
                           'maximize', 'capturable', 'params']] * 2)
        self.assertEqual(opt['param_groups'][0]['params'][0], 0)
        self.assertEqual(opt['param_groups'][1]['params'][0], len(opt['param_groups'][0]['params']))
        # Stage 1 starts with the tied copies: word embeddings, then the (decayed) positions.
        first = opt['state'][0]
        self.assertEqual(list(first), ['step', 'exp_avg', 'exp_avg_sq'])
        self.assertEqual(first['step'], torch.tensor(10.0))
        self.assertEqual(first['exp_avg'].shape, (56, 16))  # 112 padded rows / TP 2, h 16
        layer = torch.load(os.path.join(root, 'global_step10', 'layer_01-model_00-model_states.pt'))
        self.assertEqual(layer['word_embeddings.weight'].dtype, torch.float32)
        self.assertTrue(torch.equal(first['exp_avg'], mf._adam_m(layer['word_embeddings.weight'])))
        self.assertFalse(os.path.exists(os.path.join(root, 'zero_to_fp32.py')))

    def test_legacy_v065_shards(self):
        cfg, root, _ = make(self.tmp, 'bs_bloom', (1, 1, 2), legacy_v065=True)
        osd = self.load(root, 'bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt')['optimizer_state_dict']
        self.assertNotIn('param_slice_mappings', osd)
        self.assertIn('groups_padding', osd)
        self.assertEqual(osd['ds_version'], '0.6.5')

    def test_tied_copy_on_last_stage(self):
        cfg, root, _ = make(self.tmp, 'bs_gpt', (1, 2, 1))
        last = self.load(root, 'mp_rank_01_model_states.pt')['param_shapes']
        names = [n for g in last for n in g]
        self.assertIn('tied_modules.embed.word_embeddings.weight', names)
        self.assertIn('tied_modules.embed.position_embeddings.weight', names)
        logical = mf.load_logical(root, cfg)
        diffs = logical.meta['tied_copy_max_diff']
        self.assertEqual(diffs['word_embeddings.weight@tp0'], 0.0)
        self.assertGreater(diffs['position_embeddings.weight@tp0'], 0.0)
        bloom_cfg, bloom_root, _ = make(self.tmp, 'bs_bloom', (1, 2, 1))
        last = self.load(bloom_root, 'mp_rank_01_model_states.pt')['param_shapes']
        self.assertFalse([n for g in last for n in g if 'norm' in n and n.startswith('tied')])


class RoundTripTest(Timed):
    """load_logical(write_checkpoint(cfg)) == canonical, for every style and many layouts."""

    def check(self, style, layout, opts):
        cfg, root, summary = make(self.tmp, style, layout, **opts)
        tp, pp, dp = layout
        problems = mf.structural_problems(root, cfg)
        self.assertEqual(problems, [])
        logical = mf.load_logical(root, cfg)
        self.assertEqual((logical.layout['tp'], logical.layout['pp']), (tp, pp))
        if cfg.optimizer in ('bf16_zero', 'zero1'):
            self.assertEqual(logical.layout['dp'], dp)
        self.assertEqual(mf.compare_with_canonical(logical, cfg), [])
        padding = logical['embedding.word_embeddings.padding']
        self.assertEqual(padding.shape, (mf.padded_vocab(cfg, tp) - cfg.V, cfg.h))
        self.assertTrue(torch.all(padding == cfg.pad_fill))
        self.assertEqual(max(logical.drift.values(), default=0.0), 0.0)
        canon = mf.canonical_tensors(cfg)
        self.assertEqual(set(canon), {k for k in logical if not k.endswith('.padding')})
        if cfg.optimizer == 'none':
            self.assertEqual(logical.optimizer, {})
        else:
            # A torch state has no fp32 masters: its first moment is 0.1 * the fp32 weight.
            state, scale = ('exp_avg', 0.1) if cfg.optimizer == 'torch_adamw' else ('fp32', 1)
            self.assertTrue(logical.optimizer[state])
            for name, value in canon.items():
                if not name.endswith('inv_freq'):
                    self.assertTrue(torch.equal(logical.optimizer[state][name], scale * value), name)
        return cfg, root, logical

    def test_matrix(self):
        for style, opts in CASES:
            for layout in LAYOUTS:
                with self.subTest(style=style, layout=layout, **{k: str(v) for k, v in opts.items()}):
                    self.check(style, layout, opts)

    def test_extra_variants(self):
        for style, opts, layout in EXTRA_CASES:
            with self.subTest(style=style, layout=layout, **{k: str(v) for k, v in opts.items()}):
                self.check(style, layout, opts)

    def test_padding_spans_two_ranks(self):
        cfg, root, _ = make(self.tmp, 'bs_bloom', (4, 1, 1), V=70)
        self.assertEqual(mf.padded_vocab(cfg, 4), 96)  # 26 padding rows, 24 rows per rank
        tag = os.path.join(root, 'global_step10')
        r2 = torch.load(os.path.join(tag, 'layer_01-model_02-model_states.pt'))['word_embeddings.weight']
        self.assertTrue(torch.all(r2[22:] == cfg.pad_fill))
        self.assertFalse(torch.any(r2[:22] == cfg.pad_fill))

    def test_oracle_reads_any_layout(self):
        """Same model at two layouts -> identical logical tensors except the padding rows."""
        a_cfg, a_root, _ = make(self.tmp, 'ms_llama', (2, 2, 2))
        b_cfg, b_root, _ = make(self.tmp, 'ms_llama', (1, 4, 1))
        a, b = mf.load_logical(a_root, a_cfg), mf.load_logical(b_root, a_cfg)  # b read with a's config
        self.assertEqual((b.layout['tp'], b.layout['pp'], b.layout['dp']), (1, 4, 1))
        for name in a:
            if not name.endswith('.padding'):
                self.assertTrue(torch.equal(a[name], b[name]), name)
                self.assertTrue(torch.equal(a.optimizer['fp32'][name], b.optimizer['fp32'][name]), name)
        self.assertEqual(b['lm_head.padding'].shape[0], 104 - 100)

    def test_drift(self):
        eps = 1e-3
        cfg, root, _ = make(self.tmp, 'bs_bloom', (2, 1, 2), tp_drift_eps=eps)
        self.assertEqual(mf.structural_problems(root, cfg), [])
        logical = mf.load_logical(root, cfg)
        self.assertEqual(mf.compare_with_canonical(logical, cfg), [])  # rank 0 is drift free
        reps = mf.replicated_names(cfg)
        self.assertEqual(set(logical.optimizer_drift), set(reps))
        for name in reps:
            self.assertAlmostEqual(logical.optimizer_drift[name], eps, delta=1e-6)
        self.assertGreater(max(logical.drift[n] for n in reps), 0.0)
        for name, drift in logical.drift.items():
            if name not in reps:
                self.assertEqual(drift, 0.0, name)


class OracleRejectsTest(Timed):
    """The structural checker must catch the mistakes a converter can make."""

    def fixture(self):
        cfg, root, _ = make(self.tmp, 'bs_bloom', (2, 2, 2))
        return cfg, root, os.path.join(root, 'global_step10')

    def test_missing_zero_file(self):
        cfg, root, tag = self.fixture()
        os.remove(os.path.join(tag, 'bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt'))
        self.assertTrue(mf.structural_problems(root, cfg))

    def test_key_order_dtype_and_storage(self):
        cfg, root, tag = self.fixture()
        path = os.path.join(tag, 'layer_03-model_01-model_states.pt')
        sd = torch.load(path)
        items = list(sd.items())
        items[0], items[1] = items[1], items[0]
        torch.save(collections.OrderedDict(items), path)
        path = os.path.join(tag, 'layer_04-model_00-model_states.pt')
        sd = torch.load(path)
        big = torch.zeros(1000, dtype=torch.bfloat16)
        sd['input_layernorm.weight'] = big[:16]            # shares a larger storage
        sd['input_layernorm.bias'] = sd['input_layernorm.bias'].float()
        torch.save(sd, path)
        problems = mf.structural_problems(root, cfg)
        self.assertTrue(any('key order' in p for p in problems), problems)
        self.assertTrue(any('not a compact clone' in p for p in problems), problems)
        self.assertTrue(any('dtype' in p for p in problems), problems)

    def test_stale_metadata(self):
        cfg, root, tag = self.fixture()
        path = os.path.join(tag, 'mp_rank_01_model_states.pt')
        sd = torch.load(path, weights_only=False)
        sd['mp_world_size'] = 2
        sd['args'].padded_vocab_size = 104
        torch.save(sd, path)
        problems = mf.structural_problems(root, cfg)
        self.assertTrue(any('mp_world_size' in p for p in problems), problems)
        self.assertTrue(any('padded_vocab_size' in p for p in problems), problems)

    def test_wrong_fragment(self):
        cfg, root, tag = self.fixture()
        path = os.path.join(tag, 'bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt')
        sd = torch.load(path, weights_only=False)
        mapping = sd['optimizer_state_dict']['param_slice_mappings'][0]
        name = next(iter(mapping))
        mapping[name] = type(mapping[name])(numel=mapping[name].numel - 1, start=mapping[name].start)
        torch.save(sd, path)
        self.assertTrue(mf.structural_problems(root, cfg))
        with self.assertRaises(mf.CheckpointFormatError):
            mf.load_logical(root, cfg)

    def test_changed_weight(self):
        cfg, root, tag = self.fixture()
        path = os.path.join(tag, 'layer_05-model_01-model_states.pt')
        sd = torch.load(path)
        sd['mlp.dense_h_to_4h.weight'][3, 3] += 1
        torch.save(sd, path)
        logical = mf.load_logical(root, cfg)
        self.assertTrue(mf.compare_with_canonical(logical, cfg))
        self.assertTrue(any('fp32 master' in p for p in mf.structural_problems(root, cfg)))


class CommandLineTest(Timed):
    def run_cli(self, *args):
        env = dict(os.environ, PYTHONPATH=TESTS_DIR, PYTHONDONTWRITEBYTECODE='1')
        return subprocess.run([PYTHON, '-m', 'fixtures.megatron_fixture', *args],
                              env=env, capture_output=True, text=True, timeout=120)

    def test_write_and_check(self):
        out = os.path.join(self.tmp, 'cli')
        res = self.run_cli('--style', 'bs_bloom', '--tp', '2', '--pp', '2', '--dp', '2', '--drift', '1e-3', out)
        self.assertEqual(res.returncode, 0, res.stderr)
        self.assertTrue(os.path.isfile(os.path.join(out, 'global_step10', 'mp_rank_03_model_states.pt')))
        res = self.run_cli('--style', 'bs_bloom', '--drift', '1e-3', '--check', out)
        self.assertEqual(res.returncode, 0, res.stdout + res.stderr)
        res = self.run_cli('--style', 'ms_llama', '--tp', '4', os.path.join(self.tmp, 'bad'))
        self.assertEqual(res.returncode, 2)
        self.assertIn('nkv', res.stderr)


class ShapeOnlyTest(Timed):
    """FixtureConfig(shape_only=True): torch.save's exact container, every pickle as usual,
    tensor data as sparse zeros (used by benchmarks/plan_at_scale.py for BLOOM-176B shapes)."""

    def test_crc32_of_zeros(self):
        for n in (0, 1, 3, 64, 4095, 4096, 65537, 1 << 20, 3_000_001):
            for start in (0, 1, 0xDEADBEEF):
                self.assertEqual(mf.crc32_of_zeros(n, start), zlib.crc32(bytes(n), start), (n, start))

    def test_same_bytes_as_torch_save(self):
        """save_shape_only of meta tensors == torch.save of the same tensors filled with zeros,
        byte for byte: views and shared storages, a real CPU tensor (kept), an empty one."""
        def obj(device):
            base = torch.zeros(10, 4, device=device)
            return collections.OrderedDict(
                w=torch.zeros(1000, 33, dtype=torch.bfloat16, device=device), view=base[2:5], base=base,
                t=base.t(), empty=torch.zeros(0, device=device), tiny=torch.zeros(1, dtype=torch.uint8, device=device),
                rng=torch.Generator().manual_seed(3).get_state(),
                nested=[{'m': torch.zeros(7, dtype=torch.float16, device=device)}, (1, torch.Size([3, 4]))])
        # Same base name: torch names the archive's top folder after it.
        os.makedirs(os.path.join(self.tmp, 'sparse'))
        real, sparse = os.path.join(self.tmp, 'x.pt'), os.path.join(self.tmp, 'sparse', 'x.pt')
        torch.save(obj('cpu'), real)
        mf.save_shape_only(obj('meta'), sparse)
        self.assertTrue(filecmp.cmp(real, sparse, shallow=False))
        got = torch.load(sparse)
        self.assertEqual(got['view'].storage().data_ptr(), got['base'].storage().data_ptr())
        self.assertTrue(torch.equal(got['rng'], torch.Generator().manual_seed(3).get_state()))

    def test_pickles_match_faithful_fixture(self):
        """Same files, same zip records at the same offsets, identical data.pkl, valid CRCs;
        every tensor loads as zeros of the faithful one's shape, dtype and strides."""
        for style, opts, layout in [('bs_bloom', {}, (2, 2, 2)), ('bs_gpt', {'optimizer': 'zero1'}, (2, 2, 3)),
                                    ('ms_gpt2', {'optimizer': 'nozero_fp16'}, (2, 2, 2)),
                                    ('ms_llama', {'legacy_v065': False}, (2, 2, 1))]:
            with self.subTest(style=style, layout=layout, **{k: str(v) for k, v in opts.items()}):
                _, root, summary = make(self.tmp, style, layout, **opts)
                _, sroot, ssummary = make(self.tmp, style, layout, shape_only=True, **opts)
                self.assertEqual(summary['files'], ssummary['files'])
                for name in (f for f in summary['files'] if f.endswith('.pt')):
                    path, spath = os.path.join(root, name), os.path.join(sroot, name)
                    with zipfile.ZipFile(path) as za, zipfile.ZipFile(spath) as zb:
                        self.assertEqual([(i.filename, i.header_offset, i.file_size) for i in za.infolist()],
                                         [(i.filename, i.header_offset, i.file_size) for i in zb.infolist()], name)
                        pkl = next(n for n in za.namelist() if n.endswith('/data.pkl'))
                        self.assertEqual(za.read(pkl), zb.read(pkl), name)
                        self.assertIsNone(zb.testzip(), name)
                    self.assert_zeros_like(torch.load(path), torch.load(spath), name)

    def assert_zeros_like(self, real, sparse, where):
        if isinstance(real, torch.Tensor):
            self.assertEqual((real.shape, real.dtype, real.stride()), (sparse.shape, sparse.dtype, sparse.stride()), where)
            if real.dtype == torch.uint8:  # RNG states are real CPU tensors: kept
                self.assertTrue(torch.equal(real, sparse), where)
            else:
                self.assertFalse(sparse.any(), where)
        elif isinstance(real, dict):
            self.assertEqual(list(real), list(sparse), where)
            for key in real:
                self.assert_zeros_like(real[key], sparse[key], f'{where}[{key!r}]')
        elif isinstance(real, (list, tuple)):
            for i, (a, b) in enumerate(zip(real, sparse)):
                self.assert_zeros_like(a, b, f'{where}[{i}]')

    def test_reshard_lint_accepts_shape_only(self):
        if RESHARD is None:
            self.skipTest('no --reshard given')
        _, root, _ = make(self.tmp, 'bs_bloom', (2, 2, 2), shape_only=True)
        res = subprocess.run([RESHARD, 'lint', root], capture_output=True, text=True, timeout=300)
        self.assertEqual(res.returncode, 0, res.stdout + res.stderr)
        self.assertIn('lint: ok', res.stdout)


def main(argv):
    global RESHARD
    if any(a.startswith('--reshard=') for a in argv):
        RESHARD = next(a for a in argv if a.startswith('--reshard=')).split('=', 1)[1]
    argv = [a for a in argv if not a.startswith('--reshard=')]
    if '--reshard' in argv:
        i = argv.index('--reshard')
        RESHARD = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i:i + 2]
    start = time.time()
    program = unittest.main(argv=[argv[0]] + argv[1:], exit=False, verbosity=1)
    print(f'fixture self-check took {time.time() - start:.1f} s', file=sys.stderr)
    return 0 if program.result.wasSuccessful() else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv))
