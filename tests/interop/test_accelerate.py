"""Hugging Face Trainer / Accelerate FSDP checkpoints, read and written (engine/formats/accelerate/):
`checkpoint-N/` with `pytorch_model_fsdp_0/` and `optimizer_0/`, as Accelerate's own
`save_fsdp_model` / `save_fsdp_optimizer` write them (the Trainer calls them for each checkpoint).

Real Accelerate and Transformers from PyPI (accelerate_pypi.py) run in the torch 2.6 chroot
(torch2_chroot.py) on the CPU with gloo; the test is skipped with one line when either cannot be
had. A tiny LlamaForCausalLM (transformers, from a config: nothing downloaded) is wrapped with torch's
FSDP (FSDP1, the layers auto-wrapped), trained two AdamW steps and saved with SHARDED_STATE_DICT:

* `w2`: world 2, use_orig_params=True, the Trainer's two param groups (the norms without weight decay);
* `w3`: world 3 (uneven shares), use_orig_params=False, one group;

each with the model's config.json, the Trainer's trainer_state.json (TrainerState.save_to_json,
global_step 2) and a scheduler.pt and rng_state_<rank>.pth as the Trainer saves them; and each run
continued two more steps (the losses of the uninterrupted run).

reshard reads each save (inspect: format accelerate, step 2, the AdamW state; from the
checkpoint folder, its pytorch_model_fsdp_0 or its optimizer_0), converts it to `--to accelerate` at another world
size (w2 -> 3, w3 -> 2), and Accelerate's own `load_fsdp_model` / `load_fsdp_optimizer` load the
output strictly into a fresh FSDP model at that world size: every parameter, exp_avg, exp_avg_sq and
step equals the save's, and the next two steps reach the uninterrupted run's losses. `verify` finds
the w3 save the same model, optimizer state included, as its Megatron-DeepSpeed (PP 2, DP 2) and
torch_dist (PP 2) conversions, and the same weights as its HF export. At the save's world size the
Trainer's run state is copied byte for byte, the ranks' RNG states included.

`fsdp2`: Accelerate's FSDP2 save (fsdp_version 2, fully_shard) at world 2 with the Trainer's two
groups, whose optimizer state is keyed by parameter index; converted to 3 ranks and back to 2 (the
index form kept), each loaded by Accelerate's own FSDP2 load, every tensor equal to the save's; the
next loss at 2 is the uninterrupted run's, at 3 bit-equal to Accelerate's load of the save itself at
3. Refused in one line: `fsdp2_frozen` (lm_head.weight in no group: its model holds a tensor the
optimizer does not number) unless --weights-only; --fsdp-version 2 from an FSDP1 save.

`full`: the FULL_STATE_DICT form of the w2 run (pytorch_model_fsdp.bin as save_fsdp_model torch.saves
it, Accelerate's own save_fsdp_optimizer's optimizer.bin) converts to the sharded form at 3 ranks,
which Accelerate loads (every tensor equal, the next losses the uninterrupted run's), and to HF.

`fsdp2_w1_full`: the FULL_STATE_DICT form of an FSDP2 run on one rank, as Accelerate's save functions
write it (their plugin refuses the type for FSDP2 when built, not when set after): torch.save files whose
tensors are DTensors, each whole. Converted to the sharded form at 2 and 3 ranks (the index form kept),
each loaded by Accelerate's own FSDP2 load with every tensor equal to the save's, the next losses
bit-equal to torch's own set_state_dict of the save's state at that world size. `fsdp2_w2_full`, the
same at 2 ranks, holds only rank 0's shard of each DTensor: refused in one line.

Run: PYTHONPATH=tests:tests/interop /usr/bin/python3 tests/interop/test_accelerate.py
     --reshard build/reshard
"""
import json
import os
import shutil
import sys
import tempfile

import accelerate_pypi
import interop_support as support
from interop_support import FixtureTestCase
import torch2_chroot

run = support.reshard

