"""torchtitan checkpoints as a source: real torch 2.6 DCP saves of a torchtitan-named Llama
(tests/data/torchtitan: FSDP2 over 2 ranks with an uneven shard, FSDP x TP over 4 with strided
shards, one process, tied) read through rule set megatron-llama(-tied)'s torchtitan section.

The references were written by torch itself (NAME_full.pt: every tensor whole; NAME_logits.pt:
the model's logits after its AdamW step), and tests/fixtures/torchtitan_reference.py turns
torchtitan's tensors into HF's (q / k rows of each head from interleaved pairs to halves) and
computes LlamaForCausalLM's logits from them. Checked:

* `export --to hf` of every save (also one of the model nested under `model.` with its rotary
  table, as torchtitan saved it before mid-2025: the table is skipped, in a note) gives the reference's HF tensors bit for bit, and their logits
  are the torchtitan model's;
* `convert` to Megatron-DeepSpeed (FSDP x TP save -> TP 2, PP 2; FSDP2 -> TP 1, PP 2) carries
  the AdamW state: through `export --to universal`, every canonical tensor's fp32 master,
  exp_avg and exp_avg_sq equal the reference's (q / k / v fused per KV group, gate and up
  stacked), and the shards' param groups and step are the run's; `verify` finds the two the
  same model;
* `export --to torch_dist` (with the AdamW state) and from there `--to torchtitan` again: `verify`
  finds both the source's model;
* without the head count (torchtitan records no model config) `convert` is refused in one line
  naming --set num_attention_heads, nothing written; a head count the tensors cannot have is
  refused too; `inspect` shows the checkpoint as a plain DCP with that reason.

Run: /usr/bin/python3 tests/interop/test_torchtitan_source.py --reshard build/reshard
"""
import glob
import json
import os
import sys

import torch

import interop_support as support
from interop_support import FixtureTestCase

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'fixtures'))
import torchtitan_reference as ref  # noqa: E402

run = support.reshard
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'torchtitan')
# nested_w1: the model under `model.` with its rotary table (torchtitan before mid-2025)
SAVES = ['single_w1', 'single_tied_w1', 'fsdp2_w2', 'fsdp2_tp_w4', 'nested_w1']
HEADS = ('--set', 'num_attention_heads=4')


def step_folder(name):
    return os.path.join(DATA, name, 'step-1')


def config(name):
    with open(os.path.join(DATA, name + '_config.json')) as f:
        return json.load(f)


def reference(name):
    """NAME_full.pt with the model's keys at top level, as later torchtitan saves them."""
    full = torch.load(os.path.join(DATA, name + '_full.pt'))
    return {k[len('model.'):] if k.startswith('model.') else k: v for k, v in full.items()}


