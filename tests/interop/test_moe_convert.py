"""`reshard convert` of DeepSpeed MoE checkpoints to another TP, PP, EP and DP size.

Each case writes a fixture A with the MoE generator (tests/fixtures/deepspeed_moe.py), converts it
to B, and checks B three ways, none of which uses reshard to read it:

* its structure is what the generator writes at B's layout, exactly: the same files, keys, shapes,
  partition counts, paddings, fragment addresses (EP-local names), group names ``ep_size_{EP}``,
  the module's ``_metadata`` (EP rank 0's expert modules) -- with the module tensors compact
  (``shared_storage=False``), as reshard writes them;
* the oracle (``load_moe``) reads B back as the canonical model: every weight, fp32 master,
  exp_avg and exp_avg_sq bit for bit;
* converting B back to A's layout gives A's structure again, and the same values (round trip).

PP changes of pipeline-engine saves (each stage numbers its MoE layers from 0; a target stage's
module, expert files and optimizer groups come from several source stages) are checked the same
way, with EP and DP changed at the same time, and verify finds A and B the same model; an uneven
--layers-per-stage split is checked through its round trip. The real saves are converted too (the
pipeline one to PP 1), and verify finds the same model (weights and every optimizer state) at the
new layout. fp32 saves without ZeRO (each EP rank's torch state in its expp_rank file) are checked
the same way at EP, DP and PP changes, and their torch states compared with the generator's at the
target (params indices, hyperparameters, step, both moments) and after the round trip with A's;
verify compares both moments of every parameter; --weights-only writes expp_rank files of None;
BF16_Optimizer saves (bf16 without ZeRO, whose expp_rank files copy their EP rank's first shard, or
ZeRO-1 with an fp32 gradient accumulation dtype) are checked the same way, the copies against the
shards;
groups that are not DeepSpeed's are refused in one line. An EP change of a ZeRO save of DeepSpeed
before 0.15.4 notes that such a version's expert gradients scale with EP. Refusals: TP changes, PP changes without the pipeline engine, an EP that does not
divide the experts or DP, --ep on a checkpoint without experts -- one line, exit 2, nothing
written.

Run by ctest as ``/usr/bin/python3 tests/interop/test_moe_convert.py --reshard BIN`` with
PYTHONPATH=tests.
"""

import dataclasses
import os
import re
from unittest import mock

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


# (source, target PP, EP, DP) of pipeline-engine saves: PP 2 -> 1, 1 -> 2, 2 -> 4 (a stage
# without MoE layers), 3 -> 2, 2 -> 3 (stages of one and of two blocks), with EP up, down and kept,
# DP up and down; fp32 / bf16 / fp16, ZeRO-1 / 2, residual MoE, 8 experts.
PP_CASES = [
    (MoeConfig(engine='pipe', pp=2, dp=2, ep=2, megatron_groups=False, client_iteration=False), 1, 2, 2),
    (MoeConfig(engine='pipe', pp=1, dp=4, ep=2, dtype='bf16', zero_stage=2), 2, 4, 4),
    (MoeConfig(engine='pipe', pp=2, dp=4, ep=2, num_layers=6, dtype='fp16', residual=True), 4, 1, 2),
    (MoeConfig(engine='pipe', pp=3, dp=2, ep=2, dtype='bf16'), 2, 2, 6),
    (MoeConfig(engine='pipe', pp=2, dp=4, ep=4, num_experts=8, zero_stage=2), 3, 2, 2),
]


# fp32 saves without ZeRO (each EP rank's torch AdamW state in its expp_rank file): (source, target
# PP, EP, DP) with EP up and down, DP up and down, residual MoE, PP 2 -> 1 and 1 -> 2.
NO_ZERO_CASES = [
    (MoeConfig(engine='module', dp=4, ep=2, zero_stage=0), 1, 4, 8),
    (MoeConfig(engine='module', dp=4, ep=4, zero_stage=0, residual=True), 1, 1, 2),
    (MoeConfig(engine='pipe', pp=2, dp=2, ep=2, zero_stage=0), 1, 1, 2),
    (MoeConfig(engine='pipe', pp=1, dp=4, ep=2, num_experts=8, zero_stage=0), 2, 4, 4),
]


