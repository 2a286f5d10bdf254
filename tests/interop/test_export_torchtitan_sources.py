"""`export --to torchtitan` from the other formats that hold a Llama: a Hugging Face folder and a
Megatron-Core `torch_dist` checkpoint, loaded by real torch 2.6 (the Debian trixie chroot,
torch2_chroot.py; skipped with one line when it cannot be built) into torchtitan's model
(tests/fixtures/torchtitan_save.py) in one process and under FSDP2 over 2 ranks.

Checked:

* an HF LlamaForCausalLM folder written here (not by reshard) from torch's own save fsdp2_w2 (its
  tensors renamed, q / k rows turned from interleaved pairs into halves, as
  tests/fixtures/torchtitan_reference.py converts) exported at --dp-shard 1 and 2: `dcp.load` gives
  every model tensor of the save bit for bit, and the model the save's logits and loss;
* the real Megatron-Core 0.19 SwiGLU save with its AdamW state (tests/data/megatron-core,
  w2_tp2_swiglu_optim_fully_reshardable) exported at --dp-shard 1 and 2: `dcp.load` gives every
  parameter, exp_avg and exp_avg_sq as Megatron-Core's whole tensors (`_optim_full.pt`) make them
  under torchtitan's keys (fused QKV split per query group, q / k rows interleaved, linear_fc1
  split into w1 / w3), its step and hyperparameters; the loaded model's logits are the HF forward's
  of Megatron-Core's tensors (torchtitan_reference.hf_forward), and one more AdamW step gives the
  same loss in one process and on 2 ranks.

Run: /usr/bin/python3 tests/interop/test_export_torchtitan_sources.py --reshard build/reshard
"""
import json
import os

import torch

from fixtures import torchtitan_reference as reference
import interop_support as support
from interop_support import FixtureTestCase
from megatron_core_data import DATA as MC_DATA, config_of, llama_hf_tensors, sizes
from test_export_torchtitan import DATA, load_in_torch2
from test_import_hf import write_folder

run = support.reshard
MC_SAVE = '0.19/w2_tp2_swiglu'


def torchtitan_config(name):
    """The fsdp2_w2-style config of torchtitan save `name` (tests/data/torchtitan)."""
    with open(os.path.join(DATA, name + '_config.json')) as f:
        return json.load(f)


def hf_llama_config(cfg):
    """config.json of the LlamaForCausalLM `cfg` (a torchtitan_save CONFIG) is."""
    return {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': cfg['dim'],
            'intermediate_size': cfg['ffn'], 'num_hidden_layers': cfg['n_layers'],
            'num_attention_heads': cfg['n_heads'], 'num_key_value_heads': cfg['n_kv_heads'],
            'max_position_embeddings': cfg['max_seq_len'], 'rms_norm_eps': cfg['norm_eps'],
            'rope_theta': cfg['rope_theta'], 'hidden_act': 'silu', 'tie_word_embeddings': cfg['tied'],
            'vocab_size': cfg['vocab'], 'torch_dtype': 'float32'}


