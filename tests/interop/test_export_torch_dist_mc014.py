"""`export --to torch_dist --megatron-core-version 0.14`: Megatron-Core 0.14's form (common.pt,
metadata.json's common_backend, the optimizer layout fully_sharded_model_space with `.metadata`'s
mcore_data), and `--ddp-bucket-size` for 0.19's dp_reshardable (engine/formats/megatron_core/:
torch_dist/torch_dist_export.h, common/nd_reformulation.h, common/megatron_buckets.h).

Checked:

* the real 0.14 save re-exported at its own layout (its own version by default) reads back as the
  same model and optimizer state, and its `.metadata` has the real one's keys, global shapes,
  chunks and mcore_data; its common.pt loads with Debian's torch and holds the real one's param
  groups and a step tensor per parameter;
* 0.19 saves go to 0.14 at TP 1 / 2, PP 1 / 2, DP 1 / 2 and back to 0.19 (dp_reshardable) as the
  same model and optimizer state;
* a Megatron-DeepSpeed fixture with BF16_Optimizer shards goes to 0.14 and back to its layout
  with every tensor equal;
* real torch 2.6 (the trixie chroot, torch2_chroot.py; skipped with one line when it cannot be
  built) `dcp.load`s every reformulated state of a 0.14 export equal to Megatron's own states
  (`TAG_optim_full.pt`) reformulated;
* the version / layout pairs a version cannot load, and --ddp-bucket-size outside dp_reshardable,
  are refused in one line, nothing written;
* dp_reshardable at two --ddp-bucket-size values has several buckets on the first stage, one on
  the others, and reads back with the state equal.

Run: /usr/bin/python3 tests/interop/test_export_torch_dist_mc014.py --reshard build/reshard
"""
import glob
import json
import os
import pickle
import re

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
import torch2_chroot
from megatron_core_data import DATA, config_of, sizes
from test_export_torch_dist import LOAD
from test_export_torch_dist_optimizer import compared

run = support.reshard
REAL_014 = os.path.join(DATA, '0.14', 'w2_tp2_optim_fully_sharded_model_space')
STATES = {'param': 'fp32_param', 'exp_avg': 'exp_avg', 'exp_avg_sq': 'exp_avg_sq'}


class _Inert:
    """Any class a `.metadata` names (Megatron's MCoreSavePlan among them), read as its state."""

    def __setstate__(self, state):
        self.state = state


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == 'builtins' or module == 'collections':
            return super().find_class(module, name)
        if (module, name) == ('torch', 'Size'):
            return tuple
        return type(name, (_Inert,), {'__new__': lambda cls, *a: object.__new__(cls),
                                      '__init__': lambda self, *a: None})


def metadata(folder):
    """{key: (global shape, sorted chunks) or 'bytes'} and mcore_data of a torch_dist folder."""
    with open(os.path.join(folder, '.metadata'), 'rb') as f:
        state = _InertUnpickler(f).load().state
    items = {}
    for key, m in state['state_dict_metadata'].items():
        if getattr(m, 'state', None) is None:
            items[key] = 'bytes'
            continue
        chunks = sorted((tuple(c.state['offsets']), tuple(c.state['sizes'])) for c in m.state['chunks'])
        items[key] = (tuple(m.state['size']), chunks)
    return items, state.get('mcore_data')


def iter_folder(out):
    return glob.glob(os.path.join(out, 'iter_*'))[0]


