"""The MoE fixture generator (tests/fixtures/deepspeed_moe.py) against the real DeepSpeed saves,
and reshard reading what it writes.

* Written with the configuration of each real save (``REAL_SAVES``), the generator's folder has
  the real save's structure exactly: the same files, keys in the same order, tensor dtypes,
  shapes and places in their storages (module tensors are views into the group flats), object
  types, fragment addresses, partition counts, paddings, num_experts, world sizes, group names
  and flags, the module's ``_metadata``.  A layout change (EP 4) and a model change (residual
  MoE) must make the comparison fail: it can.
* The oracle (``load_moe``, no reshard) reads the real saves' weights equal to their fp32
  masters (DeepSpeed's fp32 ZeRO-1 keeps them so), and the generator's fixtures at many layouts
  back to the canonical model.
* reshard's lint names the layout each fixture was written with, and verify finds the same
  model in fixtures of one model at different EP x DP layouts (weights and every optimizer
  state, experts compared by global id), and names the one expert state or weight changed;
  ``export --to consolidated`` writes the canonical model (from the masters); the universal
  export refuses.

Run by ctest as ``/usr/bin/python3 tests/interop/test_moe_fixture.py --reshard BIN`` with
PYTHONPATH=tests.
"""

import dataclasses
import os
import re

import torch

from fixtures import deepspeed_moe as dm
from fixtures.deepspeed_moe import MoeConfig

import interop_support as support
from interop_support import FixtureTestCase, read_safetensors

DATA, RULES = dm.DATA_DIR, dm.TOY_RULES
differences = dm.structure_differences

# Layouts beyond the real saves': EP 1 / 4, expert-DP 1..4, PP 1..3 (a stage without MoE
# layers), more experts, bf16 and fp16, ZeRO-2, residual MoE, module tensors not shared, fp32
# without ZeRO, BF16_Optimizer (bf16 without ZeRO, and ZeRO-1 with fp32 gradient accumulation),
# TP 2 (the non-expert matrices split, experts whole on every TP rank).
LAYOUTS = [
    MoeConfig(engine='module', dp=4, ep=1),
    MoeConfig(engine='module', dp=8, ep=4, num_experts=8, dtype='bf16', zero_stage=2),
    MoeConfig(engine='module', dp=6, ep=2, dtype='fp16', residual=True),
    MoeConfig(engine='module', dp=2, ep=2, expert_interval=1, shared_storage=False),
    MoeConfig(engine='pipe', pp=3, dp=4, ep=4, dtype='bf16'),
    MoeConfig(engine='pipe', pp=2, dp=4, ep=2, num_layers=6, expert_interval=3, residual=True, zero_stage=2),
    MoeConfig(engine='pipe', pp=2, dp=4, ep=2, zero_stage=0),
    MoeConfig(engine='module', dp=4, ep=2, dtype='bf16', zero_stage=0, residual=True),
    MoeConfig(engine='pipe', pp=2, dp=4, ep=2, dtype='bf16', grad_accum_fp32=True),
    MoeConfig(engine='module', tp=2, dp=4, ep=2, residual=True),
    MoeConfig(engine='pipe', tp=2, pp=2, dp=2, ep=2, dtype='bf16', zero_stage=0),
]

run = support.reshard


def rule_name(save_name, cfg):
    """The canonical name the toy rule files give a tensor saved as `save_name`."""
    if cfg.engine == 'module':
        return re.sub(r'^language_model\.(?:encoder\.)?', '', save_name)
    spec, key = save_name.split('.', 1)
    if int(spec) == 0:
        return 'embedding.' + key
    return key if int(spec) == cfg.num_layers + 1 else f'layers.{int(spec) - 1}.{key}'