# Each save: its world size and whether FSDP keeps the original parameters (the Trainer's two param
# groups need them; without them the optimizer holds FSDP's flat parameters, one group).
SAVES = {'w2': (2, True), 'w3': (3, False)}
# The Trainer's param groups, as LOAD reports them: the norms without weight decay.
TRAINER_GROUPS = ["[('betas', (0.9, 0.95)), ('lr', 0.01), ('weight_decay', 0.0)] 5 params",
                  "[('betas', (0.9, 0.95)), ('lr', 0.01), ('weight_decay', 0.1)] 16 params"]

COMMON = r'''
import copy, datetime, functools, json, os, socket
import torch, torch.distributed as dist, torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions

CONFIG = dict(vocab_size=100, hidden_size=32, intermediate_size=27, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)

def port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def start(r, world, p):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(p), RANK=str(r), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(r))
    dist.init_process_group('gloo', rank=r, world_size=world, timeout=datetime.timedelta(seconds=120))
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    return Accelerator(cpu=True), FullyShardedDataParallelPlugin(state_dict_type='SHARDED_STATE_DICT', fsdp_version=1)

def build(orig, seed=0):
    torch.manual_seed(seed)
    model = FSDP(LlamaForCausalLM(LlamaConfig(**CONFIG)), use_orig_params=orig, device_id=torch.device('cpu'),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={LlamaDecoderLayer}))
    if orig:  # the Trainer's groups: no weight decay for the norms
        named = list(model.named_parameters())  # FSDP's flat shards: told apart by name
        groups = [{'params': [p for n, p in named if 'norm' not in n], 'weight_decay': 0.1},
                  {'params': [p for n, p in named if 'norm' in n], 'weight_decay': 0.0}]
    else:
        groups = [{'params': list(model.parameters()), 'weight_decay': 0.1}]
    return model, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))

def step(model, optimizer, batch):
    """One step on batch `batch` (the same on every rank); its loss."""
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(batch))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()

def full(model, optimizer):
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))

def fsdp2_plugin():
    from accelerate import FullyShardedDataParallelPlugin
    return FullyShardedDataParallelPlugin(state_dict_type='SHARDED_STATE_DICT', fsdp_version=2)

def build2(world, seed=0, frozen=()):
    """The model under FSDP2 (fully_shard) at `world`, and the Trainer's two AdamW groups, each listing its
    parameters in the module's order; none for those named in `frozen`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # torch 2.6's FSDP2 on CPU waits on stream events that torch.cpu.Stream lacks; CPU work runs in
    # order, so there is nothing to wait for (test_dcp_recipe_source.py does the same).
    if not hasattr(torch.cpu.Stream, 'record_event'):
        torch.cpu.Stream.record_event = lambda self, event=None: event if event is not None else torch.cpu.Event()
        torch.cpu.Stream.wait_event = lambda self, event: None
    mesh = init_device_mesh('cpu', (world,))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    named = [(n, p) for n, p in model.named_parameters() if n not in frozen]
    groups = [{'params': [p for n, p in named if 'norm' not in n], 'weight_decay': 0.1},
              {'params': [p for n, p in named if 'norm' in n], 'weight_decay': 0.0}]
    return model, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
'''

