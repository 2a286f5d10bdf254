"""The distributed optimizer's state of Megatron-Core `torch_dist` checkpoints carried into
Megatron-DeepSpeed (engine/formats/megatron_core/torch_dist/torch_dist_optimizer.h, formats/deepspeed/optimizer/imported_state.h).

The sources are the real Megatron-Core 0.19 saves after one AdamW step in both of its layouts,
`fully_reshardable` (per-key states chunked like the weights) and `dp_reshardable` (flat bucket
buffers per model-parallel rank); `TAG_optim_full.pt`, written by torch from Megatron's own state,
holds each key's whole fp32 `param`, `exp_avg` and `exp_avg_sq`. Checked:

* `convert` to Megatron-DeepSpeed at TP 1, TP 2 and (one save) PP 2 writes DeepSpeed's optimizer
  shards (BF16_Optimizer for the bf16 save, ZeRO-1 otherwise) whose states, read back through
  `export --to universal` (DeepSpeed's per-parameter files, torch.load-ed), equal Megatron's
  fp32 master, exp_avg and exp_avg_sq of every parameter bit for bit, with its step and
  hyperparameters;
* `verify` finds the two layouts of one save the same model with the same optimizer state, and
  each save equal to what it was converted to;
* `export --to universal` of a save itself writes the per-parameter files (and the mp_rank file
  a conversion at TP 1, PP 1 writes), which read back equal;
* Megatron-Core 0.14's `fully_sharded_model_space` (each state of a key saved reformulated: its
  fragments, the layers' TP pieces, flattened; engine/formats/dcp/nd_reformulation.h) is read:
  converted to Megatron-DeepSpeed at TP 1 and at TP 2, PP 2, the fp32 masters equal the save's
  weights after the step bit for bit, and the moments are Megatron's own: one AdamW step from the
  weights before it (`w2_tp2_full.pt`) with the exp_avg and exp_avg_sq read gives the weights after
  it bit for bit, for every element. (0.14's `w2_tp2_optim_full.pt` holds the weights after the step
  but no optimizer states, so this is the reference; the README's gradients, recomputed with this
  machine's torch 1.13 `sin`, differ from the run's in the last bits, so exp_avg is only checked
  against them to 1e-5.) `verify` finds the save equal to its conversion and to its
  `export --to torch_dist --optimizer-layout fully_reshardable` at TP 1;
* Megatron-Core 0.14's `dp_zero_gather_scatter` (each model-parallel rank's state gathered onto DP
  rank 0 and pickled whole: engine/formats/megatron_core/common/megatron_gathered.h) holds the same state after the same
  step as its `fully_sharded_model_space` twin: `verify` finds the two saves equal, weights and
  states, and both convert to Megatron-DeepSpeed files equal byte for byte, optimizer shards
  included; a damaged item (a buffer whose numel_unpadded its tensors do not have) is refused in
  one line naming it and --weights-only.

Run: /usr/bin/python3 tests/interop/test_torch_dist_optimizer.py --reshard build/reshard
"""
import glob
import json
import math
import os
import shutil
import struct
import zlib

import torch

import interop_support as support
from interop_support import FixtureTestCase
from megatron_core_data import config_of
from test_torch_dist_import import BLOCK_KEYS, DATA, sizes

run = support.reshard
LAYOUTS = ('fully_reshardable', 'dp_reshardable')
STATES = {'param': 'fp32', 'exp_avg': 'exp_avg', 'exp_avg_sq': 'exp_avg_sq'}


def saves():
    """(tag path, config) of every 0.19 save with optimizer state."""
    out = []
    for full in sorted(glob.glob(os.path.join(DATA, '0.19', '*_optim_full.pt'))):
        tag = full[:-len('_optim_full.pt')]
        with open(tag + '_config.json') as f:
            out.append((tag, json.load(f)))
    return out


def universal_name(key, layer, layers):
    """The universal checkpoint's parameter folder of a Megatron-Core key (of block `layer`)."""
    if key == 'embedding.word_embeddings.weight':
        return '1.word_embeddings.weight'
    if key.startswith('decoder.final_layernorm.'):
        return f'{2 + layers}.' + key.rsplit('.', 1)[1]
    if key == 'output_layer.weight':
        return f'{3 + layers}.lm_head.weight'
    rest = key[len('decoder.layers.'):]
    rest = rest.replace('self_attention.linear_qkv.layer_norm_', 'input_layernorm.')
    rest = rest.replace('mlp.linear_fc1.layer_norm_', 'pre_mlp_layernorm.')
    return f'{2 + layer}.' + BLOCK_KEYS[rest]


