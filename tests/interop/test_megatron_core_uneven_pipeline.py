"""Uneven pipeline stages, with checkpoints the real Megatron-Core writes and loads.

Megatron-Core splits the layers evenly over the pipeline stages unless the run gives the first or
last stage's (Megatron-LM's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers,
TransformerConfig's num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage). Real
Megatron-Core 0.19.1 from PyPI (megatron_core_pypi.py), in the torch 2.6 chroot (torch2_chroot.py) on
CPU with gloo, saves a 3-layer GPTModel of the local layer spec (hidden 16, 4 heads in 2 query
groups, FFN 32, vocabulary 64, GeLU, rotary, untied: rule set megatron-core-gpt) at PP 2 with the
first stage holding 2 layers, as Megatron-LM does: the model's sharded state beside args that record
the split.

Checked: reshard converts it to torch_dist at PP 1, PP 3, PP 2 with the first stage holding 1 layer,
PP 2 with the embedding counted as a layer (--account-for-embedding-in-pipeline-split) and PP 2
keeping its own split, and to Megatron-LM's `torch` format at its own split and with the loss
counted (--account-for-loss-in-pipeline-split); each output converts back to the source's layout,
and the one with the embedding counted keeps its split at its PP. Megatron-Core loads every output at its layout strictly
(dist_checkpointing.load with StrictHandling.RAISE_ALL; a `torch` rank file's model with
load_state_dict(strict=True)), every parameter equal to what it loads from its own save at that
layout; at PP 1 the loaded model's loss, and its loss after one SGD step, are bit-identical to the
source's (Megatron's own save loaded at PP 1). Stage sizes that do not add up are refused in one
line. Skipped with one line when the chroot or the wheels cannot be had.

Without the framework: the optimizer state written at uneven stages (torch_dist's dp_reshardable
buckets, the torch format's distrib_optim.pt) reads back as the source's, and a dp_reshardable save
whose args do not record its stage sizes takes them from --set, as its refusal advises.

Run: /usr/bin/python3 tests/interop/test_megatron_core_uneven_pipeline.py --reshard build/reshard
"""
import json
import os
import re
import sys

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
import megatron_core_data
import megatron_core_pypi
import torch2_chroot

run = support.reshard

MODEL = dict(hidden=16, heads=4, groups=2, ffn=32, layers=3, vocab=64, max_seq=32)
SIZES = ['--set', f"num_attention_heads={MODEL['heads']}", '--set', f"num_key_value_heads={MODEL['groups']}",
         '--set', 'make_vocab_size_divisible_by=16', '--vocab-size', MODEL['vocab']]
FIRST = '--decoder-first-pipeline-num-layers'
EMBEDDING = '--account-for-embedding-in-pipeline-split'
LOSS = '--account-for-loss-in-pipeline-split'

# Run by every script: builds the GPTModel at PP `pp` split as `split` says (TransformerConfig's
# fields: {} for even), after the process group; `worlds` runs each case in its own world.
BUILD = r'''
import argparse, datetime, json, os, socket, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

M = json.loads(%r)

def build(pp, split):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    config = TransformerConfig(
        num_layers=M['layers'], hidden_size=M['hidden'], num_attention_heads=M['heads'],
        num_query_groups=M['groups'], ffn_hidden_size=M['ffn'], pipeline_model_parallel_size=pp,
        **split, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        activation_func=F.gelu, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False)
    torch.manual_seed(1234)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=M['vocab'], max_sequence_length=M['max_seq'],
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False, position_embedding_type='rope')

''' % json.dumps(MODEL) + megatron_core_pypi.RANKS

# The source: PP 2, the first stage's 2 layers, saved as Megatron-LM saves (args beside the model).
SAVE = r'''
def save(r, port, world):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    start(r, port, world)
    model = build(2, {'num_layers_in_first_pipeline_stage': 2})
    # The norms start at 1 and the biases at 0: values a misplaced copy would show.
    g = torch.Generator().manual_seed(7 + ps.get_pipeline_model_parallel_rank())
    for p in model.parameters():
        if p.dim() == 1:
            p.data.add_(torch.randn(p.shape, generator=g))
    args = argparse.Namespace(num_layers=M['layers'], tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                              data_parallel_size=1, decoder_first_pipeline_num_layers=2,
                              decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
                              account_for_loss_in_pipeline_split=False)
    os.makedirs('/data/src', exist_ok=True)  # as Megatron-LM makes it
    dist_checkpointing.save({'model': model.sharded_state_dict(), 'args': args, 'checkpoint_version': 3.0},
                            '/data/src')
    end_rank(dist)

worlds(save, [(2,)])
print('megatron-core', __import__('megatron.core.package_info').core.package_info.__version__)
'''

