"""Megatron-Core 0.19.1 resumes reshard's `torch_dist` outputs of a Mixture-of-Experts model with its
distributed optimizer state.

Real Megatron-Core from PyPI (megatron_core_pypi.py), in the torch 2.6 chroot on CPU with gloo, trains the
MoE GPTModel of tests/data/megatron-core/0.19-moe (local spec, SequentialMLP, 4 experts top-2, 2 layers) at
EP 1, and again at EP 2 (world 2: TP 1, DP 2), with its DDP and distributed optimizer (Adam, lr 1e-3, wd
0.01): one step, a `fully_reshardable` save (the source, written by Megatron-Core itself), then one more step,
and the loss after it. reshard converts each source to EP 1 and EP 2 at TP 1 and at TP 2 (world 2, or 4 for
TP 2 × EP 2; the EP 2 source's ChainedOptimizer groups read as one optimizer's), and Megatron-Core, at each
of these layouts, builds its optimizers (at EP 1 one; at EP 2 a
ChainedOptimizer of the dense parameters' and the experts'), loads the output strictly with
StrictHandling.RAISE_ALL, saves what it then holds, and takes the second step. Checked:

* every optimizer state Megatron-Core loaded (fp32 master, exp_avg, exp_avg_sq of every parameter, the
  experts' too) equals the source's bit for bit, and so does every weight; the param groups it loaded
  are its own optimizers' (is_expert_parallel, wd_mult), at step 1;
* the loss of the step and the loss after it equal, bit for bit, what Megatron-Core's own save gives at
  that TP (resumed at its own EP, the structure it was saved with), and at TP 1 the source run's own; at
  TP 2, which sums in another order, they are within 1e-3 of the source run's;
* Megatron-Core's own save does not load at the other EP (its state has one optimizer where the
  ChainedOptimizer has two, or two where it has one), which is what the conversion is for;
* reshard's common state holds the param groups of the target's optimizers; at TP 1 each state is in the
  file Megatron-Core's own save of it puts it in (an expert's in its EP rank's); the optimizer layouts
  not written for a model with experts are refused in one line.

Skipped with one line when the chroot or the wheels cannot be had.

Run: /usr/bin/python3 tests/interop/test_megatron_core_moe_optimizer.py --reshard build/reshard
"""
import json
import os
import sys

import torch

import interop_support as support
from megatron_core_data import config_of
import megatron_core_pypi
import torch2_chroot
from test_megatron_core_moe import BUILD, WHOLE, placement, vocab

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
# As Megatron-LM 0.19 describes its sharded state dict with --use-distributed-optimizer
# --dist-ckpt-optim-fully-reshardable.
METADATA = {'distrib_optim_sharding_type': 'fully_reshardable', 'singleton_local_shards': False,
            'chained_optim_avoid_prefix': True}
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

def sharded(model, optimizer, is_loading=False):
    model_sd = model.sharded_state_dict()
    return {'model': model_sd, 'optimizer': optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                          metadata=METADATA)}
"""

# The source: one step, Megatron-Core's save, one more step and the loss after it.
SAVE = r"""
def source(r, port, world, tp, ep):
    start(r, port, world)
    model, ddp, optimizer = trained(tp, ep)
    losses = [train_step(model, ddp, optimizer)]
    os.makedirs('/data/source', exist_ok=True)
    dist_checkpointing.save({**sharded(model, optimizer), 'iteration': 1}, '/data/source')
    losses.append(train_step(model, ddp, optimizer))
    with torch.no_grad():
        losses.append(loss_of(model).item())
    if r == 0:
        with open('/data/source_losses.json', 'w') as f:
            json.dump(losses, f)
    end_megatron_rank()

worlds(source, [%r])
save_whole('/data/source')
"""

# Each case (world, folder, resaved, record, TP, EP): load the folder strictly with the optimizer state,
# save what is held, take the second step; the record says what happened.
RESUME = r"""
CASES = json.loads(%r)

