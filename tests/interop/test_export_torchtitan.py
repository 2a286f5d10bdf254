"""`export --to torchtitan --dp-shard N` (engine/formats/hf/torchtitan_export.h): a torchtitan
checkpoint (`OUT/step-N/`, FSDP2 `Shard(0)` over N ranks) with its AdamW state.

Checked:

* real torch 2.6 torchtitan saves (tests/data/torchtitan: fsdp2_w2 at --dp-shard 1 and 3, the tied
  single_tied_w1 at 2) exported have the save's model and `optimizer.state` keys with the same global shapes and dtypes, each
  tensor cut as torch.chunk cuts dim 0 (the step one chunk), and the param groups' items; `verify`
  finds it the same model as the save, and its `export --to hf` equals the save's byte for byte;
* real torch 2.6 (the Debian trixie chroot, torch2_chroot.py; skipped with one line when it cannot
  be built) `dcp.load`s the output into the save's own model (tests/fixtures/torchtitan_save.py)
  in one process and under FSDP2 over 2 ranks, with tensors equal to the save's, and one more
  AdamW step from the loaded model and optimizer reaches the loss the save's run reached;
* a Megatron-DeepSpeed Llama with BF16 ZeRO shards -> torchtitan -> convert back at its layout:
  every fp32 master, exp_avg and exp_avg_sq equal the source's (through `export --to universal`),
  the weights are the masters (the source's bf16 weights are those cast), `verify` finds the
  torchtitan folder and the converted one the same model;
* what cannot be written is refused in one line, nothing written.

Run: /usr/bin/python3 tests/interop/test_export_torchtitan.py --reshard build/reshard
"""
import filecmp
import json
import os
import re

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
import torch2_chroot

run = support.reshard
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'torchtitan')
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'fixtures')
SAVE = os.path.join(DATA, 'fsdp2_w2', 'step-1')
HEADS = ('--set', 'num_attention_heads=4')
TENSOR_LINE = re.compile(r'^  (\S+) (\w+)\[([0-9, ]*)\], (\d+) chunks?:? ?(.*)$')


# Runs in torch 2.6: the save's own model (tests/fixtures/torchtitan_save.py), built as the save's
# run built it, loads /ckpt with dcp.load as torchtitan's checkpointer does (model keys at top level,
# the flattened AdamW state under `optimizer`), in one process and under FSDP2 over 2 forked ranks;
# rank 0 compares every tensor and param group value with /data's fsdp2_w2_full.pt, takes one more
# AdamW step and writes /out/world_N.json.
LOAD_AND_STEP = r'''
import datetime, functools, json, socket
namespace = {'__name__': 'torchtitan_save'}
with open('/fixtures/torchtitan_save.py') as f:
    exec(compile(f.read(), 'torchtitan_save.py', 'exec'), namespace)
CONFIG, OPTIM = namespace['CONFIG'], namespace['OPTIM']

def check(m):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    m.c.__dict__.update(CONFIG)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_of(model, opt):
        model_sd = get_model_state_dict(model)
        model_sd.pop('freqs_cis', None)
        return model_sd, get_optimizer_state_dict(model, opt, options=flat)

    def load_and_step(rank, world):
        torch.manual_seed(0)
        model = m.Transformer(False)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh('cpu', (world,), mesh_dim_names=('dp_shard',))
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, reshard_after_forward=namespace['RESHARD_AFTER_FORWARD'])
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=OPTIM['lr'], betas=OPTIM['betas'], eps=OPTIM['eps'],
                                weight_decay=OPTIM['weight_decay'], foreach=True, fused=False)
        # as the run (and torchtitan) built it before loading: it gives the groups initial_lr
        torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(m.constant_lr, warmup_steps=0))
        model_sd, optim_sd = state_of(model, opt)
        state = dict(model_sd, optimizer=optim_sd)
        dcp.load(state, checkpoint_id='/ckpt')
        set_model_state_dict(model, {k: state[k] for k in model_sd})
        set_optimizer_state_dict(model, opt, state['optimizer'], options=flat)
        model_sd, optim_sd = state_of(model, opt)
        # copies: the step below changes the parameters and moments in place
        got = {k: m.full(v).detach().clone() for k, v in model_sd.items()}
        got.update({'optimizer.' + k: m.full(v).detach().clone() if isinstance(v, torch.Tensor) else v
                    for k, v in optim_sd.items()})
        inputs, labels = m.batch()
        opt.zero_grad()
        loss = m.loss_of(model(inputs), labels)
        # torch 2.6's FSDP2 on gloo (no AVG reduction) sums the ranks' gradients: the run's steps
        # over 2 ranks of one batch took twice one process's gradient, so the one-process step
        # does too, or its Adam update (moments of the doubled gradients) is another
        (loss * (2 if world == 1 else 1)).backward()
        opt.step()
        with torch.no_grad():
            after = m.loss_of(model(inputs), labels).item()
        if rank != 0:
            return
        want = torch.load('/data/fsdp2_w2_full.pt', weights_only=False)
        want = {k: v for k, v in want.items() if not k.startswith(('lr_scheduler.', 'dataloader.', 'train_state.'))}
        differ = [f'{k}: {got.get(k)!r:.60} vs {v!r:.60}' for k, v in want.items()
                  if k not in got or not (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v)]
        with open(f'/out/world_{world}.json', 'w') as f:
            json.dump({'compared': len(want), 'differ': differ, 'extra': sorted(set(got) - set(want)),
                       'loss_forward': loss.item(), 'loss_after_next_step': after}, f)

    def rank_main(rank, port):
        dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=300))
        torch.set_num_threads(1)
        load_and_step(rank, 2)
        dist.destroy_process_group()

    with socket.socket() as s:  # forked first, while this process has no threads
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(port,), nprocs=2, start_method='fork')
    load_and_step(0, 1)

namespace['inside_main']('/out', then=check)
'''


