"""`reshard convert HF_FOLDER OUT --tp T --pp P`: a Hugging Face transformers folder in,
Megatron-DeepSpeed out.

The HF folders are written here, not by reshard: a fixture's canonical tensors mapped by the
documented HF conventions (test_export_hf's expected_* maps: GPT-2's Conv1D transposes and
[q; k; v], Llama's separate q/k/v/gate/up, BLOOM's per-head fused QKV), cast to bf16, with a
config.json of the HF architecture's fields, as one safetensors file, safetensors shards with an
index, or pytorch_model.bin. Oracles:

* at each target layout the layer files hold, key by key, what a fixture written directly at
  that layout from the same canonical tensors holds (the vocabulary rows past the true size are
  zeros here and the fixture's own filler there, so only the true rows are compared);
* a Megatron-semantics forward on the imported layer files gives the HF forward's logits on the
  folder (float64, to 1e-9; test_export_hf's forwards), and a folder with its QKV reordered does not;
* the round trip HF -> Megatron-DeepSpeed -> HF through reshard's export is bit-exact;
* `verify` finds the folder and the imported checkpoint the same model;
* what other savers write imports too: a folder saved from the base model, recomputed buffers,
  a tied head in a .bin;
* refusals (exit 2, one line, nothing written): an architecture no rule set maps, a missing and
  an extra tensor, a config that disagrees with the tensors or asks for what the family does
  not compute, a damaged safetensors header.

Run: cd tests/interop && PYTHONPATH=../ /usr/bin/python3 test_import_hf.py --reshard ../../build/reshard
"""
import json
import os
import struct

import torch

from fixtures import megatron_fixture as mf

import interop_support as support
from interop_support import FixtureTestCase, make_fixture, read_safetensors, write_safetensors
import test_export_hf as hf

GPT2, LLAMA, BLOOM = hf.GPT2, hf.LLAMA, hf.BLOOM
S = support.SIZES
CONFIGS = {
    'ms_gpt2': {'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2', 'n_embd': S['h'], 'n_layer': S['L'],
                'n_head': S['n'], 'n_inner': GPT2['ffn'], 'n_positions': 32, 'layer_norm_epsilon': 1e-5,
                'activation_function': 'gelu_new', 'tie_word_embeddings': True, 'vocab_size': S['V'],
                'torch_dtype': 'bfloat16'},
    'ms_llama': {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': S['h'],
                 'intermediate_size': LLAMA['ffn'], 'num_hidden_layers': S['L'], 'num_attention_heads': S['n'],
                 'num_key_value_heads': LLAMA['nkv'], 'max_position_embeddings': 32, 'rms_norm_eps': 1e-5,
                 'rope_theta': 10000.0, 'hidden_act': 'silu', 'tie_word_embeddings': False,
                 'vocab_size': S['V'], 'torch_dtype': 'bfloat16'},
    'bs_bloom': {'architectures': ['BloomForCausalLM'], 'model_type': 'bloom', 'hidden_size': S['h'],
                 'n_layer': S['L'], 'n_head': S['n'], 'layer_norm_epsilon': 1e-5,
                 'apply_residual_connection_post_layernorm': False, 'tie_word_embeddings': True, 'vocab_size': S['V'],
                 'torch_dtype': 'bfloat16'},
}
EXPECTED = {'ms_gpt2': lambda c: hf.expected_gpt2(c, S['L']), 'ms_llama': lambda c: hf.expected_llama(c, S['L']),
            'bs_bloom': lambda c: hf.expected_bloom(c, S['L'], S['n'], S['hd'])}
def write_folder(path, tensors, config, form='safetensors'):
    """An HF folder: config.json and the tensors as `form` (safetensors, shards, bin)."""
    os.makedirs(path)
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    if form == 'safetensors':
        write_safetensors(os.path.join(path, 'model.safetensors'), tensors)
    elif form == 'shards':
        names = list(tensors)
        halves = {'model-00001-of-00002.safetensors': names[::2], 'model-00002-of-00002.safetensors': names[1::2]}
        for file, part in halves.items():
            write_safetensors(os.path.join(path, file), {n: tensors[n] for n in part})
        with open(os.path.join(path, 'model.safetensors.index.json'), 'w') as f:
            json.dump({'metadata': {}, 'weight_map': {n: file for file, part in halves.items() for n in part}}, f)
    else:
        torch.save(dict(tensors), os.path.join(path, 'pytorch_model.bin'))