SAVE = COMMON + r'''
SAVES = __SAVES__

def rank(r, world, p, name):
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer
    from transformers import TrainerState
    acc, plugin = start(r, world, p)
    orig = SAVES[name][1]
    model, optimizer = build(orig)
    for batch in (1, 2):
        step(model, optimizer, batch)
    ckpt = f'/data/{name}/checkpoint-2'
    save_fsdp_model(plugin, acc, model, ckpt)
    save_fsdp_optimizer(plugin, acc, optimizer, model, ckpt)
    torch.save({'cpu': torch.random.get_rng_state()}, f'{ckpt}/rng_state_{r}.pth')
    if name == 'w2':  # the FULL_STATE_DICT form: Accelerate's own optimizer.bin (kept on the CPU it is on)
        from accelerate import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import FullOptimStateDictConfig
        whole = FullyShardedDataParallelPlugin(state_dict_type='FULL_STATE_DICT', fsdp_version=1)
        whole.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)
        save_fsdp_optimizer(whole, acc, optimizer, model, '/data/full/checkpoint-2')
    msd, osd = full(model, optimizer)
    losses = [step(model, optimizer, batch) for batch in (3, 4)]
    if r == 0:
        LlamaConfig(**CONFIG).save_pretrained(ckpt)
        TrainerState(global_step=2, max_steps=4).save_to_json(f'{ckpt}/trainer_state.json')
        torch.save({'last_epoch': 2, '_last_lr': [1e-2]}, f'{ckpt}/scheduler.pt')
        torch.save({'model': msd, 'optim': osd, 'losses': losses}, f'/data/{name}_full.pt')
        # The FULL_STATE_DICT form's model as save_fsdp_model writes it (torch.save of the whole state
        # dict on rank 0); Accelerate's own call offloads to the CPU with copies torch 2.6 crashes in on
        # this CPU-only host.
        if name == 'w2':
            torch.save(msd, '/data/full/checkpoint-2/pytorch_model_fsdp.bin')
            TrainerState(global_step=2, max_steps=4).save_to_json('/data/full/checkpoint-2/trainer_state.json')
            LlamaConfig(**CONFIG).save_pretrained('/data/full/checkpoint-2')
    end_rank(dist)

def fsdp2(r, world, p, name, frozen):
    """Accelerate's FSDP2 save (fsdp_version 2): its optimizer's own state_dict(), keyed by index. A name
    ending in _full: the FULL_STATE_DICT form. Accelerate 1.6.0's plugin refuses it for FSDP2 when built
    ("FSDP2 only supports SHARDED_STATE_DICT for now"), but its save functions write it when the state dict
    type is set after: rank 0's torch.save of model.state_dict() and optimizer.state_dict(), which FSDP2
    holds as DTensors, each with only that rank's local shard (all of it on one rank)."""
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import StateDictType
    from transformers import TrainerState
    acc, _ = start(r, world, p)
    plugin = fsdp2_plugin()
    if name.endswith('_full'):
        plugin.state_dict_type = StateDictType.FULL_STATE_DICT
    model, optimizer = build2(world, frozen=frozen)
    for batch in (1, 2):
        step(model, optimizer, batch)
    ckpt = f'/data/{name}/checkpoint-2'
    save_fsdp_model(plugin, acc, model, ckpt)
    save_fsdp_optimizer(plugin, acc, optimizer, model, ckpt)
    msd, osd = copy.deepcopy(full(model, optimizer))  # FSDP2's steps are the optimizer's own tensors
    losses = [step(model, optimizer, batch) for batch in (3, 4)]
    if r == 0:
        LlamaConfig(**CONFIG).save_pretrained(ckpt)
        TrainerState(global_step=2, max_steps=4).save_to_json(f'{ckpt}/trainer_state.json')
        torch.save({'model': msd, 'optim': osd, 'losses': losses}, f'/data/{name}_full.pt')
    end_rank(dist)

for name, (world, orig) in SAVES.items():
    mp.start_processes(rank, args=(world, port(), name), nprocs=world, start_method='fork')
mp.start_processes(fsdp2, args=(2, port(), 'fsdp2', ()), nprocs=2, start_method='fork')
mp.start_processes(fsdp2, args=(1, port(), 'fsdp2_w1_full', ()), nprocs=1, start_method='fork')
mp.start_processes(fsdp2, args=(2, port(), 'fsdp2_w2_full', ()), nprocs=2, start_method='fork')
# lm_head.weight trained by no group: the model's state dict holds a tensor the optimizer does not number.
mp.start_processes(fsdp2, args=(2, port(), 'fsdp2_frozen', ('lm_head.weight',)), nprocs=2, start_method='fork')
print('saved with torch', torch.__version__)
'''

