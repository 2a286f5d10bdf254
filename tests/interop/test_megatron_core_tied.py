"""Tied embeddings in Megatron-Core `torch_dist`, with checkpoints the real framework writes and loads.

Megatron-LM's default GPT shares the output layer with the word embedding
(`share_embeddings_and_output_weights`). The saves here are made each run by real Megatron-Core
0.19.1 from PyPI (megatron_core_pypi.py) in the torch 2.6 chroot (torch2_chroot.py), with its own
`dist_checkpointing.save` on CPU with 2 gloo processes, for a tiny GPTModel of the local layer spec
(hidden 16, 4 heads, FFN 32, 2 layers, vocabulary 64), tied:

* `gelu_tp2`, `gelu_pp2`: GeLU, 2 query groups, rotary, LayerNorm and linear biases (rule set
  megatron-gpt2), at TP 2 and at PP 2;
* `gpt2_tp2`: GeLU, multi-head attention, learned positions (megatron-gpt2, exported to HF as GPT-2);
* `swiglu_tp2`, `swiglu_pp2`: SwiGLU, RMSNorm, no biases, 2 query groups (megatron-llama-tied).

At PP 2 Megatron-Core's last stage holds the embedding's copy as output_layer.weight, equal to the
first stage's (an all-reduce at build), and saves it under the embedding's key as a replica, which is
not stored: the save holds the embedding once. torch's `dcp.load` gives every save's whole tensors.

Checked: reshard reads each save as its family; `convert --to deepspeed` gives those tensors in
Megatron-DeepSpeed's layer files; `export --to hf` gives GPT-2 / Llama tensors equal to them (and a
rotary GeLU model is refused in one line); and a `torch_dist` output at another layout (TP 2 -> PP 2,
PP 2 -> TP 2), and its conversion back to the save's layout, are loaded by Megatron-Core's
`dist_checkpointing.load` with StrictHandling.RAISE_ALL into the model at that layout, every
parameter (the last stage's output layer included) equal to what Megatron-Core loads from its own
save at that layout, and at TP 2 the loss, before and after one SGD step, the same as with its own
save. Skipped with one line when the chroot or the wheels cannot be had.

Run: /usr/bin/python3 tests/interop/test_megatron_core_tied.py --reshard build/reshard
"""
import json
import os
import sys

import torch

import interop_support as support
from megatron_core_data import llama_hf_tensors
import megatron_core_pypi
import torch2_chroot

run = support.reshard

MODEL = dict(hidden=16, heads=4, ffn=32, layers=2, vocab=64, max_seq=32)
# tag: (model kind, query groups, TP, PP)
SAVES = {'gelu_tp2': ('gelu', 2, 2, 1), 'gelu_pp2': ('gelu', 2, 1, 2), 'gpt2_tp2': ('gpt2', 4, 2, 1),
         'swiglu_tp2': ('swiglu', 2, 2, 1), 'swiglu_pp2': ('swiglu', 2, 1, 2)}
FAMILY = {'gelu': 'megatron-gpt2', 'gpt2': 'megatron-gpt2', 'swiglu': 'megatron-llama-tied'}

# Run by both scripts: builds the tied GPTModel of a kind at a layout (after the process group).
BUILD = r'''
import datetime, json, os, socket, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

M = json.loads(%r)
KINDS = {'gelu': dict(swiglu=False, position='rope'), 'gpt2': dict(swiglu=False, position='learned_absolute'),
         'swiglu': dict(swiglu=True, position='rope')}

def build(kind, groups, tp, pp):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    k = KINDS[kind]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    config = TransformerConfig(
        num_layers=M['layers'], hidden_size=M['hidden'], num_attention_heads=M['heads'], num_query_groups=groups,
        ffn_hidden_size=M['ffn'], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, gated_linear_unit=k['swiglu'],
        activation_func=F.silu if k['swiglu'] else F.gelu, normalization='RMSNorm' if k['swiglu'] else 'LayerNorm',
        add_bias_linear=not k['swiglu'], bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    torch.manual_seed(1234)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization), vocab_size=M['vocab'],
                     max_sequence_length=M['max_seq'], pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=True,
                     position_embedding_type=k['position'])
    return model

''' % json.dumps(MODEL) + megatron_core_pypi.RANKS