# Loads, at each case's layout, Megatron-Core's own save and reshard's output into the model (every
# parameter zeroed first), both strictly, and saves what each rank holds after each; at PP 1 also
# the loss on fixed tokens, and after one SGD step.
LOAD = megatron_core_pypi.LOSSES + r'''
def load(r, port, world, name, out, form, pp, split):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling
    start(r, port, world)
    model = build(pp, split)
    held, loss = {}, {}
    for who, folder, kind in (('megatron', '/data/src', 'torch_dist'), ('reshard', out, form)):
        for p in model.parameters():
            p.data.zero_()
        if kind == 'torch_dist':
            state = dist_checkpointing.load({'model': model.sharded_state_dict()}, folder,
                                            strict=StrictHandling.RAISE_ALL)['model']
        else:
            rank = 'mp_rank_00' if pp == 1 else f'mp_rank_00_{ps.get_pipeline_model_parallel_rank():03d}'
            state = torch.load(f'{folder}/{rank}/model_optim_rng.pt', weights_only=False)['model']
        model.load_state_dict(state, strict=True)
        held[who] = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        if pp == 1:
            loss[who] = losses(model)
    torch.save({'held': held, 'loss': loss}, f'/data/{name}_loaded_rank{r}.pt')
    end_rank(dist)

worlds(load, CASES)
'''


class MegatronCoreUnevenPipelineTest(megatron_core_pypi.MegatronCoreTestCase):

    SAVE = torch2_chroot.END_RANK + BUILD + SAVE

    def convert(self, source, name, *flags):
        out = self.saved(name)
        p = run('convert', self.saved(source), out, *flags, *SIZES)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def test_the_source_is_read_at_its_own_split(self):
        p = run('inspect', self.saved('src'), *SIZES[:-2])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('rule set megatron-core-gpt;', p.stdout)
        self.assertIn('PP 2 (args)', p.stdout)

    def test_stage_sizes_that_do_not_add_up_are_refused(self):
        out = self.path('bad')
        p = run('convert', self.saved('src'), out, '--pp', 2, FIRST, 3, *SIZES)
        self.assertRefused(p, 'the pipeline stage sizes (first stage 3) leave 0 layers of 3 for 1 other stage', out)
        # An even source at 2 stages of 3 layers: the fix is named.
        self.convert('src', 'even1', '--pp', 1)
        p = run('convert', self.saved('even1'), out, '--pp', 2, *SIZES)
        self.assertRefused(p, '3 layers do not divide into 2 stages; give --decoder-first-pipeline-num-layers N', out)

    def test_megatron_core_loads_every_layout_strictly(self):
        # name: (output, form, PP, its split as TransformerConfig's fields, conversion flags, source)
        first = lambda n: {'num_layers_in_first_pipeline_stage': n}
        embedding = {'account_for_embedding_in_pipeline_split': True}
        loss = {'account_for_loss_in_pipeline_split': True}
        outputs = {
            'pp1': ('torch_dist', 1, {}, ['--pp', 1], 'src'),
            'pp3': ('torch_dist', 3, {}, ['--pp', 3], 'src'),
            'pp2_first1': ('torch_dist', 2, first(1), ['--pp', 2, FIRST, 1], 'src'),
            'pp2_own': ('torch_dist', 2, first(2), ['--pp', 2], 'src'),
            'pp2_embedding': ('torch_dist', 2, embedding, ['--pp', 2, EMBEDDING], 'src'),
            'pp2_loss': ('torch', 2, loss, ['--to', 'megatron', '--pp', 2, LOSS], 'src'),
            'torch_own': ('torch', 2, first(2), ['--to', 'megatron'], 'src'),
            'pp1_back': ('torch_dist', 2, first(2), ['--pp', 2, FIRST, 2], 'pp1'),
            'pp3_back': ('torch_dist', 2, first(2), ['--pp', 2, FIRST, 2], 'pp3'),
            'pp2_first1_back': ('torch_dist', 2, first(2), ['--pp', 2, FIRST, 2], 'pp2_first1'),
            'pp2_embedding_own': ('torch_dist', 2, embedding, ['--pp', 2], 'pp2_embedding'),
            'torch_back': ('torch_dist', 2, first(2), ['--to', 'torch_dist'], 'torch_own'),
        }
        cases = []
        for name, (form, pp, split, flags, source) in outputs.items():
            self.convert(source, name, *flags)
            p = run('verify', self.saved('src'), self.saved(name), *SIZES[:-2])
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn('same model', p.stdout)
            cases.append([pp, name, f'/data/{name}/iter_0000000', form, pp, split])
        # The split each output's args record (torch_dist's keys are global, so its load cannot tell).
        for name in ('torch_own', 'pp2_loss'):
            with open(os.path.join(self.saved(name), 'iter_0000000', 'mp_rank_00_000', 'model_optim_rng.pt'),
                      'rb') as f:
                args = vars(torch.load(f, weights_only=False)['args'])
            split = outputs[name][2]
            self.assertEqual(args['decoder_first_pipeline_num_layers'], split.get('num_layers_in_first_pipeline_stage'))
            for field in ('account_for_embedding_in_pipeline_split', 'account_for_loss_in_pipeline_split'):
                self.assertEqual(bool(args.get(field)), split.get(field, False), (name, field))
        for name, stages in (('pp2_first1', 'first stage 1'), ('pp2_embedding', 'the embedding counted as a layer'),
                             ('pp2_embedding_own', 'the embedding counted as a layer')):
            p = run('inspect', self.saved(name), *SIZES[:-2])
            self.assertIn(f'PP 2 (args), DP 1 (args), stages {stages} (args)', p.stdout)
        p = self.megatron(torch2_chroot.END_RANK + BUILD + 'CASES = json.loads(%r)\n' % json.dumps(cases) + LOAD)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-4000:])
        for _, name, _, form, pp, split in cases:
            with self.subTest(output=name, pp=pp, split=split):
                compared, got = self.assertLoadedAsItsOwn(name, pp)
                print(f'{name} ({form}) at PP {pp}, split {split}: {compared} tensors loaded strictly, equal' +
                      (f"; loss {got['loss']['reshard']}" if pp == 1 else ''), file=sys.stderr)