# Loads each of LOADS ([label, folder under /data, world, use_orig_params, the save it came from, the
# FSDP version]) with Accelerate's own load at that world size into a fresh FSDP model (a folder of None:
# torch's own set_state_dict of the save's whole state dict, the save itself at that world size), and
# writes /data/<label>.json: the tensors that differ from the save's, how many were compared, the param
# groups, and the losses of the next two steps.
LOAD = COMMON + r'''
LOADS = __LOADS__

def rank(r, world, p, label, folder, orig, save, version):
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer
    acc, plugin = start(r, world, p)
    if version == 2:
        plugin = fsdp2_plugin()
    model, optimizer = build2(world, seed=1) if version == 2 else build(orig, seed=1)  # other weights than the save's
    step(model, optimizer, 9)  # an optimizer state to be replaced
    want = torch.load(f'/data/{save}_full.pt', weights_only=False)
    if folder is None:
        set_state_dict(model, optimizer, model_state_dict=copy.deepcopy(want['model']),
                       optim_state_dict=copy.deepcopy(want['optim']),
                       options=StateDictOptions(full_state_dict=True))
    else:
        load_fsdp_model(plugin, acc, model, '/data/' + folder)
        load_fsdp_optimizer(plugin, acc, optimizer, model, '/data/' + folder)
    msd, osd = full(model, optimizer)
    differ, compared = [], 0
    for key, t in want['model'].items():
        compared += 1
        if key not in msd or not torch.equal(msd[key], t):
            differ.append(key)
    for fqn, states in want['optim']['state'].items():
        for name, t in states.items():
            compared += 1
            got = osd['state'].get(fqn, {}).get(name, torch.tensor(float('nan')))
            if not torch.equal(got, t):
                differ.append(fqn + '.' + name + (f' is {got.item()}, not {t.item()}' if t.dim() == 0 else ''))
    groups = sorted(str(sorted({k: v for k, v in g.items() if k in ('lr', 'betas', 'weight_decay')}.items()))
                    + f" {len(g['params'])} params" for g in osd['param_groups'])
    losses = [step(model, optimizer, batch) for batch in (3, 4)]
    if r == 0:
        with open(f'/data/{label}.json', 'w') as f:
            json.dump({'differ': differ, 'compared': compared, 'groups': groups, 'losses': losses,
                       'want': want['losses']}, f)
    end_rank(dist)

for label, folder, world, orig, save, version in LOADS:
    mp.start_processes(rank, args=(world, port(), label, folder, orig, save, version), nprocs=world,
                       start_method='fork')
print('loaded')
'''


