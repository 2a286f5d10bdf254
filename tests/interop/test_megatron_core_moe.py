"""Megatron-Core Mixture-of-Experts `torch_dist` saves read as the model of rules/megatron-core-moe.yaml.

The sources are real Megatron-Core 0.19.1 saves (tests/data/megatron-core/0.19-moe: a GPTModel of the
local spec with SequentialMLP experts, 4 experts top-2 in both layers, saved at EP 2 and at TP 2 ×
EP 1), each with every tensor whole in `TAG_full.pt`, written by Megatron and torch, not by reshard.
Checked:

* the rule set is found from the keys; `inspect` shows the experts and the saved layout with its EP,
  `lint` passes;
* `export --to consolidated` writes the router and every expert of every layer under its canonical
  name, equal to `TAG_full.pt`'s slice of the stacked key ([L, E, ...]) bit for bit;
* the two saves were initialised at different layouts, so they hold different random weights: `verify`
  says they differ in exactly the tensors their references differ in, and each is the same model as
  its own consolidated export; one with two experts swapped is not;
* `convert` to torch_dist at another TP (EP 1: this slice writes each expert whole on every DP rank)
  keeps every global tensor, with the (layer, expert) chunks and the experts' empty _extra_state items
  Megatron-Core writes; the torch format's experts and another EP are refused in one line.

* real Megatron-Core 0.19 (the torch 2.6 chroot, CPU, gloo) builds the MoE model at each target layout,
  loads reshard's torch_dist output strictly, and saves it again: every tensor of that save equals the
  reference.

Run: /usr/bin/python3 tests/interop/test_megatron_core_moe.py --reshard build/reshard
"""
import json
import os
import sys

import torch

import interop_support as support
from megatron_core_data import DATA, config_of
from interop_support import FixtureTestCase
import megatron_core_pypi
import torch2_chroot

run = support.reshard

SAVES = ('0.19-moe/w2_ep2', '0.19-moe/w2_tp2_ep1')
# Megatron-Core key -> canonical name (`{l}` the layer, `{e}` the expert) of the rule set.
CANONICAL = {
    'embedding.word_embeddings.weight': 'embedding.word_embeddings.weight',
    'decoder.layers.self_attention.linear_qkv.layer_norm_weight': 'layers.{l}.input_layernorm.weight',
    'decoder.layers.self_attention.linear_qkv.layer_norm_bias': 'layers.{l}.input_layernorm.bias',
    'decoder.layers.self_attention.linear_qkv.weight': 'layers.{l}.self_attention.query_key_value.weight',
    'decoder.layers.self_attention.linear_proj.weight': 'layers.{l}.self_attention.dense.weight',
    'decoder.layers.mlp.linear_fc1.layer_norm_weight': 'layers.{l}.post_attention_layernorm.weight',
    'decoder.layers.mlp.linear_fc1.layer_norm_bias': 'layers.{l}.post_attention_layernorm.bias',
    'decoder.layers.mlp.router.weight': 'layers.{l}.mlp.deepspeed_moe.gate.wg.weight',
    'decoder.layers.mlp.experts.experts.linear_fc1.weight':
        'layers.{l}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_h_to_4h.weight',
    'decoder.layers.mlp.experts.experts.linear_fc2.weight':
        'layers.{l}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_4h_to_h.weight',
    'decoder.final_layernorm.weight': 'final_layernorm.weight',
    'decoder.final_layernorm.bias': 'final_layernorm.bias',
    'output_layer.weight': 'lm_head.weight',
}


def canonical_tensors(full):
    """{canonical name: tensor} of a save's whole tensors `full` ({Megatron-Core key: tensor})."""
    out = {}
    for key, tensor in full.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        name = CANONICAL[key]
        if '{e}' in name:
            for layer in range(tensor.shape[0]):
                for expert in range(tensor.shape[1]):
                    out[name.format(l=layer, e=expert)] = tensor[layer, expert]
        elif '{l}' in name:
            for layer in range(tensor.shape[0]):
                out[name.format(l=layer)] = tensor[layer]
        else:
            out[name] = tensor
    return out


def sizes(tag):
    """The --set values the saves do not record (they were written without Megatron-LM's args)."""
    m = config_of(tag)['model']
    return ['--set', f"num_attention_heads={m['heads']}", '--set', f"num_key_value_heads={m['groups']}",
            '--set', 'make_vocab_size_divisible_by=16']


def vocab(tag):
    """What a conversion also needs: the true vocabulary size, which they do not record either."""
    return sizes(tag) + ['--vocab-size', str(config_of(tag)['model']['vocab'])]


