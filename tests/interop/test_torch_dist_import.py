"""Megatron-Core `torch_dist` checkpoints read as the models their family's rules describe
(rules/megatron-core-gpt.yaml, megatron-llama.yaml: their torch_dist sections).

The sources are real Megatron-Core 0.19 and 0.14 saves (tests/data/megatron-core: GQA with 4 heads
in 2 groups, TP 1 / 2, PP 2, LayerNorm with biases or RMSNorm without, GeLU or SwiGLU, fp32 and
bf16). Each comes with the tensors every rank held in memory (`TAG_rankN_ref_state_dict.pt`) and
every tensor whole (`TAG_full.pt`), written by Megatron and torch, not by reshard. Checked:

* `convert` to Megatron-DeepSpeed at the save's own TP and PP writes in every layer file exactly
  the tensors the Megatron-Core rank held (its fused QKV per query group, SwiGLU's linear_fc1 as
  [gate; up] of the rank, biases and norms, the padded vocabulary rows), bit for bit and in its
  dtype: the re-cut of the stacked layer axis and of the chunks is proven element by element;
* a conversion to another layout verifies equal to the source (`verify` across the formats), and
  converting that back to the save's layout gives the same layer files again;
* `export --to consolidated` writes every weight whole under its canonical name, equal to
  `TAG_full.pt`; `export --to hf` of the SwiGLU save gives LlamaForCausalLM's q/k/v and gate/up;
* the family is chosen from the keys and shapes; a save no rule set reads is read without one,
  saying why; the optimizer state and Transformer Engine's _extra_state are named in notes.

Run: /usr/bin/python3 tests/interop/test_torch_dist_import.py --reshard build/reshard
"""
import glob
import json
import os

import torch

import interop_support as support
from megatron_core_data import DATA, config_of, llama_hf_tensors, samples, sizes
from interop_support import FixtureTestCase

run = support.reshard

# Megatron-Core's module names (a rank's state dict) -> Megatron-DeepSpeed's layer keys.
BLOCK_KEYS = {
    'input_layernorm.weight': 'input_layernorm.weight',
    'input_layernorm.bias': 'input_layernorm.bias',
    'self_attention.linear_qkv.weight': 'self_attention.query_key_value.weight',
    'self_attention.linear_qkv.bias': 'self_attention.query_key_value.bias',
    'self_attention.linear_proj.weight': 'self_attention.dense.weight',
    'self_attention.linear_proj.bias': 'self_attention.dense.bias',
    'pre_mlp_layernorm.weight': 'post_attention_layernorm.weight',
    'pre_mlp_layernorm.bias': 'post_attention_layernorm.bias',
    'mlp.linear_fc1.weight': 'mlp.dense_h_to_4h.weight',
    'mlp.linear_fc1.bias': 'mlp.dense_h_to_4h.bias',
    'mlp.linear_fc2.weight': 'mlp.dense_4h_to_h.weight',
    'mlp.linear_fc2.bias': 'mlp.dense_4h_to_h.bias',
}


def layer_key(key, layers_per_stage, stage, last_layer_file):
    """(layer file id, key in it) of a Megatron-Core rank's parameter."""
    if key == 'embedding.word_embeddings.weight':
        return 1, 'word_embeddings.weight'
    if key.startswith('decoder.final_layernorm.'):
        return last_layer_file - 1, key.rsplit('.', 1)[1]
    if key == 'output_layer.weight':
        return last_layer_file, 'lm_head.weight'
    _, _, local, rest = key.split('.', 3)
    return 2 + stage * layers_per_stage + int(local), BLOCK_KEYS[rest]