class MoeFixtureTests(FixtureTestCase):

    def write(self, name, cfg):
        root = self.path(name)
        dm.write_moe(root, cfg)
        return root

    def test_structure_is_the_real_saves(self):
        for name, cfg in dm.REAL_SAVES.items():
            with self.subTest(save=name):
                real = dm.structure(os.path.join(DATA, name))
                ours = dm.structure(self.write(name, cfg))
                self.assertEqual(differences(real, ours), [])

    def test_without_zero_the_expp_rank_files_hold_each_ep_rank_torch_state(self):
        # The reference's w4_z0_fp32 save (deepspeed-moe-layout.md sections 2 and 3.3): no ZeRO
        # shards and no zero_to_fp32.py; expp_rank_r holds EP rank r's AdamW state_dict(), 53
        # states in groups of 11, 26, 8, 8 indices; module tensors standalone.
        root = self.write('z0', MoeConfig(engine='module', dp=4, ep=2, zero_stage=0))
        tag = os.path.join(root, 'global_step2')
        self.assertEqual(sorted(os.listdir(root)), ['global_step2', 'latest'])
        self.assertEqual(sorted(os.listdir(tag)), sorted(
            ['mp_rank_00_model_states.pt', 'expp_rank_0_mp_rank_00_optim_states.pt',
             'expp_rank_1_mp_rank_00_optim_states.pt'] +
            [f'layer_{m}_expert_{e}_mp_rank_00_model_states.pt' for m in range(2) for e in range(4)]))
        states = [torch.load(os.path.join(tag, f'expp_rank_{r}_mp_rank_00_optim_states.pt')) for r in range(2)]
        for r, expp in enumerate(states):
            self.assertEqual(list(expp), ['optimizer'])
            sd = expp['optimizer']
            self.assertEqual(list(sd), ['state', 'param_groups'])
            self.assertEqual(sorted(sd['state']), list(range(53)))
            self.assertEqual([g['params'] for g in sd['param_groups']],
                             [list(range(0, 11)), list(range(11, 37)), list(range(37, 45)), list(range(45, 53))])
            self.assertEqual([(g['name'], g.get('moe', False), g['weight_decay']) for g in sd['param_groups']],
                             [('wd_no_scale_lr', False, 0.01), ('no_wd_no_scale_lr', False, 0.0),
                              ('ep_size_2', True, 0.01), ('ep_size_2', True, 0.0)])
            step = sd['state'][0]['step']
            self.assertEqual((step.dtype, step.dim(), float(step)), (torch.float32, 0, 2.0))
        # Non-expert states alike on both EP ranks, expert states each rank's own.
        for i in range(53):
            same = all(torch.equal(states[0]['optimizer']['state'][i][s], states[1]['optimizer']['state'][i][s])
                       for s in ('exp_avg', 'exp_avg_sq'))
            self.assertEqual(same, i < 37, i)
        module = torch.load(os.path.join(tag, 'mp_rank_00_model_states.pt'))['module']
        self.assertTrue(all(t.storage_offset() == 0 and t.storage().size() == t.numel() for t in module.values()))
        self.assertEqual(dm.canonical_differences(root, MoeConfig(engine='module', dp=4, ep=2, zero_stage=0)), [])

    def test_the_comparison_sees_layout_and_model_changes(self):
        name, cfg = 'zero1_fp32_ep2_dp4', dm.REAL_SAVES['zero1_fp32_ep2_dp4']
        real = dm.structure(os.path.join(DATA, name))
        for change in ({'ep': 4}, {'residual': True}, {'dp': 2}):
            with self.subTest(**change):
                ours = dm.structure(self.write(f'changed_{list(change)[0]}', dataclasses.replace(cfg, **change)))
                self.assertNotEqual(differences(real, ours), [])

    def test_oracle_reads_real_weights_equal_to_their_masters(self):
        for name in dm.REAL_SAVES:
            with self.subTest(save=name):
                state = dm.load_moe(os.path.join(DATA, name))
                self.assertEqual(set(state['weights']), set(state['fp32']))
                for key, weight in state['weights'].items():
                    self.assertTrue(torch.equal(weight, state['fp32'][key]), key)

    def test_fixtures_read_back_as_the_canonical_model(self):
        for i, cfg in enumerate(LAYOUTS + list(dm.REAL_SAVES.values())):
            with self.subTest(layout=i):
                self.assertEqual(dm.canonical_differences(self.write(f'f{i}', cfg), cfg), [])

    def test_reshard_lint_names_the_layout_written(self):
        for i, cfg in enumerate(LAYOUTS):
            with self.subTest(layout=i):
                p = run('lint', self.write(f'l{i}', cfg), '--rules', RULES[cfg.engine])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                blocks = [b for b in range(cfg.num_layers) if cfg.is_moe(b)]
                self.assertIn(f'info: MoE: EP {cfg.ep} x expert-DP {cfg.edp}; {len(blocks)} MoE layers of '
                              f'{cfg.num_experts} experts (blocks {", ".join(map(str, blocks))}', p.stdout)
                self.assertIn(f'TP {cfg.tp}, PP {cfg.pp}, DP {cfg.dp}', p.stdout)
                self.assertEqual([line for line in p.stdout.splitlines() if line.startswith('error:')], [])
                self.assertTrue(p.stdout.splitlines()[-1].startswith('lint: ok'), p.stdout)

    def test_reshard_verify_finds_one_model_across_ep_layouts(self):
        a = self.write('a', MoeConfig(engine='module', dp=4, ep=2, num_experts=8))
        b = self.write('b', MoeConfig(engine='module', dp=8, ep=8, num_experts=8, global_samples=16))
        p = run('verify', a, b, '--rules', RULES['module'])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        # Every weight and its fp32 master, exp_avg and exp_avg_sq.
        params = len(dm.canonical_tensors(MoeConfig(engine='module', num_experts=8)))
        self.assertIn(f'verify: {4 * params} tensors', p.stdout)
        # One element of one expert's exp_avg changed, in the expert-DP partition of EP rank 1 on
        # DP rank 3 (EP 2): named by the global id of the expert it belongs to.
        f = os.path.join(a, 'global_step2', 'zero_pp_rank_3_mp_rank_00_optim_states.pt')
        shard = torch.load(f)
        osd = shard['optimizer_state_dict']
        moe_wd = next(g for g, group in enumerate(osd['base_optimizer_state']['param_groups'])
                      if group.get('moe') and group['weight_decay'] > 0)
        name, frag = next(iter(osd['param_slice_mappings'][moe_wd].items()))
        osd['base_optimizer_state']['state'][moe_wd]['exp_avg'][frag.start] += 1.0
        torch.save(shard, f)
        local = int(name.split('deepspeed_experts.')[1].split('.')[0])
        glob_name = name.replace(f'deepspeed_experts.{local}.', f'deepspeed_experts.{4 + local}.')
        p = run('verify', a, b, '--rules', RULES['module'])
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        differs = [line for line in p.stdout.splitlines() if line.startswith('differs:')]
        self.assertEqual(len(differs), 1, p.stdout)
        self.assertIn('optimizer exp_avg ' + glob_name.replace('language_model.encoder.', ''), differs[0])
        self.assertIn('1 of ', differs[0])
        a = self.write('a2', MoeConfig(engine='module', dp=4, ep=2, num_experts=8))  # unchanged again
        # One element of one expert changed: verify names that expert by its global id, and only it.
        f = os.path.join(b, 'global_step2', 'layer_0_expert_7_mp_rank_00_model_states.pt')
        sd = torch.load(f)
        key = next(k for k in sd if k.endswith('dense_h_to_4h.weight'))
        sd[key][1, 2] += 0.5
        torch.save(sd, f)
        p = run('verify', a, b, '--rules', RULES['module'])
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        differs = [line for line in p.stdout.splitlines() if line.startswith('differs:')]
        self.assertEqual(len(differs), 1, p.stdout)
        self.assertIn('layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.7.dense_h_to_4h.weight', differs[0])
        self.assertIn('1 of 512 elements differ', differs[0])

    def test_reshard_verify_finds_one_model_across_pipeline_layouts(self):
        a = self.write('a', MoeConfig(engine='pipe', pp=2, dp=2, ep=2, dtype='bf16'))
        b = self.write('b', MoeConfig(engine='pipe', pp=3, dp=8, ep=4, dtype='bf16', zero_stage=2, global_samples=8))
        p = run('verify', a, b, '--rules', RULES['pipe'])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        params = len(dm.canonical_tensors(MoeConfig(engine='pipe')))
        self.assertIn(f'verify: {4 * params} tensors', p.stdout)
        self.assertIn('same model', p.stdout)

    def test_reshard_verify_finds_one_model_across_tp_layouts(self):
        for engine, tp2 in (('module', MoeConfig(engine='module', tp=2, dp=4, ep=2)),
                            ('pipe', MoeConfig(engine='pipe', tp=2, pp=2, dp=2, ep=2))):
            with self.subTest(engine=engine):
                a = self.write(f'{engine}_tp2', tp2)
                b = self.write(f'{engine}_tp1', dataclasses.replace(tp2, tp=1))
                p = run('verify', a, b, '--rules', RULES[engine])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn(f'verify: {4 * len(dm.canonical_tensors(tp2))} tensors', p.stdout)
                self.assertIn('same model', p.stdout)
                # One element of TP rank 1's half of a split matrix: verify finds it.
                f = os.path.join(a, 'global_step2', 'mp_rank_01_model_states.pt')
                states = torch.load(f)
                key = next(k for k in states['module'] if k.endswith('mlp.dense_h_to_4h.weight'))
                states['module'][key] = states['module'][key].clone()
                states['module'][key][0, 0] += 0.5
                torch.save(states, f)
                p = run('verify', a, b, '--rules', RULES[engine])
                self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                self.assertIn('dense_h_to_4h.weight', p.stdout)


    def test_consolidated_export_is_the_canonical_model(self):
        for i, cfg in enumerate([MoeConfig(engine='module', dp=8, ep=4, num_experts=8, dtype='bf16'),
                                 MoeConfig(engine='pipe', pp=3, dp=4, ep=2, dtype='fp16', residual=True)]):
            with self.subTest(engine=cfg.engine):
                out = self.path(f'export{i}')
                p = run('export', self.write(f'e{i}', cfg), out, '--to', 'consolidated', '--rules', RULES[cfg.engine])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                tensors, _ = read_safetensors(os.path.join(out, 'model.safetensors'))
                canon = {rule_name(k, cfg): v for k, v in dm.canonical_tensors(cfg).items()}
                self.assertEqual(set(tensors), set(canon))
                for name, value in canon.items():  # from the fp32 masters
                    self.assertTrue(torch.equal(tensors[name], value), name)

    def test_other_exports_are_refused(self):
        root = self.write('x', MoeConfig())
        p = run('export', root, self.path('u'), '--to', 'universal', '--rules', RULES['module'])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn('exporting a DeepSpeed MoE checkpoint --to universal is not implemented yet', p.stderr)
        self.assertFalse(os.path.exists(self.path('u')))


if __name__ == '__main__':
    support.main()
