"""An FSDP2 run saved with PyTorch's DCP recipe resumes in Megatron-Core from reshard's `torch_dist` output,
on the run's own trajectory.

Real torch 2.6 (the chroot of torch2_chroot.py) trains test_dcp_recipe_source's Llama-style model (GQA 4
heads / 2 groups, SwiGLU FFN 27, RMSNorm, vocabulary 100, untied, no position embedding) one AdamW step
under FSDP2 at world 2, saves it as the recipe does (`get_state_dict` -> `dcp.save`), and continues the
run: the loss of its next step (batch 100) and of batch 101 after it (test_dcp_recipe_target's GENERATE).
torch also resumes the save in one process: the recipe's model and AdamW given the save's every
parameter and state, the same step and loss.

reshard exports the save `--to torch_dist` (TP 1: the FFN of 27 does not split; the vocabulary unpadded:
make_vocab_size_divisible_by 1; the schedule's bounds the resumed run's, `--set lr=0.001 --set min_lr=0`,
which the recipe does not record), and real Megatron-Core 0.19.1 (megatron_core_pypi.py) builds the same
model (GPTModel of the local spec, no position embedding) on 2 gloo ranks (DP 2) and on 1, with its DDP
and distributed optimizer (Adam, which is torch's AdamW without Apex; no gradient clipping, as the
recipe's run), loads the output strictly (StrictHandling.RAISE_ALL), takes the step on batch 100 and
computes the loss of batch 101.

Checked: both losses equal torch's own one-process resume of the save to 1e-6 (Megatron-Core's forward
rounds otherwise in the last bits), and the continued run's (the first to 1e-6; the second within 2e-3:
FSDP2 at world 2 sums the gradients in another order than one process), where the model Megatron-Core builds before loading is further than 1e-2 from
them (what the check would see of a weight or a state not carried); the step Megatron-Core resumes from
is the save's. Skipped with one line when the chroot or the wheels cannot be had.

Run: PYTHONPATH=tests:tests/interop /usr/bin/python3 tests/interop/test_fsdp_recipe_to_megatron_core.py
     --reshard build/reshard
"""
import json
import os
import sys

import interop_support as support
import megatron_core_pypi
import torch2_chroot
from test_dcp_recipe_source import HEADS
from test_dcp_recipe_target import GENERATE, SAVES

run = support.reshard

SOURCE = 'recipe_w2'
WORLDS = (2, 1)  # Megatron-Core's DP sizes

# torch's own resume of the save, in one process (no FSDP2: its gradients summed as one rank sums them):
# the recipe's model and AdamW given every parameter and state of the save, the step on batch 100, then
# the loss of batch 101.
RESUMED_IN_TORCH = r'''
import json
full = torch.load('/data/%s_full.pt')
model = LlamaForCausalLM()
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(full['model.' + name])
optimizer = adamw(model)
for name, p in model.named_parameters():
    optimizer.state[p] = {s: full[f'optim.state.{name}.{s}'].clone() for s in ('step', 'exp_avg', 'exp_avg_sq')}
with open('/data/resumed_in_torch.json', 'w') as f:
    json.dump([step(model, optimizer, 100), batch_loss(model, 101).item()], f)
''' % SOURCE

# Each case (world, folder, record): build the recipe's model in Megatron-Core at TP 1, load the
# folder strictly with its optimizer state, take the step on batch 100, then the loss of batch 101; the
# record has the losses before loading (the built model's), the step loaded and the two losses after.
RESUME = r'''
import contextlib, json
import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

CASES = json.loads(%r)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 32, 4, 2, 8, 27, 100, 2
# No dropout is drawn (eval mode), so none needs the GPU's RNG tracker.
tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()

def build():
    ps.initialize_model_parallel()
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu, normalization='RMSNorm',
        layernorm_epsilon=1e-5, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization='RMSNorm'), vocab_size=VOCAB,
                     max_sequence_length=16, share_embeddings_and_output_weights=False,
                     position_embedding_type='none')
    model.eval()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer='adam', lr=1e-3, min_lr=0.0, clip_grad=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                        weight_decay=0.1, use_distributed_optimizer=True), [ddp])
    start_adam_state(optimizer)
    return model, ddp, optimizer

def batch_loss(model, seed):
    """The recipe's loss of its fixed batch `seed`: next-token cross entropy over 8 positions."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    positions = torch.arange(8).unsqueeze(0).expand(2, 8)
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)
    return model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()

def train_step(model, ddp, optimizer, seed):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = batch_loss(model, seed)
    loss.backward()
    ddp.finish_grad_sync()
    stepped, _, _ = optimizer.step()
    assert stepped
    return loss.item()

def resume(r, port, world, folder, record):
    start(r, port, world)
    model, ddp, optimizer = build()
    with torch.no_grad():
        built = [batch_loss(model, 100).item(), batch_loss(model, 101).item()]
    # As Megatron-LM 0.19 describes its sharded state dict with --dist-ckpt-optim-fully-reshardable.
    metadata = {'distrib_optim_sharding_type': 'fully_reshardable', 'singleton_local_shards': False,
                'chained_optim_avoid_prefix': True}
    model_sd = model.sharded_state_dict()
    sharded = {'model': model_sd,
               'optimizer': optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    state = dist_checkpointing.load(sharded, folder, strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(state['model'], strict=True)
    optimizer.load_state_dict(state['optimizer'])
    steps = sorted({g['step'] for chained in optimizer.chained_optimizers for g in chained.param_groups})
    losses = [train_step(model, ddp, optimizer, 100)]
    with torch.no_grad():
        losses.append(batch_loss(model, 101).item())
    if r == 0:
        with open(record, 'w') as f:
            json.dump({'built': built, 'steps': steps, 'losses': losses}, f)
    end_rank(dist)

worlds(resume, CASES)
'''


