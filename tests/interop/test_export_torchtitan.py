"""`export --to torchtitan --dp-shard N [--tp T]` (engine/formats/torchtitan/torchtitan_export.h): a
torchtitan checkpoint (`OUT/step-N/`, FSDP2 `Shard(0)` over N ranks, or FSDP x TP over the mesh
[dp_shard N, tp T] as torchtitan's TP plan shards each tensor) with its AdamW state.

Checked:

* real torch 2.6 torchtitan saves (tests/data/torchtitan: fsdp2_w2 at --dp-shard 1 and 3, the tied
  single_tied_w1 at 2, the FSDP x TP fsdp2_tp_w4 at 2 x 2, 1 x 2 and 3 x 2) exported have the save's
  model and `optimizer.state` keys with the same global shapes and dtypes, each tensor cut as torch
  places it (TP's share of the dim the save's placements shard, torch.chunk of its rows over
  dp_shard, the replicas once; each chunk in its rank's file; the step one chunk), and the param
  groups' items; `verify` finds it the same model as the save, and its `export --to hf` equals the
  save's byte for byte;
* fsdp2_tp_w4 exported at its own layout gives back every chunk torch wrote, bit for bit, at the
  same offsets and (but the TP replicas, which torch's planner places by load) in the same files;
* real torch 2.6 (the Debian trixie chroot, torch2_chroot.py; skipped with one line when it cannot
  be built) `dcp.load`s the output into the save's own model (tests/fixtures/torchtitan_save.py)
  in one process, under FSDP2 over 2 ranks, and under FSDP x TP on the meshes 2 x 2 and 1 x 2,
  with tensors equal to the save's and the save's logits, and one more AdamW step from the loaded
  model and optimizer reaches the loss the save's run reached;
* a Megatron-DeepSpeed Llama with BF16 ZeRO shards -> torchtitan (FSDP, and FSDP x TP) -> convert
  back at its layout: every fp32 master, exp_avg and exp_avg_sq equal the source's (through
  `export --to universal`), the weights are the masters (the source's bf16 weights are those
  cast), `verify` finds the torchtitan folder and the converted one the same model;
* what cannot be written is refused in one line, nothing written: a --tp that cuts a head or shares
  a dim unevenly, a rule set whose torchtitan section declares no TP sharding, --pp.

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


# Runs in torch 2.6, RUN (a dict set before it) saying what: the model of
# tests/fixtures/torchtitan_save.py, its CONFIG changed by RUN['config'], built as torchtitan builds it
# (torchtitan_save.parallelize: on a mesh [dp_shard] or [dp_shard, tp], TP plan then FSDP2; no mesh:
# one process, plain tensors), its AdamW and LambdaLR built before loading as torchtitan's are; it
# dcp.loads each of RUN['loads'] ([label, checkpoint folder inside, mesh shape]), model keys at top
# level and (RUN['optimizer']) the flattened AdamW state under `optimizer`, as torchtitan's
# checkpointer does. Rank 0 compares every tensor and param group value with RUN['want'] (a
# torch.save of {key: value}; its run states, and without RUN['optimizer'] its AdamW state, left
# out), keeps the fixed batch and its logits and, with the optimizer, takes one
# more AdamW step: /out/<label>.json and /out/<label>_logits.pt. The loads on a mesh run on forked
# ranks (gloo) first, the one-process loads after.
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
    from torch.distributed.device_mesh import init_device_mesh
    m.c.__dict__.update(CONFIG, **RUN['config'])
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_of(model, opt):
        model_sd = get_model_state_dict(model)
        model_sd.pop('freqs_cis', None)
        return model_sd, get_optimizer_state_dict(model, opt, options=flat)

    def load_and_step(rank, label, ckpt, shape):
        torch.manual_seed(0)
        model = m.Transformer(RUN.get('tied', False))
        dp = 1
        if shape:
            dims = ('dp_shard', 'tp')[:len(shape)]
            _, dp = m.parallelize(model, init_device_mesh('cpu', tuple(shape), mesh_dim_names=dims), dims)
        opt = torch.optim.AdamW(model.parameters(), lr=OPTIM['lr'], betas=OPTIM['betas'], eps=OPTIM['eps'],
                                weight_decay=OPTIM['weight_decay'], foreach=True, fused=False)
        # as the run (and torchtitan) built it before loading: it gives the groups initial_lr
        torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(m.constant_lr, warmup_steps=0))
        model_sd, optim_sd = state_of(model, opt)
        state = dict(model_sd, optimizer=optim_sd) if RUN['optimizer'] else dict(model_sd)
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, {k: state[k] for k in model_sd})
        if RUN['optimizer']:
            set_optimizer_state_dict(model, opt, state['optimizer'], options=flat)
        model_sd, optim_sd = state_of(model, opt)
        # copies: the step below changes the parameters and moments in place
        got = {k: m.full(v).detach().clone() for k, v in model_sd.items()}
        if RUN['optimizer']:
            got.update({'optimizer.' + k: m.full(v).detach().clone() if isinstance(v, torch.Tensor) else v
                        for k, v in optim_sd.items()})
        inputs, labels = m.batch()
        opt.zero_grad()
        logits = model(inputs)
        loss = m.loss_of(logits, labels)
        result = {'loss_forward': loss.item()}
        if RUN['optimizer']:
            # torch 2.6's FSDP2 on gloo (no AVG reduction) sums the data-parallel ranks' gradients:
            # the run's steps over grad_dp ranks of one batch took grad_dp times one process's
            # gradient, so a step over dp ranks scales the loss by grad_dp / dp, or its Adam update
            # (moments of other gradients) is another
            (loss * (RUN['grad_dp'] / dp)).backward()
            opt.step()
            with torch.no_grad():
                result['loss_after_next_step'] = m.loss_of(model(inputs), labels).item()
        if rank != 0:
            return
        # what an export carries: the model and (RUN['optimizer']) its AdamW state, no run state
        left_out = ('lr_scheduler.', 'dataloader.', 'train_state.') + (() if RUN['optimizer'] else ('optimizer.',))
        want = {k: v for k, v in torch.load(RUN['want'], weights_only=False).items() if not k.startswith(left_out)}
        result['differ'] = [f'{k}: {got.get(k)!r:.60} vs {v!r:.60}' for k, v in want.items()
                            if k not in got or not (torch.equal(got[k], v) if isinstance(v, torch.Tensor)
                                                    else got[k] == v)]
        result.update(compared=len(want), extra=sorted(set(got) - set(want)))
        torch.save({'logits': logits.detach().float(), 'input_ids': inputs}, f'/out/{label}_logits.pt')
        with open(f'/out/{label}.json', 'w') as f:
            json.dump(result, f)

    def rank_main(rank, port, label, ckpt, shape):
        world = 1
        for n in shape:
            world *= n
        dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        torch.set_num_threads(1)
        load_and_step(rank, label, ckpt, shape)
        end_rank(dist)

    for label, ckpt, shape in RUN['loads']:  # forked first, while this process has no threads
        if not shape:
            continue
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
        world = 1
        for n in shape:
            world *= n
        mp.start_processes(rank_main, args=(port, label, ckpt, shape), nprocs=world, start_method='fork')
    for label, ckpt, shape in RUN['loads']:
        if not shape:
            load_and_step(0, label, ckpt, shape)

namespace['inside_main']('/out', then=check)
'''


def load_in_torch2(test, run_spec, binds):
    """Runs LOAD_AND_STEP in the torch 2.6 chroot (the test skipped with one line without it) with
    RUN = run_spec and `binds` ({host folder: folder inside}; /data, /fixtures and /out are added);
    returns {label: (result dict, {'logits': the batch's logits, 'input_ids': the batch})}."""
    root = torch2_chroot.root_or_skip()
    results = test.path('torch2_results')
    os.makedirs(results, exist_ok=True)
    binds = dict(binds, **{os.path.abspath(DATA): '/data', os.path.abspath(FIXTURES): '/fixtures', results: '/out'})
    p = torch2_chroot.run(root, f'RUN = {run_spec!r}\n' + torch2_chroot.END_RANK + LOAD_AND_STEP, binds)
    test.assertEqual(p.returncode, 0, p.stdout + p.stderr)
    out = {}
    for label, _, _ in run_spec['loads']:
        with open(os.path.join(results, label + '.json')) as f:
            out[label] = (json.load(f), torch.load(os.path.join(results, label + '_logits.pt')))
    return out


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


def tp_dims():
    """{key: the dim torchtitan's TP plan shards it on (None: replicated)} of every model key and
    moment, as torch 2.6 recorded the placements of fsdp2_tp_w4 ([FSDP's, TP's]: 'S(1)', 'R')."""
    with open(os.path.join(DATA, 'fsdp2_tp_w4_config.json')) as f:
        placements = json.load(f)['placements']
    dims = {k: int(tp[2]) if tp.startswith('S(') else None for k, (_, tp) in placements.items()}
    dims.update({f'optimizer.state.{k}.{moment}': d for k, d in dims.items() for moment in ('exp_avg', 'exp_avg_sq')})
    return dims


def expected_boxes(shape, tp_dim, dp, tp):
    """{chunk offsets: (sizes, rank)} of a tensor cut over the mesh [dp_shard, tp] (rank d * tp + t):
    TP rank t holds the t-th equal share of tp_dim, FSDP2 then torch.chunks the rows of that share
    over dp (a replicated tensor's rows: written by TP rank 0); an empty share has no chunk."""
    if not shape:
        return {(): ([], 0)}
    out = {}
    for d in range(dp):
        for t in range(tp if tp_dim is not None else 1):
            offsets, sizes = [0] * len(shape), list(shape)
            if tp_dim is not None:
                sizes[tp_dim] = shape[tp_dim] // tp
                offsets[tp_dim] = t * sizes[tp_dim]
            rows = chunk_rows(sizes[0], dp)
            if d < len(rows):
                offsets[0] += sum(rows[:d])
                sizes[0] = rows[d]
                out[tuple(offsets)] = (sizes, d * tp + t)
    return out


def chunk_ranks(folder):
    """{(key, chunk offsets): the rank whose __R_0.distcp file holds it} of a DCP folder."""
    return {(index.fqn, tuple(index.offset)): int(re.match(r'__(\d+)_0\.distcp$', where.relative_path).group(1))
            for index, where in support.dcp_metadata(folder).storage_data.items()
            if getattr(index, 'offset', None) is not None}


class ExportTorchtitanTest(FixtureTestCase):

    def export(self, src, out, n, *extra):
        p = run('export', src, out, '--to', 'torchtitan', '--dp-shard', n, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def test_a_torchtitan_save_round_trips_at_any_layout(self):
        keys = 0
        # the FSDP2 save at 1 and 3 ranks (uneven shares); the tied one (its head under both keys) at 2;
        # the FSDP x TP save at dp_shard 2 x TP 2 (its own), 1 x 2, and 3 x 2 (uneven FSDP shares)
        for name, layouts in (('fsdp2_w2', ((1, 1), (3, 1))), ('single_tied_w1', ((2, 1),)),
                              ('fsdp2_tp_w4', ((2, 2), (1, 2), (3, 2)))):
            keys += self.round_trip(os.path.join(DATA, name, 'step-1'), layouts)
        print(f'\n[ torchtitan ] {keys} keys, shapes, dtypes and chunks (TP shares, torch.chunk FSDP shares, '
              f'rank files) at dp_shard x tp 1, 2, 3, 1x2, 2x2, 3x2; same model; HF export byte-equal')

    def round_trip(self, save, layouts):
        want = {k: v for k, v in dcp_tensors(save).items() if saved(k)}
        hf_src = self.path(os.path.basename(os.path.dirname(save)) + '_hf')
        p = run('export', save, hf_src, '--to', 'hf', *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        dims = tp_dims()
        for dp, tp in layouts:
            with self.subTest(save=save, dp_shard=dp, tp=tp):
                out = self.path(f'{os.path.basename(hf_src)}_tt{dp}x{tp}')
                self.export(save, out, dp, '--tp', tp, *HEADS)
                self.assertEqual(sorted(os.listdir(os.path.join(out, 'step-1'))),
                                 ['.metadata'] + [f'__{r}_0.distcp' for r in range(dp * tp)] + ['reshard-model.json'])
                got = dcp_tensors(os.path.join(out, 'step-1'))
                ranks = chunk_ranks(os.path.join(out, 'step-1'))
                self.assertEqual(sorted(got), sorted(want))
                for key, (dtype, shape, chunks) in got.items():
                    self.assertEqual((dtype, shape), want[key][:2], key)
                    boxes = expected_boxes(shape, dims.get(key), dp, tp)
                    self.assertEqual({tuple(at): size for at, size in chunks}, {at: b[0] for at, b in boxes.items()},
                                     key)
                    self.assertEqual({at: ranks[key, at] for at in boxes}, {at: b[1] for at, b in boxes.items()}, key)
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

    def test_the_fsdp_tp_save_comes_back_bit_for_bit(self):
        """fsdp2_tp_w4 read and written again at its own layout: every chunk torch wrote, at the same
        offsets, in the same rank's file, with the same values, and every param group item."""
        save = os.path.join(DATA, 'fsdp2_tp_w4', 'step-1')
        out = self.path('tt')
        self.export(save, out, 2, '--tp', 2, *HEADS)
        ours, torchs = support.distcp_items(os.path.join(out, 'step-1')), support.distcp_items(save)
        self.assertEqual(sorted(ours), sorted(k for k in torchs if saved(k)))
        chunks = 0
        for key, items in ours.items():
            want = {tuple(at): value for at, value in torchs[key]}
            self.assertEqual(sorted(tuple(at) for at, _ in items), sorted(want), key)
            for at, value in items:
                if isinstance(value, torch.Tensor):
                    self.assertEqual(value.dtype, want[tuple(at)].dtype, key)
                    self.assertTrue(torch.equal(value, want[tuple(at)]), f'{key} at {at}')
                    chunks += 1
                else:
                    self.assertEqual(value, want[tuple(at)], key)
        # The same rank files, but for the TP replicas (the norms and their moments), which torch's
        # planner gives to the less loaded rank of their dp_shard row and reshard to its TP rank 0.
        dims, ours, torchs = tp_dims(), chunk_ranks(os.path.join(out, 'step-1')), chunk_ranks(save)
        same = 0
        for (key, at), rank in ours.items():
            if dims.get(key, 0) is None:
                self.assertEqual(rank // 2, torchs[key, at] // 2, key)
            elif at:  # not a step, which torch also places by load
                self.assertEqual(rank, torchs[key, at], key)
                same += 1
        print(f'\n[ torchtitan ] fsdp2_tp_w4 -> --dp-shard 2 --tp 2: {chunks} chunks equal to torch\'s bit for bit; '
              f'{same} TP-sharded ones in the same rank\'s file, the replicas in their dp_shard row\'s')

    def test_torch_loads_fsdp_tp_exports_and_takes_the_next_step(self):
        """The FSDP x TP save exported at its own layout (2 x 2), at 1 x 2, and at 3 x 2 (uneven FSDP
        shares, which torch 2.6's FSDP over TP cannot build, so loaded in one process): loaded into
        torchtitan's model on the same mesh, and the first into one process."""
        save = os.path.join(DATA, 'fsdp2_tp_w4', 'step-1')
        binds, loads = {}, []
        for dp, tp, meshes in ((2, 2, ([2, 2], [])), (1, 2, ([1, 2],)), (3, 2, ([],))):
            out = self.path(f'tt{dp}x{tp}')
            self.export(save, out, dp, '--tp', tp, *HEADS)
            binds[os.path.join(out, 'step-1')] = f'/ckpt{dp}x{tp}'
            loads += [[f'dp_shard{dp}_tp{tp}_on_' + ('x'.join(map(str, mesh)) or 'one_process'), f'/ckpt{dp}x{tp}', mesh]
                      for mesh in meshes]
        got = load_in_torch2(self, {'config': {'ffn': 28}, 'want': '/data/fsdp2_tp_w4_full.pt', 'optimizer': True,
                                    'grad_dp': 2, 'loads': loads}, binds)
        self.assertEqual(len(got), 4)
        self.assertLoadedTheRun(got, 'fsdp2_tp_w4', 'dcp.load')
        reference = torch.load(os.path.join(DATA, 'fsdp2_tp_w4_logits.pt'))
        for label, (r, out) in got.items():
            self.assertLess((out['logits'] - reference['logits']).abs().max().item(), 1e-5, label)
            self.assertAlmostEqual(r['loss_forward'], reference['loss_after'], delta=1e-6, msg=label)

    def test_megatron_deepspeed_to_torchtitan_and_back(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        heads = ('--set', 'num_attention_heads=12')
        # the source's weights (the masters' bf16 casts) and optimizer states, as the ones back must be
        u_src, c_src = self.path('u_src'), self.path('c_src')
        for folder, to in ((c_src, ('consolidated', '--from', 'weights')), (u_src, ('universal',))):
            p = run('export', src, folder, '--to', *to)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for dp, tp in ((2, 1), (2, 2)):  # FSDP2, and FSDP x TP
            with self.subTest(dp_shard=dp, tp=tp):
                tt = self.path(f'tt{dp}x{tp}')
                p = self.export(src, tt, dp, '--tp', tp)
                self.assertIn('39 of 39 tensors from the fp32 masters', p.stdout + p.stderr)
                step = os.path.join(tt, 'step-10')
                back = self.path(f'back{dp}x{tp}')
                p = run('convert', '--to', 'deepspeed', step, back, '--tp', 2, '--pp', 2, '--dp', 1, '--no-update-latest', *heads,
                        '--set', 'make_vocab_size_divisible_by=8')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                p = run('verify', step, back, *heads)
                self.assertIn('same model', p.stdout, p.stdout + p.stderr)
                compared = self.assertSameRun(c_src, u_src, back)
                print(f'\n[ fixture ] Megatron-DeepSpeed -> torchtitan (dp_shard {dp} x tp {tp}) -> Megatron-DeepSpeed: '
                      f'{compared} optimizer states equal, weights the masters')

    def assertSameRun(self, c_src, u_src, back):
        """`back` holds the weights of `c_src` (cast to bf16: the masters) and every optimizer state of
        `u_src`; returns how many states were compared."""
        c_back, u_back = back + '_c', back + '_u'
        p = run('export', back, c_back, '--to', 'consolidated', '--from', 'weights', '--dtype', 'bf16')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertTrue(filecmp.cmp(os.path.join(c_src, 'model.safetensors'), os.path.join(c_back, 'model.safetensors'),
                                    shallow=False))
        # Every optimizer state, through the universal export (the true vocabulary rows: the
        # source's padding rows are not the model's).
        p = run('export', back, u_back, '--to', 'universal')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        params = sorted(p for p in os.listdir(os.path.join(u_src, 'zero')) if os.path.isdir(os.path.join(u_src, 'zero', p)))
        self.assertEqual(params, sorted(p for p in os.listdir(os.path.join(u_back, 'zero'))
                                        if os.path.isdir(os.path.join(u_back, 'zero', p))))
        compared = 0
        for param in params:
            for state in ('fp32', 'exp_avg', 'exp_avg_sq'):
                a = support.load(os.path.join(u_src, 'zero', param, state + '.pt'))['param']
                b = support.load(os.path.join(u_back, 'zero', param, state + '.pt'))['param']
                if 'word_embeddings' in param:
                    a, b = a[:100], b[:100]
                self.assertTrue(torch.equal(a, b), f'{param} {state}')
                compared += 1
        self.assertEqual(compared, 3 * len(params))
        return compared

    def test_torch_loads_it_and_takes_the_next_step(self):
        out = self.path('tt')
        self.export(SAVE, out, 3, *HEADS)
        loads = [['world_2', '/ckpt', [2]], ['world_1', '/ckpt', []]]
        got = load_in_torch2(self, {'config': {}, 'want': '/data/fsdp2_w2_full.pt', 'optimizer': True, 'grad_dp': 2,
                                    'loads': loads}, {os.path.join(out, 'step-1'): '/ckpt'})
        self.assertLoadedTheRun(got, 'fsdp2_w2', 'dcp.load of --dp-shard 3')

    def assertLoadedTheRun(self, got, save, what):
        """Every load gave every key of the save (its model and AdamW state) equal, and one more AdamW
        step the loss the save's run reached."""
        want = torch.load(os.path.join(DATA, save + '_logits.pt'))['loss_after_next_step']
        for label, (r, _) in got.items():
            self.assertEqual((r['differ'], r['extra']), ([], []), label)
            self.assertGreater(r['compared'], 200)
            self.assertAlmostEqual(r['loss_after_next_step'], want, delta=1e-6, msg=label)
            print(f'\n[ torch 2.6 ] {label}: {what} gave {r["compared"]} keys equal to {save}\'s; the next '
                  f'step\'s loss {r["loss_after_next_step"]:.7f} (the run: {want:.7f})')

    def test_refusals(self):
        out = self.path('refused')
        p = run('export', SAVE, out, '--to', 'torchtitan', *HEADS)
        self.assertRefused(p, 'needs --dp-shard N', out)
        p = run('export', SAVE, out, '--to', 'torchtitan', '--dp-shard', 2, '--tp', 2, '--pp', 2, *HEADS)
        self.assertRefused(p, '--pp sets the layout of --to deepspeed, megatron, torch_dist; --to torchtitan has no such size', out)
        # a --tp that cuts a KV head, or splits the vocabulary's 100 rows unevenly
        p = run('export', SAVE, out, '--to', 'torchtitan', '--dp-shard', 1, '--tp', 4, *HEADS)
        self.assertRefused(p, "--tp 4 does not divide layers.0.attention.wk.weight's num_key_value_heads = 2, which "
                              "torchtitan's TP plan shares out evenly; use a --tp that divides 2", out)
        p = run('export', SAVE, out, '--to', 'torchtitan', '--dp-shard', 1, '--tp', 3, *HEADS)
        self.assertRefused(p, "--tp 3 does not divide tok_embeddings.weight's dim 0 of size 100", out)
        # a rule set whose torchtitan section says nothing of TP
        with open(os.path.join(os.path.dirname(FIXTURES), '..', 'rules', 'megatron-llama.yaml')) as f:
            rules = re.sub(r',? tp: \{[^}]*\}', '', re.sub(r'\n +tp: \{[^}]*\}', '', f.read()))
        self.assertNotIn('tp: {', rules)
        with open(self.path('no_tp.yaml'), 'w') as f:
            f.write(rules)
        p = run('export', SAVE, out, '--to', 'torchtitan', '--dp-shard', 1, '--tp', 2, '--rules', self.path('no_tp.yaml'),
                *HEADS)
        self.assertRefused(p, "declares no tensor's TP sharding (tp: {dim: ...}); add them (docs/rules.md) or leave "
                              "out --tp", out)
        p = run('export', SAVE, out, '--to', 'hf', '--dp-shard', 2, *HEADS)
        self.assertRefused(p, '--dp-shard is an option of --to accelerate, dcp_recipe, torchtitan; --to hf does not take it', out)
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