class ExportTorchtitanSourcesTest(FixtureTestCase):

    def export(self, src, dp, *extra):
        """Exports `src` at --dp-shard dp; returns {host step folder: folder inside the chroot}."""
        out = self.path(f'tt{dp}')
        p = run('export', src, out, '--to', 'torchtitan', '--dp-shard', dp, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        [step] = [d for d in os.listdir(out) if d.startswith('step-')]
        return {os.path.join(out, step): f'/ckpt{dp}'}

    def export_and_load(self, src, run_spec, extra=(), binds=None):
        """Exports `src` (with the options `extra`) at --dp-shard 1 and 2 and loads each into
        torchtitan's model on as many ranks (and `binds`, {host folder: inside}, mounted)."""
        binds = dict(binds or {}, **self.export(src, 1, *extra), **self.export(src, 2, *extra))
        loads = [['dp_shard2_on_2', '/ckpt2', [2]], ['dp_shard1_one_process', '/ckpt1', []]]
        got = load_in_torch2(self, dict(run_spec, loads=loads), binds)
        for label, (r, _) in got.items():
            self.assertEqual((r['differ'], r['extra']), ([], []), label)
        return got

    def test_hf_llama_folder(self):
        cfg = torchtitan_config('fsdp2_w2')
        whole = torch.load(os.path.join(DATA, 'fsdp2_w2_full.pt'))
        folder = self.path('hf')
        write_folder(folder, reference.torchtitan_to_hf(whole, cfg), hf_llama_config(cfg))
        got = self.export_and_load(folder, {'config': {}, 'want': '/data/fsdp2_w2_full.pt', 'optimizer': False})
        want = torch.load(os.path.join(DATA, 'fsdp2_w2_logits.pt'))
        for label, (r, out) in got.items():
            self.assertEqual(r['compared'], len(reference.torchtitan_to_hf(whole, cfg)))
            self.assertLess((out['logits'] - want['logits']).abs().max().item(), 1e-5, label)
            self.assertAlmostEqual(r['loss_forward'], want['loss_after'], delta=1e-6, msg=label)
            print(f'\n[ torch 2.6 ] HF folder -> torchtitan, {label}: {r["compared"]} tensors equal to fsdp2_w2\'s, '
                  f'its logits, loss {r["loss_forward"]:.7f} (the save\'s: {want["loss_after"]:.7f})')

    def test_megatron_core_torch_dist_with_its_adamw_state(self):
        m = config_of(MC_SAVE)['model']
        cfg = dict(dim=m['hidden'], n_layers=m['layers'], n_heads=m['heads'], n_kv_heads=m['groups'],
                   head_dim=m['hidden'] // m['heads'], ffn=m['ffn'], vocab=m['vocab'], norm_eps=1e-5,
                   rope_theta=10000.0, max_seq_len=16, tied=False)
        full = torch.load(os.path.join(MC_DATA, MC_SAVE + '_optim_full.pt'))['optimizer']
        want = reference.hf_to_torchtitan(llama_hf_tensors(full['param'], m), cfg)
        for state in ('exp_avg', 'exp_avg_sq'):
            moments = reference.hf_to_torchtitan(llama_hf_tensors(full[state], m), cfg)
            want.update({f'optimizer.state.{k}.{state}': t for k, t in moments.items()})
        # Megatron-Core's AdamW after its one step, as its param groups record it; initial_lr (which
        # torchtitan's LR scheduler adds before loading) its lr
        groups = {'lr': 0.001, 'betas': (0.9, 0.999), 'eps': 1e-08, 'weight_decay': 0.01, 'amsgrad': False,
                  'foreach': None, 'maximize': False, 'capturable': False, 'differentiable': False, 'fused': None,
                  'initial_lr': 0.001}
        for key in [k for k in want if not k.startswith('optimizer.')]:
            want[f'optimizer.state.{key}.step'] = torch.tensor(1.0)
            want.update({f'optimizer.param_groups.{key}.{field}': v for field, v in groups.items()})
        os.makedirs(self.path('want'))
        torch.save(want, self.path('want', 'want.pt'))
        src = os.path.join(MC_DATA, MC_SAVE + '_optim_fully_reshardable')
        got = self.export_and_load(src, {'config': {k: v for k, v in cfg.items() if k != 'tied'},
                                         'want': '/want/want.pt', 'optimizer': True, 'grad_dp': 2},
                                   sizes(config_of(MC_SAVE)), {self.path('want'): '/want'})
        losses = []
        for label, (r, out) in got.items():
            self.assertEqual(r['compared'], len(want))
            logits = reference.hf_forward(llama_hf_tensors(full['param'], m), cfg, out['input_ids'])
            self.assertLess((out['logits'] - logits).abs().max().item(), 1e-5, label)
            losses.append(r['loss_after_next_step'])
            print(f'\n[ torch 2.6 ] Megatron-Core torch_dist -> torchtitan, {label}: {r["compared"]} keys equal to '
                  f'Megatron-Core\'s (parameters, moments, step, param groups), logits the HF forward\'s; next '
                  f'step\'s loss {r["loss_after_next_step"]:.7f}')
        self.assertLess(max(losses) - min(losses), 1e-6, losses)


if __name__ == '__main__':
    support.main()
