"""Changing the DP size of non-pipeline DeepSpeed checkpoints (HF Trainer style).

For ZeRO stages 1, 2 and 3, bf16 and fp16, odd DP sizes, DP >= 10 and groups
whose alignment padding exceeds a partition: reshard converts A (DP a) to B
(DP b); the independent oracle reads B back as the canonical model and
optimizer state and finds no structural problem; converting B back to DP a
gives A's files bit for bit. Without ZeRO (fp32, the torch optimizer's state
inside mp_rank_00) a DP change carries the state and rewrites dp_world_size.
Changing TP or PP is refused with one line.

Run: /usr/bin/python3 tests/interop/test_nonpipe_convert.py --reshard build/reshard
"""
import os
import tempfile
import unittest

import torch

from fixtures import deepspeed_nonpipe as dn
from fixtures import megatron_fixture as mf

import interop_support as support
from interop_support import differences

# (zero stage, dtype, sub_group_size, DP a, DP b)
CASES = [
    (1, 'bf16', None, 3, 16), (1, 'fp16', None, 16, 5), (1, 'bf16', None, 4, 12),
    (2, 'bf16', None, 12, 3), (2, 'fp16', None, 5, 7), (2, 'bf16', None, 1, 4),
    (3, 'bf16', None, 3, 16), (3, 'bf16', 40, 3, 5), (3, 'fp16', 3, 12, 4), (3, 'bf16', 40, 16, 1),
]


reshard = support.reshard


class NonPipelineTest(unittest.TestCase):

    def setUp(self):
        mf.install_pickle_shims()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def convert(self, src, out, dp):
        """Converts the root `src` into the root `out` (a root in gives a root out)."""
        p = reshard('convert', src, out, '--tp', 1, '--pp', 1, '--dp', dp, '-q')
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_dp_changes_keep_every_optimizer_state(self):
        for stage, dtype, sub_group_size, dp_a, dp_b in CASES:
            with self.subTest(stage=stage, dtype=dtype, sub_group_size=sub_group_size, a=dp_a, b=dp_b):
                cfg = dn.NonPipeConfig(zero_stage=stage, dtype=dtype, dp=dp_a, sub_group_size=sub_group_size)
                a, b, a2 = (os.path.join(self.tmp, f'{x}{stage}{dp_a}{dp_b}{dtype}') for x in 'ab' 'c')
                dn.write_nonpipe(a, cfg)
                self.convert(a, b, dp_b)
                self.assertEqual(dn.compare_nonpipe(dn.load_nonpipe(b), cfg), [])
                self.assertEqual(dn.structural_problems_nonpipe(b), [])
                self.assertIn('same model', reshard('verify', a, b).stdout)
                self.convert(b, a2, dp_a)
                tag_a, tag_a2 = os.path.join(a, 'global_step10'), os.path.join(a2, 'global_step10')
                self.assertEqual(sorted(os.listdir(tag_a2)), sorted(os.listdir(tag_a) + [support.MANIFEST]))
                for name in os.listdir(tag_a):
                    diffs = differences(torch.load(os.path.join(tag_a, name)),
                                        torch.load(os.path.join(tag_a2, name)), name)
                    self.assertEqual(diffs, [])

    def test_without_zero_the_torch_state_is_carried(self):
        """ZeRO stage 0, fp32: nothing is partitioned over DP, so B is A with B's dp_world_size;
        verify compares the optimizer state too, and A comes back bit for bit."""
        for dp_a, dp_b in ((3, 7), (1, 4), (5, 1)):
            with self.subTest(a=dp_a, b=dp_b):
                cfg = dn.NonPipeConfig(zero_stage=0, dtype='fp32', dp=dp_a)
                a, b, a2 = (os.path.join(self.tmp, f'z0{x}{dp_a}{dp_b}') for x in 'abc')
                dn.write_nonpipe(a, cfg)
                lint = reshard('lint', a)
                self.assertEqual(lint.returncode, 0, lint.stdout)
                self.assertIn('optimizer state inside the mp_rank files is carried unchanged', lint.stdout)
                self.convert(a, b, dp_b)
                ckpt = dn.load_nonpipe(b)
                self.assertEqual(dn.compare_nonpipe(ckpt, cfg), [])
                self.assertEqual(dn.structural_problems_nonpipe(b), [])
                self.assertEqual(ckpt.meta['dp_world_size'], dp_b)
                before, after = (torch.load(os.path.join(x, 'global_step10', 'mp_rank_00_model_states.pt'))
                                 for x in (a, b))
                self.assertEqual(differences(before['optimizer'], after['optimizer'], 'optimizer'), [])
                verify = reshard('verify', a, b)
                self.assertIn('same model', verify.stdout)
                self.assertRegex(verify.stdout, r'verify: \d+ tensors')
                self.convert(b, a2, dp_a)
                self.assertEqual(differences(before, torch.load(os.path.join(a2, 'global_step10',
                                                                             'mp_rank_00_model_states.pt'))), [])
        # A moment that differs is found.
        sd = torch.load(os.path.join(b, 'global_step10', 'mp_rank_00_model_states.pt'))
        sd['optimizer']['state'][2]['exp_avg_sq'].view(-1)[0] += 1
        torch.save(sd, os.path.join(b, 'global_step10', 'mp_rank_00_model_states.pt'))
        p = reshard('verify', a, b)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn('differs: mp_rank_00 optimizer.state.2.exp_avg_sq', p.stdout)

    def test_layout_changes_are_refused(self):
        for stage in (1, 3):
            with self.subTest(stage=stage):
                src = os.path.join(self.tmp, f'src{stage}')
                dn.write_nonpipe(src, dn.NonPipeConfig(zero_stage=stage, dp=2))
                out = os.path.join(self.tmp, f'out{stage}', 'global_step10')
                p = reshard('convert', src, out, '--tp', 2, '--pp', 1, '--dp', 4)
                self.assertEqual(p.returncode, 2)
                self.assertEqual(len(p.stderr.splitlines()), 1, p.stderr)
                self.assertRegex(p.stderr, r'keeps its (tensor-parallel|model) layout; pass --tp 1 --pp 1')
                self.assertFalse(os.path.exists(os.path.dirname(out)))

    def test_lint_and_a_perturbed_moment(self):
        src = os.path.join(self.tmp, 'src')
        dn.write_nonpipe(src, dn.NonPipeConfig(zero_stage=3, dp=3))
        self.assertEqual(reshard('lint', src).returncode, 0)
        out = os.path.join(self.tmp, 'out')
        self.convert(src, out, 4)
        shard = os.path.join(out, 'global_step10', 'bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt')
        sd = torch.load(shard)
        sd['optimizer_state_dict']['optimizer_state_dict']['state'][0]['exp_avg'][0] += 1
        torch.save(sd, shard)
        p = reshard('verify', src, out)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn('differs: optimizer exp_avg model.embed_tokens.weight', p.stdout)


if __name__ == '__main__':
    support.main()
