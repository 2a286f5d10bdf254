"""`reshard export --to megatron` writes Megatron-Core's GPTModel keys, as current Megatron-LM's
`torch` format holds them (state_dict_for_save_checkpoint of each rank's model).

The sources are real Megatron-Core 0.19 saves (tests/data/megatron-core: `torch_dist` folders of a
GPTModel of the local layer spec; GQA with 4 heads in 2 groups, TP 1 / 2, PP 2, LayerNorm with
biases or RMSNorm without, GeLU or SwiGLU, fp32 and bf16). Each comes with the tensors every
Megatron-Core rank held in memory (`TAG_rankN_ref_state_dict.pt`: module names, the stage's own
layer index), written by Megatron and torch, not by reshard. Checked:

* exported at the save's own TP and PP with the default (local) layer spec, each rank's file
  `iter_0000000/mp_rank_TT[_PPP]/model_optim_rng.pt` holds in `model` exactly the keys of the
  rank's state dict, every tensor bit for bit and in its dtype, plus only `_extra_state` entries:
  None for each of Megatron-Core's linear layers (ColumnParallelLinear / RowParallelLinear
  .get_extra_state) on the stage that has it;
* with --layer-spec te, Transformer Engine's names: the norms fused into linear_qkv / linear_fc1
  (`layer_norm_weight`, `layer_norm_bias`), empty uint8 `_extra_state` for TE's modules
  (linear layers, core_attention, the final norm), None for the output layer;
* the 0.14 save as well, whose ref state dict has the same module names.

Run: /usr/bin/python3 tests/interop/test_export_megatron_core_keys.py --reshard build/reshard
"""
import json
import os

import torch

import interop_support as support
from megatron_core_data import DATA, samples, sizes
from interop_support import FixtureTestCase

run = support.reshard
EXTRA = '._extra_state'

# Megatron-Core's linear layers: their state_dict() holds `_extra_state` (None without TE).
LAYER_LINEARS = ('self_attention.linear_qkv', 'self_attention.linear_proj', 'mlp.linear_fc1', 'mlp.linear_fc2')


def rank_file(out, tp_rank, stage, pp):
    rank = f'mp_rank_{tp_rank:02d}' if pp == 1 else f'mp_rank_{tp_rank:02d}_{stage:03d}'
    return os.path.join(out, 'iter_0000000', rank, 'model_optim_rng.pt')


def layers_of(ref):
    return sorted({int(k.split('.')[2]) for k in ref if k.startswith('decoder.layers.')})


def te_key(key):
    """A local-spec key under Transformer Engine's spec, whose norms live in the linear layers."""
    return (key.replace('.input_layernorm.', '.self_attention.linear_qkv.layer_norm_')
               .replace('.pre_mlp_layernorm.', '.mlp.linear_fc1.layer_norm_'))


class MegatronCoreKeysTest(FixtureTestCase):

    def export(self, folder, config, out, *extra):
        layout = config['layout']
        p = run('export', folder, out, '--to', 'megatron', '--tp', layout['tp'], '--pp', layout['pp'],
                *sizes(config), *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def check_ranks(self, folder, config, out, key_of, extra_states):
        """Every rank's `model` against its ref state dict; returns the tensors compared."""
        layout = config['layout']
        compared = 0
        for rank in range(layout['tp'] * layout['pp']):
            tp_rank, stage = rank % layout['tp'], rank // layout['tp']
            ref = torch.load(f'{folder}_rank{rank}_ref_state_dict.pt')
            model = support.load(rank_file(out, tp_rank, stage, layout['pp']))['model']
            tensors = {k: v for k, v in model.items() if not k.endswith(EXTRA)}
            self.assertEqual(sorted(tensors), sorted(key_of(k) for k in ref), f'rank {rank}')
            for key, want in ref.items():
                self.assertEqual(support.differences(model[key_of(key)], want, key), [], f'rank {rank}')
                compared += 1
            want_extra = extra_states(ref, stage == layout['pp'] - 1)
            got_extra = {k: v for k, v in model.items() if k.endswith(EXTRA)}
            self.assertEqual(sorted(got_extra), sorted(want_extra), f'rank {rank}')
            for key, want in want_extra.items():
                self.assertEqual(support.differences(got_extra[key], want, key), [], f'rank {rank}')
        return compared

    def test_every_rank_holds_what_the_megatron_core_rank_held(self):
        def extra_states(ref, last):
            keys = [f'decoder.layers.{l}.{m}{EXTRA}' for l in layers_of(ref) for m in LAYER_LINEARS]
            return dict.fromkeys(keys + (['output_layer' + EXTRA] if last else []))

        compared = 0
        for folder, config in samples('0.19') + samples('0.14'):
            with self.subTest(save=os.path.relpath(folder, DATA)):
                out = self.path(os.path.relpath(folder, DATA).replace('/', '_'))
                p = self.export(folder, config, out)
                self.assertIn('Megatron-Core GPTModel keys, local layer spec', p.stdout)
                compared += self.check_ranks(folder, config, out, lambda k: k, extra_states)
        print(f'compared {compared} tensors')
        self.assertGreater(compared, 250)

    def test_the_transformer_engine_spec_names_the_fused_norms(self):
        def extra_states(ref, last):
            empty = torch.empty(0, dtype=torch.uint8)
            out = {f'decoder.layers.{l}.{m}{EXTRA}': empty for l in layers_of(ref)
                   for m in LAYER_LINEARS + ('self_attention.core_attention',)}
            if last:
                out.update({'decoder.final_layernorm' + EXTRA: empty, 'output_layer' + EXTRA: None})
            return out

        for name in ('w2_tp2', 'w2_pp2'):
            folder = os.path.join(DATA, '0.19', name)
            with open(folder + '_config.json') as f:
                config = json.load(f)
            with self.subTest(save=name):
                out = self.path(name + '_te')
                p = self.export(folder, config, out, '--layer-spec', 'te')
                self.assertIn('Transformer Engine layer spec', p.stdout)
                self.assertGreater(self.check_ranks(folder, config, out, te_key, extra_states), 0)
                model = support.load(rank_file(out, 0, 0, config['layout']['pp']))['model']
                self.assertIn('decoder.layers.0.self_attention.linear_qkv.layer_norm_bias', model)
                self.assertNotIn('decoder.layers.0.input_layernorm.weight', model)


if __name__ == '__main__':
    support.main()