def resume(r, port, world, folder, resaved, record, tp, ep):
    start(r, port, world)
    model, ddp, optimizer = trained(tp, ep)
    out = {}
    try:
        state = dist_checkpointing.load(sharded(model, optimizer, is_loading=True), folder,
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
        out['losses'] = [train_step(model, ddp, optimizer)]
        with torch.no_grad():
            out['losses'].append(loss_of(model).item())
    if r == 0:
        with open(record, 'w') as f:
            json.dump(out, f)
    end_megatron_rank()

worlds(resume, CASES)
for case in CASES:
    if os.path.exists(case[2]):
        save_whole(case[2])
"""

STATES = ('param', 'exp_avg', 'exp_avg_sq')
EXPERT_FC1 = 'decoder.layers.mlp.experts.experts.linear_fc1.weight'
ROUTER = 'decoder.layers.mlp.router.weight'


def script(*parts):
    model = config_of(TAG)['model']
    return (torch2_chroot.END_RANK + megatron_core_pypi.RANKS + megatron_core_pypi.OPTIMIZER + BUILD + WHOLE +
            megatron_core_pypi.LOSS_OF + TRAIN % json.dumps(model) + ''.join(parts))


class MegatronCoreResumesMoeOptimizerTest(megatron_core_pypi.MegatronCoreTestCase):
    """From Megatron-Core's save at EP 1."""
    TIMEOUT = 900
    SAVE = None  # made in setUpClass: the script needs the model's sizes
    SOURCE_LAYOUT = (2, 1, 1)  # world, TP, EP
    # (output, world, TP, EP): reshard's outputs of the source, and the layouts Megatron-Core resumes them at.
    CASES = (('ep1', 2, 1, 1), ('ep2', 2, 1, 2), ('tp2_ep1', 2, 2, 1), ('tp2_ep2', 4, 2, 2))
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
        cases = []  # (name, [world, folder, resaved, record, TP, EP])
        for name, world, tp, ep in cls.CASES:
            out = os.path.join(cls.work, name)
            p = run('convert', os.path.join(cls.work, 'source'), out, '--to', 'torch_dist', '--tp', str(tp),
                    '--ep', str(ep), '--dp', str(world // tp), *vocab(TAG))
            if p.returncode:
                raise AssertionError(p.stdout + p.stderr)
            cls.notes = p.stdout + p.stderr
            cases.append((name, [world, f'/data/{name}/iter_0000001', f'/data/{name}_resaved',
                                 f'/data/{name}.json', tp, ep]))
        # Megatron-Core's own save, at its own layout, at TP 2 and at the other EP.
        own = (('own', cls.SOURCE_LAYOUT), ('own_tp2', cls.OWN_TP2), ('own_other_ep', cls.OTHER_EP))
        for name, (world, tp, ep) in own:
            cases.append((name, [world, '/data/source', f'/data/{name}_resaved', f'/data/{name}.json', tp, ep]))
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
        for name, _, tp, ep in self.CASES:
            with self.subTest(output=name):
                self.resumed(name)
                held = torch.load(os.path.join(self.work, name + '_resaved_full.pt'))
                self.assertEqual(sorted(held), sorted(self.source))
                for key, tensor in held.items():
                    self.assertEqual(support.differences(tensor, self.source[key], key), [])
                fc1, router = (held[f'optimizer.state.exp_avg_sq.{k}'] for k in (EXPERT_FC1, ROUTER))
                print(f'{name} (TP {tp}, EP {ep}): {len(held)} tensors equal to the source\'s; exp_avg_sq of '
                      f'layer 1 expert 3 fc1 [0, :3] {fc1[1, 3, 0, :3].tolist()}, of the router [1, 2, :3] '
                      f'{router[1, 2, :3].tolist()}', file=sys.stderr)
        # The moments are the step's, not zeros: a check that the comparison compares something.
        self.assertGreater(self.source[f'optimizer.state.exp_avg_sq.{EXPERT_FC1}'].abs().min().item(), 0)

    def test_the_param_groups_loaded_are_the_targets_optimizers(self):
        dense = [[False, 1.0, 1.0], [False, 0.0, 1.0]]
        for name, _, _, ep in self.CASES:
            with self.subTest(output=name):
                want = sorted(dense) if ep == 1 else sorted(dense) + [[True, 1.0, 1.0]]
                got = self.resumed(name)['groups']
                self.assertEqual(sorted(got[:2]) + got[2:], want)

    def test_at_tp_1_each_state_is_in_the_file_megatron_core_writes_it_in(self):
        # (At TP 2 Megatron-Core writes a dense state's TP pieces from each TP rank, reshard the whole
        # state from TP rank 0: the same tensor to a load.)
        for name, _, tp, ep in self.CASES:
            if tp != 1:
                continue
            with self.subTest(output=name):
                ours, theirs = (placement(os.path.join(self.work, folder))
                                for folder in (os.path.join(name, 'iter_0000001'), name + '_resaved'))
                states = {k: v for k, v in ours.items() if k[0].startswith('optimizer.state.')}
                self.assertEqual(states, {k: v for k, v in theirs.items() if k[0].startswith('optimizer.state.')})
                # An expert's states in the file of its EP rank.
                files = {v for k, v in states.items() if k[0].endswith(EXPERT_FC1)}
                self.assertEqual(len(files), ep)

    def test_the_next_step_is_the_source_runs(self):
        want = self.source_losses[1:]
        self.assertLess(want[1], want[0])  # the step trains
        for name, _, tp, ep in self.CASES:
            with self.subTest(output=name):
                got = self.resumed(name)['losses']
                # Megatron-Core's own save resumed at this TP (at its own EP): TP 2 sums in another order.
                own = self.resumed('own' if tp == 1 else 'own_tp2')['losses']
                self.assertEqual(got, own)
                if tp == 1:
                    self.assertEqual(got, want)
                for g, w in zip(got, want):
                    self.assertAlmostEqual(g, w, delta=1e-3)
                print(f'{name} (TP {tp}, EP {ep}): step loss {got[0]!r}, after it {got[1]!r}; Megatron-Core\'s own '
                      f'save at TP {tp}: {own[0]!r}, {own[1]!r}; the source run: {want[0]!r}, {want[1]!r}',
                      file=sys.stderr)

    def test_megatron_cores_own_save_does_not_resume_at_the_other_ep(self):
        self.assertIn('error', self.records['own_other_ep'])
        print(f'Megatron-Core\'s own EP {self.SOURCE_LAYOUT[2]} save at EP {self.OTHER_EP[2]}:',
              self.records['own_other_ep']['error'][:300], file=sys.stderr)

    def test_the_common_state_holds_the_targets_param_groups(self):
        for name, _, _, ep in self.CASES:
            with self.subTest(output=name):
                folder = os.path.join(self.work, name, 'iter_0000001')
                optimizer = support.distcp_items(folder)['common_state/shard_0_1'][0][1][0]['optimizer']
                entries = [optimizer] if ep == 1 else [optimizer[0], optimizer[1]]
                self.assertEqual([[g['is_expert_parallel'] for g in e['optimizer']['param_groups']] for e in entries],
                                 [[False, False]] if ep == 1 else [[False, False], [True]])
                self.assertEqual({e['param_state_sharding_type'] for e in entries}, {'fully_reshardable'})

    def test_the_layouts_not_written_for_experts_are_refused_in_one_line(self):
        for layout in ('dp_reshardable', 'fully_sharded_model_space'):
            with self.subTest(layout=layout):
                out = os.path.join(self.work, 'refused_' + layout)
                p = run('convert', os.path.join(self.work, 'source'), out, '--to', 'torch_dist', '--ep', '2',
                        '--dp', '2', '--optimizer-layout', layout, *vocab(TAG))
                self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
                lines = p.stderr.strip().splitlines()
                self.assertEqual(len(lines), 1, p.stderr)
                self.assertIn('the optimizer state of a model with experts is written as fully_reshardable only, '
                              f'not yet as {layout}; give --optimizer-layout fully_reshardable', lines[0])
                self.assertFalse(os.path.exists(out))


class MegatronCoreResumesMoeOptimizerFromEp2Test(MegatronCoreResumesMoeOptimizerTest):
    """From Megatron-Core's save at EP 2, whose ChainedOptimizer keeps the dense and the experts' groups apart
    (read as one optimizer's, split again for the target's EP)."""
    SOURCE_LAYOUT = (2, 1, 2)
    CASES = (('ep1', 2, 1, 1), ('ep2', 2, 1, 2), ('tp2_ep1', 2, 2, 1))
    OWN_TP2 = (4, 2, 2)
    OTHER_EP = (2, 1, 1)


if __name__ == '__main__':
    support.main()