def true_rows(file, key, t):
    """How many rows of `t` (key `key` of layer file `file`) a comparison covers: those of the true
    vocabulary in a vocabulary shard, else all."""
    if key not in ('word_embeddings.weight', 'lm_head.weight'):
        return t.shape[0]
    rank = int(file.split('-model_')[1][:2])
    return max(0, min(t.shape[0], S['V'] - rank * t.shape[0]))


class ImportHfTest(FixtureTestCase):

    def hf_folder(self, name, family, form='safetensors', change=None):
        """Writes an HF folder of `family`'s canonical tensors; returns (folder, canonical tensors)."""
        canon = mf.canonical_tensors(mf.FixtureConfig(**family))
        tensors = {k: v.to(torch.bfloat16) for k, v in EXPECTED[family['style']](canon).items()}
        config = dict(CONFIGS[family['style']])
        if change:
            change(tensors, config)
        path = self.path(name)
        write_folder(path, tensors, config, form)
        return path, canon

    def convert(self, folder, out, tp, pp, *options, code=0):
        p = support.reshard('convert', folder, out, '--tp', tp, '--pp', pp, '--set', f'make_vocab_size_divisible_by={S["mvsdb"]}',
                            *options)
        self.assertEqual(p.returncode, code, p.stdout + p.stderr)
        return p

    def refused(self, folder, says):
        out = self.path('refused', 'global_step0')
        p = self.convert(folder, out, 2, 1, code=2)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn(says, p.stderr)
        self.assertFalse(os.path.exists(self.path('refused')))

    def assertLayerFilesLikeFixture(self, tag, family, tp, pp):
        """Every layer file of `tag` holds the tensors of a fixture written at (tp, pp) directly."""
        root = self.path(f'fixture_{family["style"]}_{tp}{pp}')
        want = os.path.join(root, 'global_step10') if os.path.exists(root) else \
            make_fixture(root, **dict(family, tp=tp, pp=pp))
        names = sorted(n for n in os.listdir(want) if n.startswith('layer_'))
        self.assertEqual(sorted(n for n in os.listdir(tag) if n.startswith('layer_')), names)
        for name in names:
            got, expected = support.load(os.path.join(tag, name)), support.load(os.path.join(want, name))
            self.assertEqual(list(got), list(expected), name)
            for key, value in expected.items():
                self.assertEqual(got[key].dtype, value.dtype, (name, key))
                self.assertEqual(got[key].shape, value.shape, (name, key))
                rows = true_rows(name, key, value)
                self.assertTrue(torch.equal(got[key][:rows], value[:rows]), (name, key))
                self.assertEqual(got[key][rows:].abs().sum().item(), 0, (name, key))  # padding: zeros

    def assertMetadata(self, tag, tp, pp):
        vp = -(-S['V'] // (S['mvsdb'] * tp)) * S['mvsdb'] * tp
        for mp in range(tp * pp):
            sd = support.load(support.mp_file(tag, mp))
            self.assertEqual((sd['mp_world_size'], sd['dp_world_size'], sd['iteration']), (tp * pp, 1, 0))
            args = sd['args']
            self.assertEqual((args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                              args.padded_vocab_size, args.num_layers, args.hidden_size),
                             (tp, pp, vp, S['L'], S['h']))
            self.assertIsNone(sd['optimizer'])
            self.assertTrue(sd['param_shapes'], 'param_shapes of the target stage')
        with open(os.path.join(os.path.dirname(tag), 'latest')) as f:
            self.assertEqual(f.read().strip(), os.path.basename(tag))

    def assertRoundTrip(self, folder, tag):
        """reshard's export of the imported checkpoint gives the folder's tensors and config back."""
        back = self.path(os.path.basename(os.path.dirname(tag)) + '_back')
        p = support.reshard('export', tag, back, '--to', 'hf')
        self.assertEqual(p.returncode, 0, p.stderr)
        got, want = hf.read_folder(back)[0], {}
        for name in os.listdir(folder):
            if name.endswith('.safetensors'):
                want.update(read_safetensors(os.path.join(folder, name))[0])
            elif name.endswith('.bin'):
                want.update(torch.load(os.path.join(folder, name)))
        self.assertEqual(sorted(got), sorted(want))
        for name, t in want.items():
            self.assertTrue(torch.equal(got[name], t), name)
        config = hf.read_json(os.path.join(folder, 'config.json'))
        for key, value in hf.read_json(os.path.join(back, 'config.json')).items():
            if key in config:
                self.assertEqual(value, config[key], key)

    def check_family(self, family, layouts, form='safetensors'):
        folder, _ = self.hf_folder(f'{family["style"]}_{form}', family, form)
        for tp, pp in layouts:
            with self.subTest(style=family['style'], form=form, tp=tp, pp=pp):
                tag = self.path(f'out_{family["style"]}_{form}_{tp}{pp}', 'global_step0')
                self.convert(folder, tag, tp, pp)
                self.assertLayerFilesLikeFixture(tag, family, tp, pp)
                self.assertMetadata(tag, tp, pp)
                self.assertRoundTrip(folder, tag)
                p = support.reshard('verify', folder, tag)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout + p.stderr)
        return folder

    def test_llama_layouts_and_forms(self):
        folder = self.check_family(LLAMA, ((1, 1), (2, 2), (3, 1), (6, 3)))
        self.check_family(LLAMA, ((2, 1),), form='shards')
        self.check_family(LLAMA, ((2, 2),), form='bin')
        self.assertLogitsMatch(folder, LLAMA)

    def test_gpt2_transposed_conv1d(self):
        folder = self.check_family(GPT2, ((1, 1), (2, 2), (4, 3)))
        self.assertLogitsMatch(folder, GPT2)

    def test_bloom_fused_qkv_and_embedding_norm(self):
        folder = self.check_family(BLOOM, ((1, 1), (3, 2)))
        self.assertLogitsMatch(folder, BLOOM)

    def assertLogitsMatch(self, folder, family):
        """The HF forward on the folder = the Megatron forward on the import; a folder whose first
        layer has k and v swapped (Llama) or its fused QKV reversed imports into other logits."""
        style = family['style']
        tensors, config = self.read_plain(folder)
        want = hf.HF_LOGITS[style](tensors, config, hf.TOKENS)
        tag = self.path(f'logits_{style}', 'global_step0')
        self.convert(folder, tag, 2, 1)
        self.assertLess((hf.megatron_logits(family, tag, 2) - want).abs().max().item(), hf.TOLERANCE)

        def swap(t, c):
            if style == 'ms_llama':
                t['model.layers.0.self_attn.k_proj.weight'], t['model.layers.0.self_attn.v_proj.weight'] = \
                    t['model.layers.0.self_attn.v_proj.weight'], t['model.layers.0.self_attn.k_proj.weight']
            else:
                key = 'transformer.h.0.attn.c_attn.weight' if style == 'ms_gpt2' else \
                      'transformer.h.0.self_attention.query_key_value.weight'
                t[key] = t[key].flip(0) if style == 'bs_bloom' else t[key].flip(1)
        swapped, _ = self.hf_folder(f'swapped_{style}', family, change=swap)
        tag = self.path(f'swapped_{style}_out', 'global_step0')
        self.convert(swapped, tag, 2, 1)
        self.assertGreater((hf.megatron_logits(family, tag, 2) - want).abs().max().item(), hf.MOVED)

    def read_plain(self, folder):
        """(tensors, config) of a folder with one model.safetensors."""
        config = hf.read_json(os.path.join(folder, 'config.json'))
        return read_safetensors(os.path.join(folder, 'model.safetensors'))[0], config

    def test_what_other_savers_write(self):
        """A folder saved from the base model (no 'transformer.'), with the attention masks older
        transformers saved and the tied head a .bin holds, imports as the clean folder does; Llama's
        old rotary frequencies are skipped too. A head that is not the embedding is refused."""
        def gpt2_base_model(t, c):  # GPT2Model.save_pretrained of older transformers
            for i in range(S['L']):
                t[f'transformer.h.{i}.attn.bias'] = torch.ones(1, 1, 32, 32).tril()
                t[f'transformer.h.{i}.attn.masked_bias'] = torch.tensor(-1e4)
            for name in list(t):
                t[name[len('transformer.'):]] = t.pop(name)
        def gpt2_tied_head(t, c):
            t['lm_head.weight'] = t['transformer.wte.weight']  # one storage, as torch.save writes tied weights
        def llama_with_inv_freq(t, c):
            for i in range(S['L']):
                t[f'model.layers.{i}.self_attn.rotary_emb.inv_freq'] = torch.ones(S['hd'] // 2)
        cases = (('base', GPT2, gpt2_base_model, 'safetensors', 'saved from the base model'),
                 ('tied', GPT2, gpt2_tied_head, 'bin', 'skipped what GPT2LMHeadModel recomputes or ties'),
                 ('inv_freq', LLAMA, llama_with_inv_freq, 'safetensors', 'skipped what LlamaForCausalLM'))
        for name, family, change, form, says in cases:
            with self.subTest(case=name):
                folder, _ = self.hf_folder(f'old_{name}', family, form, change=change)
                tag = self.path(f'old_{name}_out', 'global_step0')
                p = self.convert(folder, tag, 2, 2)
                self.assertIn(says, p.stderr + p.stdout)
                self.assertLayerFilesLikeFixture(tag, family, 2, 2)

        def untied(t, c):
            t['lm_head.weight'] = t['transformer.wte.weight'] + 1
        folder, _ = self.hf_folder('untied', GPT2, 'bin', change=untied)
        self.refused(folder, "the HF folder's lm_head.weight is not the same tensor as transformer.wte.weight")

    def test_megatron_lm_export_of_a_folder(self):
        """`export --to megatron` of an HF folder writes the tensors the export of the fixture
        checkpoint writes (the vocabulary's true rows; padding may differ)."""
        folder, _ = self.hf_folder('mlm_llama', LLAMA)
        source = make_fixture(self.path('mlm_src'), **dict(LLAMA, tp=2, pp=2))
        outs = [self.path('mlm_from_hf'), self.path('mlm_from_ckpt')]
        for src, out in zip((folder, source), outs):
            p = support.reshard('export', src, out, '--to', 'megatron', '--tp', 2, '--pp', 2,
                                '--set', f'make_vocab_size_divisible_by={S["mvsdb"]}')
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

        def tensors(tree, prefix=''):
            for key, value in tree.items():
                if isinstance(value, dict):
                    yield from tensors(value, prefix + key + '.')
                else:
                    yield prefix + key, value
        # The iterations differ (a fresh run's 0, the fixture's 10): compare rank folders.
        iters = [os.path.join(o, next(n for n in os.listdir(o) if n.startswith('iter_'))) for o in outs]
        ranks = sorted(os.listdir(iters[1]))
        self.assertEqual(sorted(os.listdir(iters[0])), ranks)
        self.assertEqual(len(ranks), 4)
        for rank in ranks:
            got, want = (dict(tensors(support.load(os.path.join(i, rank, 'model_optim_rng.pt'))['model']))
                         for i in iters)
            self.assertEqual(sorted(got), sorted(want), rank)
            tp_rank = int(rank.split('_')[2])
            for key, t in want.items():
                if t is None:  # a Megatron-Core linear layer's _extra_state
                    self.assertIsNone(got[key], (rank, key))
                    continue
                vocab = 'word_embeddings' in key or 'output_layer' in key
                rows = max(0, min(t.shape[0], S['V'] - tp_rank * t.shape[0])) if vocab else t.shape[0]
                self.assertTrue(torch.equal(got[key][:rows], t[:rows]), (rank, key))

    def test_gpt2_n_inner_null_is_four_times_n_embd(self):
        # transformers writes "n_inner": null by default (4 x n_embd); some configs leave it out.
        family = dict(GPT2, ffn=4 * S['h'])
        for name, change in (('null', lambda t, c: c.update(n_inner=None)), ('absent', lambda t, c: c.pop('n_inner'))):
            with self.subTest(n_inner=name):
                folder, _ = self.hf_folder(f'gpt2_{name}', family, change=change)
                tag = self.path(f'out_{name}', 'global_step0')
                p = self.convert(folder, tag, 2, 1)
                self.assertIn('n_inner is null, which GPT2LMHeadModel reads as 4*args.hidden_size', p.stdout)
                self.assertEqual(support.load(support.mp_file(tag, 0))['args'].ffn_hidden_size, 4 * S['h'])
                self.assertLayerFilesLikeFixture(tag, family, 2, 1)
                back = self.path(f'back_{name}')
                p = support.reshard('export', tag, back, '--to', 'hf')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertEqual(hf.read_json(os.path.join(back, 'config.json'))['n_inner'], 4 * S['h'])
                p = support.reshard('export', folder, self.path(f'direct_{name}'), '--to', 'hf')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_config_fields_kept_and_token_ids_from_the_tokenizer(self):
        # From an HF source: every field the conversion does not write is kept, in the source's place.
        extra = {'bos_token_id': 1, 'eos_token_id': 2, 'pad_token_id': None, 'use_cache': True,
                 'initializer_range': 0.02, 'task_specific_params': {'text-generation': {'max_length': 50}}}
        folder, _ = self.hf_folder('kept', LLAMA, change=lambda t, c: c.update(extra))
        out = self.path('kept_out')
        p = support.reshard('export', folder, out, '--to', 'hf')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        source, written = hf.read_json(os.path.join(folder, 'config.json')), hf.read_json(os.path.join(out, 'config.json'))
        self.assertEqual(list(written)[:len(source)], list(source))  # then what the rules add (attention_bias, ...)
        self.assertEqual({k: written[k] for k in source}, source)
        # From a Megatron-DeepSpeed source: the special token ids from --tokenizer's files.
        tag = make_fixture(self.path('mds'), **dict(LLAMA, tp=2, pp=1))
        tok = self.path('tok')
        os.makedirs(tok)
        with open(os.path.join(tok, 'tokenizer_config.json'), 'w') as f:
            json.dump({'bos_token': '<s>', 'eos_token': {'content': '</s>'}, 'pad_token': None,
                       'added_tokens_decoder': {'1': {'content': '<s>'}}}, f)
        with open(os.path.join(tok, 'tokenizer.json'), 'w') as f:
            json.dump({'added_tokens': [{'id': 2, 'content': '</s>'}], 'model': {'vocab': {'<s>': 1, '</s>': 2}}}, f)
        out = self.path('mds_out')
        p = support.reshard('export', tag, out, '--to', 'hf', '--tokenizer', tok)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        config = hf.read_json(os.path.join(out, 'config.json'))
        self.assertEqual((config['bos_token_id'], config['eos_token_id']), (1, 2))
        self.assertNotIn('pad_token_id', config)

    def test_tied_llama(self):
        # Llama-3.2-1B/3B: tie_word_embeddings true and no lm_head.weight; Megatron-DeepSpeed trains
        # such a model with the head tied to the embedding (rule set megatron-llama-tied).
        def tied(t, c):
            t.pop('lm_head.weight')
            c.update(tie_word_embeddings=True)
        folder, canon = self.hf_folder('tied_llama', LLAMA, change=tied)
        for tp, pp in ((1, 1), (2, 2)):
            with self.subTest(tp=tp, pp=pp):
                tag = self.path(f'tied_{tp}{pp}', 'global_step0')
                self.convert(folder, tag, tp, pp)
                layers = sorted(n for n in os.listdir(tag) if n.startswith('layer_'))
                self.assertEqual(len(layers), (S['L'] + 2) * tp, layers)  # embedding, blocks, final norm: no head file
                shapes = support.load(support.mp_file(tag, tp * pp - 1))['param_shapes']
                self.assertIn('tied_modules.embed.word_embeddings.weight', [n for g in shapes for n in g])
                self.assertMetadata(tag, tp, pp)
                self.assertFalse(support.load(support.mp_file(tag, 0))['args'].untie_embeddings_and_output_weights)
                self.assertRoundTrip(folder, tag)  # back to HF: the same tensors, tie_word_embeddings true
                p = support.reshard('verify', folder, tag)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('rule set megatron-llama-tied', support.reshard('inspect', tag).stdout)
        # The imported checkpoint converts again as the Megatron-DeepSpeed checkpoint it is (a root in:
        # a root out), the --set divisor recorded in its args.
        p = support.reshard('convert', self.path('tied_22'), self.path('tied_again'), '--tp', 1, '--pp', 3, '-q')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = support.reshard('verify', folder, self.path('tied_again', 'global_step0'))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # Untied folders still import as megatron-llama, with or without tie_word_embeddings.
        for name, change in (('untied', None), ('untied_no_key', lambda t, c: c.pop('tie_word_embeddings'))):
            with self.subTest(folder=name):
                folder, _ = self.hf_folder(name, LLAMA, change=change)
                tag = self.path(f'out_{name}', 'global_step0')
                self.convert(folder, tag, 1, 1)
                self.assertIn('rule set megatron-llama ', support.reshard('inspect', tag).stdout)

    def test_llama_features_megatron_deepspeed_lacks_name_the_torch_dist_target(self):
        llama3 = {'rope_type': 'llama3', 'factor': 32.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                  'original_max_position_embeddings': 8192}
        cases = [(lambda t, c: c.update(attention_bias=True), 'has attention_bias = True', 'Qwen2ForCausalLM'),
                 # Megatron-Core computes it; Megatron-DeepSpeed, convert's target, does not.
                 (lambda t, c: c.update(rope_scaling=llama3), 'args.use_rope_scaling is true (config.json\'s '
                  'rope_scaling', 'export --to torch_dist writes it for Megatron-Core'),
                 (lambda t, c: c.update(rope_scaling={'rope_type': 'llama3', 'factor': 32.0}),
                  'has no rope_scaling.low_freq_factor', "reshard's torch_dist target")]
        for i, (change, says, target) in enumerate(cases):
            with self.subTest(says=says):
                folder, _ = self.hf_folder(f'feature{i}', LLAMA, change=change)
                self.refused(folder, says)
                p = self.convert(folder, self.path('refused', 'x'), 2, 1, code=2)
                self.assertIn(target, p.stderr)

    def test_refusals(self):
        def drop(name):
            return lambda t, c: t.pop(name)
        cases = [
            (lambda t, c: c.update(architectures=['MistralForCausalLM']), 'names MistralForCausalLM, which no built-in rule set maps'),
            (drop('model.layers.2.self_attn.v_proj.weight'), 'the HF folder has model.layers.2.self_attn.q_proj.weight but not '
                                                             'model.layers.2.self_attn.v_proj.weight'),
            (drop('lm_head.weight'), 'the HF folder lacks lm_head.weight'),
            (lambda t, c: t.update({'model.extra.weight': torch.zeros(2)}), "the HF folder's model.extra.weight is not a tensor"),
            (lambda t, c: c.update(num_key_value_heads=4), 'config.json disagrees with the tensors'),
            (lambda t, c: c.update(num_hidden_layers=5), 'gives 5 layers (args.num_layers as rule set megatron-llama reads it)'),
            (lambda t, c: c.update(hidden_act='gelu'), "has hidden_act = 'gelu'"),
            (lambda t, c: c.pop('rms_norm_eps'), 'has no rms_norm_eps, which rule set megatron-llama reads as args.layernorm_epsilon'),
        ]
        for i, (change, says) in enumerate(cases):
            with self.subTest(says=says):
                folder, _ = self.hf_folder(f'bad{i}', LLAMA, change=change)
                self.refused(folder, says)
        folder, _ = self.hf_folder('damaged', LLAMA)
        with open(os.path.join(folder, 'model.safetensors'), 'r+b') as f:
            f.write(struct.pack('<Q', 1 << 40))
        self.refused(folder, 'is not a safetensors file')


if __name__ == '__main__':
    support.main()
