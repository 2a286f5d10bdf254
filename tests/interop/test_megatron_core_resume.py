"""Resuming a `torch_dist` output with real Megatron-Core 0.19.1's distributed optimizer: the learning
-rate schedule its load pairs param groups by, and a GQA model built from the args reshard wrote.

Megatron-Core's DistributedOptimizer.load_state_dict pairs each param group it builds with a saved
one by the group's identifier, which holds the run's max_lr (--lr) and min_lr (--min-lr) beside
wd_mult and lr_mult: a saved group whose bounds are not the resumed run's is not found (KeyError).
Megatron-Core 0.19.1 from PyPI (megatron_core_pypi.py) runs in the torch 2.6 chroot
(torch2_chroot.py) on CPU with gloo, one process: it builds a GPTModel of the local layer spec from
the args reshard wrote, as Megatron-LM's core_transformer_config_from_args reads them
(group_query_attention gives num_query_groups), wraps it in its DDP with the distributed optimizer
(fully_reshardable), loads the output with StrictHandling.RAISE_ALL and takes a training step.

Checked:

* a torchtitan step (which records no LR schedule) exported --to torch_dist with `--set lr=3e-4
  --set min_lr=0`: the groups and the args say them, a note says where they came from, and
  Megatron-Core loads the model and its optimizer state with --lr 3e-4 --min-lr 0 and steps;
* the same step exported without them: a note says the groups' max_lr and min_lr are missing and
  the --set that gives them, and Megatron-Core's load fails with a KeyError, as the note says;
* another learning rate: Megatron-Core's own save (made by the run above after its step) resumed
  with --lr 1e-3 fails its optimizer load with a KeyError (its scheduler flags,
  --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler, act on the scheduler's
  state only, which is read after), and reshard's output does the same;
* a Megatron-DeepSpeed GQA run (12 heads, 6 KV groups; its args record lr and min_lr) exported
  --to torch_dist: the args say group_query_attention and num_query_groups 6, Megatron-Core builds
  the GQA model from them and loads the output strictly with the run's --lr and --min-lr (taken from
  its args, noted), and steps.

Skipped with one line when the chroot or the wheels cannot be had.

Run: /usr/bin/python3 tests/interop/test_megatron_core_resume.py --reshard build/reshard
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

import interop_support as support
from interop_support import FAMILIES, make_fixture
import megatron_core_pypi
import torch2_chroot

run = support.reshard
TORCHTITAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'torchtitan', 'fsdp2_w2',
                          'step-1')
TT_SIZES = ['--set', 'num_attention_heads=4']
LR, OTHER_LR = 3e-4, 1e-3
BATCH = 8  # the torchtitan run's global batch, given with --set

# Loads each case's folder into the model its args describe, with the distributed optimizer of a
# run with the case's --lr and --min-lr, then takes a step; writes what happened to /data/results.json.
SCRIPT = r'''
import datetime, json, socket, traceback
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state as ps
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

# Its attention draws dropout under the GPU's model-parallel RNG; the runs here have no dropout
# and no GPU, so the draw runs under the CPU's.
import contextlib
from megatron.core import tensor_parallel
tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()

CASES = json.loads(%r)
# As Megatron-LM 0.19 describes its sharded state dict with --use-distributed-optimizer
# --dist-ckpt-optim-fully-reshardable.
METADATA = {'distrib_optim_sharding_type': 'fully_reshardable', 'singleton_local_shards': False,
            'chained_optim_avoid_prefix': True}

def build(args):
    """The model of `args` as Megatron-LM's --use-checkpoint-args builds it: the GQA groups only with
    group_query_attention, SwiGLU from swiglu."""
    swiglu = bool(getattr(args, 'swiglu', False))
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=getattr(args, 'kv_channels', None),
        normalization=args.normalization, layernorm_epsilon=args.layernorm_epsilon, gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu, add_bias_linear=getattr(args, 'add_bias_linear', True),
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(1234)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)
    return config, model

def resume(case):
    folder, lr, min_lr = case['folder'], case['lr'], case['min_lr']
    args = dist_checkpointing.load_common_state_dict(folder)['args']
    for name, value in case.get('given', {}).items():  # what a run gives on its command line
        setattr(args, name, value)
    config, model = build(args)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer='adam', lr=lr, min_lr=min_lr, weight_decay=case['wd'],
                        use_distributed_optimizer=True), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=0,
                                        lr_decay_steps=100, lr_decay_style='constant',
                                        start_wd=case['wd'], end_wd=case['wd'], wd_incr_steps=100,
                                        wd_incr_style='constant')
    out = {'num_query_groups': config.num_query_groups,
           'qkv_rows': model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]}
    start_adam_state(optimizer)
    try:
        model_sd = model.sharded_state_dict()
        state = dist_checkpointing.load(
            {'model': model_sd, 'optimizer': optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                          metadata=METADATA)},
            folder, strict=StrictHandling.RAISE_ALL)
        model.load_state_dict(state['model'], strict=True)
        optimizer.load_state_dict(state['optimizer'])
    except Exception as e:
        out['error'] = type(e).__name__ + ': ' + str(e)[:1500]
        out['trace'] = traceback.format_exc()[-1500:]
        return out
    out['loaded_groups'] = [[g.get('max_lr'), g.get('min_lr'), g['wd_mult'], g['step']]
                            for g in optimizer.param_groups]
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.arange(16).remainder(args.padded_vocab_size).view(1, 16)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens, torch.arange(16).view(1, 16), None, labels=tokens.roll(-1, 1)).mean()
    loss.backward()  # into the grad buffer; one data-parallel rank has nothing to reduce (no finish_grad_sync)
    stepped, _, _ = optimizer.step()
    scheduler.step(1)
    out.update(loss=loss.item(), stepped=bool(stepped),
               changed=sum(not torch.equal(a, p) for a, p in zip(before, model.parameters())),
               params=len(before), lr_after=[g['lr'] for g in optimizer.param_groups])
    if case.get('save'):  # Megatron-Core's own save after the step, with the scheduler as Megatron-LM saves it
        model_sd = model.sharded_state_dict()
        dist_checkpointing.save({'model': model_sd, 'args': args, 'opt_param_scheduler': scheduler.state_dict(),
                                 'optimizer': optimizer.sharded_state_dict(model_sd, metadata=METADATA)},
                                case['save'])
    out['scheduler'] = load_scheduler(folder, optimizer, lr, min_lr, case)
    return out

def load_scheduler(folder, optimizer, lr, min_lr, case):
    """The common state's opt_param_scheduler as Megatron-LM's load hands it to a run's scheduler (after the
    step, so that the step above ran at the run's lr): its state_dict after the load, or the error."""
    saved = dist_checkpointing.load_common_state_dict(folder).get('opt_param_scheduler')
    if saved is None:
        return {'error': 'no opt_param_scheduler'}
    # The resumed run's own schedule; --override-opt-param-scheduler where the case says so.
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=0,
                                        lr_decay_steps=1000, lr_decay_style='cosine', start_wd=case['wd'],
                                        end_wd=case['wd'], wd_incr_steps=1000, wd_incr_style='constant',
                                        use_checkpoint_opt_param_scheduler=not case.get('override'),
                                        override_opt_param_scheduler=bool(case.get('override')))
    try:
        scheduler.load_state_dict(saved)
    except Exception as e:
        return {'error': type(e).__name__ + ': ' + str(e)[:500]}
    return scheduler.state_dict()