class FsdpRecipeResumesInMegatronCoreTest(megatron_core_pypi.MegatronCoreTestCase):
    TIMEOUT = 600

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        script = (torch2_chroot.END_RANK + GENERATE.replace('__SAVES__', repr({SOURCE: SAVES[SOURCE]})) +
                  RESUMED_IN_TORCH)
        p = torch2_chroot.run(cls.root, script, {cls.work: '/data'}, timeout=600)
        if p.returncode:
            raise AssertionError('torch 2 could not write the save:\n' + p.stdout + p.stderr[-4000:])
        with open(os.path.join(cls.work, 'continued.json')) as f:
            cls.continued = json.load(f)
        with open(os.path.join(cls.work, 'resumed_in_torch.json')) as f:
            cls.resumed_in_torch = json.load(f)
        out = os.path.join(cls.work, 'torch_dist')
        p = run('export', os.path.join(cls.work, SOURCE), out, '--to', 'torch_dist', '--tp', 1, '--pp', 1,
                '--set', 'make_vocab_size_divisible_by=1', '--set', 'lr=0.001', '--set', 'min_lr=0', *HEADS)
        if p.returncode:
            raise AssertionError(p.stdout + p.stderr)
        (tag,) = [name for name in os.listdir(out) if name.startswith('iter_')]
        cases = [[world, f'/data/torch_dist/{tag}', f'/data/dp{world}.json'] for world in WORLDS]
        script = (torch2_chroot.END_RANK + megatron_core_pypi.RANKS + megatron_core_pypi.OPTIMIZER +
                  RESUME % json.dumps(cases))
        p = cls.megatron(script)
        if p.returncode:
            raise AssertionError('Megatron-Core could not resume the outputs:\n' + p.stdout + p.stderr[-4000:])
        cls.records = {}
        for world in WORLDS:
            with open(os.path.join(cls.work, f'dp{world}.json')) as f:
                cls.records[world] = json.load(f)

    def test_the_next_step_is_torchs_own_resume_of_the_save(self):
        print('the run continued at world 2:', self.continued, '; resumed by torch in one process:',
              self.resumed_in_torch, '; by Megatron-Core:',
              {f'DP {dp}': r['losses'] for dp, r in self.records.items()}, file=sys.stderr)
        for dp, record in self.records.items():
            with self.subTest(dp=dp):
                # Megatron-Core's forward (its attention, its vocabulary-parallel cross entropy) rounds
                # otherwise than the recipe's in the last bits.
                for got, want in zip(record['losses'], self.resumed_in_torch):
                    self.assertAlmostEqual(got, want, delta=1e-6)
                self.assertAlmostEqual(record['losses'][0], self.continued[0], delta=1e-6)
                # FSDP2 at world 2 sums the gradients in another order than one process does.
                self.assertAlmostEqual(record['losses'][1], self.continued[1], delta=2e-3)

    def test_the_check_sees_a_model_not_loaded(self):
        for dp, record in self.records.items():
            with self.subTest(dp=dp):
                self.assertGreater(max(abs(a - b) for a, b in zip(record['built'], self.continued)), 1e-2)

    def test_it_resumes_from_the_saves_step(self):
        for dp, record in self.records.items():
            with self.subTest(dp=dp):
                self.assertEqual(record['steps'], [1])


if __name__ == '__main__':
    support.main()
