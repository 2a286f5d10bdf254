"""Megatron-Core 0.19.1 resumes reshard's `torch_dist` outputs of a Mixture-of-Experts model with its
distributed optimizer state, in both of its optimizer layouts, and reshard reads its own dp_reshardable saves.

Real Megatron-Core from PyPI (megatron_core_pypi.py), in the torch 2.6 chroot on CPU with gloo, trains the
MoE GPTModel of tests/data/megatron-core/0.19-moe (local spec, SequentialMLP, 4 experts top-2, 2 layers) at
EP 1, and again at EP 2 (world 2: TP 1, DP 2), with its DDP and distributed optimizer (Adam, lr 1e-3, wd
0.01): one step, a `fully_reshardable` save (the source, written by Megatron-Core itself), then one more step,
and the loss after it. reshard converts each source to EP 1 and EP 2 at TP 1 and at TP 2 (world 2, or 4 for
TP 2 × EP 2; the EP 2 source's ChainedOptimizer groups read as one optimizer's), as `fully_reshardable` and as
`dp_reshardable` (at EP 2 a ChainedOptimizer's buckets: `chained_0.` dense over DP, `chained_1.` each EP
rank's experts over the expert-DP ranks, 2 of them at world 4), and Megatron-Core, at each of these layouts,
builds its optimizers (at EP 1 one; at EP 2 a ChainedOptimizer of the dense parameters' and the experts'),
loads the output strictly with StrictHandling.RAISE_ALL and the load flag of its layout, saves what it then
holds, and takes the second step. Checked:

* every optimizer state Megatron-Core loaded (fp32 master, exp_avg, exp_avg_sq of every parameter, the
  experts' too) equals the source's bit for bit, and so does every weight, while the same state with two
  experts traded does not (the negative control); the param groups it loaded are its own optimizers'
  (is_expert_parallel, wd_mult), at step 1;
* the loss of the step and the loss after it equal, bit for bit, what Megatron-Core's own save gives at
  that TP (resumed at its own EP, the structure it was saved with), and at TP 1 the source run's own; at
  TP 2, which sums in another order, they are within 1e-3 of the source run's;
* Megatron-Core's own save does not load at the other EP (its state has one optimizer where the
  ChainedOptimizer has two, or two where it has one), which is what the conversion is for;
* reshard's common state holds the target's optimizers (fully_reshardable: their param groups; dp_reshardable:
  each optimizer's layout, its groups in its ranks' `optimizer` items); at TP 1 each fully_reshardable state
  is in the file Megatron-Core's own save of it puts it in (an expert's in its EP rank's); every dp_reshardable
  item (each bucket's chunks, per_bucket_numel, param groups) is under the key and in the file Megatron-Core's
  own dp_reshardable save of the loaded state puts it in; 0.14's layout, not written for a model with experts,
  is refused in one line.

And without Megatron-Core: its own dp_reshardable saves in tests/data/megatron-core/0.19-moe (EP 2, a
ChainedOptimizer's buckets; TP 2 × EP 1, one optimizer's) read by reshard give every optimizer state
Megatron-Core held (TAG_optim_full.pt) bit for bit, and `verify` finds each its fully_reshardable twin.

Skipped with one line when the chroot or the wheels cannot be had.

Run: /usr/bin/python3 tests/interop/test_megatron_core_moe_optimizer.py --reshard build/reshard
"""
import json
import os
import sys

import torch

import interop_support as support
from interop_support import FixtureTestCase
from megatron_core_data import DATA, config_of
import megatron_core_pypi
import torch2_chroot
from test_megatron_core_moe import BUILD, WHOLE, placement, sizes, vocab

run = support.reshard

