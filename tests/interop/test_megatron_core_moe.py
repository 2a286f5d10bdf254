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
* `convert` to torch_dist at another TP keeps every global tensor, with the (layer, expert) chunks and
  the experts' empty _extra_state items Megatron-Core writes; EP 2 -> EP 1 -> EP 2 gives the source back,
  every tensor equal and every item in the file Megatron-Core's own EP 2 save has it in; an EP the save
  does not record and is not given, one that does not divide the experts or DP, `--ep` to a target
  without experts' layout, and the torch format's experts are refused in one line.

* real Megatron-Core 0.19 (the torch 2.6 chroot, CPU, gloo) builds the MoE model at each target layout
  (EP 1, 2 and 4; TP 1 and 2; 2 or 4 ranks), loads reshard's torch_dist output strictly, and saves it
  again: every tensor of that save equals the reference, and each of its items is in the file reshard
  wrote it in (the rank whose replica id is 0 writes it).

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


# The samples' MoE GPTModel (local spec, SequentialMLP; M its sizes) at TP `tp` and EP `ep`, DP the rest of
# the world.
BUILD = r"""
import torch.nn.functional as F

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
"""

# save_whole(folder): torch's dcp.load reads a save whole into FOLDER_full.pt ({key: global tensor}).
WHOLE = r"""
def save_whole(folder):
    import pickle
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    with open(folder + '/.metadata', 'rb') as f:
        meta = pickle.load(f)
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}
    dcp.load(full, checkpoint_id=folder)
    torch.save(full, folder + '_full.pt')
"""

# Megatron-Core, in WORLD forked ranks per case: builds the model at a case's TP and EP, loads reshard's
# output strictly and saves what it holds again; then each save is read whole (WHOLE).
LOAD = r"""
import json, os
import torch

M, CASES = json.loads(%r)

def load(r, port, world, folder, out, tp, ep):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    start(r, port, world)
    model = build(tp, ep)
    for p in model.parameters():
        p.data.zero_()
    state = dist_checkpointing.load({'model': model.sharded_state_dict()}, folder, strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(state['model'], strict=True)
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), out)
    end_rank(dist)

worlds(load, CASES)
for case in CASES:
    save_whole(case[2])
"""


def placement(folder):
    """{(item, chunk offsets): the .distcp file holding it} of a DCP folder: which rank wrote what."""
    return {(index.fqn, tuple(getattr(index, 'offset', None) or ())): where.relative_path
            for index, where in support.dcp_metadata(folder).storage_data.items()}


