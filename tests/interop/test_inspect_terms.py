"""`inspect` of a checkpoint another format than DeepSpeed's wrote speaks that format's terms.

The sources are the real Megatron-Core 0.19 and 0.14 saves (tests/data/megatron-core), the real
torchtitan steps (tests/data/torchtitan) and an HF folder exported from one of them. Checked:

* the layout a torch_dist save was made at is read from the save where its args do not record
  it, and only where the save shows it for certain: TP from the chunks along each tensor's TP
  dimension, the world size from the ranks that wrote, PP 1 where one rank wrote every layer;
  the derived sizes equal the layout the saves were made at (`TAG_config.json`), a save whose
  PP the chunks cannot tell says so, and `convert` with no size keeps the derived ones;
* torchtitan's mesh is read from its chunks (TP from the RowwiseParallel tensors' chunks along
  dim 1, dp_shard from the ranks that wrote over TP where a tensor shows that many FSDP2
  chunks): it equals the mesh the steps were saved at (`NAME_config.json`), and `convert` keeps
  its TP;
* `inspect` prints the format's own metadata (torch_dist: its form and version, optimizer layout,
  iteration, saved layout; torchtitan: its step; HF: config.json's architecture values), then
  every tensor by its canonical name with its global shape, dtype and TP policy; none of
  DeepSpeed's mp_rank metadata (`module: None`, `mp_world_size`) or layer files (`layer_01`).
* messages about an imported model's tensors name them by canonical name and the source's own
  key, never by a Megatron-DeepSpeed layer file (`layer_02/...`), for torch_dist and HF sources.

Run: /usr/bin/python3 tests/interop/test_inspect_terms.py --reshard build/reshard
"""
import json
import os

import interop_support as support
from interop_support import FixtureTestCase
from megatron_core_data import DATA, config_of, sizes

run = support.reshard

TORCHTITAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'torchtitan')
TORCHTITAN_HEADS = ('--set', 'num_attention_heads=4', '--set', 'num_key_value_heads=2')

# What only DeepSpeed's metadata and layer files print.
DEEPSPEED_TERMS = ('mp_rank', 'module: None', 'mp_world_size', 'layer files (', 'layer_0')