TAG = '0.19-moe/w2_ep2'  # the model's sizes
# What the runs share: the model with Megatron-Core's DDP and distributed optimizer (trained), a training
# step on fixed tokens, the same on every rank (train_step), and the loss alone (loss_of, from
# megatron_core_pypi.LOSS_OF).
TRAIN = r"""
import contextlib, json, os
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

M = json.loads(%r)
# No dropout is drawn (eval mode), so none needs the GPU's RNG tracker.
tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()

def trained(tp, ep):
    torch.manual_seed(1234)  # every DP rank starts from the same weights
    model = build(tp, ep)
    model.eval()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer='adam', lr=1e-3, weight_decay=0.01, use_distributed_optimizer=True), [ddp])
    start_adam_state(optimizer)
    return model, ddp, optimizer

def train_step(model, ddp, optimizer):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = loss_of(model)
    loss.backward()
    ddp.finish_grad_sync()
    stepped, _, _ = optimizer.step()
    assert stepped
    return loss.item()

def step_save_step(r, tp, ep, saves, losses_file):
    # One step, each save (its folder, its optimizer layout and what else it holds), one more step and the
    # loss after it: the losses written to losses_file.
    model, ddp, optimizer = trained(tp, ep)
    losses = [train_step(model, ddp, optimizer)]
    for folder, layout, items in saves:
        os.makedirs(folder, exist_ok=True)
        dist_checkpointing.save({**sharded(model, optimizer, layout=layout), **items, 'iteration': 1}, folder)
    losses.append(train_step(model, ddp, optimizer))
    with torch.no_grad():
        losses.append(loss_of(model).item())
    if r == 0:
        with open(losses_file, 'w') as f:
            json.dump(losses, f)

def sharded(model, optimizer, is_loading=False, layout='fully_reshardable'):
    # As Megatron-LM 0.19 describes its sharded state dict with --use-distributed-optimizer: the optimizer
    # state dp_reshardable, or with --dist-ckpt-optim-fully-reshardable fully_reshardable.
    metadata = {'distrib_optim_sharding_type': layout, 'singleton_local_shards': False,
                'chained_optim_avoid_prefix': True}
    model_sd = model.sharded_state_dict()
    return {'model': model_sd, 'optimizer': optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                          metadata=metadata)}
"""

# The source: one step, Megatron-Core's save, one more step and the loss after it.
SAVE = r"""
def source(r, port, world, tp, ep):
    start(r, port, world)
    step_save_step(r, tp, ep, [('/data/source', 'fully_reshardable', {})], '/data/source_losses.json')
    end_rank(dist)

worlds(source, [%r])
save_whole('/data/source')
"""

# Each case (world, folder, resaved, record, TP, EP, optimizer layout): load the folder strictly with the
# optimizer state in its layout (the load flag Megatron-LM sets for it), save what is held (fully_reshardable;
# a dp_reshardable folder also in its own layout, RESAVED_dp), take the second step; the record says what
# happened.
RESUME = r"""
CASES = json.loads(%r)

def resume(r, port, world, folder, resaved, record, tp, ep, layout):
    start(r, port, world)
    model, ddp, optimizer = trained(tp, ep)
    out = {}
    try:
        state = dist_checkpointing.load(sharded(model, optimizer, is_loading=True, layout=layout), folder,
                                        strict=StrictHandling.RAISE_ALL)
        model.load_state_dict(state['model'], strict=True)
        optimizer.load_state_dict(state['optimizer'])
    except Exception as e:
        out['error'] = (type(e).__name__ + ': ' + str(e))[:500]
    else:
        out['groups'] = [[g['is_expert_parallel'], g['wd_mult'], g['step']]
                         for chained in optimizer.chained_optimizers for g in chained.param_groups]
        os.makedirs(resaved, exist_ok=True)
        dist_checkpointing.save(sharded(model, optimizer), resaved)
        if layout == 'dp_reshardable':
            os.makedirs(resaved + '_dp', exist_ok=True)
            dist_checkpointing.save(sharded(model, optimizer, layout=layout), resaved + '_dp')
        out['losses'] = [train_step(model, ddp, optimizer)]
        with torch.no_grad():
            out['losses'].append(loss_of(model).item())
    if r == 0:
        with open(record, 'w') as f:
            json.dump(out, f)
    end_rank(dist)

worlds(resume, CASES)
for case in CASES:
    if os.path.exists(case[2]):
        save_whole(case[2])
"""

