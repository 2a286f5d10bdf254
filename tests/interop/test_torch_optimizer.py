"""A plain torch optimizer state (fp32, ZeRO stage 0) through `reshard convert`, with real PyTorch.

fp32 training without ZeRO keeps DeepSpeed's client optimizer unwrapped: each mp_rank file's
`optimizer` is torch.optim.AdamW's state_dict() -- per parameter {'step', 'exp_avg',
'exp_avg_sq'} shaped like that rank's parameter shard, `param_groups` indexing the stage's
parameters in group order (format doc fact 12; the MoE layout doc's z0 fp32 runs).  The
fixture builds it with a real AdamW (`optimizer='torch_adamw'`).  For every conversion A -> B
(test_optimizer.OptimizerTestCase.convert_and_check):

  * B's weights and moments, read back by the oracle, are the canonical ones; vocabulary rows B
    adds have the weights' fill and zero moments;
  * B's mp_rank optimizers equal, key for key and bit for bit, the state_dicts real AdamW gives
    at B's layout (the fixture at B), except in the new vocabulary rows and the last stage's
    unused tied position-embedding copy, which reshard fills from stage 0;
  * hyperparameters and `step` are the source's, `params` re-indexed, dp_world_size is B's DP,
    every tensor compact fp32 with a storage of its own (AdamW steps `step` in place);
  * B -> A gives A's optimizer states back bit for bit (same exceptions).

Also: verify (same model, and a perturbed moment found), lint, the dry run's index listing,
another torch optimizer (SGD momentum), a state saved before the first step, weights only,
drifted replicas, and the refusals (steps that disagree, a group that does not hold the stage's
parameters, a state not shaped like its parameter).

Run: /usr/bin/python3 tests/interop/test_torch_optimizer.py --reshard build/reshard  (PYTHONPATH=tests)
"""
import os

import torch

from fixtures import megatron_fixture as mf

import interop_support as support
from interop_support import differences, load, mp_file, rewrite
from test_optimizer import (ERROR_PREFIX, OptimizerTestCase, apply_torch_mask, convert, make_cfg, mask_rules,
                            nozero_group_shapes, run, run_ok)

TORCH = dict(optimizer='torch_adamw')


def rewrite_optimizers(tag, change):
    """Applies ``change(optimizer, mp index)`` to the optimizer of every mp_rank file of ``tag``."""
    for name in sorted(os.listdir(tag)):
        if name.startswith('mp_rank_'):
            mm = int(name[len('mp_rank_'):].split('_')[0])
            rewrite(os.path.join(tag, name), lambda sd: change(sd['optimizer'], mm))


class TorchLayoutTest(OptimizerTestCase):
    """A -> B -> A, TP, PP and DP changing alone and at once."""

    CASES = [
        ('ms_gpt2', (2, 1, 1), (1, 1, 1)),    # TP 2 -> 1
        ('ms_gpt2', (1, 1, 2), (2, 1, 2)),    # TP 1 -> 2
        ('ms_gpt2', (1, 2, 1), (3, 2, 1)),    # TP 1 -> 3 (vocabulary re-padded: 104 -> 120 rows)
        ('ms_gpt2', (2, 2, 1), (2, 1, 1)),    # PP 2 -> 1: the tied copy disappears
        ('ms_gpt2', (1, 2, 2), (1, 4, 2)),    # PP 2 -> 4, uneven stages
        ('ms_gpt2', (2, 2, 2), (2, 2, 5)),    # DP alone: only dp_world_size changes
        ('ms_gpt2', (2, 2, 3), (3, 4, 1)),    # all three at once
        ('ms_llama', (2, 2, 1), (1, 1, 3)),   # GQA, SwiGLU, untied head
        ('ms_llama', (1, 1, 1), (3, 4, 2)),
        ('bs_gpt_glu', (2, 2, 1), (1, 4, 2)), # BS: three groups, GLU gate second
        ('bs_bloom', (1, 2, 2), (2, 1, 1)),   # BS embedding norm (stage 0 only)
    ]

    def test_round_trips(self):
        for family, a, b in self.CASES:
            with self.subTest(family=family, a=a, b=b):
                self.convert_and_check(family, a, b, **TORCH)

    def test_vocab_pad_value(self):
        """New vocabulary rows: the weights take --vocab-pad-value, the moments 0."""
        self.convert_and_check('ms_gpt2', (1, 1, 1), (6, 1, 1), extra=('--vocab-pad-value', '0.5'),
                               pad_value=0.5, reference=False, **TORCH)


