"""Self-check of the torchtitan saves in tests/data/torchtitan/ (tests/fixtures/torchtitan_save.py,
real torch 2.6) against a forward in Hugging Face's convention (tests/fixtures/torchtitan_reference.py).

For every save: the HF-convention forward of the converted NAME_full.pt weights gives NAME_logits.pt's
logits (the ones torch 2.6 computed with the torchtitan-named model after the step) within 1e-5 —
which proves the per-head q/k row permutation the reshard importer must implement (and without it
the logits differ); the keys are the ones the README lists (model keys at top level, the flat AdamW
state and param_groups under optimizer., lr_scheduler., dataloader., train_state.); with --reshard,
`reshard inspect` lists every key with the chunks the mesh implies.

Runs with /usr/bin/python3 (torch 1.13), no chroot: /usr/bin/python3 tests/interop/test_torchtitan_fixture.py
[--reshard build/reshard], PYTHONPATH=tests.
"""
import json
import os
import re
import subprocess
import sys
import unittest

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fixtures import torchtitan_reference as ref  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'data', 'torchtitan')
SAVES = ['fsdp2_w2', 'fsdp2_tp_w4', 'single_w1', 'single_tied_w1']
RESHARD = None
ADAMW_GROUP = {'lr', 'initial_lr', 'betas', 'eps', 'weight_decay', 'amsgrad', 'foreach', 'maximize',
               'capturable', 'differentiable', 'fused'}


def load(name, suffix):
    return torch.load(os.path.join(DATA, f'{name}_{suffix}.pt'), map_location='cpu')


def config(name):
    with open(os.path.join(DATA, f'{name}_config.json')) as f:
        return json.load(f)


def model_keys(cfg):
    keys = ['tok_embeddings.weight', 'norm.weight', 'output.weight']
    for i in range(cfg['n_layers']):
        keys += [f'layers.{i}.{k}' for k in ref._LAYER_NAMES]
    return keys