STATES = ('param', 'exp_avg', 'exp_avg_sq')
EXPERT_FC1 = 'decoder.layers.mlp.experts.experts.linear_fc1.weight'
ROUTER = 'decoder.layers.mlp.router.weight'
FULLY, DP = 'fully_reshardable', 'dp_reshardable'


def script(*parts):
    model = config_of(TAG)['model']
    return (torch2_chroot.END_RANK + megatron_core_pypi.RANKS + megatron_core_pypi.OPTIMIZER + BUILD + WHOLE +
            megatron_core_pypi.LOSS_OF + TRAIN % json.dumps(model) + ''.join(parts))


def experts_swapped(tensor):
    """A stacked expert state with layer 0's experts 0 and 1 traded: what a reader that mixed up two experts
    would give."""
    out = tensor.clone()
    out[0, 0], out[0, 1] = tensor[0, 1], tensor[0, 0]
    return out


def distributed_items(placed):
    """The dp_reshardable items (`[chained_N.]optimizer.distributed.…`) of a placement()."""
    return {k: v for k, v in placed.items() if 'optimizer.distributed.' in k[0]}


class MegatronCoreResumesMoeOptimizerTest(megatron_core_pypi.MegatronCoreTestCase):
    """From Megatron-Core's save at EP 1."""
    TIMEOUT = 900
    SAVE = None  # made in setUpClass: the script needs the model's sizes
    SOURCE_LAYOUT = (2, 1, 1)  # world, TP, EP
    # (output, world, TP, EP, optimizer layout): reshard's outputs of the source, and the layouts Megatron-Core
    # resumes them at.
    CASES = (('ep1', 2, 1, 1, FULLY), ('ep2', 2, 1, 2, FULLY), ('tp2_ep1', 2, 2, 1, FULLY),
             ('tp2_ep2', 4, 2, 2, FULLY), ('dp_ep1', 2, 1, 1, DP), ('dp_ep2', 2, 1, 2, DP),
             ('dp_dp4_ep2', 4, 1, 2, DP), ('dp_tp2_ep2', 4, 2, 2, DP))
    OWN_TP2 = (2, 2, 1)  # (world, TP, EP) Megatron-Core's own save resumes at, at TP 2
    OTHER_EP = (2, 1, 2)  # and an EP its optimizers have another structure at

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        p = cls.megatron(script(SAVE % [*cls.SOURCE_LAYOUT]))
        if p.returncode:
            raise AssertionError('Megatron-Core could not write the source:\n' + p.stdout + p.stderr[-4000:])
        with open(os.path.join(cls.work, 'source_losses.json')) as f:
            cls.source_losses = json.load(f)
        cases = []  # (name, [world, folder, resaved, record, TP, EP, layout])
        for name, world, tp, ep, layout in cls.CASES:
            out = os.path.join(cls.work, name)
            p = run('convert', os.path.join(cls.work, 'source'), out, '--to', 'torch_dist', '--tp', str(tp),
                    '--ep', str(ep), '--dp', str(world // tp), '--optimizer-layout', layout, *vocab(TAG))
            if p.returncode:
                raise AssertionError(p.stdout + p.stderr)
            cases.append((name, [world, f'/data/{name}/iter_0000001', f'/data/{name}_resaved',
                                 f'/data/{name}.json', tp, ep, layout]))
        # Megatron-Core's own save, at its own layout, at TP 2 and at the other EP.
        own = (('own', cls.SOURCE_LAYOUT), ('own_tp2', cls.OWN_TP2), ('own_other_ep', cls.OTHER_EP))
        for name, (world, tp, ep) in own:
            cases.append((name, [world, '/data/source', f'/data/{name}_resaved', f'/data/{name}.json', tp, ep,
                                 FULLY]))
        p = cls.megatron(script(RESUME % json.dumps([case for _, case in cases])))
        if p.returncode:
            raise AssertionError('Megatron-Core could not resume the outputs:\n' + p.stdout + p.stderr[-4000:])
        cls.records = {}
        for name, _ in cases:
            with open(os.path.join(cls.work, name + '.json')) as f:
                cls.records[name] = json.load(f)
        cls.source = torch.load(os.path.join(cls.work, 'source_full.pt'))

    def resumed(self, name):
        record = self.records[name]
        self.assertNotIn('error', record)
        return record

    def test_every_optimizer_state_loaded_is_the_sources(self):
        states = sorted(k for k in self.source if k.startswith('optimizer.state.'))
        self.assertEqual(len(states), 3 * 13)  # param, exp_avg, exp_avg_sq of each of the 13 keys
        for name, _, tp, ep, layout in self.CASES:
            with self.subTest(output=name):
                self.resumed(name)
                held = torch.load(os.path.join(self.work, name + '_resaved_full.pt'))
                self.assertEqual(sorted(held), sorted(self.source))
                for key, tensor in held.items():
                    self.assertEqual(support.differences(tensor, self.source[key], key), [])
                fc1, router = (held[f'optimizer.state.exp_avg_sq.{k}'] for k in (EXPERT_FC1, ROUTER))
                print(f'{name} (TP {tp}, EP {ep}, {layout}): {len(held)} tensors equal to the source\'s; exp_avg_sq '
                      f'of layer 1 expert 3 fc1 [0, :3] {fc1[1, 3, 0, :3].tolist()}, of the router [1, 2, :3] '
                      f'{router[1, 2, :3].tolist()}', file=sys.stderr)
                # The negative control: two experts' states traded do not pass the comparison.
                key = f'optimizer.state.exp_avg_sq.{EXPERT_FC1}'
                self.assertNotEqual(support.differences(experts_swapped(held[key]), self.source[key], key), [])
        # The moments are the step's, not zeros: a check that the comparison compares something.
        self.assertGreater(self.source[f'optimizer.state.exp_avg_sq.{EXPERT_FC1}'].abs().min().item(), 0)

    def test_the_param_groups_loaded_are_the_targets_optimizers(self):
        dense = [[False, 1.0, 1.0], [False, 0.0, 1.0]]
        for name, _, _, ep, _ in self.CASES:
            with self.subTest(output=name):
                want = sorted(dense) if ep == 1 else sorted(dense) + [[True, 1.0, 1.0]]
                got = self.resumed(name)['groups']
                self.assertEqual(sorted(got[:2]) + got[2:], want)

    def test_at_tp_1_each_state_is_in_the_file_megatron_core_writes_it_in(self):
        # (At TP 2 Megatron-Core writes a dense state's TP pieces from each TP rank, reshard the whole
        # state from TP rank 0: the same tensor to a load.)
        for name, _, tp, ep, layout in self.CASES:
            if tp != 1 or layout != FULLY:
                continue
            with self.subTest(output=name):
                ours, theirs = (placement(os.path.join(self.work, folder))
                                for folder in (os.path.join(name, 'iter_0000001'), name + '_resaved'))
                states = {k: v for k, v in ours.items() if k[0].startswith('optimizer.state.')}
                self.assertEqual(states, {k: v for k, v in theirs.items() if k[0].startswith('optimizer.state.')})
                # An expert's states in the file of its EP rank.
                files = {v for k, v in states.items() if k[0].endswith(EXPERT_FC1)}
                self.assertEqual(len(files), ep)

    def test_dp_reshardable_items_are_megatron_cores_own(self):
        # Every bucket tensor's chunks and every per-rank item (numels, param groups) under the key and in the
        # file Megatron-Core's own dp_reshardable save of the loaded state at that layout has.
        for name, _, tp, ep, layout in self.CASES:
            if layout != DP:
                continue
            with self.subTest(output=name):
                self.resumed(name)
                ours_folder = os.path.join(self.work, name, 'iter_0000001')
                theirs_folder = os.path.join(self.work, name + '_resaved_dp')
                ours, theirs = (distributed_items(placement(f)) for f in (ours_folder, theirs_folder))
                self.assertEqual(ours, theirs)
                chained = sorted({k[0].split('.')[0] for k in ours if k[0].startswith('chained_')})
                self.assertEqual(chained, [] if ep == 1 else ['chained_0', 'chained_1'])
                ours, theirs = (distcp_objects(f) for f in (ours_folder, theirs_folder))
                for key in ('per_bucket_numel', 'per_bucket_numel_unpadded', 'optimizer'):
                    got = {k: v for k, v in ours.items() if k.endswith(f'.{key}/shard_0_1')}
                    self.assertEqual(got, {k: v for k, v in theirs.items() if k.endswith(f'.{key}/shard_0_1')})
                    self.assertGreater(len(got), 0)
                print(f'{name} (TP {tp}, EP {ep}): {len(placement(ours_folder))} items; Megatron-Core\'s own '
                      f'dp_reshardable save has the same {len(distributed_items(placement(theirs_folder)))} '
                      f'optimizer chunks in the same files, numels '
                      f'{sorted(set(str(v) for k, v in ours.items() if k.endswith(".per_bucket_numel/shard_0_1")))}',
                      file=sys.stderr)

    def test_the_next_step_is_the_source_runs(self):
        want = self.source_losses[1:]
        self.assertLess(want[1], want[0])  # the step trains
        for name, _, tp, ep, layout in self.CASES:
            with self.subTest(output=name):
                got = self.resumed(name)['losses']
                # Megatron-Core's own save resumed at this TP (at its own EP): TP 2 sums in another order.
                own = self.resumed('own' if tp == 1 else 'own_tp2')['losses']
                self.assertEqual(got, own)
                if tp == 1:
                    self.assertEqual(got, want)
                for g, w in zip(got, want):
                    self.assertAlmostEqual(g, w, delta=1e-3)
                print(f'{name} (TP {tp}, EP {ep}, {layout}): step loss {got[0]!r}, after it {got[1]!r}; '
                      f'Megatron-Core\'s own save at TP {tp}: {own[0]!r}, {own[1]!r}; the source run: {want[0]!r}, '
                      f'{want[1]!r}', file=sys.stderr)

    def test_megatron_cores_own_save_does_not_resume_at_the_other_ep(self):
        self.assertIn('error', self.records['own_other_ep'])
        print(f'Megatron-Core\'s own EP {self.SOURCE_LAYOUT[2]} save at EP {self.OTHER_EP[2]}:',
              self.records['own_other_ep']['error'][:300], file=sys.stderr)

    def test_the_common_state_holds_the_targets_param_groups(self):
        for name, _, _, ep, layout in self.CASES:
            with self.subTest(output=name):
                folder = os.path.join(self.work, name, 'iter_0000001')
                objects = distcp_objects(folder)
                optimizer = objects['common_state/shard_0_1']['optimizer']
                entries = [optimizer] if ep == 1 else [optimizer[0], optimizer[1]]
                self.assertEqual({e['param_state_sharding_type'] for e in entries}, {layout})
                if layout == FULLY:
                    groups = [e['optimizer']['param_groups'] for e in entries]
                else:  # each optimizer's rank 0 item holds them
                    prefixes = [''] if ep == 1 else ['chained_0.', 'chained_1.']
                    groups = [objects[f'{p}optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1']['param_groups']
                              for p in prefixes]
                self.assertEqual([[g['is_expert_parallel'] for g in e] for e in groups],
                                 [[False, False]] if ep == 1 else [[False, False], [True]])

    def test_the_layout_not_written_for_experts_is_refused_in_one_line(self):
        out = os.path.join(self.work, 'refused')
        p = run('convert', os.path.join(self.work, 'source'), out, '--to', 'torch_dist', '--ep', '2',
                '--dp', '2', '--optimizer-layout', 'fully_sharded_model_space', *vocab(TAG))
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        lines = p.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, p.stderr)
        self.assertIn('the optimizer state of a model with experts is written in Megatron-Core 0.19\'s layouts only, '
                      'not yet as fully_sharded_model_space; give --optimizer-layout dp_reshardable or '
                      'fully_reshardable', lines[0])
        self.assertFalse(os.path.exists(out))


class MegatronCoreResumesMoeOptimizerFromEp2Test(MegatronCoreResumesMoeOptimizerTest):
    """From Megatron-Core's save at EP 2, whose ChainedOptimizer keeps the dense and the experts' groups apart
    (read as one optimizer's, split again for the target's EP)."""
    SOURCE_LAYOUT = (2, 1, 2)
    CASES = (('ep1', 2, 1, 1, FULLY), ('ep2', 2, 1, 2, FULLY), ('tp2_ep1', 2, 2, 1, FULLY),
             ('dp_ep1', 2, 1, 1, DP), ('dp_ep2', 2, 1, 2, DP), ('dp_dp4_ep2', 4, 1, 2, DP))
    OWN_TP2 = (4, 2, 2)
    OTHER_EP = (2, 1, 1)


def distcp_objects(folder):
    """{fqn: object} of a DCP folder's bytes items, each unwrapped from the list Megatron-Core saves it in."""
    return {k: v[0][1][0] for k, v in support.distcp_items(folder).items()
            if not isinstance(v[0][1], torch.Tensor) and isinstance(v[0][1], list) and len(v[0][1]) == 1}


class ReshardReadsMegatronCoresDpReshardableMoeSavesTest(FixtureTestCase):
    """Megatron-Core 0.19's own dp_reshardable saves of the MoE model (tests/data/megatron-core/0.19-moe: EP 2,
    whose ChainedOptimizer writes `chained_0.` dense and `chained_1.` expert buckets, and TP 2 × EP 1, one
    optimizer whose buckets hold the experts too), read by reshard: converted to fully_reshardable at their own
    layout, every optimizer state is the one Megatron-Core held (TAG_optim_full.pt)."""

    def test_every_state_read_is_megatron_cores(self):
        for tag in ('w2_ep2', 'w2_tp2_ep1'):
            with self.subTest(save=tag):
                layout = config_of('0.19-moe/' + tag)['layout']
                src = os.path.join(DATA, '0.19-moe', tag + '_optim_dp_reshardable')
                out = self.path(tag)
                p = run('convert', src, out, '--to', 'torch_dist', '--optimizer-layout', FULLY, '--tp',
                        str(layout['tp']), '--ep', str(layout['ep']), '--dp', str(layout['dp']), *vocab(TAG))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                whole = self.path(tag + '_whole')
                p = run('export', os.path.join(out, 'iter_0000001'), whole, '--to', 'consolidated', '--format', 'pt',
                        '--rules', 'none')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got = torch.load(os.path.join(whole, 'pytorch_model.bin'))
                want = support.load(os.path.join(DATA, '0.19-moe', tag + '_optim_full.pt'))
                compared = elements = 0
                for state in STATES:
                    for key, tensor in want['optimizer'][state].items():
                        name = f'optimizer.state.{state}.{key}'
                        self.assertEqual(support.differences(got[name], tensor, name), [])
                        compared += 1
                        elements += tensor.numel()
                for key, tensor in want['model'].items():
                    self.assertEqual(support.differences(got[key], tensor, key), [])
                self.assertEqual(compared, 3 * 13)
                # The negative control: two experts' states traded do not pass the comparison.
                name = f'optimizer.state.exp_avg.{EXPERT_FC1}'
                self.assertNotEqual(support.differences(experts_swapped(got[name]), want['optimizer']['exp_avg'][
                    EXPERT_FC1], name), [])
                print(f'{tag}: {compared} optimizer tensors ({elements} elements) and {len(want["model"])} weights '
                      f'read from its dp_reshardable buckets equal Megatron-Core\'s', file=sys.stderr)

    def test_verify_finds_each_save_its_fully_reshardable_twin(self):
        for tag in ('w2_ep2', 'w2_tp2_ep1'):
            with self.subTest(save=tag):
                folder = os.path.join(DATA, '0.19-moe', tag + '_optim_')
                p = run('verify', folder + DP, folder + FULLY, *sizes(TAG))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                print(f'{tag}: {p.stdout.strip().splitlines()[-1]}', file=sys.stderr)


if __name__ == '__main__':
    support.main()