class TorchStateTest(OptimizerTestCase):

    def source(self, family='ms_gpt2', layout=(2, 2, 2), **options):
        cfg = make_cfg(family, layout, **TORCH, **options)
        tmp = self.tmpdir()
        return cfg, tmp, mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']

    def assert_refused(self, proc, *words):
        self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
        lines = proc.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertTrue(lines[0].startswith(ERROR_PREFIX), lines[0])
        for word in words:
            self.assertIn(word, lines[0])

    def test_verify_lint_and_dry_run(self):
        cfg, tmp, a_tag = self.source('ms_llama', (2, 2, 1))
        lint = run('lint', a_tag)
        self.assertEqual(lint.returncode, 0, lint.stdout + lint.stderr)
        self.assertIn('torch optimizer state in the mp_rank files', lint.stdout)
        self.assertIn('lint: ok', lint.stdout)
        dry = run_ok('convert', a_tag, os.path.join(tmp, 'dry', cfg.tag), '--tp', 3, '--pp', 1, '--dry-run')
        self.assertRegex(dry.stdout, r'  mp_rank_00_model_states\.pt  stage 0 .*\n(    .*\n)*    group 0: torch state of')
        self.assertIn('0: 1.word_embeddings.weight [40, 48]', dry.stdout)  # 120 rows / TP 3
        self.assertFalse(os.path.exists(os.path.join(tmp, 'dry')))
        b_tag = os.path.join(tmp, 'b', cfg.tag)
        convert(a_tag, b_tag, (3, 1, 4))
        proc = run('verify', a_tag, b_tag)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn('same model', proc.stdout)
        lint = run('lint', b_tag)
        self.assertEqual(lint.returncode, 0, lint.stdout + lint.stderr)
        self.assertIn('lint: ok', lint.stdout)
        # One moment element off: verify names it.
        def change(opt, mm):
            if mm == 2:
                opt['state'][5]['exp_avg_sq'].view(-1)[3] += 0.5
        rewrite_optimizers(b_tag, change)
        proc = run('verify', a_tag, b_tag)
        self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
        self.assertIn('exp_avg_sq', proc.stdout)
        self.assertNotIn('same model', proc.stdout)

    def test_sgd_momentum(self):
        """Any torch optimizer whose per-parameter states are shaped like the parameter: SGD's
        momentum_buffer follows the parameter's rule, its hyperparameters are carried."""
        cfg, tmp, a_tag = self.source('ms_gpt2', (2, 2, 1))
        def to_sgd(opt, mm):
            for i, state in opt['state'].items():
                opt['state'][i] = {'momentum_buffer': state['exp_avg']}
            for pg in opt['param_groups']:
                params = pg['params']
                pg.clear()
                pg.update(lr=0.1, momentum=0.9, dampening=0, weight_decay=0.0, nesterov=True,
                          maximize=False, foreach=None, params=params)
        rewrite_optimizers(a_tag, to_sgd)
        b_tag, a2_tag = (os.path.join(tmp, x, cfg.tag) for x in ('b', 'a2'))
        convert(a_tag, b_tag, (1, 1, 1))
        opt = load(mp_file(b_tag, 0))['optimizer']
        for pg in opt['param_groups']:
            self.assertEqual(list(pg), ['lr', 'momentum', 'dampening', 'weight_decay', 'nesterov',
                                        'maximize', 'foreach', 'params'])
            self.assertEqual((pg['lr'], pg['momentum'], pg['nesterov']), (0.1, 0.9, True))
        # The momentum buffers were the source's exp_avg: canonical after the merge.
        got = mf.load_logical(b_tag, cfg).optimizer['momentum_buffer']
        want = mf.expected_optimizer_state(cfg, 1)['exp_avg']
        self.assertEqual(list(got), list(want))
        self.assertEqual([n for n in want if not torch.equal(got[n], want[n])], [])
        # Back at A: A's states, except the rows B had no room for and the last stage's tied
        # position copy (filled from stage 0).
        convert(b_tag, a2_tag, (2, 2, 1))
        rule = mask_rules(cfg, 2, 2, first_free_row=mf.padded_vocab(cfg, 1))
        for mm in range(4):
            want, got = (load(mp_file(tag, mm))['optimizer'] for tag in (a_tag, a2_tag))
            for opt in (want, got):
                apply_torch_mask(opt, nozero_group_shapes(cfg, (2, 2, 1), mm), rule, mm)
            self.assertEqual(differences(want, got, f'mp_rank_{mm:02d}'), [])

    def test_before_the_first_step(self):
        """A state saved before any step has no per-parameter states: only the groups move."""
        cfg, tmp, a_tag = self.source('ms_gpt2', (2, 2, 1))
        rewrite_optimizers(a_tag, lambda opt, mm: opt['state'].clear())
        b_tag = os.path.join(tmp, 'b', cfg.tag)
        convert(a_tag, b_tag, (1, 1, 1))
        opt = load(mp_file(b_tag, 0))['optimizer']
        self.assertEqual(opt['state'], {})
        sizes = [len(group) for group in nozero_group_shapes(cfg, (1, 1, 1), 0)]
        self.assertEqual([pg['params'] for pg in opt['param_groups']],
                         [list(range(sum(sizes[:g]), sum(sizes[:g + 1]))) for g in range(len(sizes))])

    def test_drifted_replicas(self):
        """Replicated weights and their moments that differ across TP ranks are refused by default;
        `first` gives TP rank 0's weights and moments."""
        cfg, tmp, a_tag = self.source('ms_gpt2', (2, 2, 1), tp_drift_eps=1e-2)
        self.assert_refused(run('convert', a_tag, os.path.join(tmp, 'b', cfg.tag), '--tp', 1, '--pp', 2),
                            '--replicated')
        b_tag = os.path.join(tmp, 'first', cfg.tag)
        run_ok('convert', a_tag, b_tag, '--tp', 1, '--pp', 2, '--replicated', 'first', '-q')
        self.check_canonical(b_tag, cfg, (1, 2, 1), mf.padded_vocab(cfg, 1) - cfg.V)

    def test_weights_only(self):
        cfg, tmp, a_tag = self.source()
        b_tag = os.path.join(tmp, 'b', cfg.tag)
        proc = run_ok('convert', a_tag, b_tag, '--tp', 1, '--pp', 1, '--weights-only')
        self.assertIn('optimizer state inside its mp_rank files were not converted', proc.stdout + proc.stderr)
        self.assertIsNone(load(mp_file(b_tag, 0))['optimizer'])
        self.assertEqual(mf.compare_with_canonical(mf.load_logical(b_tag, cfg), cfg), [])

    def test_steps_that_disagree_are_refused(self):
        """One step for all: a parameter (on another rank) that stepped differently is refused."""
        cfg, tmp, a_tag = self.source()
        def change(opt, mm):
            if mm == 3:
                opt['state'][4]['step'] = torch.tensor(9.0)
        rewrite_optimizers(a_tag, change)
        proc = run('convert', a_tag, os.path.join(tmp, 'b', cfg.tag), '--tp', 1, '--pp', 1)
        self.assert_refused(proc, "'step'", 'mp_rank_03', 'tensor(9)', 'tensor(10)')
        self.assertEqual(run('lint', a_tag).returncode, 1)

    def test_groups_that_do_not_fit_the_stage_are_refused(self):
        cfg, tmp, a_tag = self.source()
        def change(opt, mm):
            if mm == 1:
                moved = opt['param_groups'][0]['params'].pop()
                opt['param_groups'][1]['params'].insert(0, moved)
        rewrite_optimizers(a_tag, change)
        proc = run('convert', a_tag, os.path.join(tmp, 'b', cfg.tag), '--tp', 1, '--pp', 1)
        self.assert_refused(proc, 'mp_rank_01_model_states.pt', 'group 0', '--weights-only')

    def test_states_not_shaped_like_the_parameter_are_refused(self):
        cfg, tmp, a_tag = self.source()
        def change(opt, mm):
            if mm == 2:
                opt['state'][1]['exp_avg'] = opt['state'][1]['exp_avg'].reshape(-1)
        rewrite_optimizers(a_tag, change)
        proc = run('convert', a_tag, os.path.join(tmp, 'b', cfg.tag), '--tp', 1, '--pp', 1)
        self.assert_refused(proc, "'exp_avg'", 'mp_rank_02', "parameter's shape")


if __name__ == '__main__':
    support.main()
