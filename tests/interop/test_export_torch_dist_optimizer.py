"""`export --to torch_dist` with the optimizer state: Megatron-Core 0.19's `fully_reshardable` layout
(engine/formats/megatron_core/torch_dist/torch_dist_export.h), its param groups from the source
(SourceCheckpoint::ParamGroupsAndStep).

Checked:

* every real 0.19 save with optimizer state, in both of its layouts, exported at another TP and PP
  reads back through reshard as the same model with the same optimizer state (`verify` compares a
  weight and three states per canonical tensor), and converted to Megatron-DeepSpeed its states,
  read back through `export --to universal`, equal Megatron's own (`TAG_optim_full.pt`) bit for
  bit, with the step and hyperparameters;
* real torch 2.6 (the Debian trixie chroot, torch2_chroot.py; skipped with one line when it cannot
  be built) `dcp.load`s every `optimizer.state.{param,exp_avg,exp_avg_sq}.<key>` equal to
  `TAG_optim_full.pt`, and a common state whose optimizer entry has the save's param groups (lr,
  betas, eps, weight_decay, step, wd_mult) and `param_state_sharding_type` fully_reshardable;
* `--optimizer-layout dp_reshardable` (engine/formats/megatron_core/torch_dist/dp_reshardable_items.h) writes what
  Megatron-Core 0.19 writes: exporting each save's fully_reshardable folder at its own layout gives
  the chunks, the per_bucket_numel items, the param groups and every parameter's element of the
  flat buckets of the save's own dp_reshardable folder, as real torch 2.6 loads both (the alignment
  gaps, which Megatron leaves uninitialised, are zero); at another TP / PP and DP 2 it reads back
  through reshard as the same model with the same optimizer state;
* a Megatron-DeepSpeed checkpoint with BF16_Optimizer shards goes to torch_dist and back to its
  layout as the same model with the same optimizer state, in both layouts; with a tied embedding
  at PP > 1, its two copies are buckets of their own in dp_reshardable;
* --weights-only leaves the state out, and --optimizer-layout is refused where it lays out nothing.

Run: /usr/bin/python3 tests/interop/test_export_torch_dist_optimizer.py --reshard build/reshard
"""
import glob
import os
import re

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
import torch2_chroot
from test_export_torch_dist import LOAD, other_layout
from test_torch_dist_import import sizes
import test_torch_dist_optimizer as converting
from test_torch_dist_optimizer import LAYOUTS, saves

run = support.reshard
STATES = ('param', 'exp_avg', 'exp_avg_sq')
GROUP_FIELDS = ('lr', 'betas', 'eps', 'weight_decay', 'step', 'wd_mult')


# Loads the flat buckets and per-rank items of /ours and /megatron (real torch 2.6) and compares
# them: chunk lists, objects, and every element of a parameter's chunk. A chunk that starts off
# Megatron's 64-element parameter alignment is an alignment gap (DP 1), which Megatron leaves
# uninitialised and reshard writes as zeros.
COMPARE_BUCKETS = r'''
import pickle, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
def load(folder):
    with open(folder + '/.metadata', 'rb') as f:
        meta = pickle.load(f).state_dict_metadata
    state, chunks = {}, {}
    for k, m in meta.items():
        if not k.startswith('optimizer.distributed.'):
            continue
        state[k] = None
        if isinstance(m, TensorStorageMetadata):
            state[k] = torch.empty(m.size, dtype=m.properties.dtype)
            chunks[k] = [(c.offsets[0], c.sizes[0]) for c in m.chunks]
    dcp.load(state, checkpoint_id=folder)
    return state, chunks
ours, our_chunks = load('/ours')
megatron, megatron_chunks = load('/megatron')
if sorted(ours) != sorted(megatron) or not megatron:
    print('KEYS', sorted(ours), sorted(megatron))
equal = 0
for k, want in megatron.items():
    got = ours.get(k)
    if not isinstance(want, torch.Tensor):
        if got != want:
            print('OBJECT', k, got, want)
        continue
    if sorted(our_chunks[k]) != sorted(megatron_chunks[k]):
        print('CHUNKS', k)
        continue
    for offset, size in megatron_chunks[k]:
        a, b = got[offset:offset + size], want[offset:offset + size]
        if offset % 64 != 0:
            if torch.count_nonzero(a):
                print('ZERO', k, offset)
        elif not torch.equal(a, b):
            print('DIFF', k, offset)
        else:
            equal += size
print('equal', equal)
'''


def compared(stdout):
    """The tensors verify says it compared."""
    return int(re.search(r'verify: (\d+) tensors', stdout).group(1))