def dcp_tensors(folder):
    """{key: (dtype, shape, [(offsets, sizes), ...])} as `inspect --rules none` lists a DCP folder."""
    p = run('inspect', folder, '--rules', 'none')
    assert p.returncode == 0, p.stdout + p.stderr
    out = {}
    for line in p.stdout.splitlines():
        m = TENSOR_LINE.match(line)
        if m:
            shape = [int(d) for d in m.group(3).split(',') if d.strip()]
            chunks = [([int(x) for x in re.findall(r'\d+', at)], [int(x) for x in re.findall(r'\d+', size)])
                      for at, size in re.findall(r'\[([0-9, ]*)\]\+\[([0-9, ]*)\]', m.group(5))]
            out[m.group(1)] = (m.group(2), shape, chunks)
    return out


def saved(key):
    """The keys a torchtitan export carries: the model and the AdamW state."""
    return not key.startswith(('lr_scheduler.', 'train_state.', 'dataloader.'))


def chunk_rows(rows, n):
    """The rows of each non-empty share of torch.chunk over n (what DTensor's Shard(0) holds)."""
    return [len(c) for c in torch.arange(rows).chunk(n)]


class ExportTorchtitanTest(FixtureTestCase):

    def export(self, src, out, n, *extra):
        p = run('export', src, out, '--to', 'torchtitan', '--dp-shard', n, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def test_a_torchtitan_save_round_trips_at_any_world_size(self):
        keys = 0
        # the FSDP2 save at 1 and 3 ranks (uneven shares); the tied one (its head under both keys) at 2
        for name, worlds in (('fsdp2_w2', (1, 3)), ('single_tied_w1', (2,))):
            keys += self.round_trip(os.path.join(DATA, name, 'step-1'), worlds)
        print(f'\n[ torchtitan ] {keys} keys, shapes, dtypes and torch.chunk shares at dp_shard 1, 2 and 3; '
              f'same model; HF export byte-equal')

    def round_trip(self, save, worlds):
        want = {k: v for k, v in dcp_tensors(save).items() if saved(k)}
        hf_src = self.path(os.path.basename(os.path.dirname(save)) + '_hf')
        p = run('export', save, hf_src, '--to', 'hf', *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for n in worlds:
            with self.subTest(save=save, dp_shard=n):
                out = self.path(f'{os.path.basename(hf_src)}_tt{n}')
                self.export(save, out, n, *HEADS)
                self.assertEqual(sorted(os.listdir(os.path.join(out, 'step-1'))),
                                 ['.metadata'] + [f'__{r}_0.distcp' for r in range(n)])
                got = dcp_tensors(os.path.join(out, 'step-1'))
                self.assertEqual(sorted(got), sorted(want))
                for key, (dtype, shape, chunks) in got.items():
                    self.assertEqual((dtype, shape), want[key][:2], key)
                    if not shape:  # a step: one 0-d chunk
                        self.assertEqual(len(chunks), 1, key)
                        continue
                    self.assertEqual([size[0] for at, size in chunks], chunk_rows(shape[0], n), key)
                    self.assertEqual([at[0] for at, size in chunks],
                                     [sum(chunk_rows(shape[0], n)[:i]) for i in range(len(chunks))], key)
                p = run('inspect', os.path.join(out, 'step-1'), '--rules', 'none')
                groups = set(re.findall(r'optimizer\.param_groups\.tok_embeddings\.weight\.(\w+)', p.stdout))
                self.assertEqual(groups, {'lr', 'initial_lr', 'betas', 'eps', 'weight_decay', 'amsgrad', 'foreach',
                                          'maximize', 'capturable', 'differentiable', 'fused'})
                p = run('verify', save, os.path.join(out, 'step-1'), *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                hf_out = out + '_hf'
                p = run('export', os.path.join(out, 'step-1'), hf_out, '--to', 'hf', *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                for name in ('model.safetensors', 'config.json'):
                    self.assertTrue(filecmp.cmp(os.path.join(hf_src, name), os.path.join(hf_out, name), shallow=False),
                                    name)
        return len(want)

    def test_megatron_deepspeed_to_torchtitan_and_back(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        tt = self.path('tt')
        p = self.export(src, tt, 2)
        self.assertIn('39 of 39 tensors from the fp32 masters', p.stdout + p.stderr)
        step = os.path.join(tt, 'step-10')
        heads = ('--set', 'num_attention_heads=12')
        back = self.path('back')
        p = run('convert', step, back, '--tp', 2, '--pp', 2, '--dp', 1, '--no-update-latest', *heads,
                '--set', 'make_vocab_size_divisible_by=8')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', step, back, *heads)
        self.assertIn('same model', p.stdout, p.stdout + p.stderr)
        # The weights: the masters, which the source's bf16 weights are cast from.
        for name, folder, extra in (('c_src', src, ()), ('c_back', back, ('--dtype', 'bf16'))):
            p = run('export', folder, self.path(name), '--to', 'consolidated', '--from', 'weights', *extra)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertTrue(filecmp.cmp(self.path('c_src', 'model.safetensors'), self.path('c_back', 'model.safetensors'),
                                    shallow=False))
        # Every optimizer state, through the universal export (the true vocabulary rows: the
        # source's padding rows are not the model's).
        for name, folder in (('u_src', src), ('u_back', back)):
            p = run('export', folder, self.path(name), '--to', 'universal')
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        params = sorted(p for p in os.listdir(self.path('u_src', 'zero')) if os.path.isdir(self.path('u_src', 'zero', p)))
        self.assertEqual(params, sorted(p for p in os.listdir(self.path('u_back', 'zero'))
                                        if os.path.isdir(self.path('u_back', 'zero', p))))
        compared = 0
        for param in params:
            for state in ('fp32', 'exp_avg', 'exp_avg_sq'):
                a = support.load(self.path('u_src', 'zero', param, state + '.pt'))['param']
                b = support.load(self.path('u_back', 'zero', param, state + '.pt'))['param']
                if 'word_embeddings' in param:
                    a, b = a[:100], b[:100]
                self.assertTrue(torch.equal(a, b), f'{param} {state}')
                compared += 1
        self.assertEqual(compared, 3 * len(params))
        print(f'\n[ fixture ] Megatron-DeepSpeed -> torchtitan -> Megatron-DeepSpeed: {compared} optimizer '
              f'states equal, weights the masters')

    def test_torch_loads_it_and_takes_the_next_step(self):
        root = torch2_chroot.root_or_skip()
        out = self.path('tt')
        self.export(SAVE, out, 3, *HEADS)
        results = self.path('results')
        os.makedirs(results)
        p = torch2_chroot.run(root, LOAD_AND_STEP, {os.path.join(out, 'step-1'): '/ckpt', os.path.abspath(DATA): '/data',
                                                    os.path.abspath(FIXTURES): '/fixtures', results: '/out'})
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        want = torch.load(os.path.join(DATA, 'fsdp2_w2_logits.pt'))['loss_after_next_step']
        for world in (1, 2):
            with open(os.path.join(results, f'world_{world}.json')) as f:
                r = json.load(f)
            self.assertEqual((r['differ'], r['extra']), ([], []), world)
            self.assertGreater(r['compared'], 200)
            self.assertAlmostEqual(r['loss_after_next_step'], want, delta=1e-6, msg=f'world {world}')
            print(f'\n[ torch 2.6 ] world {world}: dcp.load of --dp-shard 3 gave {r["compared"]} keys equal to the '
                  f'save\'s; the next step\'s loss {r["loss_after_next_step"]:.7f} (the run: {want:.7f})')

    def test_refusals(self):
        out = self.path('refused')
        p = run('export', SAVE, out, '--to', 'torchtitan', *HEADS)
        self.assertRefused(p, 'needs --dp-shard N', out)
        p = run('export', SAVE, out, '--to', 'torchtitan', '--dp-shard', 2, '--tp', 2, *HEADS)
        self.assertRefused(p, 'leave out --tp and --pp', out)
        p = run('export', SAVE, out, '--to', 'hf', '--dp-shard', 2, *HEADS)
        self.assertRefused(p, '--dp-shard chooses the FSDP2 sharding of --to torchtitan', out)
        p = run('export', SAVE, out, '--to', 'torchtitan', '--dp-shard', 2, '--dtype', 'bf16', *HEADS)
        self.assertRefused(p, 'add --weights-only', out)
        gpt = make_fixture(self.path('gpt'), **dict(FAMILIES['ms_gpt2'], tp=1, pp=1, dp=1))
        p = run('export', gpt, out, '--to', 'torchtitan', '--dp-shard', 2)
        self.assertRefused(p, 'has none', out)
        # Weights only: no optimizer key.
        self.export(SAVE, out, 2, '--weights-only', *HEADS)
        self.assertFalse([k for k in dcp_tensors(os.path.join(out, 'step-1')) if k.startswith('optimizer.')])


if __name__ == '__main__':
    support.main()
