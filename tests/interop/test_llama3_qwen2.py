"""Llama 3.x (RoPE scaling, rope_theta 500000) and Qwen2 (q/k/v biases) through Megatron-Core's
torch_dist and back to HF.

Tiny HF folders are written here by the HF conventions (not with reshard): a Llama-3.1-style
LlamaForCausalLM with `rope_scaling` {"rope_type": "llama3", ...} and a Qwen2ForCausalLM with
q_proj/k_proj/v_proj biases, each untied and tied. Each goes HF -> torch_dist (TP 2) -> HF, and
the test checks:
- every tensor of the folder comes back bit for bit, and config.json's rope_theta, rope_scaling,
  attention_bias, use_sliding_window and tie_word_embeddings with it;
- the torch_dist common state's args say what Megatron-Core computes the model with (rotary_base,
  use_rope_scaling and rope_scaling_factor; add_qkv_bias and --disable-bias-linear);
- linear_qkv.bias, read from the .distcp chunks (and from each rank of `export --to megatron`), is
  laid out per query group exactly as the weight's rows: [the group's query heads; its key; its
  value], each TP rank holding whole groups;
- refusals, each one line, exit 2, nothing written: a rope_scaling Megatron-Core does not compute
  (another rope_type, other low/high factors or original positions), Llama's attention_bias, Qwen2's
  sliding window, and the Megatron-DeepSpeed target (convert) for either model.

`transformers` is not installed on the test machines, so no logits are compared here.
"""
import json
import os

import torch

import interop_support as support
from interop_support import FixtureTestCase, distcp_items, read_safetensors, whole
from test_import_hf import write_folder

run = support.reshard

# Sizes where TP 2 holds whole query groups: 4 heads in 2 groups of head dim 8.
L, H, HEADS, GROUPS, HD, FFN, VOCAB = 2, 32, 4, 2, 8, 48, 60
ROPE_SCALING = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                'original_max_position_embeddings': 8192}


def hf_config(family, tied):
    common = {'hidden_size': H, 'intermediate_size': FFN, 'num_hidden_layers': L, 'num_attention_heads': HEADS,
              'num_key_value_heads': GROUPS, 'max_position_embeddings': 128, 'rms_norm_eps': 1e-5,
              'hidden_act': 'silu', 'tie_word_embeddings': tied, 'vocab_size': VOCAB}
    if family == 'llama':
        return dict(common, architectures=['LlamaForCausalLM'], model_type='llama', rope_theta=500000.0,
                    rope_scaling=dict(ROPE_SCALING), attention_bias=False, torch_dtype='bfloat16')
    return dict(common, architectures=['Qwen2ForCausalLM'], model_type='qwen2', rope_theta=1000000.0,
                rope_scaling=None, use_sliding_window=False, sliding_window=4096, max_window_layers=L,
                torch_dtype='float32')


def hf_tensors(family, tied):
    """Random weights of the folder, by HF name; bf16 Llama, fp32 Qwen2."""
    dtype = torch.bfloat16 if family == 'llama' else torch.float32
    g = torch.Generator().manual_seed(3 if family == 'llama' else 5)
    shapes = {'model.embed_tokens.weight': [VOCAB, H], 'model.norm.weight': [H]}
    if not tied:
        shapes['lm_head.weight'] = [VOCAB, H]
    for b in range(L):
        p = f'model.layers.{b}.'
        shapes.update({p + 'input_layernorm.weight': [H], p + 'post_attention_layernorm.weight': [H],
                       p + 'self_attn.q_proj.weight': [HEADS * HD, H], p + 'self_attn.k_proj.weight': [GROUPS * HD, H],
                       p + 'self_attn.v_proj.weight': [GROUPS * HD, H], p + 'self_attn.o_proj.weight': [H, HEADS * HD],
                       p + 'mlp.gate_proj.weight': [FFN, H], p + 'mlp.up_proj.weight': [FFN, H],
                       p + 'mlp.down_proj.weight': [H, FFN]})
        if family == 'qwen2':
            shapes.update({p + 'self_attn.q_proj.bias': [HEADS * HD], p + 'self_attn.k_proj.bias': [GROUPS * HD],
                           p + 'self_attn.v_proj.bias': [GROUPS * HD]})
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in shapes.items()}