def reformulated(full, shape):
    """A state of global shape full.shape as 0.14 saves it at `shape` (counts + [fragment numel])."""
    counts = shape[:-1]
    fragment = [n // c for n, c in zip(full.shape, counts)]
    split = full.reshape([x for c, f in zip(counts, fragment) for x in (c, f)])
    n = len(counts)
    return split.permute(list(range(0, 2 * n, 2)) + list(range(1, 2 * n, 2))).reshape(shape)


class ExportTorchDistMc014Test(FixtureTestCase):

    def export(self, src, out, tp, pp, *extra):
        p = run('export', src, out, '--to', 'torch_dist', '--tp', tp, '--pp', pp, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def assert_same(self, a, b, *extra):
        p = run('verify', a, b, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        self.assertEqual(p.stdout.count('weights and optimizer state'), 2, p.stdout)
        return compared(p.stdout)

    def test_the_real_0_14_save_is_written_again_as_megatron_core_0_14_wrote_it(self):
        config = config_of('0.14/w2_tp2')
        out = self.path('again')
        p = self.export(REAL_014, out, 2, 1, *sizes(config))
        self.assertIn('fully_sharded_model_space (Megatron-Core 0.14', p.stdout + p.stderr)
        tensors = self.assert_same(REAL_014, out, *sizes(config)[:-2])
        self.assertEqual(tensors, 4 * 28)  # 28 parameters, each a weight and three states
        ours, real = metadata(iter_folder(out)), metadata(REAL_014)
        self.assertEqual(sorted(ours[0]), sorted(real[0]))
        self.assertEqual({k: v for k, v in ours[0].items() if v != 'bytes'},
                         {k: v for k, v in real[0].items() if v != 'bytes'})
        self.assertEqual(ours[1], real[1])
        self.assertEqual(sum('nd_reformulated_orig_global_shape' in v for v in real[1].values()), 48)
        folder = iter_folder(out)
        with open(os.path.join(folder, 'metadata.json')) as f:
            self.assertEqual(json.load(f)['common_backend'], 'torch')
        common, real_common = (torch.load(os.path.join(f, 'common.pt')) for f in (folder, REAL_014))
        self.assertEqual(common['optimizer']['optimizer'], real_common['optimizer']['optimizer'])
        self.assertEqual(common['optimizer']['param_state_sharding_type'], 'fully_sharded_model_space')
        self.assertEqual(common['content_metadata']['distrib_optim_sharding_type'], 'fully_sharded_model_space')
        steps = common['optimizer']['param_state']
        self.assertEqual(sorted(steps), sorted(real_common['optimizer']['param_state']))
        self.assertTrue(all(torch.equal(s['step'], torch.tensor(1.0)) for s in steps.values()))
        self.assertEqual((common['iteration'], common['args'].tensor_model_parallel_size), (1, 2))
        print(f'\n[ 0.14 ] {len(real[0])} items with the real save\'s shapes and chunks, '
              f'{len(real[1])} mcore_data entries; verify: {tensors} tensors equal')

    def test_0_19_saves_go_to_0_14_at_every_layout_and_back(self):
        runs = 0
        every = [(t, p, d) for t in (1, 2) for p in (1, 2) for d in (1, 2)]
        # SwiGLU (two fragments per TP rank) at every layout; bf16 (two grad buffers) at two.
        for name, layouts in (('w2_tp2_swiglu', every), ('w2_tp2_bf16', [(1, 2, 2), (2, 1, 1)])):
            config = config_of('0.19/' + name)
            source = os.path.join(DATA, '0.19', name + '_optim_dp_reshardable')
            for tp, pp, dp in layouts:
                with self.subTest(save=name, tp=tp, pp=pp, dp=dp):
                    out, back = self.path(f'{name}_{tp}{pp}{dp}'), self.path(f'{name}_{tp}{pp}{dp}_back')
                    p = self.export(source, out, tp, pp, '--dp', dp, '--megatron-core-version', '0.14',
                                    *sizes(config))
                    self.assertIn('Megatron-Core 0.14', p.stdout)
                    folder = iter_folder(out)
                    self.assertTrue(os.path.exists(os.path.join(folder, 'common.pt')))
                    self.assertNotIn('common_state/shard_0_1', metadata(folder)[0])
                    # Back to 0.19: its own version is 0.14, so the version comes from the layout.
                    p = self.export(out, back, 2, 1, '--optimizer-layout', 'dp_reshardable', *sizes(config)[:-2])
                    self.assertIn('Megatron-Core 0.19', p.stdout)
                    self.assertEqual(self.assert_same(source, back, *sizes(config)[:-2]),
                                     self.assert_same(source, source, *sizes(config)[:-2]))
                    runs += 1
        print(f'\n[ 0.19 -> 0.14 -> 0.19 ] {runs} layouts, model and optimizer state equal')

    def test_a_megatron_deepspeed_checkpoint_goes_to_0_14_and_back_bit_for_bit(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        itself = run('verify', src, src)
        out, back = self.path('td'), self.path('back')
        self.export(src, out, 2, 1, '--dp', 2, '--megatron-core-version', '0.14')
        p = run('convert', '--to', 'deepspeed', out, back, '--tp', 2, '--pp', 2, '--dp', 1, '--no-update-latest')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', src, back)
        # torch_dist carries the learning-rate scheduler (opt_param_scheduler), not DeepSpeed's sample counter.
        self.assertEqual(re.findall(r'differs: (.*)', p.stdout), ['global_samples differs'])
        self.assertNotIn('elements differ', p.stdout)
        self.assertEqual(compared(p.stdout), compared(itself.stdout))
        self.assertEqual(compared(p.stdout), 4 * 39, p.stdout)  # 39 weights, each with three states

    def test_torch_loads_the_reformulated_states(self):
        root = torch2_chroot.root_or_skip()
        name = 'w2_tp2_swiglu'
        config = config_of('0.19/' + name)
        out = self.path('torch')
        self.export(os.path.join(DATA, '0.19', name + '_optim_fully_reshardable'), out, 2, 2, '--dp', 2,
                    '--megatron-core-version', '0.14', *sizes(config))
        folder = os.path.basename(iter_folder(out))
        # 0.14's form has no common_state item to load.
        load = LOAD.replace("state['common_state/shard_0_1'] = None\n", '')
        self.assertNotEqual(load, LOAD)
        p = torch2_chroot.run(root, f"FOLDER = '/data/{folder}'\n" + load, {out: '/data'})
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        loaded = torch.load(os.path.join(out, 'loaded.pt'))
        full = support.load(os.path.join(DATA, '0.19', name + '_optim_full.pt'))['optimizer']
        checked = 0
        for state, saved_as in STATES.items():
            for key, want in full[state].items():
                got = loaded[f'optimizer.state.{saved_as}.{key}']
                self.assertEqual(got.dim(), want.dim() + 1)
                self.assertEqual(support.differences(got, reformulated(want, list(got.shape)), key), [])
                checked += 1
        self.assertEqual(checked, sum(k.startswith('optimizer.state.') for k in loaded))
        self.assertNotIn('common_state/shard_0_1', loaded)
        print(f'\n[ torch 2.6 ] {checked} reformulated states equal to Megatron-Core\'s')

    def test_what_a_version_cannot_load_is_refused(self):
        config = config_of('0.14/w2_tp2')
        src = os.path.join(DATA, '0.19', 'w2_tp2_optim_fully_reshardable')
        out = self.path('refused')
        for extra, message in [
            (('--megatron-core-version', '0.14', '--optimizer-layout', 'dp_reshardable'),
             'Megatron-Core 0.14 does not load the optimizer layout dp_reshardable'),
            (('--megatron-core-version', '0.14', '--optimizer-layout', 'fully_reshardable'),
             'use --optimizer-layout fully_sharded_model_space, or --megatron-core-version 0.19'),
            (('--megatron-core-version', '0.19', '--optimizer-layout', 'fully_sharded_model_space'),
             'Megatron-Core 0.19 does not load the optimizer layout fully_sharded_model_space'),
            (('--ddp-bucket-size', '1000'), '--ddp-bucket-size cuts the grad buffers of the optimizer layout '
                                            'dp_reshardable, and the layout written is fully_reshardable'),
            (('--ddp-bucket-size', '1000', '--optimizer-layout', 'dp_reshardable', '--weights-only'),
             '--weights-only leaves the optimizer state out')]:
            with self.subTest(extra=extra):
                p = run('export', src, out, '--to', 'torch_dist', '--tp', 1, '--pp', 1, *extra, *sizes(config))
                self.assertRefused(p, message, out)
        p = run('export', src, out, '--to', 'hf', '--megatron-core-version', '0.14', *sizes(config))
        self.assertRefused(p, '--megatron-core-version is an option of --to torch_dist; --to hf does not take it', out)

    def test_dp_reshardable_at_two_bucket_sizes_reads_back_equal(self):
        name = 'w2_tp2'
        config = config_of('0.19/' + name)
        source = os.path.join(DATA, '0.19', name + '_optim_fully_reshardable')
        # The first stage's TP-local parameters in backprop order (layer 0 reversed, then the
        # embedding), each start rounded up to 64: fc2.bias [0, 16), fc2.weight [64, 320), fc1.bias
        # [320, 336), fc1.weight [384, 640), fc1 norm bias / weight [640, 656) [704, 720), proj.bias
        # [768, 784), proj.weight [832, 960), qkv.bias [960, 976), qkv.weight [1024, 1280), input
        # norm bias / weight [1280, 1296) [1344, 1360), the embedding [1408, 1920). A bucket closes
        # after the parameter that makes it reach the size: 600 closes at 640, 1280 and 1920;
        # 1000 at 1280, the rest a last bucket.
        for bucket_size, first_stage_buckets in ((600, 3), (1000, 2)):
            with self.subTest(bucket_size=bucket_size):
                out = self.path(f'buckets_{bucket_size}')
                self.export(source, out, 2, 2, '--dp', 2, '--optimizer-layout', 'dp_reshardable',
                                '--ddp-bucket-size', bucket_size, *sizes(config))
                keys = metadata(iter_folder(out))[0]
                buckets = {}
                for key in keys:
                    m = re.match(r'optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_0\..*\.bucket_idx_(\d+)\.param$',
                                 key)
                    if m:
                        buckets.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
                # Groups 0, 1: the first stage's TP ranks, cut by size; groups 2, 3: one bucket each.
                self.assertEqual({g: len(b) for g, b in buckets.items()},
                                 {0: first_stage_buckets, 1: first_stage_buckets, 2: 1, 3: 1})
                self.assert_same(source, out, *sizes(config)[:-2])


if __name__ == '__main__':
    support.main()