# Saves each sample at /data/TAG, then (no process group, after every fork) has torch's dcp.load
# read its whole tensors into /data/TAG_full.pt.
SAVE = r'''
SAVES = json.loads(%r)

def save(r, port, world, tag):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    start(r, port, world)
    model = build(*SAVES[tag])
    # The norms start at 1 and the biases at 0: values a misplaced copy would show.
    g = torch.Generator().manual_seed(7 + ps.get_pipeline_model_parallel_rank())
    for p in model.parameters():
        if p.dim() == 1:
            p.data.add_(torch.randn(p.shape, generator=g))
    os.makedirs('/data/' + tag, exist_ok=True)  # as Megatron-LM makes it
    dist_checkpointing.save(model.sharded_state_dict(), '/data/' + tag)
    torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
               f'/data/{tag}_rank{r}.pt')
    end_rank(dist)

worlds(save, [(2, tag) for tag in SAVES])

import pickle
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
for tag in SAVES:
    with open(f'/data/{tag}/.metadata', 'rb') as f:
        meta = pickle.load(f)
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}
    dcp.load(full, checkpoint_id='/data/' + tag)
    torch.save(full, f'/data/{tag}_full.pt')
print('megatron-core', __import__('megatron.core.package_info').core.package_info.__version__)
''' % json.dumps(SAVES)

# Loads, at the layout each case names, Megatron-Core's own save and reshard's output into the
# model (every parameter zeroed first), both strictly, and saves what each rank holds after each; at
# PP 1 also the loss, before and after one SGD step.
LOAD = megatron_core_pypi.LOSSES + r'''
def load(r, port, world, name, out, kind, groups, tp, pp):
    tag = name.rsplit('_', 1)[0]  # the save: TAG_out, TAG_back
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    start(r, port, world)
    model = build(kind, groups, tp, pp)
    held, loss = {}, {}
    for who, folder in (('megatron', '/data/' + tag), ('reshard', out)):
        for p in model.parameters():
            p.data.zero_()
        # As Megatron-LM loads: the model's state under 'model', the common state (args,
        # iteration) beside it.
        state = dist_checkpointing.load({'model': model.sharded_state_dict()}, folder,
                                        strict=StrictHandling.RAISE_ALL)
        model.load_state_dict(state['model'], strict=True)
        held[who] = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        if pp == 1:  # the TP ranks compute the loss together
            loss[who] = losses(model)
    torch.save({'held': held, 'loss': loss}, f'/data/{name}_loaded_rank{r}.pt')
    end_rank(dist)

worlds(load, [(2, *case) for case in CASES])
'''


def sizes(tag):
    """The values a save made without Megatron-LM's args does not record."""
    kind, groups = SAVES[tag][:2]
    out = ['--set', f"num_attention_heads={MODEL['heads']}", '--set', 'make_vocab_size_divisible_by=16']
    if groups != MODEL['heads']:
        out += ['--set', f'num_key_value_heads={groups}']
    if kind != 'gpt2':
        out += ['--set', 'position_embedding_type=rope']
    return out + ['--vocab-size', MODEL['vocab']]  # last: inspect and verify take it off


def sorted_dict(d):
    return dict(sorted(d.items()))


HF_SIZES = ['--set', f"max_position_embeddings={MODEL['max_seq']}", '--set', 'layernorm_epsilon=1e-5']

# Megatron-DeepSpeed's layer file names of a block's tensors -> Megatron-Core's stacked keys.
BLOCK_KEYS = {
    'input_layernorm.weight': 'self_attention.linear_qkv.layer_norm_weight',
    'input_layernorm.bias': 'self_attention.linear_qkv.layer_norm_bias',
    'self_attention.query_key_value.weight': 'self_attention.linear_qkv.weight',
    'self_attention.query_key_value.bias': 'self_attention.linear_qkv.bias',
    'self_attention.dense.weight': 'self_attention.linear_proj.weight',
    'self_attention.dense.bias': 'self_attention.linear_proj.bias',
    'post_attention_layernorm.weight': 'mlp.linear_fc1.layer_norm_weight',
    'post_attention_layernorm.bias': 'mlp.linear_fc1.layer_norm_bias',
    'mlp.dense_h_to_4h.weight': 'mlp.linear_fc1.weight',
    'mlp.dense_h_to_4h.bias': 'mlp.linear_fc1.bias',
    'mlp.dense_4h_to_h.weight': 'mlp.linear_fc2.weight',
    'mlp.dense_4h_to_h.bias': 'mlp.linear_fc2.bias',
}


