"""`export --to dcp_recipe` and `convert` of a PyTorch DCP-recipe save (engine/formats/dcp_recipe/
dcp_recipe_export.h): a model and its AdamW state saved as torch's recipe saves them, FSDP2 over
`--dp-shard N` ranks, loaded back by the recipe's own code.

Real torch 2.6 (the Debian trixie chroot of torch2_chroot.py; skipped with one line when it cannot be
had) trains test_dcp_recipe_source's Llama-style model (FFN 27, vocabulary 100: uneven shares) one
AdamW step under FSDP2 on gloo and saves it:

* `recipe_w2`: world 2, `get_state_dict` -> `dcp.save({"model": ..., "optim": ...})`;
* `appflat_w2`: world 2, the tutorial's `{"app": AppState}` with the optimizer state dict flattened
  (`optim.param_groups.<fqn>.lr`);
* `recipe_w3`: the same run at world 3: where torch places each chunk at 3 ranks;
* `bf16_w2`: world 2, the model in bf16 (AdamW then keeps no fp32 master, and bf16 moments);
* and the run continued at world 2: one more step, then the loss of a third batch.

reshard converts them (`convert SRC OUT --dp-shard N`, the recipe's layout and prefixes kept) to
world 3 and 1, and through torchtitan and back. Checked, in torch 2.6: the outputs' `.metadata`
has the save's keys and torch's planner paths, and at world 3 the chunks (offsets, sizes, files) of
torch's own world-3 save; the recipe's own load at that world size (a zeroed FSDP2 model,
`get_state_dict`, `dcp.load`, `set_state_dict`) gives every parameter, exp_avg, exp_avg_sq and
step of the save, and its next step reaches the loss of the run continued at world 2. On the host:
`verify` finds each output the save's model with its optimizer state, and what cannot be written is
refused in one line, nothing written. The bf16 save converts with its bf16 moments and resumes as
torch's own load of it does; the targets whose optimizer keeps fp32 masters refuse its state naming
`--weights-only`, with which its weights convert and verify, equal to the save's.

Run: PYTHONPATH=tests:tests/interop /usr/bin/python3 tests/interop/test_dcp_recipe_target.py
     --reshard build/reshard
"""
import json
import os
import shutil
import sys
import tempfile

import torch

import interop_support as support
from interop_support import FixtureTestCase
import torch2_chroot
from test_dcp_recipe_source import COMPARED, HEADS, MODEL

run = support.reshard

# The saves, each with its world size, whether it is the tutorial's AppState (app.model / app.optim),
# whether its optimizer state dict is flattened, and its parameters' dtype (a bf16 run keeps no fp32
# master).
SAVES = {'recipe_w2': (2, False, False, 'float32'), 'appflat_w2': (2, True, True, 'float32'),
         'recipe_w3': (3, False, False, 'float32'), 'bf16_w2': (2, False, False, 'bfloat16')}

# Saves the SAVES, and the run of recipe_w2 continued: the loss of its next step (batch 100) and of
# batch 101 after it.
GENERATE = MODEL + r'''
import json

SAVES = __SAVES__

def build(r, world, dtype):
    mesh = init_device_mesh('cpu', (world,))
    model = LlamaForCausalLM().to(getattr(torch, dtype))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model, adamw(model)

def rank(r, world, port, name):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=r, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    _, app, flat, dtype = SAVES[name]
    model, optimizer = build(r, world, dtype)
    step(model, optimizer)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    if app:
        dcp.save({'app': AppState(model, optimizer, options)}, checkpoint_id='/data/' + name)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        dcp.save({'model': model_sd, 'optim': optim_sd}, checkpoint_id='/data/' + name)
    if name == 'recipe_w2':
        losses = [step(model, optimizer, 100), batch_loss(model, 101).item()]
        if r == 0:
            with open('/data/continued.json', 'w') as f:
                json.dump(losses, f)
    end_rank(dist)

for name, (world, *_) in SAVES.items():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.start_processes(rank, args=(world, port, name), nprocs=world, start_method='fork')
for name in SAVES:
    load_back(name)
print('torch', torch.__version__)
'''