class InspectTermsTest(FixtureTestCase):
    def inspect(self, folder, *args):
        p = run('inspect', folder, *args)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for term in DEEPSPEED_TERMS:
            self.assertNotIn(term, p.stdout)
        return p.stdout

    def test_torch_dist_prints_its_form_optimizer_layout_and_iteration(self):
        for version, tag, layout in (('0.19', 'w2_tp2_swiglu_optim_fully_reshardable', 'fully_reshardable'),
                                     ('0.19', 'w2_pp2_optim_dp_reshardable', 'dp_reshardable'),
                                     ('0.14', 'w2_tp2_optim_fully_sharded_model_space', 'fully_sharded_model_space')):
            with self.subTest(tag=tag):
                name = tag.split('_optim')[0]
                out = self.inspect(os.path.join(DATA, version, tag), *sizes(config_of(f'{version}/{name}'))[:-2])
                self.assertIn('\ntorch_dist:\n', out)
                self.assertIn(f'  form: Megatron-Core {version}', out)
                self.assertIn(f'layout {layout}, step 1', out)
                self.assertIn('  iteration: 1\n', out)
                self.assertIn('tensors (canonical names, global shapes):\n', out)
                self.assertRegex(out, r'\n  layers\.1\.self_attention\.query_key_value\.weight  float32\[32, 16\]  '
                                      r'split dim 0 \(blocks ')
                self.assertRegex(out, r'\n  embedding\.word_embeddings\.weight  float32\[64, 16\]  vocab\n')
        # The 0.14 form keeps its common state in common.pt.
        self.assertIn("its common state in common.pt", self.inspect(os.path.join(DATA, '0.14', 'w2_tp2'),
                                                                 *sizes(config_of('0.14/w2_tp2'))[:-2]))

    def test_torch_dist_layout_is_derived_from_the_save(self):
        for name in ('0.19/w1_tp1', '0.19/w2_tp2', '0.19/w2_tp2_bf16', '0.19/w2_tp2_swiglu', '0.14/w2_tp2'):
            layout = config_of(name)['layout']
            for tag in [os.path.basename(name)] + config_of(name).get('optim_folders', []):
                with self.subTest(tag=tag):
                    out = self.inspect(os.path.join(DATA, os.path.dirname(name), tag), *sizes(config_of(name))[:-2])
                    self.assertIn(f"format: torch_dist, saved at TP {layout['tp']}, PP {layout['pp']}, "
                                  f"DP {layout['dp']}\n", out)
                    self.assertIn(f"  saved at: TP {layout['tp']} (the save), PP {layout['pp']} (the save), "
                                  f"DP {layout['dp']} (the save); {layout['world']} rank", out)
        # Each rank of the PP 2 save wrote one stage's layers: so would the two DP ranks of a PP 1
        # save sharing the writing, so PP and DP stay open; TP is certain.
        layout = config_of('0.19/w2_pp2')['layout']
        self.assertEqual((layout['tp'], layout['pp']), (1, 2))
        out = self.inspect(os.path.join(DATA, '0.19', 'w2_pp2'), *sizes(config_of('0.19/w2_pp2'))[:-2])
        self.assertIn('format: torch_dist, saved at TP 1\n', out)
        self.assertIn('  saved at: TP 1 (the save), PP not recorded, DP not recorded; 2 ranks wrote it\n', out)

    def test_convert_keeps_the_derived_layout(self):
        config = config_of('0.19/w2_tp2')
        out = self.path('out')
        p = run('convert', os.path.join(DATA, '0.19', 'w2_tp2'), out, *sizes(config))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('format: torch_dist, saved at TP 2, PP 1, DP 1\n', self.inspect(out, *sizes(config)[:-2]))

    def assertRefusedNaming(self, p, *names):
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertNotIn('layer_0', p.stdout + p.stderr)
        for name in names:
            self.assertIn(name, p.stderr)

    def test_messages_name_canonical_tensors_and_source_keys(self):
        src = os.path.join(DATA, '0.19', 'w2_tp2_swiglu_optim_fully_reshardable')
        qkv = 'layers.0.self_attention.query_key_value.weight'
        # A value the save does not record, for every command that needs it.
        self.assertRefusedNaming(run('convert', src, self.path('hf'), '--to', 'hf'),
                                 f'the block count of {qkv} (from decoder.layers.self_attention.linear_qkv.weight)')
        p = run('lint', src, '--tp', 2, '--pp', 1)
        self.assertIn(f'the block count of {qkv} (from decoder.layers.self_attention.linear_qkv.weight)', p.stdout)
        self.assertNotIn('layer_0', p.stdout)
        # A TP the heads do not divide by, from torch_dist and from HF.
        config = config_of('0.19/w2_tp2_swiglu')
        self.assertRefusedNaming(run('convert', src, self.path('ds'), '--to', 'deepspeed', '--tp', 3, '--pp', 1,
                                     *sizes(config)),
                                 f'cannot split {qkv} (from decoder.layers.self_attention.linear_qkv.weight) over 3')
        hf = self.path('hf_ok')
        p = run('export', src, hf, '--to', 'hf', *sizes(config), '--set', 'max_position_embeddings=32',
                '--set', 'layernorm_epsilon=1e-5', '--weights-only')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertRefusedNaming(run('convert', hf, self.path('ds2'), '--to', 'deepspeed', '--tp', 3, '--pp', 1),
                                 f'cannot split {qkv} (from model.layers.0.self_attn.q_proj.weight, '
                                 'model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight) over 3')

    def test_torchtitan_mesh_is_derived_from_the_chunks(self):
        for name in ('fsdp2_tp_w4', 'fsdp2_w2', 'nested_w1', 'single_w1', 'single_tied_w1'):
            with self.subTest(name=name):
                with open(os.path.join(TORCHTITAN, name + '_config.json')) as f:
                    config = json.load(f)
                mesh = dict(zip(config['mesh']['dim_names'], config['mesh']['shape'])) if config.get('mesh') else {}
                dp_shard, tp = mesh.get('dp_shard', 1), mesh.get('tp', 1)
                self.assertEqual(dp_shard * tp, config['world'])
                out = self.inspect(os.path.join(TORCHTITAN, name, 'step-1'), *TORCHTITAN_HEADS)
                self.assertIn(f'format: torchtitan, saved at TP {tp}, PP 1, DP {dp_shard}\n', out)
                self.assertIn(f"  mesh: dp_shard {dp_shard}, tp {tp} (the chunks; {config['world']} rank", out)
        # convert keeps what it is not told: the source's TP and dp_shard.
        for given, mesh in ((('--dp-shard', 3), 'dp_shard 3, tp 2 (the chunks; 6 ranks'),
                            ((), 'dp_shard 2, tp 2 (the chunks; 4 ranks')):
            with self.subTest(given=given):
                out = self.path('tt' + ''.join(map(str, given)))
                p = run('convert', os.path.join(TORCHTITAN, 'fsdp2_tp_w4', 'step-1'), out, *given, *TORCHTITAN_HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('  mesh: ' + mesh, self.inspect(os.path.join(out, 'step-1'), *TORCHTITAN_HEADS))

    def test_torchtitan_prints_its_step(self):
        out = self.inspect(os.path.join(TORCHTITAN, 'fsdp2_w2', 'step-1'), *TORCHTITAN_HEADS)
        self.assertIn('\ntorchtitan:\n  step: 1\n', out)
        self.assertIn("optimizer state: torchtitan's AdamW state", out)
        self.assertRegex(out, r'\n  layers\.0\.mlp\.dense_4h_to_h\.weight  float32\[\d+, \d+\]  split dim 1\n')

    def test_hf_prints_the_configs_architecture(self):
        m = config_of('0.19/w2_tp2_swiglu')['model']
        hf = self.path('hf')
        p = run('export', os.path.join(DATA, '0.19', 'w2_tp2_swiglu'), hf, '--to', 'hf', '--vocab-size', m['vocab'],
                *sizes(config_of('0.19/w2_tp2_swiglu'))[:-2], '--set', 'max_position_embeddings=32',
                '--set', 'layernorm_epsilon=1e-5')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        out = self.inspect(hf)
        self.assertIn('\nhf:\n', out)
        for line in ("  model_type: 'llama'", '  num_hidden_layers: 2', '  hidden_size: 16', '  num_attention_heads: 4',
                     '  num_key_value_heads: 2', '  vocab_size: 64', "  torch_dtype: 'float32'",
                     '  tie_word_embeddings: False'):
            self.assertIn(line + '\n', out)
        self.assertRegex(out, r'\n  lm_head\.weight  float32\[64, 16\]  vocab\n')


if __name__ == '__main__':
    support.main()
