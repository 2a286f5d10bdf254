"""`reshard convert` of DeepSpeed MoE checkpoints to another EP and DP size (TP and PP kept).

Each case writes a fixture A with the MoE generator (tests/fixtures/deepspeed_moe.py), converts it
to B, and checks B three ways, none of which uses reshard to read it:

* its structure is what the generator writes at B's layout, exactly: the same files, keys, shapes,
  partition counts, paddings, fragment addresses (EP-local names), group names ``ep_size_{EP}``,
  the module's ``_metadata`` (EP rank 0's expert modules) -- with the module tensors compact
  (``shared_storage=False``), as reshard writes them;
* the oracle (``load_moe``) reads B back as the canonical model: every weight, fp32 master,
  exp_avg and exp_avg_sq bit for bit;
* converting B back to A's layout gives A's structure again, and the same values (round trip).

The real non-pipeline save is converted too, and verify finds the same model (weights and every
optimizer state) at the new layout. Refusals: TP or PP changes, an EP that does not divide the
experts or DP, --ep on a checkpoint without experts -- one line, exit 2, nothing written.

Run by ctest as ``/usr/bin/python3 tests/interop/test_moe_convert.py --reshard BIN`` with
PYTHONPATH=tests.
"""

import dataclasses
import os

import torch

from fixtures import deepspeed_moe as dm
from fixtures.deepspeed_moe import MoeConfig

import interop_support as support
from interop_support import FixtureTestCase, make_fixture

DATA, RULES = dm.DATA_DIR, dm.TOY_RULES
differences = dm.structure_differences
run = support.reshard

# (source, target EP, target DP): EP up and down, expert-DP 1..3, both engines, PP 1..3 (a stage
# without MoE layers), fp32 / bf16 / fp16, ZeRO-1 / 2, residual MoE, 8 experts.
CASES = [
    (MoeConfig(engine='module', dp=4, ep=2), 4, 8),
    (MoeConfig(engine='module', dp=8, ep=4, num_experts=8, dtype='bf16', zero_stage=2), 2, 6),
    (MoeConfig(engine='module', dp=4, ep=2), 1, 3),
    (MoeConfig(engine='pipe', pp=2, dp=2, ep=2, dtype='fp16', residual=True), 1, 3),
    (MoeConfig(engine='pipe', pp=3, dp=4, ep=4), 2, 2),
]


def convert(src, dst, cfg, *extra):
    return run('convert', src, os.path.join(dst, cfg.tag), '--tp', '1', '--pp', str(cfg.pp),
               '--rules', RULES[cfg.engine], *extra)


class MoeConvertTests(FixtureTestCase):

    def write(self, name, cfg):
        root = self.path(name)
        dm.write_moe(root, cfg)
        return root

    def test_ep_and_dp_changes_give_the_fixture_at_the_target_layout(self):
        for i, (cfg, ep, dp) in enumerate(CASES):
            with self.subTest(case=i, engine=cfg.engine, ep=f'{cfg.ep}->{ep}', dp=f'{cfg.dp}->{dp}'):
                a = self.write(f'a{i}', cfg)
                b = self.path(f'b{i}')
                p = convert(a, b, cfg, '--ep', str(ep), '--dp', str(dp))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                # A conversion keeps the samples seen.
                want = dataclasses.replace(cfg, ep=ep, dp=dp, shared_storage=False,
                                           global_samples=cfg.iteration * cfg.micro_batch * cfg.dp)
                self.assertEqual(differences(dm.structure(self.write(f'w{i}', want)), dm.structure(b)), [])
                self.assertEqual(dm.canonical_differences(b, cfg), [])
                back = self.path(f'c{i}')
                p = convert(b, back, want, '--ep', str(cfg.ep), '--dp', str(cfg.dp))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                compact = dataclasses.replace(cfg, shared_storage=False)
                self.assertEqual(differences(dm.structure(self.write(f'a{i}c', compact)), dm.structure(back)), [])
                self.assertEqual(dm.canonical_differences(back, cfg), [])

    def test_real_save_converts_to_the_same_model(self):
        src = os.path.join(DATA, 'zero1_fp32_ep2_dp4')
        out = self.path('out')
        p = run('convert', src, os.path.join(out, 'global_step2'), '--tp', '1', '--pp', '1', '--ep', '4',
                '--dp', '8', '--rules', RULES['module'])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('note: MoE: experts regrouped from EP 2 to EP 4', p.stderr + p.stdout)
        p = run('verify', src, out, '--rules', RULES['module'])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        # The oracle too: the real save's state, regrouped.
        before, after = dm.load_moe(src), dm.load_moe(out)
        for kind in ('weights', 'fp32', 'exp_avg', 'exp_avg_sq'):
            self.assertEqual(set(before[kind]), set(after[kind]))
            for key in before[kind]:
                self.assertTrue(torch.equal(before[kind][key], after[kind][key]), (kind, key))

    def test_dry_run_prints_the_regrouping_and_writes_nothing(self):
        cfg = MoeConfig(engine='pipe', pp=2, dp=2, ep=2)
        p = convert(self.write('a', cfg), self.path('out'), cfg, '--ep', '1', '--dp', '4', '--dry-run')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('target: TP 1, PP 2, DP 4, EP 1 x expert-DP 4 (source EP 2)', p.stdout)
        # EP 1 holds every expert under its global id; the source's EP rank 1 named expert 3 "1".
        self.assertIn('group 2 2.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight <- '
                      '2.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight', p.stdout)
        self.assertFalse(os.path.exists(self.path('out')))

    def test_refusals(self):
        a = self.write('a', MoeConfig(engine='module', dp=4, ep=2))
        cases = [
            (('--tp', '2', '--pp', '1'), 'changing TP or PP of a DeepSpeed MoE checkpoint is not implemented yet'),
            (('--tp', '1', '--pp', '2'), 'changing TP or PP of a DeepSpeed MoE checkpoint is not implemented yet'),
            (('--tp', '1', '--pp', '1', '--ep', '3', '--dp', '6'), 'EP 3 does not divide the 4 experts'),
            (('--tp', '1', '--pp', '1', '--ep', '4', '--dp', '6'), 'EP 4 does not divide DP 6'),
        ]
        for args, message in cases:
            with self.subTest(args=args):
                p = run('convert', a, self.path('out', 'global_step2'), '--rules', RULES['module'], *args)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertFalse(os.path.exists(self.path('out')))
        dense = make_fixture(self.path('dense'), style='ms_gpt2', tp=1, pp=2, dp=2)
        p = run('convert', dense, self.path('out', 'global_step10'), '--tp', '1', '--pp', '2', '--ep', '2')
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn('--ep sets the expert-parallel size of a DeepSpeed MoE checkpoint', p.stderr)
        self.assertFalse(os.path.exists(self.path('out')))


if __name__ == '__main__':
    support.main()