def canonical(hf, cfg):
    """{canonical name: tensor} of HF-named tensors (weights or a state laid out like them)."""
    heads, groups, hd = cfg['n_heads'], cfg['n_kv_heads'], cfg['head_dim']
    out = {'embedding.word_embeddings.weight': hf['model.embed_tokens.weight'],
           'final_layernorm.weight': hf['model.norm.weight']}
    if 'lm_head.weight' in hf and not cfg['tied']:
        out['lm_head.weight'] = hf['lm_head.weight']
    for b in range(cfg['n_layers']):
        p = f'model.layers.{b}.'
        q = hf[p + 'self_attn.q_proj.weight'].reshape(groups, heads // groups, hd, -1)
        k = hf[p + 'self_attn.k_proj.weight'].reshape(groups, 1, hd, -1)
        v = hf[p + 'self_attn.v_proj.weight'].reshape(groups, 1, hd, -1)
        c = f'layers.{b}.'
        out[c + 'self_attention.query_key_value.weight'] = torch.cat([q, k, v], 1).reshape(-1, q.shape[-1])
        out[c + 'self_attention.dense.weight'] = hf[p + 'self_attn.o_proj.weight']
        out[c + 'mlp.dense_h_to_4h.weight'] = torch.cat([hf[p + 'mlp.gate_proj.weight'], hf[p + 'mlp.up_proj.weight']])
        out[c + 'mlp.dense_4h_to_h.weight'] = hf[p + 'mlp.down_proj.weight']
        out[c + 'input_layernorm.weight'] = hf[p + 'input_layernorm.weight']
        out[c + 'post_attention_layernorm.weight'] = hf[p + 'post_attention_layernorm.weight']
    return out


def state_of(full, state):
    """The torchtitan-named tensors of optimizer state `state` of a reference."""
    prefix = 'optimizer.state.'
    return {k[len(prefix):-len(state) - 1]: v for k, v in full.items()
            if k.startswith(prefix) and k.endswith('.' + state)}


def universal_folder(name, layers):
    """The universal checkpoint's folder of canonical tensor `name`: its DeepSpeed module path
    (layer 1 the embedding, blocks from 2, then the final norm and the head)."""
    if name.startswith('layers.'):
        _, block, rest = name.split('.', 2)
        return f'{int(block) + 2}.{rest}'
    return {'embedding.word_embeddings.weight': '1.word_embeddings.weight',
            'final_layernorm.weight': f'{layers + 2}.weight',
            'lm_head.weight': f'{layers + 3}.lm_head.weight'}[name]


def assert_universal_states(test, uni, want, layers):
    """Checks that every state of `want` ({'fp32' | moment: {canonical name: tensor}}) is the universal
    export's at `uni`, its vocabulary padding rows aside; returns how many tensors were compared."""
    compared = 0
    for canon in want['fp32']:
        folder = os.path.join(uni, 'zero', universal_folder(canon, layers))
        for state, tensors in want.items():
            got = torch.load(os.path.join(folder, state + '.pt'))['param']
            rows = tensors[canon].shape[0]  # the vocabulary's padding rows follow
            test.assertEqual(support.differences(got[:rows], tensors[canon], canon + ' ' + state), [])
            compared += 1
    return compared


class TorchtitanSourceTest(FixtureTestCase):

    def test_hf_export_gives_the_reference_tensors_and_logits(self):
        for name in SAVES:
            with self.subTest(save=name):
                cfg = config(name)
                out = self.path('hf_' + name)
                p = run('export', step_folder(name), out, '--to', 'hf', '--format', 'pt', *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got = torch.load(os.path.join(out, 'pytorch_model.bin'))
                want = ref.torchtitan_to_hf(reference(name), cfg)
                if cfg['tied']:
                    self.assertNotIn('lm_head.weight', got)
                    got['lm_head.weight'] = got['model.embed_tokens.weight']
                self.assertEqual(sorted(got), sorted(want))
                for key in want:
                    self.assertEqual(support.differences(got[key], want[key], key), [])
                logits = torch.load(os.path.join(DATA, name + '_logits.pt'))
                mine = ref.hf_forward(got, cfg, logits['input_ids'])
                self.assertLess((mine - logits['logits']).abs().max().item(), 1e-5)
                with open(os.path.join(out, 'config.json')) as f:
                    written = json.load(f)
                self.assertEqual((written['num_attention_heads'], written['num_key_value_heads'],
                                  written['intermediate_size'], written['rope_theta']),
                                 (cfg['n_heads'], cfg['n_kv_heads'], cfg['ffn'], cfg['rope_theta']))

    def test_convert_carries_the_adamw_state(self):
        for name, layout in (('fsdp2_tp_w4', ('--tp', 2, '--pp', 2)), ('fsdp2_w2', ('--tp', 1, '--pp', 2)),
                             ('nested_w1', ('--tp', 1, '--pp', 1))):
            with self.subTest(save=name):
                cfg = config(name)
                ms = self.path('ms_' + name, 'global_step1')
                p = run('convert', '--to', 'deepspeed', step_folder(name), ms, *layout, *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('dataloader, lr_scheduler, train_state not carried', p.stdout + p.stderr)
                p = run('verify', step_folder(name), ms, *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                uni = self.path('uni_' + name)
                p = run('export', ms, uni, '--to', 'universal')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                full = reference(name)
                want = {'fp32': canonical(ref.torchtitan_to_hf(full, cfg), cfg)}
                for state in ('exp_avg', 'exp_avg_sq'):
                    want[state] = canonical(ref.torchtitan_to_hf(state_of(full, state), cfg), cfg)
                compared = assert_universal_states(self, uni, want, cfg['n_layers'])
                self.assertEqual(compared, 3 * len(want['fp32']))
                shard = torch.load(sorted(glob.glob(os.path.join(ms, '*optim_states.pt')))[0])
                inner = shard['optimizer_state_dict']['base_optimizer_state']
                self.assertEqual([(g['lr'], g['weight_decay'], tuple(g['betas'])) for g in inner['param_groups']],
                                 [(1e-3, 0.1, (0.9, 0.95))] * 2)
                self.assertEqual({int(s['step']) for s in inner['state'].values()}, {1})

    def test_to_torch_dist_and_back_is_the_same_model(self):
        """torchtitan -> Megatron-Core torch_dist (TP 1, PP 2, the AdamW state as
        fully_reshardable) -> torchtitan again (FSDP2 over 2): verify finds each the source's
        model, weights and optimizer state."""
        src = step_folder('fsdp2_w2')
        td = self.path('torch_dist')
        p = run('export', src, td, '--to', 'torch_dist', '--tp', 1, '--pp', 2, *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        back = self.path('back')
        p = run('export', td, back, '--to', 'torchtitan', '--dp-shard', 2)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for other in (td, os.path.join(back, 'step-1')):
            with self.subTest(other=other):
                p = run('verify', src, other, *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                # Both sides have their optimizer state, so verify compares it too.
                self.assertEqual((p.stdout + p.stderr).count('weights and optimizer state'), 2, p.stderr)

    def test_the_head_count_is_needed_and_checked(self):
        out = self.path('no_heads')
        p = run('convert', '--to', 'deepspeed', step_folder('fsdp2_w2'), out, '--tp', 1, '--pp', 1)
        self.assertRefused(p, '--set num_attention_heads=N', out)
        self.assertIn('records no model config', p.stderr)
        p = run('inspect', step_folder('fsdp2_w2'))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('no rule set (the torchtitan checkpoint records no model config', p.stdout)
        p = run('convert', '--to', 'deepspeed', step_folder('fsdp2_w2'), out, '--tp', 1, '--pp', 1, '--set', 'num_attention_heads=3')
        self.assertNotEqual(p.returncode, 0)
        self.assertFalse(os.path.exists(out))
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)


if __name__ == '__main__':
    support.main()