# Loads each of LOADS ([label, folder under /data, world, app, flat, same_as], and the save it was made
# from with its dtype where it is not recipe_w2's fp32) with the recipe's own code at its world size,
# into a zeroed FSDP2 model, and writes /data/<label>.json: whether every parameter, exp_avg,
# exp_avg_sq and step equals the save's (<save>_full.pt), the losses of the next
# step (batch 100) and of batch 101 after it; and of its .metadata against the save's (SAME_AS): the
# keys, planner paths and (at the save's world) each tensor's chunks and files.
LOAD = MODEL + r'''
import json

LOADS = __LOADS__

def chunks(metadata):
    """{key: sorted (offsets, sizes, file)} of every tensor; no file for a replicated 0-d one (a
    step), which torch's planner gives to the rank it balances the load with."""
    files = {(i.fqn, tuple(i.offset or ())): s.relative_path for i, s in metadata.storage_data.items()}
    out = {}
    for key, m in metadata.state_dict_metadata.items():
        if hasattr(m, 'chunks'):
            out[key] = sorted((list(c.offsets), list(c.sizes), files[(key, tuple(c.offsets))] if len(m.size) else None)
                              for c in m.chunks)
    return out

def metadata_report(folder, same_as):
    got = dcp.FileSystemReader(folder).read_metadata()
    want = dcp.FileSystemReader(same_as).read_metadata()
    report = {'missing': sorted(set(want.state_dict_metadata) - set(got.state_dict_metadata)),
              'extra': sorted(set(got.state_dict_metadata) - set(want.state_dict_metadata)),
              'paths_differ': sorted(k for k in want.planner_data
                                     if got.planner_data.get(k) != want.planner_data[k])}
    got_chunks, want_chunks = chunks(got), chunks(want)
    report['chunks_differ'] = sorted(k for k in want_chunks if got_chunks.get(k) != want_chunks[k])
    return report

def full(model, optimizer):
    """Every parameter and optimizer state, whole, by FQN (all ranks gather)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return model_sd, optim_sd

def rank(r, world, port, label, folder, app, flat, save, dtype):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=r, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh('cpu', (world,))
    model = LlamaForCausalLM().to(getattr(torch, dtype))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer = adamw(model)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    if app:
        dcp.load({'app': AppState(model, optimizer, options)}, checkpoint_id='/data/' + folder)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {'model': model_sd, 'optim': optim_sd}
        dcp.load(state, checkpoint_id='/data/' + folder)
        set_state_dict(model, optimizer, model_state_dict=state['model'], optim_state_dict=state['optim'],
                       options=options)
    model_sd, optim_sd = full(model, optimizer)
    if r == 0:  # before the step, which steps the optimizer's own step tensors
        want = torch.load(f'/data/{save}_full.pt')
        differ = [k for k, v in model_sd.items() if not torch.equal(v, want['model.' + k])]
        compared = len(model_sd)
        for fqn, states in optim_sd['state'].items():
            for name, v in states.items():
                compared += 1
                if not torch.equal(v, want[f'optim.state.{fqn}.{name}']):
                    differ.append(f'{fqn}.{name}')
        groups = [{k: v for k, v in g.items() if k != 'params'} for g in optim_sd['param_groups']]
    losses = [step(model, optimizer, 100), batch_loss(model, 101).item()]
    if r == 0:
        with open(f'/data/{label}.json', 'w') as f:
            json.dump({'differ': differ, 'compared': compared, 'losses': losses, 'groups': repr(groups)}, f)
    end_rank(dist)

for label, folder, world, app, flat, same_as, *made_from in LOADS:
    save, dtype = made_from or ('recipe_w2', 'float32')
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.start_processes(rank, args=(world, port, label, folder, app, flat, save, dtype), nprocs=world,
                       start_method='fork')
    with open(f'/data/{label}.json') as f:
        report = json.load(f)
    report.update(metadata_report('/data/' + folder, '/data/' + same_as))
    with open(f'/data/{label}.json', 'w') as f:
        json.dump(report, f)
print('loaded')
'''