# Megatron-Core, in 2 forked ranks per case: builds the samples' MoE GPTModel (local spec, SequentialMLP)
# at a case's TP and EP, loads reshard's output strictly and saves what it holds again; then torch's
# dcp.load reads each save whole into OUT_full.pt.
LOAD = r'''
import datetime, json, os, pickle, socket
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

M, CASES = json.loads(%r)

def build(tp, ep):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    config = TransformerConfig(
        num_layers=M['layers'], hidden_size=M['hidden'], num_attention_heads=M['heads'],
        num_query_groups=M['groups'], ffn_hidden_size=M['ffn'], num_moe_experts=M['num_moe_experts'],
        moe_router_topk=M['moe_router_topk'], moe_ffn_hidden_size=M['moe_ffn_hidden_size'],
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, use_cpu_initialization=True,
        activation_func=F.gelu, normalization='LayerNorm', add_bias_linear=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False)
    return GPTModel(config, get_gpt_layer_local_spec(num_experts=M['num_moe_experts'], moe_grouped_gemm=False,
                                                      normalization='LayerNorm'),
                    vocab_size=M['padded_vocab'], max_sequence_length=M['max_seq'],
                    share_embeddings_and_output_weights=False, position_embedding_type='rope')

def load(r, port, folder, out, tp, ep):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=r, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    model = build(tp, ep)
    for p in model.parameters():
        p.data.zero_()
    state = dist_checkpointing.load({'model': model.sharded_state_dict()}, folder, strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(state['model'], strict=True)
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), out)
    import multiprocessing
    for child in multiprocessing.active_children():
        child.terminate()
        child.join()
    end_rank(dist)

for case in CASES:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.start_processes(load, args=(port, *case), nprocs=2, start_method='fork')

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
for case in CASES:
    with open(case[1] + '/.metadata', 'rb') as f:
        meta = pickle.load(f)
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}
    dcp.load(full, checkpoint_id=case[1])
    torch.save(full, case[1] + '_full.pt')
'''


class MegatronCoreLoadsMoeTest(megatron_core_pypi.MegatronCoreTestCase):
    """Megatron-Core itself loads reshard's MoE torch_dist outputs strictly, every tensor equal."""

    def test_megatron_core_loads_the_outputs_strictly(self):
        cases = []  # (source tag, target TP)
        for tag, tp in (('0.19-moe/w2_ep2', 2), ('0.19-moe/w2_ep2', 1), ('0.19-moe/w2_tp2_ep1', 1)):
            name = tag.split('/')[1] + f'_tp{tp}'
            p = run('convert', os.path.join(DATA, tag), os.path.join(self.work, name), '--tp', str(tp),
                    '--dp', str(2 // tp), *vocab(tag))
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            cases.append((tag, [f'/data/{name}/iter_0000000', f'/data/{name}_resaved', tp, 1]))
        model = config_of(SAVES[0])['model']
        script = torch2_chroot.END_RANK + LOAD % json.dumps([model, [case for _, case in cases]])
        p = self.megatron(script)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-4000:])
        for tag, case in cases:
            with self.subTest(save=tag, tp=case[2]):
                got = torch.load(os.path.join(self.work, os.path.basename(case[1]) + '_full.pt'))
                want = torch.load(os.path.join(DATA, tag + '_full.pt'))
                self.assertEqual(sorted(got), sorted(k for k, v in want.items() if isinstance(v, torch.Tensor)))
                for key, tensor in got.items():
                    self.assertEqual(support.differences(tensor, want[key], key), [])
                print(f'{tag} at TP {case[2]}, EP 1: {len(got)} keys loaded strictly, equal', file=sys.stderr)


