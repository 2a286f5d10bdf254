"""The distributed optimizer's state of Megatron-LM's `torch` format: `distrib_optim.pt` beside each
model_optim_rng.pt (engine/formats/megatron_core/torch/distrib_optim.h, engine/formats/megatron_core/common/megatron_gathered.h),
written by `export --to megatron` and read by the Megatron-LM torch source.

Checked:

* a Megatron-DeepSpeed fixture with BF16_Optimizer / ZeRO state (TP 2, PP 2) exported --to megatron
  at TP 2, PP 2, DP 2 holds per rank what DistributedOptimizer.save_parameter_state writes (torch.load
  of the file: `buckets_coalesced`, one grad buffer keyed by (param dtype, grad dtype), flat fp32
  `param`, `exp_avg`, `exp_avg_sq` of `numel_unpadded` elements) and model_optim_rng.pt's `optimizer`
  entry the param groups without `params`; converted back to Megatron-DeepSpeed, `verify` finds every
  weight and optimizer state equal to the source's (the scheduler and sample counter, which the
  Megatron-LM torch source does not read back, differ as they do through torch_dist);
* the real Megatron-Core saves (0.19 `dp_reshardable`, 0.14 `dp_zero_gather_scatter`) exported --to
  megatron and that --to torch_dist again: `verify` equal to the save, weights and states;
* a damaged distrib_optim.pt (a buffer of the wrong numel) is refused in one line naming the file
  and --weights-only, and --weights-only converts the weights.

Run: /usr/bin/python3 tests/interop/test_megatron_distrib_optim.py --reshard build/reshard
"""
import glob
import os
import re

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
from megatron_core_data import config_of
from test_torch_dist_import import DATA, sizes

run = support.reshard


def compared(stdout):
    """The tensors verify says it compared."""
    return int(re.search(r'verify: (\d+) tensors', stdout).group(1))