def damage_pickled_item(path, old, new):
    """Replaces `old` by `new` (as long) in the data.pkl of the torch archive of `path` holding it, and
    gives the record the CRC-32 of the new bytes (torch writes it in a data descriptor after the
    data and in the central directory), so that only the content is damaged."""
    with open(path, 'rb') as f:
        data = bytearray(f.read())
    at = data.index(old)
    start = data.rindex(b'PK\x03\x04', 0, at)  # the record's local header
    name_length, extra_length = struct.unpack_from('<HH', data, start + 26)
    body = start + 30 + name_length + extra_length
    central = data.index(b'PK\x01\x02', at)  # the first entry of its central directory: data.pkl's
    crc, size = struct.unpack_from('<II', data, central + 16)
    assert zlib.crc32(bytes(data[body:body + size])) == crc and body <= at < body + size
    data[at:at + len(old)] = new
    new_crc = zlib.crc32(bytes(data[body:body + size]))
    assert data[body + size:body + size + 8] == b'PK\x07\x08' + struct.pack('<I', crc)
    struct.pack_into('<I', data, body + size + 4, new_crc)
    struct.pack_into('<I', data, central + 16, new_crc)
    with open(path, 'wb') as f:
        f.write(data)


class TorchDistOptimizerTest(FixtureTestCase):
    def convert(self, source, config, out, tp, pp):
        p = run('convert', '--to', 'deepspeed', source, out, '--tp', tp, '--pp', pp, *sizes(config))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def universal_states(self, converted, config):
        """export --to universal of a converted checkpoint: {param folder: {state: tensor}}, step, groups."""
        out = converted + '_universal'
        p = run('export', converted, out, '--to', 'universal', '--set',
                f"universal_checkpoint_info.original_vocab_size={config['model']['vocab']}")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return self.universal_states_of(out)

    def universal_states_of(self, out):
        params = {}
        for folder in sorted(glob.glob(os.path.join(out, 'zero', '*', ''))):
            name = os.path.basename(folder.rstrip('/'))
            params[name] = {s: support.load(os.path.join(folder, s + '.pt'))['param'] for s in STATES.values()}
            params[name]['step'] = support.load(os.path.join(folder, 'step.pt'))
        return params, support.load(os.path.join(out, 'zero', 'optimizer_state.pt'))

    def check_states(self, tag, config, params, optimizer_state):
        """Every Megatron key's three states equal the universal files of its parameters; returns elements."""
        full = support.load(tag + '_optim_full.pt')
        layers = config['model']['layers']
        compared = 0
        for state, file_state in STATES.items():
            for key, whole in full['optimizer'][state].items():
                pieces = [(l, whole[l]) for l in range(layers)] if key.startswith('decoder.layers.') else [(0, whole)]
                for layer, want in pieces:
                    name = universal_name(key, layer, layers)
                    self.assertEqual(support.differences(params[name][file_state], want, f'{state} {key} {layer}'), [])
                    compared += want.numel()
        self.assertEqual(len(params), sum(layers if k.startswith('decoder.layers.') else 1
                                          for k in full['optimizer']['param']))
        groups = full['objects']['common_state/shard_0_1'][0]['optimizer']['optimizer']['param_groups']
        for got, want in zip(optimizer_state['param_groups'], groups):
            for field in ('lr', 'betas', 'eps', 'weight_decay', 'wd_mult'):
                self.assertEqual(got[field], want[field], field)
        self.assertEqual({p['step'] for p in params.values()}, {groups[0]['step']})
        return compared

    def test_converted_shards_hold_megatron_states_bit_for_bit(self):
        tally = {}
        for tag, config in saves():
            name = os.path.basename(tag)
            targets = [(1, 1), (2, 1)] + ([(1, 2), (2, 2)] if name == 'w2_tp2' else [])
            for layout in LAYOUTS:
                for tp, pp in targets:
                    with self.subTest(save=name, layout=layout, tp=tp, pp=pp):
                        out = self.path(f'{name}_{layout}_tp{tp}_pp{pp}')
                        self.convert(f'{tag}_optim_{layout}', config, out, tp, pp)
                        bf16 = config['model']['dtype'] == 'bfloat16'
                        prefix = 'bf16_zero_pp_rank_0' if bf16 else 'zero_pp_rank_0'
                        shards = sorted(os.path.basename(f) for f in glob.glob(os.path.join(out, '*optim_states.pt')))
                        self.assertEqual(shards, [f'{prefix}_mp_rank_{m:02d}_optim_states.pt' for m in range(tp * pp)])
                        osd = support.load(os.path.join(out, shards[0]))['optimizer_state_dict']
                        self.assertEqual('zero_stage' in osd, not bf16)
                        params, optimizer_state = self.universal_states(out, config)
                        tally[(name, layout, tp, pp)] = self.check_states(tag, config, params, optimizer_state)
        self.assertEqual(len(tally), 2 * (2 * len(saves()) + 2))
        print(f'\n[ states ] {len(tally)} conversions, {sum(tally.values())} elements of fp32 / exp_avg / '
              f'exp_avg_sq equal to Megatron-Core\'s')

    def test_verify_finds_the_two_layouts_and_the_conversion_equal(self):
        for tag, config in saves():
            name = os.path.basename(tag)
            with self.subTest(save=name):
                given = sizes(config)[:-2]
                full, dp = f'{tag}_optim_fully_reshardable', f'{tag}_optim_dp_reshardable'
                p = run('verify', full, dp, *given)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                weights = len(support.load(tag + '_optim_full.pt')['optimizer']['param'])
                compared = int(p.stdout.split('verify: ')[1].split(' tensors')[0])
                self.assertGreater(compared, 3 * weights)  # per canonical tensor: a weight and three states
                self.assertEqual(compared % 4, 0)
                out = self.path(name)
                self.convert(dp, config, out, 2 if config['layout']['tp'] == 1 else 1, 1)
                p = run('verify', dp, out, *given)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                self.assertIn(f'verify: {compared} tensors', p.stdout)

    def test_a_universal_export_of_the_save_itself_reads_back_equal(self):
        tag = os.path.join(DATA, '0.19', 'w2_tp2')
        with open(tag + '_config.json') as f:
            config = json.load(f)
        for layout in LAYOUTS:
            with self.subTest(layout=layout):
                out = self.path(layout)
                p = run('export', f'{tag}_optim_{layout}', out, '--to', 'universal', *sizes(config)[:-2], '--set',
                        f"universal_checkpoint_info.original_vocab_size={config['model']['vocab']}")
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertTrue(os.path.isfile(os.path.join(out, 'mp_rank_00_model_states.pt')))
                params = {os.path.basename(d.rstrip('/')) for d in glob.glob(os.path.join(out, 'zero', '*', ''))}
                # w2_tp2 has 5984 parameter elements: three states of each.
                self.assertEqual(self.check_states(tag, config, *self.universal_states_of(out)), 3 * 5984)
                p = run('verify', f'{tag}_optim_{layout}', out, *sizes(config)[:-2])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                # 28 weights and their three states.
                self.assertIn('verify: 112 tensors, 23936 elements compared; same model', p.stdout)
                self.assertEqual(len(params), 28)

    def check_adamw_step(self, tag, config, params, groups):
        """The 0.14 save's states against its weights before and after the step; returns elements."""
        before, after = support.load(tag + '_full.pt'), support.load(tag + '_optim_full.pt')['model']
        layers = config['model']['layers']
        lr, (beta1, beta2), eps = groups[0]['lr'], groups[0]['betas'], groups[0]['eps']
        compared = 0
        for key, whole in after.items():
            # The run decayed the norms' weights too; its biases start at 0, where decay changes nothing.
            decay = 0.0 if key.endswith('bias') else groups[0]['weight_decay']
            for layer in range(layers) if key.startswith('decoder.layers.') else [None]:
                name = universal_name(key, layer or 0, layers)
                want, start = (whole, before[key]) if layer is None else (whole[layer], before[key][layer])
                got = params[name]
                self.assertEqual(support.differences(got['fp32'], want, f'fp32 {key} {layer}'), [])
                # torch.optim.AdamW's first step (step 1), as Megatron-Core ran it.
                stepped = start.clone().mul_(1 - lr * decay)
                denom = (got['exp_avg_sq'].sqrt() / math.sqrt(1 - beta2)).add_(eps)
                stepped.addcdiv_(got['exp_avg'], denom, value=-lr / (1 - beta1))
                self.assertEqual(support.differences(stepped, want, f'AdamW step of {key} {layer}'), [])
                grad = 1e-3 * torch.sin(1000 * start + 1)
                self.assertTrue(torch.allclose(got['exp_avg'], (1 - beta1) * grad, rtol=1e-5, atol=0), key)
                self.assertTrue(torch.allclose(got['exp_avg_sq'], (1 - beta2) * grad * grad, rtol=1e-4, atol=0), key)
                self.assertEqual(got['step'], groups[0]['step'])
                compared += want.numel()
        self.assertEqual(len(params), sum(layers if k.startswith('decoder.layers.') else 1 for k in after))
        return compared

    def test_megatron_core_0_14_fully_sharded_model_space_is_megatron_state(self):
        tag = os.path.join(DATA, '0.14', 'w2_tp2')
        config = config_of('0.14/w2_tp2')
        source = f'{tag}_optim_fully_sharded_model_space'
        groups = torch.load(os.path.join(source, 'common.pt'))['optimizer']['optimizer']['param_groups']
        elements = 0
        for tp, pp in ((1, 1), (2, 2)):
            with self.subTest(tp=tp, pp=pp):
                out = self.path(f'tp{tp}_pp{pp}')
                p = self.convert(source, config, out, tp, pp)
                self.assertIn('(fully_sharded_model_space): fp32 masters, exp_avg and exp_avg_sq', p.stdout + p.stderr)
                params, optimizer_state = self.universal_states(out, config)
                for got, want in zip(optimizer_state['param_groups'], groups):
                    for field in ('lr', 'betas', 'eps', 'weight_decay', 'wd_mult'):
                        self.assertEqual(got[field], want[field], field)
                elements += self.check_adamw_step(tag, config, params, groups)
                p = run('verify', source, out, *sizes(config)[:-2])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                # 28 weights and their three states.
                self.assertIn('verify: 112 tensors, 23936 elements compared; same model', p.stdout)
        # w2_tp2 has 5984 parameter elements, checked at each of the two layouts.
        self.assertEqual(elements, 2 * 5984)
        out = self.path('torch_dist')
        p = run('export', source, out, '--to', 'torch_dist', '--tp', 1, '--pp', 1,
                '--optimizer-layout', 'fully_reshardable', *sizes(config))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', source, out, *sizes(config)[:-2])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('verify: 112 tensors, 23936 elements compared; same model', p.stdout)
        print(f'\n[ states ] 0.14 fully_sharded_model_space: {elements} parameters\' fp32, exp_avg and '
              'exp_avg_sq reproduce Megatron-Core\'s AdamW step bit for bit')

    def test_megatron_core_0_14_dp_zero_gather_scatter_is_its_twins_state(self):
        config = config_of('0.14/w2_tp2')
        twin = os.path.join(DATA, '0.14', 'w2_tp2_optim_fully_sharded_model_space')
        source = os.path.join(DATA, '0.14', 'w2_tp2_optim_dp_zero_gather_scatter')
        p = run('verify', twin, source, *sizes(config)[:-2])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # 28 weights and their three states.
        self.assertIn('verify: 112 tensors, 23936 elements compared; same model', p.stdout)
        files = {}
        for name, folder in (('twin', twin), ('dp_zero', source)):
            out = self.path(name)
            p = self.convert(folder, config, out, 2, 2)
            files[name] = {os.path.basename(f): f for f in glob.glob(os.path.join(out, '*.pt'))}
        self.assertIn('(dp_zero_gather_scatter): fp32 masters, exp_avg and exp_avg_sq of 28 tensors, 2 param groups, '
                      'step 1.0', p.stdout + p.stderr)
        self.assertEqual(sorted(files['twin']), sorted(files['dp_zero']))
        self.assertEqual(len([f for f in files['twin'] if f.endswith('optim_states.pt')]), 4)
        for name, path in files['twin'].items():
            with open(path, 'rb') as a, open(files['dp_zero'][name], 'rb') as b:
                self.assertEqual(a.read(), b.read(), name)
        print(f'\n[ states ] 0.14 dp_zero_gather_scatter: verify equal to its twin; {len(files["twin"])} '
              'Megatron-DeepSpeed files at TP 2, PP 2 byte-equal to the twin\'s')

    def test_a_damaged_dp_zero_gather_scatter_save_is_refused(self):
        config = config_of('0.14/w2_tp2')
        source = self.path('damaged')
        shutil.copytree(os.path.join(DATA, '0.14', 'w2_tp2_optim_dp_zero_gather_scatter'), source)
        # TP rank 1's param_state item says its buffers hold 3969 elements; its tensors hold 3968.
        damage_pickled_item(os.path.join(source, '__1_1.distcp'), b'numel_unpaddedq$M\x80\x0f',
                            b'numel_unpaddedq$M\x81\x0f')
        out = self.path('refused')
        p = run('convert', '--to', 'deepspeed', source, out, '--tp', 1, '--pp', 1, *sizes(config))
        self.assertRefused(p, "optimizer.distributed.dp_group_idx_1.param_state/shard_0_1's grad buffer 0's 'param' "
                              "is tensor(float32, [3968])", out)
        self.assertIn('not a flat fp32 tensor of its numel_unpadded 3969; pass --weights-only', p.stderr)

if __name__ == '__main__':
    support.main()