class Llama3Qwen2TorchDistTest(FixtureTestCase):

    def folder(self, family, tied, change=None, name=''):
        config, tensors = hf_config(family, tied), hf_tensors(family, tied)
        if change:
            change(config)
        path = self.path(f'hf_{family}_{"tied" if tied else "untied"}{name}')
        write_folder(path, tensors, config)
        return path, config, tensors

    def ok(self, *args):
        p = run(*args)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def round_trip(self, family, tied):
        src, config, tensors = self.folder(family, tied)
        td, back = self.path(f'td_{family}_{tied}'), self.path(f'back_{family}_{tied}')
        self.ok('export', src, td, '--to', 'torch_dist', '--tp', 2, '--pp', 1)
        self.ok('export', td, back, '--to', 'hf')
        got = read_safetensors(os.path.join(back, 'model.safetensors'))[0]
        self.assertEqual(sorted(got), sorted(tensors))
        for name, want in tensors.items():
            self.assertEqual(support.differences(got[name], want, name), [])
        with open(os.path.join(back, 'config.json')) as f:
            exported = json.load(f)
        return os.path.join(td, 'iter_0000000'), config, exported, tensors

    def assertConfigCarried(self, config, exported, keys):
        for key in keys:
            self.assertEqual(exported.get(key, 'absent'), config.get(key, 'absent'), key)

    def args(self, iteration):
        [common] = [obj for _, obj in distcp_items(iteration)['common_state/shard_0_1']]
        return common[0]['args']

    def test_llama3_goes_to_torch_dist_and_back_with_its_rope_scaling(self):
        for tied in (False, True):
            with self.subTest(tied=tied):
                iteration, config, exported, _ = self.round_trip('llama', tied)
                self.assertConfigCarried(config, exported, ['architectures', 'model_type', 'rope_theta', 'rope_scaling',
                                                            'attention_bias', 'tie_word_embeddings', 'vocab_size',
                                                            'num_key_value_heads', 'rms_norm_eps'])
                args = self.args(iteration)
                self.assertEqual((args.rotary_base, args.use_rope_scaling, args.rope_scaling_factor), (500000, True, 8.0))
                self.assertEqual((args.tensor_model_parallel_size, args.num_query_groups), (2, GROUPS))

    def test_a_torch_dist_save_without_rope_scaling_exports_rope_scaling_null(self):
        src, _, _ = self.folder('llama', False, change=lambda c: c.update(rope_scaling=None, rope_theta=10000.0))
        td, back = self.path('td'), self.path('back')
        self.ok('export', src, td, '--to', 'torch_dist', '--tp', 2, '--pp', 1)
        self.assertFalse(getattr(self.args(os.path.join(td, 'iter_0000000')), 'use_rope_scaling', False))
        self.ok('export', td, back, '--to', 'hf')
        with open(os.path.join(back, 'config.json')) as f:
            exported = json.load(f)
        self.assertEqual((exported['rope_scaling'], exported['rope_theta']), (None, 10000))

    def test_qwen2_goes_to_torch_dist_and_back_with_its_qkv_biases(self):
        for tied in (True, False):
            with self.subTest(tied=tied):
                iteration, config, exported, tensors = self.round_trip('qwen2', tied)
                self.assertConfigCarried(config, exported, ['architectures', 'model_type', 'rope_theta', 'rope_scaling',
                                                            'use_sliding_window', 'tie_word_embeddings', 'vocab_size'])
                self.assertNotIn('attention_bias', exported)
                args = self.args(iteration)
                self.assertEqual((args.add_qkv_bias, args.add_bias_linear, args.rotary_base), (True, False, 1000000))
                self.assertQkvBiasPerGroup(iteration, tensors)

    def assertQkvBiasPerGroup(self, iteration, tensors):
        """linear_qkv.bias [L, (heads + 2 groups) x hd]: per group its query heads, key, value;
        TP rank r's chunk is groups r*G/2 .. (r+1)*G/2 - 1."""
        chunks = distcp_items(iteration)['decoder.layers.self_attention.linear_qkv.bias']
        rows = (HEADS + 2 * GROUPS) * HD
        self.assertEqual(sorted(offsets for offsets, _ in chunks),
                         [[b, r * rows // 2] for b in range(L) for r in range(2)])
        bias = whole(chunks, [L, rows])
        for b in range(L):
            self.assertEqual(support.differences(bias[b], self.fused_bias(tensors, b), f'layer {b}'), [])

    @staticmethod
    def fused_bias(tensors, block):
        """Block `block`'s q, k and v biases fused per query group: [its query heads; key; value]."""
        p = f'model.layers.{block}.self_attn.'
        q = tensors[p + 'q_proj.bias'].view(GROUPS, HEADS // GROUPS * HD)
        k, v = (tensors[p + n].view(GROUPS, HD) for n in ('k_proj.bias', 'v_proj.bias'))
        return torch.cat([q, k, v], dim=1).reshape(-1)

    def test_qwen2_goes_to_megatron_lm_with_each_ranks_groups_of_the_bias(self):
        src, _, tensors = self.folder('qwen2', False)
        out = self.path('mlm')
        self.ok('export', src, out, '--to', 'megatron', '--tp', 2, '--pp', 1)
        fused = self.fused_bias(tensors, 1)
        for rank in range(2):
            state = support.load(os.path.join(out, 'iter_0000000', f'mp_rank_0{rank}', 'model_optim_rng.pt'))
            self.assertEqual((state['args'].add_qkv_bias, state['args'].add_bias_linear), (True, False))
            got = state['model']['decoder.layers.1.self_attention.linear_qkv.bias']
            self.assertEqual(support.differences(got, fused.chunk(2)[rank], f'rank {rank}'), [])

    def test_verify_finds_the_torch_dist_export_the_same_model(self):
        src, _, _ = self.folder('qwen2', True)
        td = self.path('td')
        self.ok('export', src, td, '--to', 'torch_dist', '--tp', 2, '--pp', 1)
        self.assertIn('same model', self.ok('verify', src, td).stdout)

    def test_rope_scaling_megatron_core_does_not_compute_is_refused(self):
        def setting(key, value):
            return lambda c: c['rope_scaling'].update({key: value})
        cases = {'rope_type': (setting('rope_type', 'dynamic'), "rope_scaling.rope_type = 'dynamic'"),
                 'low_freq_factor': (setting('low_freq_factor', 2.0), 'rope_scaling.low_freq_factor = 2.0'),
                 'high_freq_factor': (setting('high_freq_factor', 2.0), 'rope_scaling.high_freq_factor = 2.0'),
                 'original_max_position_embeddings': (setting('original_max_position_embeddings', 4096),
                                                      'rope_scaling.original_max_position_embeddings = 4096'),
                 'no factor': (lambda c: c['rope_scaling'].pop('factor'),
                               'has no rope_scaling.factor, and rule set megatron-llama computes the model only '
                               'with a value (args.rope_scaling_factor)'),
                 'another entry': (setting('type', 'llama3'), 'rope_scaling.type'),
                 'not a mapping': (lambda c: c.update(rope_scaling='llama3'), 'rope_scaling')}
        for key, (change, says) in cases.items():
            with self.subTest(key=key):
                src, _, _ = self.folder('llama', False, change=change, name='_' + key.replace(' ', '_'))
                out = self.path('refused')
                self.assertRefused(run('export', src, out, '--to', 'torch_dist', '--tp', 2, '--pp', 1), says, out)

    def test_llama_attention_bias_and_qwen2_sliding_window_are_refused(self):
        cases = (('llama', lambda c: c.update(attention_bias=True), 'attention_bias'),
                 ('qwen2', lambda c: c.update(use_sliding_window=True), 'use_sliding_window'))
        for family, change, says in cases:
            with self.subTest(family=family):
                src, _, _ = self.folder(family, False, change=change)
                out = self.path('refused')
                self.assertRefused(run('export', src, out, '--to', 'torch_dist', '--tp', 2, '--pp', 1), says, out)

    def test_megatron_deepspeed_target_is_refused_naming_the_field_and_torch_dist(self):
        for family, says in (('llama', 'args.use_rope_scaling'), ('qwen2', 'args.add_qkv_bias')):
            with self.subTest(family=family):
                src, _, _ = self.folder(family, False)
                out = self.path(f'ms_{family}')
                p = run('convert', src, os.path.join(out, 'global_step0'), '--tp', 2, '--pp', 1)
                self.assertRefused(p, says, out)
                self.assertIn('export --to torch_dist', p.stderr)
                p = run('export', src, out, '--to', 'universal')
                self.assertRefused(p, says, out)
                # lint with convert's target finds what convert refuses.
                p = run('lint', src, '--tp', 2, '--pp', 1)
                self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn(says, p.stdout + p.stderr)


if __name__ == '__main__':
    support.main()