# BF16_Optimizer saves: bf16 without ZeRO (each expp_rank file a copy of its EP rank's first shard's
# state) and bf16 ZeRO-1 with an fp32 gradient accumulation dtype (expp_rank files of None):
# (source, target PP, EP, DP) with EP up and down, DP up and down, expert-DP 1..4, residual MoE
# (a group padded on its last rank), PP 2 -> 1.
BF16_OPTIMIZER_CASES = [
    (MoeConfig(engine='module', dp=4, ep=2, dtype='bf16', zero_stage=0), 1, 4, 8),
    (MoeConfig(engine='module', dp=4, ep=2, dtype='bf16', zero_stage=0, residual=True), 1, 1, 3),
    (MoeConfig(engine='pipe', pp=2, dp=4, ep=2, dtype='bf16', zero_stage=0), 1, 2, 2),
    (MoeConfig(engine='module', dp=4, ep=2, dtype='bf16', grad_accum_fp32=True), 1, 4, 4),
]


# Saves at TP 1 and 2 (the non-expert matrices split over TP, experts whole on every TP rank):
# (source, target TP, PP, EP, DP) with TP kept, 2 -> 1, 1 -> 2 and 2 -> 4, both engines,
# ZeRO-1 / 2, fp32 / bf16 / fp16, residual MoE, PP changes, fp32 without ZeRO and BF16_Optimizer.
TP_CASES = [
    (MoeConfig(engine='module', tp=2, dp=4, ep=2), 2, 1, 4, 8),
    (MoeConfig(engine='pipe', tp=2, pp=1, dp=4, ep=2, dtype='bf16'), 2, 2, 4, 4),
    (MoeConfig(engine='module', tp=2, dp=4, ep=2), 1, 1, 2, 4),
    (MoeConfig(engine='module', tp=1, dp=4, ep=2), 2, 1, 4, 8),
    (MoeConfig(engine='module', tp=2, dp=4, ep=2, dtype='bf16', zero_stage=2, residual=True), 1, 1, 1, 2),
    (MoeConfig(engine='pipe', tp=2, pp=2, dp=2, ep=2), 1, 1, 2, 4),
    (MoeConfig(engine='pipe', tp=1, pp=1, dp=4, ep=2, dtype='bf16'), 2, 2, 4, 4),
    (MoeConfig(engine='module', tp=2, dp=4, ep=2, zero_stage=0), 1, 1, 4, 4),
    (MoeConfig(engine='module', tp=1, dp=4, ep=2, dtype='bf16', zero_stage=0), 2, 1, 1, 2),
    (MoeConfig(engine='module', tp=2, dp=4, ep=2, dtype='fp16'), 4, 1, 2, 2),
]


# Saves with expert-TP (--enable-expert-tensor-parallelism: the experts split over TP like the
# dense MLP), read with the toy rules' expert rule split the same way: (source, target TP, PP,
# EP, DP) with TP kept, 2 -> 1, 1 -> 2 and 2 -> 4, both engines, ZeRO-1 / 2, bf16, residual MoE,
# fp32 without ZeRO and BF16_Optimizer.
EXPERT_TP_CASES = [
    (MoeConfig(engine='module', tp=2, dp=4, ep=2, expert_tp=True), 2, 1, 4, 8),
    (MoeConfig(engine='module', tp=2, dp=4, ep=2, expert_tp=True), 1, 1, 2, 4),
    (MoeConfig(engine='pipe', tp=1, pp=2, dp=4, ep=2, expert_tp=True), 2, 1, 4, 4),
    (MoeConfig(engine='module', tp=2, dp=4, ep=2, expert_tp=True, dtype='bf16', zero_stage=2, residual=True), 4, 1, 1, 2),
    (MoeConfig(engine='module', tp=2, dp=4, ep=2, expert_tp=True, zero_stage=0), 1, 1, 4, 4),
    (MoeConfig(engine='module', tp=1, dp=4, ep=2, expert_tp=True, dtype='bf16', zero_stage=0), 2, 1, 1, 2),
]