def gpt2_hf_tensors(full):
    """{GPT2LMHeadModel name: tensor} of a multi-head save's whole tensors: Conv1D weights are
    [in, out], c_attn is [q; k; v] where the fused QKV is per head [heads, 3, head dim]."""
    h, heads = MODEL['hidden'], MODEL['heads']
    out = {'transformer.wte.weight': full['embedding.word_embeddings.weight'],
           'transformer.wpe.weight': full['embedding.position_embeddings.weight'],
           'transformer.ln_f.weight': full['decoder.final_layernorm.weight'],
           'transformer.ln_f.bias': full['decoder.final_layernorm.bias']}
    for layer in range(MODEL['layers']):
        p = f'transformer.h.{layer}.'
        at = {k[len('decoder.layers.'):]: v[layer] for k, v in full.items() if k.startswith('decoder.layers.')}
        qkv = at['self_attention.linear_qkv.weight'].view(heads, 3, h // heads, h)
        qkv_bias = at['self_attention.linear_qkv.bias'].view(heads, 3, h // heads)
        out.update({p + 'ln_1.weight': at['self_attention.linear_qkv.layer_norm_weight'],
                    p + 'ln_1.bias': at['self_attention.linear_qkv.layer_norm_bias'],
                    p + 'attn.c_attn.weight': qkv.transpose(0, 1).reshape(3 * h, h).t(),
                    p + 'attn.c_attn.bias': qkv_bias.transpose(0, 1).reshape(3 * h),
                    p + 'attn.c_proj.weight': at['self_attention.linear_proj.weight'].t(),
                    p + 'attn.c_proj.bias': at['self_attention.linear_proj.bias'],
                    p + 'ln_2.weight': at['mlp.linear_fc1.layer_norm_weight'],
                    p + 'ln_2.bias': at['mlp.linear_fc1.layer_norm_bias'],
                    p + 'mlp.c_fc.weight': at['mlp.linear_fc1.weight'].t(),
                    p + 'mlp.c_fc.bias': at['mlp.linear_fc1.bias'],
                    p + 'mlp.c_proj.weight': at['mlp.linear_fc2.weight'].t(),
                    p + 'mlp.c_proj.bias': at['mlp.linear_fc2.bias']})
    return out


class MegatronCoreTiedTest(megatron_core_pypi.MegatronCoreTestCase):

    SAVE = torch2_chroot.END_RANK + BUILD + SAVE
    TIMEOUT = 240

    def full(self, tag):
        return torch.load(self.saved(tag + '_full.pt'))

    def test_each_save_is_read_as_its_tied_family(self):
        for tag, (kind, _, _, _) in SAVES.items():
            with self.subTest(save=tag):
                p = run('inspect', self.saved(tag), *sizes(tag)[:-2])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn(f'rule set {FAMILY[kind]};', p.stdout)
                self.assertIn('word_embeddings.weight  float32[64, 16]', p.stdout)

    def test_the_pp2_save_holds_the_last_stages_copy_of_the_embedding_once(self):
        for tag in ('gelu_pp2', 'swiglu_pp2'):
            with self.subTest(save=tag):
                first = torch.load(self.saved(tag + '_rank0.pt'))
                last = torch.load(self.saved(tag + '_rank1.pt'))
                # Megatron-Core's last stage holds an equal copy, which the save does not store.
                self.assertTrue(torch.equal(last['output_layer.weight'], first['embedding.word_embeddings.weight']))
                self.assertNotIn('output_layer.weight', self.full(tag))
                p = run('inspect', self.saved(tag), '--rules', 'none')
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertIn('embedding.word_embeddings.weight float32[64, 16], 1 chunk: [0, 0]+[64, 16]', p.stdout)
                self.assertNotIn('output_layer', p.stdout)

    def test_convert_to_deepspeed_gives_the_saves_tensors(self):
        for tag in SAVES:
            with self.subTest(save=tag):
                full, out = self.full(tag), self.path(tag + '_ds')
                p = run('convert', '--to', 'deepspeed', self.saved(tag), out, '--tp', 1, '--pp', 1, *sizes(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                files = sorted(f for f in os.listdir(out) if f.startswith('layer_'))
                # Embedding, two blocks, final norm; the tied head has no file of its own.
                self.assertEqual([f[:8] for f in files], ['layer_01', 'layer_02', 'layer_03', 'layer_04'])
                embedding = torch.load(os.path.join(out, files[0]))
                want = {'word_embeddings.weight': full['embedding.word_embeddings.weight']}
                if 'embedding.position_embeddings.weight' in full:
                    want['position_embeddings.weight'] = full['embedding.position_embeddings.weight']
                self.assertEqual(support.differences(sorted_dict(embedding), sorted_dict(want), files[0]), [])
                for layer in range(MODEL['layers']):
                    got = torch.load(os.path.join(out, files[1 + layer]))
                    want = {name: full['decoder.layers.' + key][layer] for name, key in BLOCK_KEYS.items()
                            if 'decoder.layers.' + key in full}
                    self.assertEqual(support.differences(sorted_dict(got), sorted_dict(want), files[1 + layer]), [])
                norm = torch.load(os.path.join(out, files[3]))
                want = {k: full['decoder.final_layernorm.' + k] for k in ('weight', 'bias')
                        if 'decoder.final_layernorm.' + k in full}
                self.assertEqual(support.differences(sorted_dict(norm), sorted_dict(want), files[3]), [])

    def test_a_layout_change_in_deepspeed_is_the_same_model(self):
        for tag in ('gelu_tp2', 'gelu_pp2', 'swiglu_pp2'):
            with self.subTest(save=tag):
                out = self.path(tag + '_ds22')
                p = run('convert', '--to', 'deepspeed', self.saved(tag), out, '--tp', 2, '--pp', 2, *sizes(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                p = run('verify', self.saved(tag), out, *sizes(tag)[:-2])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)

    def test_export_to_hf_gives_the_saves_tensors(self):
        m = dict(MODEL, groups=2)
        cases = {'gpt2_tp2': (gpt2_hf_tensors, ['--set', 'bias_gelu_fusion=false']),
                 'swiglu_tp2': (lambda full: llama_hf_tensors(full, m), []),
                 'swiglu_pp2': (lambda full: llama_hf_tensors(full, m), [])}
        for tag, (hf_of, extra) in cases.items():
            with self.subTest(save=tag):
                out = self.path(tag + '_hf')
                p = run('export', '--to', 'hf', self.saved(tag), out, *sizes(tag), *HF_SIZES, *extra)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got, _ = support.read_safetensors(os.path.join(out, 'model.safetensors'))
                full = self.full(tag)
                # Tied: HF's lm_head is the embedding, and not saved.
                want = hf_of(dict(full, **{'output_layer.weight': full['embedding.word_embeddings.weight']}))
                want.pop('lm_head.weight', None)
                self.assertEqual(support.differences(sorted_dict(got), sorted_dict(want), tag), [])
                with open(os.path.join(out, 'config.json')) as f:
                    self.assertIs(json.load(f)['tie_word_embeddings'], True)
        # GPT-2 has learned positions: a rotary GeLU model is refused in one line, nothing written.
        out = self.path('gelu_hf')
        p = run('export', '--to', 'hf', self.saved('gelu_tp2'), out, *sizes('gelu_tp2'), *HF_SIZES)
        self.assertRefused(p, 'GPT2LMHeadModel does not compute this model: args.use_rotary_position_embeddings is true',
                           out)

    def test_megatron_core_loads_the_torch_dist_outputs_strictly(self):
        cases = []
        for tag, (kind, groups, tp, pp) in SAVES.items():
            # To the other layout (TP 2 <-> PP 2), and from there back to the save's.
            for source, name, to_tp, to_pp in ((tag, tag + '_out', pp, tp), (tag + '_out', tag + '_back', tp, pp)):
                out = self.saved(name)
                p = run('convert', self.saved(source), out, '--tp', to_tp, '--pp', to_pp, *sizes(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertFalse(os.path.exists(os.path.join(out, 'iter_0000000', 'common.pt')))
                cases.append([name, f'/data/{name}/iter_0000000', kind, groups, to_tp, to_pp])
        p = self.megatron(torch2_chroot.END_RANK + BUILD + 'CASES = json.loads(%r)\n' % json.dumps(cases) + LOAD)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-4000:])
        for name, _, _, _, tp, pp in cases:
            with self.subTest(output=name, tp=tp, pp=pp):
                compared, last = self.assertLoadedAsItsOwn(name, 2)
                if pp == 2:  # the last stage's output layer: loaded from the embedding, not left zero
                    first = torch.load(self.saved(f'{name}_loaded_rank0.pt'))
                    self.assertTrue(torch.equal(last['held']['reshard']['output_layer.weight'],
                                                first['held']['reshard']['embedding.word_embeddings.weight']))
                    self.assertNotEqual(last['held']['reshard']['output_layer.weight'].abs().sum().item(), 0)
                else:
                    self.assertTrue(last['loss'])
                print(f'{name} at TP {tp} PP {pp}: {compared} tensors loaded strictly, equal' +
                      (f"; loss {last['loss']['reshard']}" if pp == 1 else ''), file=sys.stderr)


if __name__ == '__main__':
    support.main()