class AccelerateTest(FixtureTestCase):

    @classmethod
    def setUpClass(cls):
        cls.root = torch2_chroot.root_or_skip()
        cls.site = accelerate_pypi.site_or_skip(cls.root)
        cls.work = tempfile.mkdtemp(prefix='reshard-accelerate-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        p = accelerate_pypi.run(cls.root, cls.site, torch2_chroot.END_RANK + SAVE.replace('__SAVES__', repr(SAVES)),
                                {cls.work: '/data'}, timeout=600)
        if p.returncode:
            raise AssertionError('Accelerate could not write the saves:\n' + p.stdout + p.stderr[-6000:])
        print(p.stdout.strip(), file=sys.stderr)

    def checkpoint(self, name):
        return os.path.join(self.work, name, 'checkpoint-2')

    def test_inspect_reads_the_model_and_its_adamw_state(self):
        for name, (world, _) in SAVES.items():
            for path in [self.checkpoint(name)] + [os.path.join(self.checkpoint(name), folder)
                                                   for folder in ('pytorch_model_fsdp_0', 'optimizer_0')]:
                p = run('inspect', path)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn(f'format: accelerate, saved at TP 1, PP 1, DP {world}', p.stdout)
                self.assertIn('step: 2\n', p.stdout)
                self.assertIn('model config: config.json', p.stdout)
                self.assertIn("optimizer state: accelerate's AdamW state (exp_avg, exp_avg_sq; the fp32 parameters "
                              "as masters), step 2", p.stdout)
                self.assertIn('rng_state_0.pth, rng_state_1.pth', p.stdout + p.stderr)
                self.assertIn('not carried', p.stdout + p.stderr)

    def assertInspectsAdamW(self, ckpt, saved_at):
        """inspect reads `ckpt` as an Accelerate save (`saved_at`: the layout it names) with its AdamW state."""
        p = run('inspect', ckpt)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('format: accelerate' + saved_at, p.stdout)
        self.assertIn("optimizer state: accelerate's AdamW state (exp_avg, exp_avg_sq; the fp32 parameters "
                      "as masters), step 2", p.stdout)

    def load_in_accelerate(self, loads):
        """Loads each of `loads` (LOAD's) with Accelerate's own load: every tensor equals the save's, and
        so the next step's loss the uninterrupted run's; returns the reports by label."""
        p = accelerate_pypi.run(self.root, self.site, torch2_chroot.END_RANK + LOAD.replace('__LOADS__', repr(loads)),
                                {self.work: '/data'}, timeout=600)
        self.assertEqual(p.returncode, 0, 'Accelerate could not load:\n' + p.stdout + p.stderr[-6000:])
        reports = {}
        for label, *_ in loads:
            with open(os.path.join(self.work, label + '.json')) as f:
                report = reports[label] = json.load(f)
            print(f"{label}: losses {report['losses']}, the uninterrupted run's {report['want']}", file=sys.stderr)
            with self.subTest(label):
                self.assertEqual(report['differ'], [])
                self.assertEqual(report['compared'], 21 * 4)  # the 21 parameters, exp_avg, exp_avg_sq, step
                self.assertEqual(report['losses'][0], report['want'][0])  # the same model: the same forward
        return reports

    def test_convert_to_another_world_size_loads_in_accelerate(self):
        loads = []
        for name, (world, orig) in SAVES.items():
            other = 5 - world  # 2 -> 3, 3 -> 2
            out = os.path.join(self.work, f'{name}_to_{other}')
            p = run('convert', self.checkpoint(name), out, '--dp-shard', other)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            # The Trainer's run state is copied but the ranks' RNG states of the save's world size.
            self.assertEqual(sorted(os.listdir(out)), ['config.json', 'optimizer_0', 'pytorch_model_fsdp_0',
                                                       'reshard-manifest.json', 'scheduler.pt', 'trainer_state.json'])
            self.assertIn('not copied: ' + ', '.join(f'rng_state_{r}.pth' for r in range(world)), p.stdout + p.stderr)
            self.assertEqual(sorted(os.listdir(os.path.join(out, 'optimizer_0'))),
                             ['.metadata'] + [f'__{r}_0.distcp' for r in range(other)])
            p = run('verify', self.checkpoint(name), out)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn('same model', p.stdout)
            loads.append([f'{name}_at_{other}', f'{name}_to_{other}', other, orig, name, 1])
        reports = self.load_in_accelerate(loads)
        for label, report in reports.items():  # the step after: the uninterrupted run's, as FSDP1 reduces
            self.assertAlmostEqual(report['losses'][1], report['want'][1], delta=1e-4, msg=label)
        self.assertEqual(reports['w2_at_3']['groups'], TRAINER_GROUPS)

    def test_fsdp2_converts_to_another_world_size_and_back(self):
        """Accelerate's FSDP2 save (optimizer state keyed by index) at 2 -> 3 -> 2, each loaded by Accelerate."""
        ckpt = os.path.join(self.work, 'fsdp2', 'checkpoint-2')
        self.assertInspectsAdamW(ckpt, ', saved at TP 1, PP 1, DP 2')
        loads = []
        there = os.path.join(self.work, 'fsdp2_to_3')
        for source, out, world in ((ckpt, 'fsdp2_to_3', 3), (there, 'fsdp2_back_to_2', 2)):
            p = run('convert', source, os.path.join(self.work, out), '--dp-shard', world)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with open(os.path.join(self.work, out, 'optimizer_0', '.metadata'), 'rb') as f:
                metadata = f.read()  # the source's form: keyed by index, not by FQN
            self.assertIn(b'optimizer.state.20.exp_avg_sq', metadata)
            self.assertNotIn(b'optimizer.state.model.', metadata)
            self.assertEqual(sorted(os.listdir(os.path.join(self.work, out, 'optimizer_0'))),
                             ['.metadata'] + [f'__{r}_0.distcp' for r in range(world)])
            p = run('verify', ckpt, os.path.join(self.work, out))
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn('same model', p.stdout)
            self.assertIn('verify: 60 tensors', p.stdout)  # the 15 canonical tensors, masters, exp_avg, exp_avg_sq
            loads.append([f'{out}_loaded', out, world, True, 'fsdp2', 2])
        # Accelerate's own load of the save itself at 3 ranks: FSDP2 reduces the gradients of 3 ranks'
        # uneven shards in another order than of 2, and AdamW's first steps magnify that (about 5e-3 in
        # the next loss), so at 3 the next loss is what the save itself gives there, bit for bit.
        loads.append(['fsdp2_itself_at_3', 'fsdp2/checkpoint-2', 3, True, 'fsdp2', 2])
        reports = self.load_in_accelerate(loads)
        for label, *_ in loads:
            self.assertEqual(reports[label]['groups'], TRAINER_GROUPS, label)
        self.assertEqual(reports['fsdp2_to_3_loaded']['losses'], reports['fsdp2_itself_at_3']['losses'])
        self.assertAlmostEqual(reports['fsdp2_back_to_2_loaded']['losses'][1],
                               reports['fsdp2_back_to_2_loaded']['want'][1], delta=1e-4)
        # The index form is an FSDP2 save's only: an FSDP1 save records no order of the module's parameters.
        out = self.path('refused')
        p = run('convert', self.checkpoint('w3'), out, '--fsdp-version', 2)
        self.assertRefused(p, 'only an Accelerate FSDP2 save records', out)

    def test_same_world_size_keeps_the_run_state(self):
        out = self.path('w2_at_2')
        p = run('convert', self.checkpoint('w2'), out)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for name in ('rng_state_0.pth', 'rng_state_1.pth', 'scheduler.pt', 'trainer_state.json'):
            with open(os.path.join(self.checkpoint('w2'), name), 'rb') as a, open(os.path.join(out, name), 'rb') as b:
                self.assertEqual(a.read(), b.read(), name)
        self.assertEqual(sorted(os.listdir(os.path.join(out, 'pytorch_model_fsdp_0'))),
                         ['.metadata', '__0_0.distcp', '__1_0.distcp'])

    def test_converts_to_the_other_formats(self):
        """Megatron-DeepSpeed and torch_dist keep the AdamW state and the step; HF the weights."""
        for name, extra in (('ds', ('--to', 'deepspeed', '--pp', 2, '--dp', 2)), ('td', ('--to', 'torch_dist', '--pp', 2)),
                            ('hf', ('--to', 'hf'))):
            out = self.path(name)
            p = run('convert', self.checkpoint('w3'), out, *extra)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            p = run('verify', self.checkpoint('w3'), out)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn('same model', p.stdout)
            # The 15 canonical tensors, and with the optimizer state their masters, exp_avg, exp_avg_sq.
            self.assertIn('verify: 15 tensors' if name == 'hf' else 'verify: 60 tensors', p.stdout)

    def test_full_state_dict_converts_and_loads_in_accelerate(self):
        """The FULL_STATE_DICT form (pytorch_model_fsdp.bin + Accelerate's optimizer.bin of the w2 run) to
        the sharded form at 3 ranks, which Accelerate loads, and to HF."""
        ckpt = os.path.join(self.work, 'full', 'checkpoint-2')
        self.assertInspectsAdamW(ckpt, '')
        out = os.path.join(self.work, 'full_to_3')
        p = run('convert', ckpt, out, '--dp-shard', 3)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(sorted(os.listdir(out)), ['config.json', 'optimizer_0', 'pytorch_model_fsdp_0',
                                                   'reshard-manifest.json', 'trainer_state.json'])
        p = run('verify', ckpt, out)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('verify: 60 tensors', p.stdout)
        report = self.load_in_accelerate([['full_at_3', 'full_to_3', 3, True, 'w2', 1]])['full_at_3']
        self.assertAlmostEqual(report['losses'][1], report['want'][1], delta=1e-4)
        self.assertEqual(report['groups'], TRAINER_GROUPS)
        hf = self.path('hf')
        p = run('export', ckpt, hf, '--to', 'hf')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', ckpt, hf)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        self.assertIn('verify: 15 tensors', p.stdout)

    def test_fsdp2_full_state_dict_converts_and_loads_in_accelerate(self):
        """The FULL_STATE_DICT form of an FSDP2 save on one rank (its DTensors whole) to the sharded form at 2
        and 3 ranks, each loaded by Accelerate's own FSDP2 load; of a save on 2 ranks (rank 0's shards) refused."""
        ckpt = os.path.join(self.work, 'fsdp2_w1_full', 'checkpoint-2')
        self.assertInspectsAdamW(ckpt, '')
        loads = []
        for world in (2, 3):
            out = f'fsdp2_full_to_{world}'
            p = run('convert', ckpt, os.path.join(self.work, out), '--dp-shard', world)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with open(os.path.join(self.work, out, 'optimizer_0', '.metadata'), 'rb') as f:
                self.assertIn(b'optimizer.state.20.exp_avg_sq', f.read())  # FSDP2's form: keyed by index
            p = run('verify', ckpt, os.path.join(self.work, out))
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn('verify: 60 tensors', p.stdout)
            loads.append([f'{out}_loaded', out, world, True, 'fsdp2_w1_full', 2])
            loads.append([f'fsdp2_full_itself_at_{world}', None, world, True, 'fsdp2_w1_full', 2])
        reports = self.load_in_accelerate(loads)
        for world in (2, 3):
            self.assertEqual(reports[f'fsdp2_full_to_{world}_loaded']['groups'], TRAINER_GROUPS)
            # FSDP2 reduces the gradients of 2 or 3 ranks' shards in another order than of one rank's, which
            # AdamW's first steps magnify (about 1e-2 in the next loss): the next loss is torch's own load of
            # the save's state at that world size, bit for bit.
            self.assertEqual(reports[f'fsdp2_full_to_{world}_loaded']['losses'],
                             reports[f'fsdp2_full_itself_at_{world}']['losses'])
        out = self.path('refused')
        p = run('convert', os.path.join(self.work, 'fsdp2_w2_full', 'checkpoint-2'), out, '--dp-shard', 3)
        self.assertRefused(p, "pickle holds a DTensor of size [100, 32] placed (Shard(dim=0)) over a device mesh of "
                           "2 ranks, and of it only one rank's local tensor [50, 32]", out)

    def test_index_keyed_state_without_a_mapping_is_refused(self):
        """A parameter in no group (lm_head.weight): which model tensor each index is, is not recorded."""
        ckpt = os.path.join(self.work, 'fsdp2_frozen', 'checkpoint-2')
        out = self.path('out')
        p = run('convert', ckpt, out, '--dp-shard', 1)
        self.assertRefused(p, 'holds 20 parameters where the model\'s state dict holds 21 tensors', out)
        p = run('convert', ckpt, out, '--to', 'deepspeed', '--weights-only')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)


if __name__ == '__main__':
    support.main()