WHOLE_EXPERTS = ("    - key: 'mlp\\.deepspeed_moe\\.experts\\.deepspeed_experts\\.(\\d+)\\.(dense_h_to_4h|dense_4h_to_h)\\.(weight|bias)'\n"
                 "      name: 'layers.{block}.mlp.deepspeed_moe.experts.deepspeed_experts.{1}.{2}.{3}'\n"
                 "      replicated: true\n"
                 "      expert: 1\n")
SPLIT_EXPERTS = ''.join(
    f"    - key: 'mlp\\.deepspeed_moe\\.experts\\.deepspeed_experts\\.(\\d+)\\.{key}'\n"
    f"      name: 'layers.{{block}}.mlp.deepspeed_moe.experts.deepspeed_experts.{{1}}.{name}'\n"
    f"      {policy}\n"
    "      expert: 1\n"
    for key, name, policy in [('dense_h_to_4h\\.(weight|bias)', 'dense_h_to_4h.{2}', 'split: column'),
                              ('dense_4h_to_h\\.weight', 'dense_4h_to_h.weight', 'split: row'),
                              ('dense_4h_to_h\\.bias', 'dense_4h_to_h.bias', 'replicated: true')])


def tensors_of(value):
    """The tensors of a nested state, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for item in items for t in tensors_of(item)]


def torch_states(root):
    """{file name: the torch optimizer state_dict} of a save's expp_rank files."""
    tag = dm.resolve_tag_dir(root)
    return {n: torch.load(os.path.join(tag, n))['optimizer'] for n in sorted(os.listdir(tag)) if n.startswith('expp_')}


def convert(src, dst, cfg, *extra):
    """Converts the root `src` into the root `dst` (a root in gives a root out)."""
    return run('convert', src, dst, '--tp', str(cfg.tp), '--pp', str(cfg.pp),
               '--rules', RULES[cfg.engine], *extra)