class TorchDistImportTest(FixtureTestCase):

    def convert(self, folder, config, out, tp, pp, *extra):
        p = run('convert', '--to', 'deepspeed', folder, out, '--tp', tp, '--pp', pp, *sizes(config), *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def test_the_layer_files_hold_what_each_megatron_core_rank_held(self):
        checked = 0
        for folder, config in samples():
            layout, m = config['layout'], config['model']
            with self.subTest(save=os.path.relpath(folder, DATA)):
                out = self.path(os.path.relpath(folder, DATA).replace('/', '_'))
                self.convert(folder, config, out, layout['tp'], layout['pp'])
                last = 2 + m['layers'] + 1
                for rank in range(layout['tp'] * layout['pp']):
                    tp_rank, stage = rank % layout['tp'], rank // layout['tp']
                    ref = torch.load(f'{folder}_rank{rank}_ref_state_dict.pt')
                    for key, want in ref.items():
                        layer, got_key = layer_key(key, m['layers'] // layout['pp'], stage, last)
                        got = torch.load(support.layer_file(out, layer, tp_rank))
                        self.assertIn(got_key, got, f'{key} -> layer {layer}')
                        self.assertEqual(support.differences(got[got_key], want, key), [])
                        checked += 1
        self.assertGreater(checked, 200)

    def test_another_layout_verifies_equal_and_converts_back_to_the_same_files(self):
        for name in ('0.19/w2_tp2_swiglu', '0.19/w2_tp2', '0.19/w2_pp2', '0.14/w2_tp2'):
            folder = os.path.join(DATA, name)
            config = config_of(name)
            with self.subTest(save=name):
                layout = config['layout']
                other = self.path(name.replace('/', '_') + '_other')
                self.convert(folder, config, other, 1 if layout['tp'] == 2 else 2, 2 if layout['pp'] == 1 else 1)
                p = run('verify', folder, other, *sizes(config)[:-2])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                direct = self.path(name.replace('/', '_') + '_direct')
                self.convert(folder, config, direct, layout['tp'], layout['pp'])
                back = self.path(name.replace('/', '_') + '_back')
                # The sizes given with --set are recorded in the converted checkpoint's args.
                p = run('convert', '--to', 'deepspeed', other, back, '--tp', layout['tp'], '--pp', layout['pp'], '--vocab-size',
                        config['model']['vocab'], '--no-update-latest')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                for path in sorted(glob.glob(os.path.join(direct, 'layer_*'))):
                    self.assertEqual(support.differences(torch.load(os.path.join(back, os.path.basename(path))),
                                                         torch.load(path), path), [])

    def test_the_consolidated_export_equals_the_whole_tensors(self):
        for folder, config in samples():
            with self.subTest(save=os.path.relpath(folder, DATA)):
                out = self.path(os.path.relpath(folder, DATA).replace('/', '_') + '_whole')
                p = run('export', folder, out, '--to', 'consolidated', '--format', 'pt', *sizes(config))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got = torch.load(os.path.join(out, 'pytorch_model.bin'))
                full = torch.load(folder + '_full.pt')
                names = {'embedding.word_embeddings.weight': 'embedding.word_embeddings.weight',
                         'output_layer.weight': 'lm_head.weight',
                         'decoder.final_layernorm.weight': 'final_layernorm.weight',
                         'decoder.final_layernorm.bias': 'final_layernorm.bias'}
                compared = 0
                for key, want in full.items():
                    if '_extra_state' in key or not isinstance(want, torch.Tensor):
                        continue
                    if key.startswith('decoder.layers.'):
                        rest = key[len('decoder.layers.'):].replace('linear_qkv.layer_norm_', 'input_layernorm.')
                        rest = rest.replace('linear_fc1.layer_norm_', 'pre_mlp_layernorm.')
                        module = BLOCK_KEYS[rest.replace('self_attention.input_layernorm', 'input_layernorm')
                                                .replace('mlp.pre_mlp_layernorm', 'pre_mlp_layernorm')]
                        for layer in range(want.shape[0]):
                            self.assertEqual(support.differences(got[f'layers.{layer}.{module}'], want[layer], key), [])
                            compared += 1
                    else:
                        self.assertEqual(support.differences(got[names[key]], want, key), [])
                        compared += 1
                self.assertEqual(compared, len(got))

    def test_the_swiglu_save_exports_to_llama(self):
        folder = os.path.join(DATA, '0.19', 'w2_tp2_swiglu')
        m = config_of('0.19/w2_tp2_swiglu')['model']
        out = self.path('hf')
        p = run('export', folder, out, '--to', 'hf', '--vocab-size', m['vocab'],
                '--set', 'num_attention_heads=4', '--set', 'num_key_value_heads=2', '--set', 'max_position_embeddings=32',
                '--set', 'layernorm_epsilon=1e-5')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        got, _ = support.read_safetensors(os.path.join(out, 'model.safetensors'))
        want = llama_hf_tensors(torch.load(folder + '_full.pt'), m)
        self.assertEqual(sorted(got), sorted(want))
        for name, t in want.items():
            self.assertTrue(torch.equal(got[name], t), name)
        with open(os.path.join(out, 'config.json')) as f:
            hf = json.load(f)
        self.assertEqual((hf['num_key_value_heads'], hf['intermediate_size'], hf['num_hidden_layers']), (2, 32, 2))

    def test_the_family_is_named_and_what_is_not_carried_is_noted(self):
        p = run('inspect', os.path.join(DATA, '0.19', 'w2_tp2_swiglu_optim_fully_reshardable'))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('rule set megatron-llama', p.stdout)
        folder = os.path.join(DATA, '0.19', 'w2_tp2_optim_dp_reshardable')
        self.assertIn('rule set megatron-core-gpt', run('inspect', folder).stdout)
        p = run('convert', '--to', 'deepspeed', folder, self.path('out'), '--tp', 1, '--pp', 1, '--set', 'num_attention_heads=4',
                '--set', 'num_key_value_heads=2', '--vocab-size', 64, '--set', 'make_vocab_size_divisible_by=16')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("Megatron-Core's distributed optimizer (dp_reshardable)", p.stdout)
        self.assertIn("_extra_state (8 items) is not carried", p.stdout)
        p = run('lint', os.path.join(DATA, '0.19', 'w2_tp2'), '--tp', 1, '--pp', 1)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('--set args.num_key_value_heads=N --set args.num_attention_heads=N', p.stdout)

    def test_every_command_names_every_missing_value_in_one_refusal(self):
        # This save records no Megatron args: each export asks once for all it lacks (the HF one
        # for its config.json fields too), and the values given once are enough.
        folder = os.path.join(DATA, '0.19', 'w2_tp2_swiglu_optim_dp_reshardable')
        heads = '--set args.num_key_value_heads=N --set args.num_attention_heads=N'
        wanted = {'hf': '5 values this conversion needs: [args.num_key_value_heads, args.num_attention_heads] (the '
                        'block count of layers.0.self_attention.query_key_value.weight (from decoder.layers.'
                        'self_attention.linear_qkv.weight))',
                  'torchtitan': '3 values this conversion needs',
                  'consolidated': '3 values this conversion needs'}
        gives = {'hf': f'{heads} --vocab-size N --set args.max_position_embeddings=N --set args.layernorm_epsilon=N',
                 'torchtitan': f'{heads} --vocab-size N', 'consolidated': f'{heads} --vocab-size N'}
        values = ['--set', 'num_attention_heads=4', '--set', 'num_key_value_heads=2', '--vocab-size', 64]
        for to, lead in wanted.items():
            out = self.path('out-' + to)
            layout = ['--dp-shard', 2] if to == 'torchtitan' else []
            p = run('export', folder, out, '--to', to, *layout)
            self.assertRefused(p, 'the checkpoint does not record ' + lead, out)
            self.assertIn('give them as the run was trained: ' + gives[to] + ' (or as', p.stderr)
            config = ['--set', 'max_position_embeddings=64', '--set', 'layernorm_epsilon=1e-5'] if to == 'hf' else []
            p = run('export', folder, out, '--to', to, *layout, *values, *config, '-q')
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', folder, self.path('out-consolidated'))
        self.assertRefused(p, folder + ': the checkpoint does not record 2 values the comparison needs',
                           self.path('none'))
        self.assertIn(f'give them as the run was trained: {heads} (or as', p.stderr)

    def test_a_save_no_rule_set_reads_is_read_without_one_saying_why(self):
        folder = self.path('renamed')
        import shutil
        shutil.copytree(os.path.join(DATA, '0.19', 'w1_tp1'), folder)
        rules = self.path('gpt.yaml')
        with open(os.path.join(os.path.dirname(__file__), '..', '..', 'rules', 'megatron-core-gpt.yaml')) as f:
            text = f.read().replace('key: output_layer.weight', 'key: output_layer.other')
            text = text.replace('    - output_layer.weight\n', '    - output_layer.other\n')  # its optimizer_order
        with open(rules, 'w') as f:
            f.write(text)
        p = run('convert', '--to', 'deepspeed', folder, self.path('out'), '--tp', 1, '--pp', 1, '--rules', rules)
        self.assertRefused(p, 'output_layer.weight is not a tensor of the model as its torch_dist section maps it',
                           self.path('out'))


if __name__ == '__main__':
    support.main()