class DcpRecipeTargetTest(FixtureTestCase):

    @classmethod
    def setUpClass(cls):
        cls.root = torch2_chroot.root_or_skip()
        cls.work = tempfile.mkdtemp(prefix='reshard-recipe-target-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        p = torch2_chroot.run(cls.root, torch2_chroot.END_RANK + GENERATE.replace('__SAVES__', repr(SAVES)),
                              {cls.work: '/data'}, timeout=600)
        if p.returncode:
            raise AssertionError('torch 2 could not write the saves:\n' + p.stdout + p.stderr)
        print(p.stdout.strip(), file=sys.stderr)
        with open(os.path.join(cls.work, 'continued.json')) as f:
            cls.continued = json.load(f)

    def saved(self, name):
        return os.path.join(self.work, name)

    def convert(self, src, name, *extra):
        """reshard convert of save `src` into the work folder as `name`, and verify against the save."""
        out = self.saved(name)
        p = run('convert', self.saved(src) if not os.path.isabs(src) else src, out, *extra, *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', self.saved('recipe_w2'), out, *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        self.assertIn(COMPARED, p.stdout)
        return out

    def load_in_torch(self, loads):
        """Runs LOAD for `loads`; {label: its report}."""
        p = torch2_chroot.run(self.root, torch2_chroot.END_RANK + LOAD.replace('__LOADS__', repr(loads)),
                              {self.work: '/data'}, timeout=600)
        self.assertEqual(p.returncode, 0, 'torch 2 could not load:\n' + p.stdout + p.stderr)
        reports = {}
        for label, *_ in loads:
            with open(os.path.join(self.work, label + '.json')) as f:
                reports[label] = json.load(f)
        return reports

    def assertResumes(self, report, reference, same_chunks, extra=(), continued=True):
        """`report` (LOAD's) holds the save's every tensor and its metadata's keys and paths (and
        chunks), and its next step reaches the losses `reference` (torch's own load of the save at
        that world size) reaches, bit for bit, which are (`continued`: of recipe_w2) the run's
        continued at world 2 up to how FSDP2 at another world size sums the gradients."""
        self.assertEqual(report['differ'], [])
        self.assertEqual(report['compared'], 21 * 4)  # the 21 parameters, their exp_avg, exp_avg_sq and step
        self.assertIn("'lr': 0.001, 'betas': (0.9, 0.95), 'eps': 1e-08, 'weight_decay': 0.1", report['groups'])
        self.assertEqual(report['losses'], reference['losses'])
        if continued:
            self.assertEqual(report['losses'][0], self.continued[0])  # the same model: the same forward
            self.assertAlmostEqual(report['losses'][1], self.continued[1], delta=2e-3)
        self.assertEqual((report['missing'], report['extra'], report['paths_differ']), ([], list(extra), []))
        if same_chunks:
            self.assertEqual(report['chunks_differ'], [])

    def test_convert_to_another_world_size_resumes_in_torch(self):
        w3 = self.convert('recipe_w2', 'to_w3', '--dp-shard', 3)
        w1 = self.convert('recipe_w2', 'to_w1', '--dp-shard', 1)
        w2 = self.convert('appflat_w2', 'app_to_w2', '--dp-shard', 2)
        app3 = self.convert('appflat_w2', 'app_to_w3', '--dp-shard', 3)
        manifest = 'reshard-manifest.json'
        self.assertEqual(sorted(os.listdir(w3)), ['.metadata', '__0_0.distcp', '__1_0.distcp', '__2_0.distcp', manifest])
        self.assertEqual(sorted(os.listdir(w1)), ['.metadata', '__0_0.distcp', manifest])
        reports = self.load_in_torch([['to_w3', 'to_w3', 3, False, False, 'recipe_w3'],
                                      ['to_w1', 'to_w1', 1, False, False, 'recipe_w2'],
                                      ['app_to_w2', 'app_to_w2', 2, True, True, 'appflat_w2'],
                                      ['app_to_w3', 'app_to_w3', 3, True, True, 'appflat_w2'],
                                      ['torch_w3', 'recipe_w2', 3, False, False, 'recipe_w2'],
                                      ['torch_w2', 'recipe_w2', 2, False, False, 'recipe_w2'],
                                      ['torch_w1', 'recipe_w2', 1, False, False, 'recipe_w2']])
        print('losses of the next step and after it: continued at world 2', self.continued,
              {k: r['losses'] for k, r in reports.items()}, file=sys.stderr)
        self.assertEqual(reports['torch_w2']['losses'], self.continued)
        self.assertResumes(reports['to_w3'], reports['torch_w3'], same_chunks=True)
        self.assertResumes(reports['to_w1'], reports['torch_w1'], same_chunks=False)
        self.assertResumes(reports['app_to_w2'], reports['torch_w2'], same_chunks=True)
        self.assertResumes(reports['app_to_w3'], reports['torch_w3'], same_chunks=False)
        self.assertTrue(os.path.exists(app3) and os.path.exists(w2))

    def test_through_torchtitan_and_back(self):
        tt = self.saved('tt')
        p = run('export', self.saved('recipe_w2'), tt, '--to', 'torchtitan', '--dp-shard', 2, *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        step = os.path.join(tt, 'step-0')
        p = run('verify', self.saved('recipe_w2'), step, *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        back = self.convert(step, 'tt_back', '--to', 'dcp_recipe', '--dp-shard', 3)
        reports = self.load_in_torch([['tt_back', 'tt_back', 3, False, False, 'recipe_w3'],
                                      ['torch_w3', 'recipe_w2', 3, False, False, 'recipe_w2']])
        # torchtitan's groups record initial_lr (its LR scheduler's), which the recipe's keep
        self.assertResumes(reports['tt_back'], reports['torch_w3'], same_chunks=True,
                           extra=['optim.param_groups.0.initial_lr'])
        self.assertTrue(os.path.exists(back))

    def test_a_bf16_run_converts_with_its_optimizer_state(self):
        """torch's AdamW of a bf16 model keeps no fp32 master and bf16 moments: converted to world 3,
        the recipe's own load gets every bf16 parameter and moment of the save and steps as torch's own
        load of the save at world 3 does. Targets whose optimizer keeps fp32 masters refuse it in one
        line naming --weights-only, with which its weights convert and verify, the save's own."""
        src = self.saved('bf16_w2')
        w3 = self.saved('bf16_w3')
        p = run('convert', src, w3, '--dp-shard', 3, *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('0 of 15 tensors from the fp32 masters (its optimizer keeps none)', p.stdout + p.stderr)
        p = run('verify', src, w3, *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        self.assertIn('verify: 45 tensors', p.stdout)  # the 15 weights, their exp_avg and exp_avg_sq
        made_from = ['bf16_w2', 'bfloat16']
        reports = self.load_in_torch([['bf16_to_w3', 'bf16_w3', 3, False, False, 'recipe_w3', *made_from],
                                      ['torch_bf16_w3', 'bf16_w2', 3, False, False, 'bf16_w2', *made_from]])
        print('bf16 run: losses of the next step and after it', {k: r['losses'] for k, r in reports.items()},
              file=sys.stderr)
        self.assertResumes(reports['bf16_to_w3'], reports['torch_bf16_w3'], same_chunks=True, continued=False)
        tt = self.saved('bf16_tt')
        p = run('export', src, tt, '--to', 'torchtitan', '--dp-shard', 2, *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', src, os.path.join(tt, 'step-0'), *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        self.assertIn('verify: 45 tensors', p.stdout)
        out = self.path('bf16_refused')
        no_masters = 'the optimizer state holds no fp32 masters'
        for command, message in ((('export', src, out, '--to', 'torch_dist', '--tp', 1, '--pp', 1), no_masters),
                                 (('convert', src, out, '--to', 'deepspeed', '--tp', 1, '--pp', 1, '--dp', 1),
                                  no_masters),
                                 (('convert', src, out, '--dp-shard', 3, '--dtype', 'fp32'), '--dtype would make')):
            with self.subTest(command=command):
                p = run(*command, *HEADS)
                self.assertRefused(p, message, out)
                self.assertIn('--weights-only', p.stderr)
        w1 = self.saved('bf16_weights_w1')
        p = run('convert', src, w1, '--dp-shard', 1, '--weights-only', *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('inspect', w1, *HEADS)  # read back as a recipe save of the model alone
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('format: dcp_recipe, saved at TP 1, PP 1, DP 1', p.stdout)
        self.assertIn('optimizer state: none', p.stdout)
        p = run('verify', src, w1, '--weights-only', *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        self.assertIn('verify: 15 tensors', p.stdout)  # the canonical weights, nothing else
        self.assertIn('optimizer state not compared (--weights-only)', p.stdout)
        hf = self.saved('bf16_hf')
        p = run('export', src, hf, '--to', 'hf', *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        got = {}
        for name in os.listdir(hf):
            if name.endswith('.safetensors'):
                got.update(support.read_safetensors(os.path.join(hf, name))[0])
        want = {k[len('model.'):]: v for k, v in torch.load(self.saved('bf16_w2_full.pt')).items()
                if k.startswith('model.')}
        self.assertEqual(sorted(got), sorted(want))
        for key, tensor in want.items():
            self.assertEqual(tensor.dtype, torch.bfloat16, key)
            self.assertTrue(torch.equal(got[key], tensor), key)

    def test_refusals(self):
        src = self.saved('recipe_w2')
        out = self.path('refused')
        for args, message in [
                (('convert', src, out, '--dp-shard', 0), '--dp-shard takes a whole number >= 1'),
                (('export', src, out, '--to', 'dcp_recipe'), 'export --to dcp_recipe needs --dp-shard N'),
                (('convert', src, out, '--tp', 2), '--to dcp_recipe has no such size'),
                (('convert', src, out, '--prefixes', 'model'), 'give MODEL,OPTIM'),
                (('convert', src, out, '--prefixes', 'app,app.optim'), "the model's and the optimizer's keys would mix"),
                (('convert', src, out, '--prefixes', 'a..b,optim'), 'has an empty key between its dots'),
                (('convert', src, out, '--dtype', 'bf16'), 'writes the fp32 masters as the parameters')]:
            with self.subTest(args=args):
                self.assertRefused(run(*args, *HEADS), message, out)


if __name__ == '__main__':
    support.main()