with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=120))
ps.initialize_model_parallel(1, 1)
results = {}
for case in CASES:
    if case.get('save'):
        import os
        os.makedirs(case['save'], exist_ok=True)
    try:
        results[case['name']] = resume(case)
    except Exception:
        results[case['name']] = {'crash': traceback.format_exc()[-1500:]}
with open('/data/results.json', 'w') as f:
    json.dump(results, f)
import multiprocessing
for child in multiprocessing.active_children():
    child.terminate()
    child.join()
dist.destroy_process_group()
'''


class MegatronCoreResumeTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.root = torch2_chroot.root_or_skip()
        cls.site = megatron_core_pypi.site_or_skip(cls.root)
        cls.work = tempfile.mkdtemp(prefix='reshard-mcore-resume-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        cls.notes = {
            'tt_given': cls.export(TORCHTITAN, 'tt_given', *TT_SIZES, '--set', f'lr={LR}', '--set', 'min_lr=0',
                                   '--set', f'global_batch_size={BATCH}'),
            'tt_missing': cls.export(TORCHTITAN, 'tt_missing', *TT_SIZES)}
        md = make_fixture(os.path.join(cls.work, 'md'),
                          **dict(FAMILIES['ms_llama'], tp=1, pp=1, dp=1, optimizer='bf16_zero'))
        cls.md_args = support.load(os.path.join(md, 'mp_rank_00_model_states.pt'))['args']
        cls.md_scheduler = support.load(os.path.join(md, 'mp_rank_00_model_states.pt'))['lr_scheduler']
        cls.notes['md_gqa'] = cls.export(md, 'md_gqa')
        a = cls.md_args
        # torchtitan's Llama: AdamW with weight decay 0.1, no linear biases (which the args written
        # from its import do not say: the run gives --disable-bias-linear).
        # (The args written from its import say add_bias_linear False; `given` as a run without
        # --use-checkpoint-args gives it.) The scheduler made from its run values has defaulted values, which
        # a run takes from its own flags with --override-opt-param-scheduler, as the note says.
        tt = dict(wd=0.1, given={'add_bias_linear': False}, override=True)
        cases = [dict(tt, name='tt_given', folder='/data/tt_given/iter_0000001', lr=LR, min_lr=0.0,
                      save='/data/mc_save'),
                 dict(tt, name='tt_missing', folder='/data/tt_missing/iter_0000001', lr=LR, min_lr=0.0),
                 dict(tt, name='tt_other_lr', folder='/data/tt_given/iter_0000001', lr=OTHER_LR, min_lr=0.0),
                 dict(tt, name='mc_same_lr', folder='/data/mc_save', lr=LR, min_lr=0.0, override=False),
                 dict(tt, name='mc_other_lr', folder='/data/mc_save', lr=OTHER_LR, min_lr=0.0),
                 dict(name='md_gqa', folder=cls.iteration_folder('md_gqa'), lr=a.lr, min_lr=a.min_lr,
                      wd=a.weight_decay, save='/data/md_save')]
        p = megatron_core_pypi.run(cls.root, cls.site, megatron_core_pypi.OPTIMIZER + SCRIPT % json.dumps(cases), {cls.work: '/data'}, timeout=400)
        if p.returncode:
            raise AssertionError('Megatron-Core could not run the cases:\n' + p.stdout + p.stderr[-4000:])
        with open(os.path.join(cls.work, 'results.json')) as f:
            cls.results = json.load(f)

    @classmethod
    def export(cls, src, name, *extra):
        p = run('export', src, os.path.join(cls.work, name), '--to', 'torch_dist', '--tp', 1, '--pp', 1, *extra)
        if p.returncode:
            raise AssertionError(p.stdout + p.stderr)
        return p.stdout + p.stderr

    @classmethod
    def iteration_folder(cls, name):
        [it] = [d for d in os.listdir(os.path.join(cls.work, name)) if d.startswith('iter_')]
        return f'/data/{name}/{it}'

    def common_state(self, name):
        folder = os.path.join(self.work, self.iteration_folder(name)[len('/data/'):])
        return support.distcp_items(folder)['common_state/shard_0_1'][0][1][0]

    def assertResumed(self, name, max_lr, min_lr):
        r = self.results[name]
        self.assertNotIn('crash', r, r.get('crash'))
        self.assertNotIn('error', r)
        # Each group (decayed, not decayed) with the run's bounds and the source's step.
        self.assertEqual([g[:3] for g in r['loaded_groups']], [[max_lr, min_lr, 1.0], [max_lr, min_lr, 0.0]])
        self.assertTrue(r['stepped'])
        self.assertEqual(r['changed'], r['params'])
        self.assertEqual(r['lr_after'], [max_lr, max_lr])
        print(f'\n[ megatron-core 0.19.1 ] {name}: loaded strictly with --lr {max_lr} --min-lr {min_lr}, '
              f'one step, loss {r["loss"]:.4f}', file=sys.stderr)

    def assertKeyError(self, name, max_lr):
        r = self.results[name]
        self.assertNotIn('crash', r, r.get('crash'))
        self.assertTrue(r.get('error', '').startswith('KeyError'), r)
        self.assertIn(repr(max_lr), r['error'])  # the run's group, not found among the saved

    def test_the_schedule_given_is_written_and_resumed(self):
        self.assertIn(f'optimizer: the param groups\' max_lr {LR} (--set lr), min_lr 0.0 (--set min_lr), written into '
                      f'the args too: Megatron-Core pairs saved groups with its own by them, so resume with --lr {LR} '
                      '--min-lr 0.0', self.notes['tt_given'])
        state = self.common_state('tt_given')
        self.assertEqual([(g['max_lr'], g['min_lr']) for g in state['optimizer']['optimizer']['param_groups']],
                         [(LR, 0.0), (LR, 0.0)])
        self.assertEqual((state['args'].lr, state['args'].min_lr), (LR, 0.0))
        self.assertResumed('tt_given', LR, 0.0)

    def test_the_scheduler_made_from_the_run_loads_into_megatron_cores_scheduler(self):
        # Megatron-LM's load_checkpoint reads opt_param_scheduler right after the optimizer state.
        self.assertIn(f'opt_param_scheduler: made from the run (the source records none): max_lr {LR}, min_lr 0.0, '
                      f'num_steps {BATCH} (iteration 1 x global_batch_size {BATCH}); defaulted: lr_decay_steps',
                      self.notes['tt_given'])
        self.assertIn('resume with --override-opt-param-scheduler', self.notes['tt_given'])
        written = self.common_state('tt_given')['opt_param_scheduler']
        self.assertEqual((written['max_lr'], written['min_lr'], written['num_steps']), (LR, 0.0, BATCH))
        # Loaded by OptimizerParamScheduler.load_state_dict with --override-opt-param-scheduler: the run's own
        # schedule, the samples trained from the checkpoint.
        loaded = self.results['tt_given']['scheduler']
        self.assertNotIn('error', loaded)
        self.assertEqual(loaded, dict(max_lr=LR, min_lr=0.0, num_steps=BATCH, lr_warmup_steps=0, lr_decay_steps=1000,
                                      lr_decay_style='cosine', start_wd=0.1, end_wd=0.1, wd_incr_steps=1000,
                                      wd_incr_style='constant'))
        # Without the global batch nothing is made, and the note says what to give.
        self.assertIn('opt_param_scheduler: the source records no learning-rate scheduler state and its max_lr',
                      self.notes['tt_missing'])
        self.assertIn('--set global_batch_size=', self.notes['tt_missing'])
        self.assertNotIn('opt_param_scheduler', self.common_state('tt_missing'))

    def test_a_sources_scheduler_is_carried_and_loads_as_the_run_saved_it(self):
        own = self.md_scheduler  # Megatron-DeepSpeed's lr_scheduler
        self.assertIn(f"opt_param_scheduler: the source's learning-rate scheduler state, carried (num_steps "
                      f"{own['num_steps']})", self.notes['md_gqa'])
        self.assertEqual(self.common_state('md_gqa')['opt_param_scheduler'], own)
        loaded = self.results['md_gqa']['scheduler']  # with --use-checkpoint-opt-param-scheduler
        self.assertNotIn('error', loaded)
        self.assertEqual(loaded, {k: own[k] for k in loaded})
        self.assertEqual(len(loaded), 10)

    def test_megatron_cores_own_scheduler_is_kept_through_another_tp(self):
        saved = support.distcp_items(os.path.join(self.work, 'mc_save'))['common_state/shard_0_1'][0][1][0]
        self.assertEqual(saved['opt_param_scheduler']['num_steps'], 1)  # the run's one step
        self.assertEqual(self.results['mc_same_lr']['scheduler'], saved['opt_param_scheduler'])
        # The GQA run's save (whose sizes divide by TP 2), made after its step, at TP 2.
        saved = support.distcp_items(os.path.join(self.work, 'md_save'))['common_state/shard_0_1'][0][1][0]
        self.assertEqual(saved['opt_param_scheduler']['num_steps'], 1)
        out = os.path.join(self.work, 'md_tp2')
        p = run('convert', os.path.join(self.work, 'md_save'), out, '--tp', 2)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("opt_param_scheduler: the source's learning-rate scheduler state, carried (num_steps 1)",
                      p.stdout + p.stderr)
        [it] = [d for d in os.listdir(out) if d.startswith('iter_')]
        converted = support.distcp_items(os.path.join(out, it))['common_state/shard_0_1'][0][1][0]
        self.assertEqual(converted['args'].tensor_model_parallel_size, 2)
        self.assertEqual(converted['opt_param_scheduler'], saved['opt_param_scheduler'])

    def test_a_missing_schedule_is_said_and_megatron_core_fails_as_said(self):
        self.assertIn("optimizer: the source records no max_lr or min_lr (the run's --lr and --min-lr) and none was "
                      "given", self.notes['tt_missing'])
        self.assertIn("give them: --set lr=<the run's --lr> --set min_lr=<the run's --min-lr>", self.notes['tt_missing'])
        groups = self.common_state('tt_missing')['optimizer']['optimizer']['param_groups']
        self.assertEqual([(g['max_lr'], g['min_lr']) for g in groups], [(None, None), (None, None)])
        self.assertKeyError('tt_missing', LR)

    def test_another_learning_rate_fails_as_for_megatron_cores_own_save(self):
        self.assertResumed('mc_same_lr', LR, 0.0)
        self.assertKeyError('mc_other_lr', OTHER_LR)
        self.assertKeyError('tt_other_lr', OTHER_LR)
        # The same error: the run's groups, not found among the saved.
        self.assertEqual(self.results['mc_other_lr']['error'], self.results['tt_other_lr']['error'])

    def test_a_gqa_run_is_built_from_the_args_written_and_resumed(self):
        args = self.common_state('md_gqa')['args']
        self.assertEqual((args.group_query_attention, args.num_query_groups), (True, 6))
        a = self.md_args
        self.assertIn(f"optimizer: the param groups' max_lr {a.lr} (the source's args.lr), min_lr {a.min_lr} (the "
                      "source's args.min_lr)", self.notes['md_gqa'])
        r = self.results['md_gqa']
        # 12 query heads and 6 KV groups of 4 channels: (12 + 2 x 6) x 4 rows.
        self.assertEqual((r['num_query_groups'], r['qkv_rows']), (6, (12 + 2 * 6) * 4))
        self.assertResumed('md_gqa', a.lr, a.min_lr)


if __name__ == '__main__':
    support.main()