class ExportTorchDistOptimizerTest(FixtureTestCase):
    universal_states = converting.TorchDistOptimizerTest.universal_states
    universal_states_of = converting.TorchDistOptimizerTest.universal_states_of
    check_states = converting.TorchDistOptimizerTest.check_states

    def export(self, src, out, tp, pp, *extra):
        p = run('export', src, out, '--to', 'torch_dist', '--tp', tp, '--pp', pp, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def test_saves_exported_with_their_state_read_back_equal(self):
        elements = 0
        for tag, config in saves():
            name = os.path.basename(tag)
            tp, pp = other_layout(config['layout'])
            for layout in LAYOUTS:
                with self.subTest(save=name, layout=layout):
                    source, out = f'{tag}_optim_{layout}', self.path(f'{name}_{layout}')
                    p = self.export(source, out, tp, pp, *sizes(config))
                    # The source's own layout unless --optimizer-layout says otherwise.
                    self.assertIn(f'the optimizer state as {layout}', p.stdout + p.stderr)
                    p = run('verify', source, out, *sizes(config)[:-2])
                    self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                    self.assertIn('same model', p.stdout)
                    # Both sides have optimizer state, compared: a weight and three states per canonical tensor.
                    self.assertEqual(p.stdout.count('weights and optimizer state'), 2, p.stdout)
                    keys = support.load(tag + '_optim_full.pt')['optimizer']['param']
                    layers = config['model']['layers']
                    weights = sum(layers if k.startswith('decoder.layers.') else 1 for k in keys)
                    self.assertEqual(compared(p.stdout), 4 * weights, p.stdout)
                    back = self.path(f'{name}_{layout}_ds')
                    p = run('convert', '--to', 'deepspeed', out, back, '--tp', 1, '--pp', 1, *sizes(config))
                    self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                    elements += self.check_states(tag, config, *self.universal_states(back, config))
        print(f'\n[ states ] {2 * len(saves())} exports, {elements} elements of fp32 / exp_avg / exp_avg_sq '
              f'equal to Megatron-Core\'s after torch_dist and Megatron-DeepSpeed')

    def test_torch_loads_the_states_and_the_param_groups(self):
        root = torch2_chroot.root_or_skip()
        for tag, config in saves():
            name = os.path.basename(tag)
            with self.subTest(save=name):
                out = self.path(name + '_torch')
                tp, pp = other_layout(config['layout'])
                self.export(f'{tag}_optim_dp_reshardable', out, tp, pp, '--optimizer-layout', 'fully_reshardable',
                            *sizes(config))
                folder = os.path.basename(glob.glob(os.path.join(out, 'iter_*'))[0])
                p = torch2_chroot.run(root, f"FOLDER = '/data/{folder}'\n" + LOAD, {out: '/data'})
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                loaded = torch.load(os.path.join(out, 'loaded.pt'))
                full = support.load(tag + '_optim_full.pt')
                compared = 0
                for state in STATES:
                    for key, want in full['optimizer'][state].items():
                        got = loaded[f'optimizer.state.{state}.{key}']
                        self.assertEqual(support.differences(got, want, f'{state} {key}'), [])
                        compared += 1
                self.assertEqual(compared, sum(k.startswith('optimizer.state.') for k in loaded))
                common = loaded['common_state/shard_0_1'][0]['optimizer']
                self.assertEqual(common['param_state_sharding_type'], 'fully_reshardable')
                want = full['objects']['common_state/shard_0_1'][0]['optimizer']['optimizer']['param_groups']
                got = common['optimizer']['param_groups']
                self.assertEqual([{f: g[f] for f in GROUP_FIELDS} for g in got],
                                 [{f: g[f] for f in GROUP_FIELDS} for g in want])

    def test_dp_reshardable_is_written_as_megatron_core_writes_it(self):
        root = torch2_chroot.root_or_skip()
        elements = 0
        for tag, config in saves():
            name = os.path.basename(tag)
            with self.subTest(save=name):
                out = self.path(name + '_dp')
                layout = config['layout']
                self.export(f'{tag}_optim_fully_reshardable', out, layout['tp'], layout['pp'],
                            '--optimizer-layout', 'dp_reshardable', *sizes(config))
                folder = glob.glob(os.path.join(out, 'iter_*'))[0]
                p = torch2_chroot.run(root, COMPARE_BUCKETS, {folder: '/ours', f'{tag}_optim_dp_reshardable': '/megatron'})
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertEqual(re.findall(r'^(?:DIFF|ZERO|CHUNKS|OBJECT|KEYS) .*', p.stdout, re.M), [], p.stdout)
                elements += int(re.search(r'equal (\d+)', p.stdout).group(1))
        print(f'\n[ dp_reshardable ] {len(saves())} saves: {elements} bucket elements equal to Megatron-Core\'s')

    def test_dp_reshardable_at_another_layout_reads_back_equal(self):
        for tag, config in saves():
            name = os.path.basename(tag)
            with self.subTest(save=name):
                tp, pp = other_layout(config['layout'])
                source, out = f'{tag}_optim_fully_reshardable', self.path(name + '_dp2')
                p = self.export(source, out, tp, pp, '--dp', 2, '--optimizer-layout', 'dp_reshardable',
                                *sizes(config))
                self.assertIn('the optimizer state as dp_reshardable', p.stdout + p.stderr)
                files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(out, 'iter_*', '*.distcp')))
                self.assertEqual(files, sorted(f'__{r}_0.distcp' for r in range(tp * pp * 2)))
                p = run('verify', source, out, *sizes(config)[:-2])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertEqual(p.stdout.count('weights and optimizer state'), 2, p.stdout)
                self.assertNotIn('elements differ', p.stdout)
                back = self.path(name + '_dp2_ds')
                p = run('convert', '--to', 'deepspeed', out, back, '--tp', 1, '--pp', 1, *sizes(config))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.check_states(tag, config, *self.universal_states(back, config))

    def test_a_tied_embedding_at_pp_above_1_has_buckets_of_its_own(self):
        src = make_fixture(self.path('gpt2'), **dict(FAMILIES['ms_gpt2'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        out = self.path('td')
        # At the source's TP, which keeps its padded vocabulary (112 rows; a TP 1 export pads to 104).
        self.export(src, out, 2, 3, '--dp', 2, '--optimizer-layout', 'dp_reshardable')
        listing = run('inspect', out, '--rules', 'none').stdout
        buckets = {(int(g), int(k)): int(n) for g, k, n in re.findall(
            r'dp_group_idx_(\d+)\.gbuf_idx_0\.dtype_\([^)]*\)\.bucket_idx_(\d+)\.param float32\[(\d+)\]', listing)}
        # Each TP rank's piece of the first stage's word embedding (groups 0, 1) and of the last
        # stage's copy of it (groups 4, 5; Megatron-Core's shared_embedding): a bucket of its own,
        # the embedding registered first (its bucket last), the output layer last (its bucket
        # first). 56 rows x 48 per TP rank; the middle stage (groups 2, 3) has one bucket.
        piece = 56 * 48
        self.assertEqual({g: buckets[(g, 1)] for g in (0, 1)}, {0: piece, 1: piece}, listing)
        self.assertEqual({g: buckets[(g, 0)] for g in (4, 5)}, {4: piece, 5: piece}, listing)
        self.assertEqual(sorted(k for g, k in buckets if g in (2, 3)), [0, 0])
        back = self.path('back')
        p = run('convert', '--to', 'deepspeed', out, back, '--tp', 2, '--pp', 2, '--dp', 1, '--no-update-latest')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', src, back)
        # The scheduler state travels (opt_param_scheduler); the sample counter does not.
        self.assertEqual(re.findall(r'differs: (.*)', p.stdout), ['global_samples differs'])
        self.assertNotIn('elements differ', p.stdout)
        self.assertEqual(compared(p.stdout), compared(run('verify', src, src).stdout))

    def test_a_megatron_deepspeed_checkpoint_with_state_goes_to_torch_dist_and_back(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        itself = run('verify', src, src)
        self.assertEqual(itself.returncode, 0, itself.stdout + itself.stderr)
        for layout in LAYOUTS:
            with self.subTest(layout=layout):
                out = self.path('td_' + layout)
                # At TP 2 the vocabulary keeps its padding rows (the fixture's are not zero).
                self.export(src, out, 2, 1, '--optimizer-layout', layout, '--dp', 2)
                back = self.path('back_' + layout)
                p = run('convert', '--to', 'deepspeed', out, back, '--tp', 2, '--pp', 2, '--dp', 1, '--no-update-latest')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                p = run('verify', src, back)
                # Every tensor, the optimizer state's too, is equal, and the learning-rate scheduler
                # (the common state's opt_param_scheduler); the torch_dist export does not carry
                # DeepSpeed's sample counter.
                self.assertEqual(re.findall(r'differs: (.*)', p.stdout), ['global_samples differs'])
                self.assertNotIn('elements differ', p.stdout)
                self.assertEqual(compared(p.stdout), compared(itself.stdout))
                self.assertEqual(compared(p.stdout), 4 * 39, p.stdout)  # 39 weights, each with three states
        print(f'\n[ fixture ] verify: {compared(p.stdout)} tensors equal, weights and optimizer state, '
              f'through both layouts')

    def test_weights_only_and_a_layout_without_state(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=1, pp=1, dp=1, optimizer='bf16_zero'))
        out = self.path('weights')
        p = self.export(src, out, 1, 1, '--weights-only')
        self.assertIn('weights only', p.stdout + p.stderr)
        p = run('inspect', out, '--rules', 'none')
        self.assertNotIn('optimizer.state', p.stdout)
        plain = make_fixture(self.path('plain'), **dict(FAMILIES['ms_llama'], tp=1, pp=1, dp=1))
        refused = self.path('refused')
        p = run('export', plain, refused, '--to', 'torch_dist', '--tp', 1, '--pp', 1,
                '--optimizer-layout', 'fully_reshardable')
        self.assertRefused(p, 'the source has no optimizer state; drop the option', refused)
        p = run('export', src, refused, '--to', 'consolidated', '--optimizer-layout', 'fully_reshardable')
        self.assertRefused(p, '--optimizer-layout is an option of --to torch_dist; --to consolidated does not take it', refused)


if __name__ == '__main__':
    support.main()