class MegatronDistribOptimTest(FixtureTestCase):
    def test_a_megatron_deepspeed_checkpoint_with_state_goes_to_megatron_and_back(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        out = self.path('mlm')
        p = run('export', src, out, '--to', 'megatron', '--tp', 2, '--pp', 2, '--dp', 2)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('distrib_optim.pt beside each model_optim_rng.pt', p.stdout + p.stderr)
        files = sorted(glob.glob(os.path.join(out, 'iter_0000010', 'mp_rank_*', 'distrib_optim.pt')))
        self.assertEqual(len(files), 4)
        for path in files:
            state = torch.load(path)
            self.assertEqual(list(state), ['buckets_coalesced', 0], path)
            self.assertIs(state['buckets_coalesced'], True)
            (dtypes, buffer), = state[0].items()
            self.assertEqual(dtypes, (torch.bfloat16, torch.float32))
            n = buffer['numel_unpadded']
            for key in ('param', 'exp_avg', 'exp_avg_sq'):
                self.assertEqual((buffer[key].dtype, tuple(buffer[key].shape)), (torch.float32, (n,)), key)
            rank = torch.load(os.path.join(os.path.dirname(path), 'model_optim_rng.pt'))
            groups = rank['optimizer']['optimizer']['param_groups']
            self.assertEqual([g['wd_mult'] for g in groups], [1.0, 0.0])
            self.assertEqual({g['step'] for g in groups}, {10.0})
            self.assertTrue(all('params' not in g for g in groups))
            # The parameters' elements, 64-aligned, fill the buffer: the state is not all padding.
            weights = sum(v.numel() for k, v in rank['model'].items() if torch.is_tensor(v) and v.is_floating_point())
            self.assertTrue(weights <= n < weights + 64 * len(rank['model']), (weights, n))
        back = self.path('back')
        p = run('convert', '--to', 'deepspeed', out, back, '--tp', 2, '--pp', 2, '--dp', 1, '--no-update-latest', '--vocab-size', 100)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("Megatron-LM's distributed optimizer (distrib_optim.pt): fp32 masters, exp_avg and exp_avg_sq "
                      "of 39 tensors, 2 param groups, step 10.0", p.stdout + p.stderr)
        p = run('verify', src, back)
        # The learning-rate scheduler travels (Megatron-LM's lr_scheduler entry); the sample counter does not.
        self.assertEqual(re.findall(r'differs: (.*)', p.stdout), ['global_samples differs'])
        self.assertNotIn('elements differ', p.stdout)
        self.assertEqual(compared(p.stdout), 4 * 39, p.stdout)  # 39 weights, each with three states
        p = run('verify', src, out)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(compared(p.stdout), 4 * 39, p.stdout)
        print(f'\n[ fixture ] verify: {compared(p.stdout)} tensors equal, weights and optimizer state, through '
              'distrib_optim.pt at TP 2, PP 2, DP 2')

    def test_the_transformer_engine_spec_gets_the_weights_only(self):
        # Its layers register the fused input norm after linear_proj: another buffer order than the
        # local spec's, which the rule sets give.
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=1, pp=1, dp=1, optimizer='bf16_zero'))
        out = self.path('te')
        p = run('export', src, out, '--to', 'megatron', '--tp', 1, '--pp', 1, '--layer-spec', 'te')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("not for the Transformer Engine spec's", p.stdout + p.stderr)
        self.assertEqual(glob.glob(os.path.join(out, '*', '*', 'distrib_optim.pt')), [])

    def test_megatron_core_saves_go_to_megatron_and_torch_dist_with_their_state(self):
        # A Megatron-LM torch folder at PP > 1 without args does not say whether its last stage's
        # output layer is a head of its own or a tied embedding's copy: the rule set says it.
        for name, layout, tp, pp, rules, weights in (('0.19/w2_tp2_swiglu', 'dp_reshardable', 2, 2, 'megatron-llama', 15),
                                                     ('0.14/w2_tp2', 'dp_zero_gather_scatter', 2, 1, 'megatron-core-gpt', 28)):
            with self.subTest(save=name):
                config = config_of(name)
                source = os.path.join(DATA, f'{name}_optim_{layout}')
                mlm = self.path(name.replace('/', '_') + '_mlm')
                p = run('export', source, mlm, '--to', 'megatron', '--tp', tp, '--pp', pp, *sizes(config))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertEqual(len(glob.glob(os.path.join(mlm, 'iter_*', 'mp_rank_*', 'distrib_optim.pt'))), tp * pp)
                td = self.path(name.replace('/', '_') + '_td')
                p = run('export', mlm, td, '--to', 'torch_dist', '--tp', 1, '--pp', 2, '--rules', rules, *sizes(config))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                for out in (mlm, td):
                    p = run('verify', source, out, '--rules', rules, *sizes(config)[:-2])
                    self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                    self.assertRegex(p.stdout, r'verify: \d+ tensors, \d+ elements compared; same model')
                    # Every weight with its three states.
                    self.assertEqual(compared(p.stdout), 4 * weights, p.stdout)

    def test_a_damaged_distrib_optim_is_refused(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=1, pp=1, dp=1, optimizer='bf16_zero'))
        mlm = self.path('mlm')
        p = run('export', src, mlm, '--to', 'megatron', '--tp', 1, '--pp', 1)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        path, = glob.glob(os.path.join(mlm, 'iter_*', 'mp_rank_00', 'distrib_optim.pt'))
        state = torch.load(path)
        buffer = state[0][(torch.bfloat16, torch.float32)]
        n = buffer['numel_unpadded']
        for key in ('param', 'exp_avg', 'exp_avg_sq'):
            buffer[key] = buffer[key][:n - 64].clone()
        buffer['numel_unpadded'] = n - 64
        torch.save(state, path)
        out = self.path('refused')
        p = run('convert', '--to', 'deepspeed', mlm, out, '--tp', 1, '--pp', 1, '--vocab-size', 100)
        self.assertRefused(p, f"distrib_optim.pt's grad buffers (bfloat16 {n - 64}) are not those its rank's "
                              f"parameters in registration order lay out (bfloat16 {n})", out)
        self.assertIn('pass --weights-only', p.stderr)
        p = run('convert', '--to', 'deepspeed', mlm, out, '--tp', 1, '--pp', 1, '--vocab-size', 100, '--weights-only')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(glob.glob(os.path.join(out, '*optim_states.pt')), [])


if __name__ == '__main__':
    support.main()