class DpReshardableStageSizesTest(FixtureTestCase):
    """A dp_reshardable save's buckets are laid out per stage: where its args do not record the run's
    stage sizes, --set gives them (the refusal's advice), and sizes that do not add up are named."""

    SAVE = os.path.join(megatron_core_data.DATA, '0.19', 'w2_pp2_optim_dp_reshardable')
    HEADS = SIZES[:-2]

    def test_set_gives_the_stage_sizes(self):
        p = run('inspect', self.SAVE, *self.HEADS, '--set', 'decoder_first_pipeline_num_layers=1')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('optimizer state: the distributed optimizer\'s, layout dp_reshardable', p.stdout)
        out = self.path('out')
        p = run('convert', self.SAVE, out, '--pp', 1, *SIZES, '--set', 'decoder_first_pipeline_num_layers=1')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', self.SAVE, out, *self.HEADS)
        self.assertIn('same model', p.stdout)
        p = run('inspect', self.SAVE, *self.HEADS, '--set', 'decoder_first_pipeline_num_layers=2')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("optimizer state is laid out for 2 pipeline stages: the pipeline stage sizes (first stage 2) "
                      "leave 0 layers of 2 for 1 other stage, which Megatron-Core cannot split evenly; give --set "
                      "decoder_first_pipeline_num_layers=N", p.stdout)


class UnevenOptimizerStateTest(FixtureTestCase):
    """The optimizer state at uneven stages: a Megatron-DeepSpeed checkpoint with its state (6 layers)
    exported as torch_dist's dp_reshardable at PP 2 (4, 2 layers) and as the torch format's
    distrib_optim.pt at PP 3 (1, 1, 4 layers) is read back, by the split its args record, as the
    same tensors, the optimizer state's too."""

    def test_the_buckets_follow_the_stages(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=1, pp=1, dp=1, optimizer='bf16_zero'))
        itself = run('verify', src, src)
        exports = {'td': ('--to', 'torch_dist', '--pp', 2, FIRST, 4, '--optimizer-layout', 'dp_reshardable',
                          '--dp', 2),
                   'mg': ('--to', 'megatron', '--pp', 3, '--decoder-last-pipeline-num-layers', 4)}
        for name, flags in exports.items():
            with self.subTest(export=name):
                out, back = self.path(name), self.path(name + '_back', 'global_step10')
                p = run('export', src, out, '--tp', 1, *flags)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('recorded in the args', p.stdout)
                p = run('convert', '--to', 'deepspeed', out, back, '--tp', 1, '--pp', 1, '--dp', 1,
                        '--no-update-latest')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                p = run('verify', src, back)
                # Both carry the learning-rate scheduler; neither the sample counter.
                self.assertEqual(re.findall(r'differs: (.*)', p.stdout), ['global_samples differs'])
                self.assertNotIn('elements differ', p.stdout)
                self.assertEqual(re.findall(r'verify: (\d+) tensors', p.stdout),
                                 re.findall(r'verify: (\d+) tensors', itself.stdout))


if __name__ == '__main__':
    support.main()