class MegatronCoreLoadsMoeTest(megatron_core_pypi.MegatronCoreTestCase):
    """Megatron-Core itself loads reshard's MoE torch_dist outputs strictly at EP 1, 2 and 4, every tensor
    equal, and writes each item of its own save at that layout in the file reshard wrote it in."""

    TIMEOUT = 900

    def convert(self, src, name, tp, ep, world, tag):
        p = run('convert', src, os.path.join(self.work, name), '--to', 'torch_dist', '--tp', str(tp),
                '--ep', str(ep), '--dp', str(world // tp), *vocab(tag))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return os.path.join(self.work, name, 'iter_0000000')

    def test_megatron_core_loads_the_outputs_strictly(self):
        cases = []  # (source tag, output name, [world, output, resaved, TP, EP])
        for tag, world, tp, ep in (('0.19-moe/w2_ep2', 2, 2, 1), ('0.19-moe/w2_ep2', 2, 1, 1),
                                   ('0.19-moe/w2_tp2_ep1', 2, 1, 1), ('0.19-moe/w2_ep2', 2, 1, 2),
                                   ('0.19-moe/w2_tp2_ep1', 2, 1, 2), ('0.19-moe/w2_tp2_ep1', 4, 2, 2),
                                   ('0.19-moe/w2_ep2', 4, 1, 4)):
            name = tag.split('/')[1] + f'_tp{tp}_ep{ep}'
            self.convert(os.path.join(DATA, tag), name, tp, ep, world, tag)
            cases.append((tag, name, [world, f'/data/{name}/iter_0000000', f'/data/{name}_resaved', tp, ep]))
        # EP 2 -> EP 1 -> EP 2 (MegatronCoreMoeTest verifies it the source again).
        tag = '0.19-moe/w2_ep2'
        ep1 = self.convert(os.path.join(DATA, tag), 'round_ep1', 1, 1, 2, tag)
        self.convert(ep1, 'round_ep2', 1, 2, 2, tag)
        cases.append((tag, 'round_ep2', [2, '/data/round_ep2/iter_0000000', '/data/round_ep2_resaved', 1, 2]))

        model = config_of(SAVES[0])['model']
        script = (torch2_chroot.END_RANK + megatron_core_pypi.RANKS + BUILD + WHOLE +
                  LOAD % json.dumps([model, [case for _, _, case in cases]]))
        p = self.megatron(script)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-4000:])
        for tag, name, (world, _, resaved, tp, ep) in cases:
            with self.subTest(save=tag, output=name):
                got = torch.load(os.path.join(self.work, os.path.basename(resaved) + '_full.pt'))
                want = torch.load(os.path.join(DATA, tag + '_full.pt'))
                self.assertEqual(sorted(got), sorted(k for k, v in want.items() if isinstance(v, torch.Tensor)))
                for key, tensor in got.items():
                    self.assertEqual(support.differences(tensor, want[key], key), [])
                # Each chunk and object in the file of the rank Megatron-Core writes it from (its replica 0),
                # the experts' by their EP ranks; the common state aside (written by rank 0 in both).
                ours = placement(os.path.join(self.work, name, 'iter_0000000'))
                theirs = placement(os.path.join(self.work, os.path.basename(resaved)))
                self.assertEqual({k: v for k, v in ours.items() if not k[0].startswith('common_state')},
                                 {k: v for k, v in theirs.items() if not k[0].startswith('common_state')})
                print(f'{tag} -> {name} (world {world}, TP {tp}, EP {ep}): {len(got)} keys loaded strictly, '
                      f'equal; {len(ours)} items in Megatron-Core\'s files', file=sys.stderr)


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
                p = run('convert', os.path.join(DATA, tag), out, '--tp', str(tp), '--dp', '1', '--ep', '1',
                        *vocab(tag))
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

    def test_ep_2_to_1_and_back_is_the_source_with_its_items_where_megatron_core_wrote_them(self):
        """The EP 2 save to EP 1 (one rank writes every expert) and back to EP 2: every tensor the
        source's, and every chunk and object in the file of the rank that wrote it in Megatron-Core's
        own EP 2 save (an expert's by its EP rank, DP rank 0 the rest). The outputs' args record the
        layout, which convert keeps where not given: EP too."""
        tag = SAVES[0]
        src = os.path.join(DATA, tag)
        ep1, ep2, kept = self.path('ep1'), self.path('ep2'), self.path('kept')
        p = run('convert', src, ep1, '--ep', '1', *vocab(tag))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(set(placement(os.path.join(ep1, 'iter_0000000')).values()), {'__0_0.distcp'})
        p = run('inspect', ep1, *sizes(tag))
        self.assertIn('DP 2 (args), EP 1 (args)', p.stdout)
        p = run('convert', ep1, ep2, '--ep', '2', *vocab(tag))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('convert', ep2, kept, *vocab(tag))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for out in (ep2, kept):
            with self.subTest(output=os.path.basename(out)):
                p = run('inspect', out, *sizes(tag))
                self.assertIn('DP 2 (args), EP 2 (args)', p.stdout)
                p = run('verify', src, out, *sizes(tag))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                self.assertEqual(placement(os.path.join(out, 'iter_0000000')), placement(src))

    def test_the_expert_parallel_size_is_checked_in_one_line(self):
        src = os.path.join(DATA, SAVES[0])
        for args, says in ((['--tp', '1'], 'give --ep N (N dividing 4; convert keeps the source\'s where it records it'),
                           (['--ep', '3'], '--ep 3 does not divide the 4 experts of each MoE layer; give an --ep that '
                                           'divides 4'),
                           (['--ep', '4', '--dp', '2'],
                            'Megatron-Core needs EP x expert TP (4 x 1) to divide the ranks of a pipeline stage '
                            '(TP x DP = 1 x 2), so EP must divide DP; give --dp N with N a multiple of 4, or an --ep '
                            'that divides 2'),
                           (['--to', 'hf', '--ep', '2'],
                            '--ep sets the layout of --to deepspeed, torch_dist; --to hf has no such size, '
                            'so leave it out')):
            with self.subTest(args=args):
                out = self.path('refused')
                p = run('convert', src, out, *args, *vocab(SAVES[0]))
                self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
                lines = p.stderr.strip().splitlines()
                self.assertEqual(len(lines), 1, p.stderr)
                self.assertIn(says, lines[0])
                self.assertFalse(os.path.exists(out))

    def test_what_is_not_written_yet_is_refused_in_one_line(self):
        src = os.path.join(DATA, SAVES[0])
        for args, says in ((['--to', 'megatron', '--tp', '1', '--pp', '1'], 'local_experts'),
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