class MegatronCoreMoeTest(FixtureTestCase):
    def test_inspect_shows_the_experts_and_the_saved_layout(self):
        for tag in SAVES:
            with self.subTest(save=tag):
                layout = config_of(tag)['layout']
                p = run('inspect', os.path.join(DATA, tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('megatron-core-moe', p.stdout)
                self.assertIn('layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_4h_to_h.weight', p.stdout)
                self.assertIn(f"TP {layout['tp']} (the save)", p.stdout)
                # A rank that wrote every expert shows EP 1; the EP 2 save's expert chunks may as well be
                # an EP 1, DP 2 save's, which DP replica writes which being Megatron-Core's choice.
                self.assertIn('EP 1 (the save)' if layout['ep'] == 1 else 'EP not recorded', p.stdout)
                self.assertIn('4 experts per MoE layer', p.stdout)

    def test_lint_passes(self):
        for tag in SAVES:
            with self.subTest(save=tag):
                p = run('lint', os.path.join(DATA, tag), *sizes(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_the_consolidated_export_equals_the_whole_tensors(self):
        for tag in SAVES:
            with self.subTest(save=tag):
                out = self.path(tag.replace('/', '_') + '_whole')
                p = run('export', os.path.join(DATA, tag), out, '--to', 'consolidated', '--format', 'pt',
                        *vocab(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got = torch.load(os.path.join(out, 'pytorch_model.bin'))
                want = canonical_tensors(torch.load(os.path.join(DATA, tag + '_full.pt')))
                self.assertEqual(sorted(got), sorted(want))
                for name, tensor in want.items():
                    self.assertEqual(support.differences(got[name], tensor, name), [])

    def test_verify_compares_the_layouts_tensor_by_tensor(self):
        a, b = (os.path.join(DATA, tag) for tag in SAVES)
        full_a, full_b = (canonical_tensors(torch.load(os.path.join(DATA, tag + '_full.pt'))) for tag in SAVES)
        differ = sorted(name for name in full_a if not torch.equal(full_a[name], full_b[name]))
        self.assertTrue(differ and len(differ) < len(full_a), differ)  # the norms and the embedding are equal
        p = run('verify', a, b, *sizes(SAVES[0]))
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('DIFFERENT', p.stdout)
        reported = sorted(line.split()[1] for line in p.stdout.splitlines() if line.startswith('differs: '))
        self.assertEqual(reported, differ)

    def test_a_save_verifies_equal_to_its_export_and_not_with_two_experts_swapped(self):
        tag = SAVES[0]
        out = self.path('whole')
        p = run('export', os.path.join(DATA, tag), out, '--to', 'consolidated', '--format', 'pt', *vocab(tag))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', os.path.join(DATA, tag), out, *sizes(tag))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        path = os.path.join(out, 'pytorch_model.bin')
        tensors = torch.load(path)
        expert = 'layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.{}.dense_h_to_4h.weight'
        tensors[expert.format(1)], tensors[expert.format(2)] = tensors[expert.format(2)], tensors[expert.format(1)]
        torch.save(tensors, path)
        p = run('verify', os.path.join(DATA, tag), out, *sizes(tag))
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn(expert.format(1), p.stdout)
        self.assertIn(expert.format(2), p.stdout)

    def test_torch_dist_at_another_tp_keeps_every_expert(self):
        """convert to torch_dist at TP 2 / TP 1 (EP 1): the stacked keys' global tensors are the
        source's, their chunks the target TP's, each (layer, expert) its own chunk."""
        for tag, tp in (('0.19-moe/w2_ep2', 2), ('0.19-moe/w2_tp2_ep1', 1)):
            with self.subTest(save=tag, tp=tp):
                out = self.path(tag.replace('/', '_') + f'_tp{tp}')
                p = run('convert', os.path.join(DATA, tag), out, '--tp', str(tp), '--dp', '1', *vocab(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                folder = os.path.join(out, 'iter_0000000')
                p = run('verify', os.path.join(DATA, tag), folder, *sizes(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                p = run('inspect', folder, '--rules', 'none')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                fc1 = [line for line in p.stdout.splitlines() if 'experts.experts.linear_fc1.weight float32' in line]
                self.assertEqual(len(fc1), 1, p.stdout)
                self.assertIn('float32[2, 4, 32, 16], ' + str(8 * tp) + ' chunks', fc1[0])
                self.assertIn('linear_fc1._extra_state/shard_1.3_2.4', p.stdout)
                whole = self.path(tag.replace('/', '_') + f'_tp{tp}_whole')
                p = run('export', folder, whole, '--to', 'consolidated', '--format', 'pt', *vocab(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got = torch.load(os.path.join(whole, 'pytorch_model.bin'))
                want = canonical_tensors(torch.load(os.path.join(DATA, tag + '_full.pt')))
                self.assertEqual(sorted(got), sorted(want))
                for name, tensor in want.items():
                    self.assertEqual(support.differences(got[name], tensor, name), [])

    def test_what_is_not_written_yet_is_refused_in_one_line(self):
        src = os.path.join(DATA, SAVES[0])
        for args, says in ((['--to', 'megatron', '--tp', '1', '--pp', '1'], 'local_experts'),
                           (['--to', 'torch_dist', '--ep', '2'], '--ep'),
                           # Megatron-DeepSpeed loads no experts from pipeline layer files.
                           (['--to', 'deepspeed', '--tp', '1', '--pp', '1'],
                            "model has experts, and reshard writes DeepSpeed's MoE layout only from a DeepSpeed MoE "
                            'save; convert --to torch_dist or --to consolidated')):
            with self.subTest(args=args):
                out = self.path('refused_' + args[1])
                p = run('convert', src, out, *args, *vocab(SAVES[0]))
                self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn(says, p.stderr)
                self.assertFalse(os.path.exists(out))


if __name__ == '__main__':
    support.main()