class TorchtitanFixtureTest(unittest.TestCase):

    def test_hf_forward_of_converted_weights_gives_the_saved_logits(self):
        for name in SAVES:
            with self.subTest(name):
                cfg, full, want = config(name), load(name, 'full'), load(name, 'logits')
                self.assertEqual(list(want['input_ids'].shape), [2, 8])
                got = ref.hf_forward(ref.torchtitan_to_hf(full, cfg), cfg, want['input_ids'])
                self.assertEqual(got.shape, want['logits'].shape)
                err = (got - want['logits']).abs().max().item()
                self.assertTrue(torch.allclose(got, want['logits'], rtol=1e-5, atol=1e-5), f'{name}: max {err}')
                # the loss the save's run computed with these parameters
                loss = F.cross_entropy(got.reshape(-1, cfg['vocab']), want['labels'].reshape(-1)).item()
                self.assertAlmostEqual(loss, want['loss_after'], delta=1e-5)
                self.assertLess(want['loss_after'], want['loss_before'])
                self.assertLess(want['loss_after_next_step'], want['loss_after'])
                print(f'{name}: logits within {err:.1e}, loss {loss:.6f}', file=sys.stderr)

    def test_without_the_permutation_the_logits_differ(self):
        for name in SAVES:
            cfg, full, want = config(name), load(name, 'full'), load(name, 'logits')
            renamed = {ref.hf_name(k): v for k, v in full.items() if ref.hf_name(k)}
            if cfg['tied']:
                renamed['lm_head.weight'] = renamed['model.embed_tokens.weight']
            got = ref.hf_forward(renamed, cfg, want['input_ids'])
            self.assertGreater((got - want['logits']).abs().max().item(), 1e-2, name)

    def test_permutation_round_trips(self):
        w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)
        halves = ref.interleaved_to_halves(w, 4, 8)
        self.assertTrue(torch.equal(halves[1], w[2]))      # head 0: HF row 1 = pair 1's first
        self.assertTrue(torch.equal(halves[4], w[1]))      # HF row hd/2 = pair 0's second
        self.assertTrue(torch.equal(halves[8 + 5], w[8 + 3]))
        self.assertTrue(torch.equal(ref.halves_to_interleaved(halves, 4, 8), w))

    def test_keys_and_objects(self):
        for name in SAVES:
            with self.subTest(name):
                cfg, full = config(name), load(name, 'full')
                params = model_keys(cfg)
                owned = [k for k in params if not (cfg['tied'] and k == 'output.weight')]
                for k in params:  # a tied head is saved under both names (one parameter)
                    self.assertIn(k, full)
                    self.assertEqual(full[k].dtype, torch.float32)
                for k in owned:
                    for s in ('exp_avg', 'exp_avg_sq'):
                        self.assertEqual(full[f'optimizer.state.{k}.{s}'].shape, full[k].shape)
                    self.assertEqual(full[f'optimizer.state.{k}.step'].item(), 1.0)
                    groups = {key.rsplit('.', 1)[1] for key in full if key.startswith(f'optimizer.param_groups.{k}.')}
                    self.assertEqual(groups, ADAMW_GROUP)
                    self.assertEqual(full[f'optimizer.param_groups.{k}.lr'], 1e-3)
                    self.assertEqual(full[f'optimizer.param_groups.{k}.weight_decay'], 0.1)
                    self.assertEqual(tuple(full[f'optimizer.param_groups.{k}.betas']), (0.9, 0.95))
                if cfg['tied']:
                    self.assertTrue(torch.equal(full['output.weight'], full['tok_embeddings.weight']))
                    self.assertFalse([k for k in full if k.startswith('optimizer.') and '.output.weight.' in k])
                self.assertEqual(full['train_state.step'], 1)
                self.assertEqual(full['lr_scheduler.last_epoch'], 1)
                dp = cfg['mesh']['shape'][0] if cfg['mesh'] else 1
                self.assertEqual(full['dataloader.world_size'], dp)
                self.assertEqual({k for k in full if k.startswith('dataloader.dp_rank_')},
                                 {f'dataloader.dp_rank_{r}' for r in range(dp)})
                expect = set(params) | {k for k in full if re.match(
                    r'(optimizer\.(state|param_groups)|lr_scheduler|dataloader|train_state)\.', k)}
                self.assertEqual(set(full), expect)
                self.assertFalse([k for k in full if 'freqs_cis' in k])

    def test_reshard_inspect_lists_every_key_and_chunk(self):
        if RESHARD is None:
            self.skipTest('no --reshard given')
        for name in SAVES:
            with self.subTest(name):
                cfg, full = config(name), load(name, 'full')
                p = subprocess.run([RESHARD, 'inspect', '--rules', 'none', os.path.join(DATA, name, 'step-1')],
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                chunks = {m[1]: int(m[2]) for m in re.finditer(r'^  (\S+) \w+\[[\d, ]*\], (\d+) chunks?:',
                                                                p.stdout, re.M)}
                tensors = {k for k, v in full.items() if isinstance(v, torch.Tensor)}
                self.assertEqual(set(chunks), tensors)
                for k in set(full) - tensors:
                    self.assertRegex(p.stdout, rf'(?m)^  {re.escape(k)}$')
                world = cfg['world']
                for k in model_keys(cfg):
                    if name == 'fsdp2_tp_w4':  # norms: Shard(0) on dp, replicated on tp
                        want = 2 if k.endswith('norm.weight') else 4
                    else:
                        want = world
                    self.assertEqual(chunks[k], want, k)
                    if k in chunks and f'optimizer.state.{k}.exp_avg' in chunks:
                        self.assertEqual(chunks[f'optimizer.state.{k}.exp_avg'], want, k)


def main(argv):
    global RESHARD
    argv = list(argv)
    for i, a in enumerate(argv):
        if a.startswith('--reshard='):
            RESHARD = a.split('=', 1)[1]
            del argv[i]
            break
        if a == '--reshard' and i + 1 < len(argv):
            RESHARD = argv[i + 1]
            del argv[i:i + 2]
            break
    program = unittest.main(argv=argv, exit=False, verbosity=2)
    return 0 if program.result.wasSuccessful() else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv))