def layout(cfg, pp, ep, dp, tp=None):
    """The generator's config for cfg converted to (tp, pp, ep, dp): module tensors compact, the
    samples seen kept."""
    return dataclasses.replace(cfg, tp=tp or cfg.tp, pp=pp, ep=ep, dp=dp, shared_storage=False,
                               global_samples=cfg.iteration * cfg.micro_batch * cfg.dp)


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

    def assert_converts_to_the_fixture(self, i, cfg, pp, ep, dp, tp=None):
        """Writes cfg as a{i} and converts it to (tp, pp, ep, dp) as b{i}, which must have the
        generator's structure at the target and the canonical values; returns (a, b, the
        target's config, the conversion's process)."""
        a = self.write(f'a{i}', cfg)
        b = self.path(f'b{i}')
        want = layout(cfg, pp, ep, dp, tp)
        p = convert(a, b, want, '--ep', str(ep), '--dp', str(dp))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(differences(dm.structure(self.write(f'w{i}', want)), dm.structure(b)), [])
        self.assertEqual(dm.canonical_differences(b, want), [])  # read at the target's TP
        return a, b, want, p

    def assert_round_trip(self, a, b, cfg, name, *args):
        """Converts b back to cfg's layout: cfg's structure (compact) and values again."""
        back = self.path(name)
        p = run('convert', b, back, '--tp', str(cfg.tp), '--pp', str(cfg.pp), '--ep', str(cfg.ep),
                '--dp', str(cfg.dp), '--rules', RULES[cfg.engine], *args)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        compact = dataclasses.replace(cfg, shared_storage=False)
        self.assertEqual(differences(dm.structure(self.write(name + 'c', compact)), dm.structure(back)), [])
        self.assertEqual(dm.canonical_differences(back, cfg), [])

    def assert_same_model(self, a, b, cfg):
        p = run('verify', a, b, '--rules', RULES[cfg.engine])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)

    def test_pp_changes_give_the_fixture_at_the_target_layout(self):
        for i, (cfg, pp, ep, dp) in enumerate(PP_CASES):
            with self.subTest(case=i, pp=f'{cfg.pp}->{pp}', ep=f'{cfg.ep}->{ep}', dp=f'{cfg.dp}->{dp}',
                              dtype=cfg.dtype, zero=cfg.zero_stage):
                a, b, _, p = self.assert_converts_to_the_fixture(i, cfg, pp, ep, dp)
                self.assertIn(f'note: MoE: {cfg.pp} pipeline stages re-cut into {pp}', p.stderr + p.stdout)
                self.assert_same_model(a, b, cfg)
                self.assert_round_trip(a, b, cfg, f'c{i}')

    def test_saves_without_zero_give_the_fixture_at_the_target_layout(self):
        for i, (cfg, pp, ep, dp) in enumerate(NO_ZERO_CASES):
            with self.subTest(case=i, engine=cfg.engine, pp=f'{cfg.pp}->{pp}', ep=f'{cfg.ep}->{ep}',
                              dp=f'{cfg.dp}->{dp}'):
                a, b, _, _ = self.assert_converts_to_the_fixture(i, cfg, pp, ep, dp)
                # Every torch state as the generator writes it at the target: params indices,
                # hyperparameters, group names ep_size_{EP}, step and both moments, bit for bit.
                self.assert_same_torch_states(torch_states(self.path(f'w{i}')), torch_states(b))
                # verify compares the weights and both moments of every parameter.
                p = run('verify', a, b, '--rules', RULES[cfg.engine])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn(f'verify: {3 * len(dm.canonical_tensors(cfg))} tensors', p.stdout)
                self.assertIn('same model', p.stdout)
                self.assert_round_trip(a, b, cfg, f'c{i}')
                self.assert_same_torch_states(torch_states(a), torch_states(self.path(f'c{i}')))

    def test_bf16_optimizer_saves_give_the_fixture_at_the_target_layout(self):
        for i, (cfg, pp, ep, dp) in enumerate(BF16_OPTIMIZER_CASES):
            with self.subTest(case=i, engine=cfg.engine, zero=cfg.zero_stage, pp=f'{cfg.pp}->{pp}',
                              ep=f'{cfg.ep}->{ep}', dp=f'{cfg.dp}->{dp}'):
                a, b, want, _ = self.assert_converts_to_the_fixture(i, cfg, pp, ep, dp)
                self.assert_expp_copies_of_shards(b, want)
                self.assert_same_model(a, b, cfg)
                self.assert_round_trip(a, b, cfg, f'c{i}')
                self.assert_expp_copies_of_shards(self.path(f'c{i}'), cfg)

    def test_tp_changes_give_the_fixture_at_the_target_layout(self):
        for i, (cfg, tp, pp, ep, dp) in enumerate(TP_CASES):
            with self.subTest(case=i, engine=cfg.engine, zero=cfg.zero_stage, dtype=cfg.dtype, tp=f'{cfg.tp}->{tp}',
                              pp=f'{cfg.pp}->{pp}', ep=f'{cfg.ep}->{ep}', dp=f'{cfg.dp}->{dp}'):
                a, b, want, p = self.assert_converts_to_the_fixture(i, cfg, pp, ep, dp, tp)
                if tp != cfg.tp:
                    self.assertIn(f'note: MoE: TP {cfg.tp} -> {tp}', p.stdout + p.stderr)
                self.assert_expp_copies_of_shards(b, want)
                self.assert_same_model(a, b, cfg)
                self.assert_round_trip(a, b, cfg, f'c{i}')

    def test_expert_tp_saves_give_the_fixture_at_the_target_layout(self):
        rules = {}
        for engine, path in RULES.items():
            with open(path) as f:
                text = f.read()
            self.assertIn(WHOLE_EXPERTS, text)
            rules[engine] = self.path(f'expert_tp_{engine}.yaml')
            with open(rules[engine], 'w') as f:
                f.write(text.replace(WHOLE_EXPERTS, SPLIT_EXPERTS))
        for i, (cfg, tp, pp, ep, dp) in enumerate(EXPERT_TP_CASES):
            with self.subTest(case=i, engine=cfg.engine, tp=f'{cfg.tp}->{tp}', pp=f'{cfg.pp}->{pp}', ep=f'{cfg.ep}->{ep}'):
                a = self.write(f'a{i}', cfg)
                b = self.path(f'b{i}')
                want = layout(cfg, pp, ep, dp, tp)
                p = run('convert', a, b, '--tp', str(tp), '--pp', str(pp), '--ep', str(ep),
                        '--dp', str(dp), '--rules', rules[cfg.engine])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertEqual(differences(dm.structure(self.write(f'w{i}', want)), dm.structure(b)), [])
                self.assertEqual(dm.canonical_differences(b, want), [])
                self.assert_expp_copies_of_shards(b, want)
                p = run('verify', a, b, '--rules', rules[cfg.engine])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
        # A save with whole experts on every TP rank, read with the expert-TP rules: refused,
        # rather than its copies joined into experts twice the size.
        whole = self.write('whole', MoeConfig(engine='module', tp=2, dp=4, ep=2))
        for command in (('lint', whole), ('convert', whole, self.path('out', 'global_step2'), '--tp', '1', '--pp', '1')):
            with self.subTest(command=command[0]):
                p = run(*command, '--rules', rules['module'])
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
                self.assertIn('the save has whole experts on every TP rank', p.stderr)
                self.assertFalse(os.path.exists(self.path('out')))

    def test_tp_change_merges_drifted_replicas_only_as_told(self):
        """A replicated tensor whose TP copies differ: a TP change refuses it under the default
        policy and merges it under --replicated average; TP kept keeps each copy."""
        cfg = MoeConfig(engine='module', tp=2, dp=4, ep=2, shared_storage=False)
        a = self.write('a', cfg)
        f = os.path.join(a, cfg.tag, 'mp_rank_01_model_states.pt')
        states = torch.load(f)
        key = 'language_model.encoder.layers.0.input_layernorm.weight'
        states['module'][key][0] += 0.25
        torch.save(states, f)
        p = convert(a, self.path('out'), dataclasses.replace(cfg, tp=1))
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn('1 replicated tensor(s) differ across TP ranks', p.stderr)
        self.assertFalse(os.path.exists(self.path('out')))
        p = convert(a, self.path('mean'), dataclasses.replace(cfg, tp=1), '--replicated', 'average')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        merged = torch.load(os.path.join(self.path('mean'), cfg.tag, 'mp_rank_00_model_states.pt'))['module'][key]
        original = dm.canonical_tensors(cfg)[key]
        self.assertEqual(merged[0].item(), original[0].item() + 0.125)
        self.assertTrue(torch.equal(merged[1:], original[1:]))
        p = convert(a, self.path('kept'), cfg, '--ep', '4')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        kept = torch.load(os.path.join(self.path('kept'), cfg.tag, 'mp_rank_01_model_states.pt'))['module'][key]
        self.assertTrue(torch.equal(kept, states['module'][key]))

    def assert_expp_copies_of_shards(self, root, cfg):
        """With BF16_Optimizer and without ZeRO, expp_rank_{r} holds DP rank r's
        optimizer_state_dict, tensors bit for bit."""
        if cfg.zero_stage > 0 or not cfg.bf16_optimizer:
            return
        tag = dm.resolve_tag_dir(root)
        for mp in range(cfg.tp * cfg.pp):
            for r in range(cfg.ep):
                copy = torch.load(os.path.join(tag, f'expp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt'))['optimizer']
                shard = torch.load(os.path.join(tag, f'bf16_zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt'))
                osd = shard['optimizer_state_dict']
                self.assertEqual(dm._describe(copy), dm._describe(osd), (mp, r))
                pairs = list(zip(tensors_of(copy), tensors_of(osd)))
                self.assertGreater(len(pairs), 0)
                self.assertTrue(all(torch.equal(x, y) for x, y in pairs), (mp, r))

    def assert_same_torch_states(self, want, got):
        self.assertEqual(list(want), list(got))
        for name, w in want.items():
            g = got[name]
            self.assertEqual(w['param_groups'], g['param_groups'], name)
            self.assertEqual(list(w['state']), list(g['state']), name)
            for index, state in w['state'].items():
                self.assertEqual(list(state), list(g['state'][index]), (name, index))
                for key, value in state.items():
                    self.assertTrue(torch.equal(value, g['state'][index][key]), (name, index, key))

    def test_save_without_zero_weights_only_and_refusals(self):
        cfg = MoeConfig(engine='module', dp=4, ep=2, zero_stage=0)
        a = self.write('a', cfg)
        p = convert(a, self.path('w'), cfg, '--ep', '4', '--weights-only')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(list(torch_states(self.path('w')).values()), [None] * 4)
        def edited(name, edit):
            """A copy of the save with EP rank 1's torch state changed by `edit`."""
            root = self.write(name, cfg)
            path = os.path.join(root, cfg.tag, 'expp_rank_1_mp_rank_00_optim_states.pt')
            expp = torch.load(path)
            edit(expp['optimizer'])
            torch.save(expp, path)
            return root

        def assert_refused(p, *messages):
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
            for message in messages:
                self.assertIn(message, p.stderr)
            self.assertFalse(os.path.exists(self.path('out')))

        # expp_rank_1's groups are not DeepSpeed's (one dropped): whose state is whose is unknown.
        b = edited('b', lambda state: state['param_groups'].pop())
        for command in (('convert', b, self.path('out', cfg.tag), '--tp', '1', '--pp', '1', '--ep', '4'),
                        ('verify', b, b)):
            with self.subTest(command=command[0]):
                assert_refused(run(*command, '--rules', RULES['module']),
                               'expp_rank_1_mp_rank_00_optim_states.pt has 3 optimizer groups, but DeepSpeed groups '
                               "the stage's parameters in 4")

        # A non-expert state that differs between EP ranks: reading EP rank 0's would be a guess.
        def nudge_first_state(state):  # index 0: a non-expert parameter
            state['state'][0]['exp_avg'].view(-1)[0] += 1.0
        assert_refused(convert(edited('d', nudge_first_state), self.path('out'), cfg, '--ep', '4'),
                       "expp_rank_1_mp_rank_00_optim_states.pt: optimizer state 'exp_avg' of the non-expert parameter",
                       "differs from EP rank 0's")

    def test_parameters_partition_weighs_each_rank_experts(self):
        """DeepSpeed's `parameters` partition builds each spec on one rank, so a MoE block weighs
        its E/EP local experts: the target stages depend on the target EP (the generator's bounds
        come from DeepSpeed's partition_balanced over those counts)."""
        with open(RULES['pipe']) as f:
            rules = f.read().replace('partition_method: {default: uniform}', 'partition_method: {default: parameters}')
        self.assertIn('default: parameters', rules)
        weighed = self.path('parameters.yaml')
        with open(weighed, 'w') as f:
            f.write(rules)
        one_moe_block = MoeConfig(engine='pipe', pp=1, dp=4, ep=2, num_layers=4, expert_interval=4,
                                  partition='parameters')
        two_moe_blocks = dataclasses.replace(one_moe_block, pp=2, num_layers=6)
        # (source, target PP, EP, DP, the target's stage bounds)
        for i, (cfg, pp, ep, dp, bounds) in enumerate([(one_moe_block, 2, 2, 4, [0, 4, 6]),
                                                       (one_moe_block, 2, 4, 4, [0, 3, 6]),
                                                       (two_moe_blocks, 3, 1, 2, [0, 4, 5, 8]),
                                                       (two_moe_blocks, 3, 2, 2, [0, 3, 5, 8])]):
            with self.subTest(case=i, pp=f'{cfg.pp}->{pp}', ep=f'{cfg.ep}->{ep}'):
                want = layout(cfg, pp, ep, dp)
                self.assertEqual(dm.stage_bounds(want), bounds)
                a = self.write(f'a{i}', cfg)
                b = self.path(f'b{i}')
                p = run('convert', a, b, '--tp', '1', '--pp', str(pp), '--ep', str(ep),
                        '--dp', str(dp), '--rules', weighed)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertEqual(differences(dm.structure(self.write(f'w{i}', want)), dm.structure(b)), [])
                self.assertEqual(dm.canonical_differences(b, cfg), [])

    def test_layers_per_stage_split_round_trips(self):
        # 1 + 3 blocks: stage 0 holds the embedding and a dense block, stage 1 both MoE layers
        # (its layer_0 and layer_1 expert files), a split uniform partitioning does not make.
        cfg = MoeConfig(engine='pipe', pp=2, dp=4, ep=2, dtype='bf16')
        a = self.write('a', cfg)
        b = self.path('b')
        p = convert(a, b, cfg, '--ep', '4', '--layers-per-stage', '1,3')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        names = os.listdir(os.path.join(b, cfg.tag))
        self.assertNotIn('layer_0_expert_0_mp_rank_00_model_states.pt', names)
        self.assertIn('layer_1_expert_3_mp_rank_01_model_states.pt', names)
        self.assertEqual(dm.canonical_differences(b, cfg), [])
        self.assert_same_model(a, b, cfg)
        # PP kept keeps the source's stages: the way back names DeepSpeed's uniform split.
        self.assert_round_trip(a, b, cfg, 'c', '--layers-per-stage', '2,2')

    def convert_real_save(self, name, engine, *target):
        """Converts the real save `name` to `target` (--pp, --ep, --dp): verify says same model,
        and the oracle reads every weight and optimizer state back equal. Returns (src, out, stderr)."""
        src, out = os.path.join(DATA, name), self.path('out')
        p = run('convert', src, out, '--tp', '1', *target, '--rules', RULES[engine])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        converted = p.stdout + p.stderr
        p = run('verify', src, out, '--rules', RULES[engine])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        before, after = dm.load_moe(src), dm.load_moe(out)
        for kind in ('weights', 'fp32', 'exp_avg', 'exp_avg_sq'):
            self.assertEqual(set(before[kind]), set(after[kind]))
            for key in before[kind]:
                self.assertTrue(torch.equal(before[kind][key], after[kind][key]), (kind, key))
        return src, out, converted

    def test_real_pipeline_save_converts_to_one_stage(self):
        _, out, _ = self.convert_real_save('pipe_pp2_ep2_dp2', 'pipe', '--pp', '1', '--ep', '1', '--dp', '2')
        # Its structure is the generator's at PP 1 (the real save's own config otherwise).
        want = layout(dm.REAL_SAVES['pipe_pp2_ep2_dp2'], 1, 1, 2)
        self.assertEqual(differences(dm.structure(self.write('w', want)), dm.structure(out)), [])

    def test_real_save_converts_to_the_same_model(self):
        _, _, output = self.convert_real_save('zero1_fp32_ep2_dp4', 'module', '--pp', '1', '--ep', '4', '--dp', '8')
        self.assertIn('note: MoE: experts regrouped from EP 2 to EP 4', output)

    def test_dry_run_prints_the_regrouping_and_writes_nothing(self):
        cfg = MoeConfig(engine='pipe', pp=2, dp=2, ep=2)
        p = convert(self.write('a', cfg), self.path('out'), cfg, '--ep', '1', '--dp', '4', '--dry-run')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('target: TP 1, PP 2, DP 4, EP 1 x expert-DP 4 (source EP 2, PP 2); stage bounds (layer ids) '
                      '0 3 6', p.stdout)
        # EP 1 holds every expert under its global id; the source's EP rank 1 named expert 3 "1".
        self.assertIn('    group 2 (experts): 8 parameters over 4 ranks\n'
                      '      2.mlp.deepspeed_moe.experts.deepspeed_experts.0.dense_h_to_4h.weight <- ', p.stdout)
        self.assertIn('      2.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight <- '
                      '2.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight at', p.stdout)
        self.assertFalse(os.path.exists(self.path('out')))
        # A PP change: one stage drawn from both source stages, the second MoE layer renamed layer_1.
        p = convert(self.path('a'), self.path('out'), dataclasses.replace(cfg, pp=1), '--dry-run')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('(source EP 2, PP 2); stage bounds (layer ids) 0 6', p.stdout)
        self.assertIn('stage 0, TP rank 0: module of 20 tensors from mp_rank_00, mp_rank_01, 2 MoE layers', p.stdout)
        self.assertEqual(len(re.findall(r'layer_\d_expert_\d_mp_rank_00_model_states\.pt  from ', p.stdout)), 8)
        self.assertIn('layer_1_expert_3_mp_rank_00_model_states.pt  from layer_0_expert_3_mp_rank_01_model_states.pt',
                      p.stdout)
        self.assertFalse(os.path.exists(self.path('out')))

    def test_ep_change_of_a_save_before_deepspeed_0_15_4_notes_the_expert_gradient_scale(self):
        # DeepSpeed before 0.15.4 averaged ZeRO expert gradients over expert-DP only: at another EP
        # they meet the saved moments at another scale. Saves of later versions, and saves without
        # ZeRO, get no such note.
        note = "this save's DeepSpeed 0.14.5 averages ZeRO expert gradients over expert-DP only"
        for cfg, version, ep, noted in [(MoeConfig(engine='module', dp=4, ep=2), '0.14.5', 4, '2x'),
                                        (MoeConfig(engine='pipe', pp=2, dp=4, ep=4), '0.14.5', 1, '0.25x'),
                                        (MoeConfig(engine='module', dp=4, ep=2), dm.DS_VERSION, 4, None),
                                        (MoeConfig(engine='module', dp=4, ep=2, zero_stage=0), '0.14.5', 4, None)]:
            with self.subTest(version=version, ep=f'{cfg.ep}->{ep}', zero=cfg.zero_stage):
                with mock.patch.object(dm, 'DS_VERSION', version):
                    a = self.write(f'a-{version}-{cfg.engine}-{cfg.zero_stage}', cfg)
                p = convert(a, self.path('out'), cfg, '--ep', str(ep), '--dp', '4', '--dry-run')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                if noted:
                    self.assertIn(f'{note} (fixed in DeepSpeed 0.15.4): resumed at EP {ep} by such a version, '
                                  f'expert gradients are {noted} those the saved Adam moments saw', p.stdout)
                else:
                    self.assertNotIn('averages ZeRO expert gradients', p.stdout)

    def test_refusals(self):
        a = self.write('a', MoeConfig(engine='module', dp=4, ep=2))
        cases = [
            (('--tp', '3', '--pp', '1'), 'cannot split language_model.encoder.layers.0/self_attention.dense.weight '
                                         'over 3 TP ranks'),
            (('--tp', '1', '--pp', '2'), 'saved without the pipeline engine has one stage'),
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
        pipe = self.write('p', MoeConfig(engine='pipe', pp=2, dp=2, ep=2))
        for args, message in [(('--tp', '1', '--pp', '5'), 'target PP 5 exceeds the 4 transformer blocks'),
                              (('--tp', '1', '--pp', '2', '--layers-per-stage', '1,2'), 'sums to 3')]:
            with self.subTest(args=args):
                p = run('convert', pipe, self.path('out', 'global_step2'), '--rules', RULES['pipe'], *args)
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
