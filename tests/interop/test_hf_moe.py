"""Mixture-of-Experts models between Hugging Face transformers and Megatron-Core: MixtralForCausalLM
(rules/mixtral.yaml), Qwen3MoeForCausalLM (rules/qwen3-moe.yaml) and Qwen2MoeForCausalLM
(rules/qwen2-moe.yaml), an HF folder to Megatron-Core `torch_dist` at EP 1 and 2, TP 1 and 2, and back;
Megatron-Core's own saves to HF; and Megatron-Core's runs resumed at another layout.

Each source is a tiny model of the family (2 layers, 4 experts, top 2, GQA 4 heads / 2 KV heads, random
weights; Qwen3-MoE with a head dim of 8 where hidden / heads is 4, and its router's weights not
renormalized, norm_topk_prob false; Qwen2-MoE with q/k/v biases and a gated shared expert) saved by real transformers (PyPI, accelerate_pypi.py, in the torch 2.6
chroot on the CPU), with its logits on fixed tokens and two negative controls' logits: every expert's gate
and up projections swapped, and two experts of one layer swapped. Checked for each family:

* `inspect` and `lint` read the folder as the family's rule set, with every expert of every layer under
  its canonical name (DeepSpeed MoE's, as every MoE family names them);
* HF -> torch_dist at TP 1 × EP 2 (DP 2), TP 2 × EP 1 and TP 2 × EP 2 (DP 2) -> HF: every HF tensor of the
  round trip equals the source's bit for bit, and `verify` says the torch_dist outputs are the same model as
  the source; a copy with two experts swapped is not, and verify names both;
* transformers loads each round trip with no missing, unexpected or mismatched key, and its logits are the
  source's exactly;
* real Megatron-Core 0.19.1 (megatron_core_pypi.py) builds the same model as a GPTModel of the local spec
  (SequentialMLP experts with SwiGLU, RMSNorm, rotary, a top-2 softmax router; Qwen3-MoE's QK layernorm,
  kv_channels and pre-softmax router) at each layout, loads reshard's torch_dist output strictly, and its
  logits on the same tokens are transformers' within 1e-5, while both controls' differ from them by more
  than 1e-2: the fused QKV, the QK norms, the [gate; up] halves, the router and the experts' order are what
  each framework computes;
* Megatron-Core's own saves at TP 1 × EP 2 and TP 2 × EP 2, with the args Megatron-LM records, convert to
  HF with no --set: config.json has the family's MoE fields, and transformers' logits are Megatron-Core's
  within 1e-5;
* Megatron-Core's run with its distributed optimizer at TP 1 × EP 2, saved in both 0.19 optimizer layouts,
  verifies the same in either; converted to EP 1 (both layouts, from either save) and TP 2 × EP 2, each
  output resumes strictly in Megatron-Core with the source run's next losses (at TP 2 within 1e-3). A wrong
  parameter order in the rule file's optimizer_order fails the verify of the two layouts;
* experts whole at TP 2 (expert TP 1, EP 2): Megatron-Core at that layout loads reshard's output and computes
  transformers' logits, its own save converts to HF with its logits, and (Mixtral) its run resumes at TP 1 ×
  EP 1 from its fully_reshardable save, while its dp_reshardable save is refused in one line.

Run: /usr/bin/python3 tests/interop/test_hf_moe.py --reshard build/reshard
"""
import json
import os
import shutil
import sys
import tempfile

import torch

import accelerate_pypi
import interop_support as support
import megatron_core_pypi
import torch2_chroot
from interop_support import read_safetensors
from test_megatron_core_moe import WHOLE
from test_megatron_core_moe_optimizer import RESUME, TRAIN

run = support.reshard

M = dict(vocab=64, hidden=16, ffn=24, layers=2, heads=4, groups=2, experts=4, topk=2, max_seq=32, eps=1e-5)
# (output name, TP, EP, ranks): the torch_dist layouts the source is converted to.
LAYOUTS = (('tp1_ep2', 1, 2, 2), ('tp2_ep1', 2, 1, 2), ('tp2_ep2', 2, 2, 4))
# (name, TP, EP, ranks, expert TP, the conversion it loads): the layouts Megatron-Core runs at; the experts'
# TP the dense layers', or 1 at TP 2 (each expert whole on its EP rank, as large MoE runs train).
RUNS = (tuple((name, tp, ep, ranks, tp, name) for name, tp, ep, ranks in LAYOUTS) +
        (('tp2_etp1_ep2', 2, 2, 4, 1, 'tp2_ep2'),))
TOKENS = [[3, 17, 33, 42, 0, 63, 7, 21, 50, 12, 9, 44], [61, 2, 18, 27, 5, 40, 33, 11, 8, 58, 19, 36]]
CLOSE = 1e-5   # Megatron-Core's logits against transformers': the same model, other summation orders
MOVED = 1e-2   # what a negative control moves the logits by, at least

# Each family: its transformers classes and config, its expert tensors' names (`expert`: layer 1's expert
# {} weight {}; gate, up and down), the MoE fields its config.json must have after an export, and what
# Megatron-Core's config and Megatron-LM's args add for it.
FAMILIES = {
    'mixtral': dict(
        model='MixtralForCausalLM', config='MixtralConfig',
        config_args=dict(intermediate_size=M['ffn'], num_local_experts=M['experts'], sliding_window=None),
        expert='model.layers.1.block_sparse_moe.experts.{}.{}.weight', gate='w1', up='w3', down='w2',
        exported=dict(num_local_experts=M['experts'], num_experts_per_tok=M['topk'], intermediate_size=M['ffn']),
        megatron=dict(kv_channels=M['hidden'] // M['heads'])),
    'qwen3-moe': dict(
        model='Qwen3MoeForCausalLM', config='Qwen3MoeConfig',
        config_args=dict(intermediate_size=40, moe_intermediate_size=M['ffn'], num_experts=M['experts'],
                         head_dim=8, norm_topk_prob=False),
        expert='model.layers.1.mlp.experts.{}.{}.weight', gate='gate_proj', up='up_proj', down='down_proj',
        exported=dict(num_experts=M['experts'], num_experts_per_tok=M['topk'], moe_intermediate_size=M['ffn'],
                      head_dim=8, norm_topk_prob=False, decoder_sparse_step=1),
        megatron=dict(kv_channels=8, qk_layernorm=True, moe_router_pre_softmax=True)),
    'qwen2-moe': dict(
        model='Qwen2MoeForCausalLM', config='Qwen2MoeConfig',
        config_args=dict(intermediate_size=40, moe_intermediate_size=M['ffn'], shared_expert_intermediate_size=32,
                         num_experts=M['experts'], norm_topk_prob=True),
        expert='model.layers.1.mlp.experts.{}.{}.weight', gate='gate_proj', up='up_proj', down='down_proj',
        exported=dict(num_experts=M['experts'], num_experts_per_tok=M['topk'], moe_intermediate_size=M['ffn'],
                      shared_expert_intermediate_size=32, norm_topk_prob=True, qkv_bias=True),
        megatron=dict(kv_channels=M['hidden'] // M['heads'], add_qkv_bias=True, moe_shared_expert_intermediate_size=32,
                      moe_shared_expert_gate=True)),
}

# transformers builds the model from its config with random weights, saves it, and computes the logits
# of it and of the two controls.
SAVE = r'''
import json, torch, transformers
M, TOKENS, F = json.loads(%r)
torch.manual_seed(0)
config = getattr(transformers, F['config'])(
    vocab_size=M['vocab'], hidden_size=M['hidden'], num_hidden_layers=M['layers'], num_attention_heads=M['heads'],
    num_key_value_heads=M['groups'], num_experts_per_tok=M['topk'], max_position_embeddings=M['max_seq'],
    rms_norm_eps=M['eps'], rope_theta=10000.0, tie_word_embeddings=False, **F['config_args'])
model = getattr(transformers, F['model'])(config).eval()
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.3)
model.save_pretrained('/data/hf')
ids = torch.tensor(TOKENS)
logits = {}
with torch.no_grad():
    logits['source'] = model(ids).logits
    state = model.state_dict()
    gate_up = dict(state)
    for name in state:
        if name.endswith('.%%s.weight' %% F['gate']):
            up = name.replace('.%%s.' %% F['gate'], '.%%s.' %% F['up'])
            gate_up[name], gate_up[up] = state[up], state[name]
    model.load_state_dict(gate_up)
    logits['gate_up_swapped'] = model(ids).logits
    experts = dict(state)
    for w in (F['gate'], F['up'], F['down']):
        a, b = F['expert'].format(0, w), F['expert'].format(1, w)
        experts[a], experts[b] = state[b], state[a]
    model.load_state_dict(experts)
    logits['experts_swapped'] = model(ids).logits
torch.save(logits, '/data/hf_logits.pt')
'''

# transformers loads each folder and computes its logits.
LOAD_HF = r'''
import json, torch, transformers
NAMES, TOKENS, MODEL = json.loads(%r)
report = {}
for name in NAMES:
    model, info = getattr(transformers, MODEL).from_pretrained('/data/' + name, output_loading_info=True)
    with torch.no_grad():
        logits = model.eval()(torch.tensor(TOKENS)).logits
    torch.save(logits, '/data/%%s_logits.pt' %% name)
    report[name] = {k: [str(x) for x in v] for k, v in info.items()}
with open('/data/hf_load.json', 'w') as f:
    json.dump(report, f)
'''

# Megatron-Core's GPTModel of the family (build(tp, ep)) and logits_of(model): rank 0's logits (gathered
# over TP) on the tokens.
MC_MODEL = r'''
import argparse, contextlib, json, os, zlib
import torch
import torch.nn.functional as F

M, TOKENS, EXTRA, CASES = json.loads(%r)
EXPERT_TP = None  # the experts' TP size of a run whose script builds the model without saying (TRAIN's)

def build(tp, ep, gathered=False, etp=None):
    # gathered: the logits over the whole vocabulary on every TP rank (not for a loss, which takes them split);
    # etp: the experts' TP size (default: TP).
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    etp = etp or EXPERT_TP or tp
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    config = TransformerConfig(
        num_layers=M['layers'], hidden_size=M['hidden'], num_attention_heads=M['heads'],
        num_query_groups=M['groups'], ffn_hidden_size=M['ffn'], num_moe_experts=M['experts'],
        moe_router_topk=M['topk'], moe_ffn_hidden_size=M['ffn'], tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, use_cpu_initialization=True,
        activation_func=F.silu, gated_linear_unit=True,
        normalization='RMSNorm', layernorm_epsilon=M['eps'], add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, **EXTRA)
    spec = get_gpt_layer_local_spec(num_experts=M['experts'], moe_grouped_gemm=False, normalization='RMSNorm',
                                    qk_layernorm=EXTRA.get('qk_layernorm', False))
    return GPTModel(config, spec, vocab_size=M['vocab'], max_sequence_length=M['max_seq'],
                    share_embeddings_and_output_weights=False, position_embedding_type='rope', rotary_base=10000,
                    parallel_output=not gathered)

def megatron_lm_args(tp, ep, world, etp):
    # The args Megatron-LM saves with the model for the family at TP tp, EP ep, expert TP etp.
    return argparse.Namespace(
        num_layers=M['layers'], hidden_size=M['hidden'], ffn_hidden_size=M['ffn'], num_attention_heads=M['heads'],
        group_query_attention=True, num_query_groups=M['groups'], max_position_embeddings=M['max_seq'],
        position_embedding_type='rope', rotary_base=10000, rotary_percent=1.0, normalization='RMSNorm',
        norm_epsilon=M['eps'], layernorm_zero_centered_gamma=False, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, num_experts=M['experts'],
        moe_router_topk=M['topk'], moe_ffn_hidden_size=M['ffn'], moe_router_score_function='softmax',
        moe_layer_freq=1, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, data_parallel_size=world // tp, make_vocab_size_divisible_by=16,
        padded_vocab_size=M['vocab'], vocab_size=M['vocab'],
        **{'add_qkv_bias': False, 'qk_layernorm': False, 'moe_router_pre_softmax': False, **EXTRA})

def logits_of(model):
    from megatron.core import tensor_parallel
    # Attention forks the CUDA RNG tracker for its dropout, which this CPU run has no state for.
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    tokens = torch.tensor(TOKENS)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        return model.eval()(tokens, positions, mask)
'''

# Megatron-Core, in forked ranks per case: the model at the case's TP and EP, reshard's output loaded
# strictly, and its logits.
LOAD_MC = MC_MODEL + r'''
def load(r, port, world, folder, out, tp, ep, etp):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    start(r, port, world)
    model = build(tp, ep, gathered=True, etp=etp)
    state = dist_checkpointing.load({'model': model.sharded_state_dict()}, folder, strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(state['model'], strict=True)
    logits = logits_of(model)
    if r == 0:
        torch.save(logits, out)
    end_rank(dist)

worlds(load, CASES)
'''

# Megatron-Core's own save at each case's TP and EP, as Megatron-LM saves it (its args beside the model),
# of random weights, and the logits of what it saved.
SAVE_MC = MC_MODEL + r'''
def save(r, port, world, folder, out, tp, ep, etp):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    start(r, port, world)
    model = build(tp, ep, gathered=True, etp=etp)
    # Each parameter's draw: the same on the ranks that hold a replica of it, its own on each TP rank of a
    # TP-split one and on each EP rank (their local experts).
    with torch.no_grad():
        for name, p in model.named_parameters():
            tp_rank = ps.get_tensor_model_parallel_rank() if getattr(p, 'tensor_model_parallel', False) else 0
            ep_rank = ps.get_expert_model_parallel_rank() if '.experts.' in name else 0
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * tp_rank +
                                                                      100000 * ep_rank))
    args = megatron_lm_args(tp, ep, world, etp)
    os.makedirs(folder, exist_ok=True)  # as Megatron-LM makes it
    dist_checkpointing.save({'model': model.sharded_state_dict(), 'args': args, 'checkpoint_version': 3.0,
                             'iteration': 7}, folder)
    logits = logits_of(model)
    if r == 0:
        torch.save(logits, out)
    end_rank(dist)

worlds(save, CASES)
'''

# Megatron-Core's run NAME with its distributed optimizer (TRAIN: Adam, lr 1e-3, wd 0.01) at (world, TP, EP,
# expert TP): one step, its saves NAME_<layout> in both 0.19 optimizer layouts with Megatron-LM's args, one
# more step and the loss after it (NAME_losses.json).
SAVE_OPTIMIZER = r'''
def source(r, port, world, tp, ep, etp, name):
    global EXPERT_TP
    EXPERT_TP = etp
    start(r, port, world)
    items = {'args': megatron_lm_args(tp, ep, world, etp), 'checkpoint_version': 3.0}
    saves = [(f'/data/{name}_{layout}', layout, items) for layout in ('fully_reshardable', 'dp_reshardable')]
    step_save_step(r, tp, ep, saves, f'/data/{name}_losses.json')
    end_rank(dist)

worlds(source, [%r])
'''


def largest_difference(a, b):
    return (a.double() - b.double()).abs().max().item()


class MoeFamilyTest:
    """The checks of the module's docstring for FAMILY (a rule set of FAMILIES); a unittest.TestCase
    with it set per family below."""

    FAMILY = None

    @classmethod
    def setUpClass(cls):
        cls.family = FAMILIES[cls.FAMILY]
        cls.root = torch2_chroot.root_or_skip()
        cls.site = accelerate_pypi.site_or_skip(cls.root)
        cls.work = tempfile.mkdtemp(prefix='reshard-hf-moe-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        p = accelerate_pypi.run(cls.root, cls.site, SAVE % json.dumps([M, TOKENS, cls.family]), {cls.work: '/data'})
        if p.returncode:
            raise AssertionError('transformers could not save the model:\n' + p.stdout + p.stderr[-4000:])
        cls.hf = os.path.join(cls.work, 'hf')
        cls.logits = torch.load(os.path.join(cls.work, 'hf_logits.pt'))
        for name, tp, ep, ranks in LAYOUTS:
            out = os.path.join(cls.work, name)
            p = run('convert', cls.hf, out, '--to', 'torch_dist', '--tp', str(tp), '--ep', str(ep),
                    '--dp', str(ranks // tp), '--set', 'make_vocab_size_divisible_by=16')
            if p.returncode:
                raise AssertionError(f'convert to torch_dist {name}:\n' + p.stdout + p.stderr)
            p = run('convert', out, out + '_hf', '--to', 'hf')
            if p.returncode:
                raise AssertionError(f'convert {name} to hf:\n' + p.stdout + p.stderr)

    def source(self):
        return read_safetensors(os.path.join(self.hf, 'model.safetensors'))[0]

    def path(self, name):
        return os.path.join(self.work, name)

    def test_inspect_and_lint_read_every_expert(self):
        p = run('inspect', self.hf)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn(f"rule set {self.FAMILY}; HF folder ({self.family['model']}, 1 weight file); 2 blocks", p.stdout)
        for layer in range(M['layers']):
            for expert in range(M['experts']):
                for w in ('dense_h_to_4h', 'dense_4h_to_h'):
                    self.assertIn(f'layers.{layer}.mlp.deepspeed_moe.experts.deepspeed_experts.{expert}.{w}.weight',
                                  p.stdout)
        p = run('lint', self.hf)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn(f"lint: ok, the checkpoint can be converted with rule set '{self.FAMILY}'", p.stdout)

    def test_the_default_target_names_the_ones_that_write_experts(self):
        # An HF folder converts to Megatron-DeepSpeed by default, whose MoE layout has no SwiGLU experts.
        out = self.path('refused')
        self.assertRefused(run('convert', self.hf, out), "reshard writes DeepSpeed's MoE layout only from a "
                           "DeepSpeed MoE save; convert --to torch_dist (Megatron-Core), --to hf or --to consolidated",
                           out)

    def test_the_layout_not_given_is_the_whole_folders(self):
        # An HF folder holds every expert in one place: EP 1, as TP, PP and DP 1, each named in the note.
        out = self.path('whole')
        p = run('convert', self.hf, out, '--to', 'torch_dist')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('torch_dist: --tp 1, --pp 1, --dp 1, --ep 1, as the hf source is saved whole', p.stdout + p.stderr)
        p = run('inspect', out)
        self.assertIn('saved at: TP 1 (args), PP 1 (args), DP 1 (args), EP 1 (args)', p.stdout)
        p = run('verify', self.hf, out)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_torch_dist_round_trips_give_the_source_back(self):
        want = self.source()
        elements = sum(t.numel() for t in want.values())
        for name, tp, ep, ranks in LAYOUTS:
            with self.subTest(layout=name):
                folder = self.path(name)
                p = run('inspect', folder)
                self.assertIn(f'saved at: TP {tp} (args), PP 1 (args), DP {ranks // tp} (args), EP {ep} (args)',
                              p.stdout)
                self.assertIn('4 experts per MoE layer, in every layer', p.stdout)
                p = run('verify', self.hf, folder)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertRegex(p.stdout, rf'verify: \d+ tensors, {elements} elements compared; same model')
                got = read_safetensors(os.path.join(folder + '_hf', 'model.safetensors'))[0]
                self.assertEqual(sorted(got), sorted(want))
                for key, tensor in want.items():
                    self.assertEqual(support.differences(got[key], tensor, key), [])

    def test_verify_names_two_swapped_experts(self):
        swapped = self.path('swapped')
        shutil.copytree(self.hf, swapped)
        tensors = self.source()
        a, b = (self.family['expert'].format(e, self.family['gate']) for e in (0, 1))
        tensors[a], tensors[b] = tensors[b], tensors[a]
        support.write_safetensors(os.path.join(swapped, 'model.safetensors'), tensors)
        p = run('verify', self.path('tp2_ep2'), swapped)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        differ = sorted(line.split()[1] for line in p.stdout.splitlines() if line.startswith('differs: '))
        canonical = 'layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.{}.dense_h_to_4h.weight'
        self.assertEqual(differ, [canonical.format(0), canonical.format(1)])
        shutil.rmtree(swapped)

    def load_in_transformers(self, names):
        """transformers' load of each folder of `names` in the work folder: asserts it finds every key and
        no other; returns their logits."""
        script = LOAD_HF % json.dumps([names, TOKENS, self.family['model']])
        p = accelerate_pypi.run(self.root, self.site, script, {self.work: '/data'})
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-4000:])
        with open(self.path('hf_load.json')) as f:
            report = json.load(f)
        for name in names:
            self.assertEqual(report[name], {'missing_keys': [], 'unexpected_keys': [], 'mismatched_keys': [],
                                            'error_msgs': []}, name)
        return {name: torch.load(self.path(name + '_logits.pt')) for name in names}

    def test_transformers_loads_the_round_trips_with_the_source_logits(self):
        logits = self.load_in_transformers([name + '_hf' for name, *_ in LAYOUTS])
        for name, got in logits.items():
            self.assertTrue(torch.equal(got, self.logits['source']), name)

    def megatron(self, script, cases=(), *parts):
        """Runs `script` (MC_MODEL and what uses it) on `cases`, then `parts`, in Megatron-Core, or skips the
        test saying why."""
        site = megatron_core_pypi.site_or_skip(self.root)
        script = (torch2_chroot.END_RANK + megatron_core_pypi.RANKS + megatron_core_pypi.OPTIMIZER +
                  script % json.dumps([M, TOKENS, self.family['megatron'], list(cases)]) + ''.join(parts))
        p = megatron_core_pypi.run(self.root, site, script, {self.work: '/data'}, timeout=900)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-4000:])

    def test_megatron_core_computes_the_logits_of_transformers(self):
        # The expert-TP 1 run loads the output written at its TP and EP (the experts' chunks at TP 2).
        self.megatron(LOAD_MC, [[ranks, f'/data/{output}/iter_0000000', f'/data/{name}_mc_logits.pt', tp, ep, etp]
                                for name, tp, ep, ranks, etp, output in RUNS])
        for name, *_ in RUNS:
            with self.subTest(layout=name):
                got = torch.load(self.path(name + '_mc_logits.pt'))
                self.assertEqual(got.shape, self.logits['source'].shape)
                close = largest_difference(got, self.logits['source'])
                controls = [largest_difference(got, self.logits[c]) for c in ('gate_up_swapped', 'experts_swapped')]
                print(f'{self.FAMILY} {name}: Megatron-Core logits within {close:.2e} of transformers\'; controls '
                      f'off by {controls[0]:.2f} and {controls[1]:.2f}', file=sys.stderr)
                self.assertLess(close, CLOSE)
                for moved in controls:
                    self.assertGreater(moved, MOVED)

    def test_megatron_cores_own_saves_become_hf_models_of_its_logits(self):
        saves = [(f'mc_{name}', tp, ep, ranks, etp) for name, tp, ep, ranks, etp, _ in RUNS if ep > 1]
        self.megatron(SAVE_MC, [[ranks, f'/data/{name}', f'/data/{name}_logits_mc.pt', tp, ep, etp]
                                for name, tp, ep, ranks, etp in saves])
        for name, *_ in saves:
            p = run('convert', self.path(name), self.path(name + '_hf'), '--to', 'hf')
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertNotIn('--set', p.stderr)
            with open(os.path.join(self.path(name + '_hf'), 'config.json')) as f:
                config = json.load(f)
            self.assertEqual({k: config[k] for k in self.family['exported']}, self.family['exported'])
        logits = self.load_in_transformers([name + '_hf' for name, *_ in saves])
        for name, *_ in saves:
            with self.subTest(save=name):
                close = largest_difference(logits[name + '_hf'], torch.load(self.path(name + '_logits_mc.pt')))
                print(f'{self.FAMILY} {name}: transformers\' logits within {close:.2e} of Megatron-Core\'s',
                      file=sys.stderr)
                self.assertLess(close, CLOSE)

    def test_megatron_core_resumes_the_run_with_its_optimizer_state_at_another_layout(self):
        """Megatron-Core's run at TP 1 × EP 2 (its ChainedOptimizer: the dense and the experts' groups) saved
        in both layouts: reshard reads either as the same model with the same optimizer state, and converts
        the run to EP 1 (one optimizer), TP 2 × EP 2 and (from the dp_reshardable save) EP 1 in either layout;
        Megatron-Core loads each strictly with its optimizer state, and the step it takes reaches the source
        run's loss (at TP 1 exactly; at TP 2, which sums in another order, within 1e-3)."""
        train = WHOLE + megatron_core_pypi.LOSS_OF + TRAIN % json.dumps(M)
        self.megatron(MC_MODEL, (), train, SAVE_OPTIMIZER % [2, 1, 2, 1, 'run'])
        with open(self.path('run_losses.json')) as f:
            want = json.load(f)[1:]
        self.assertLess(want[1], want[0])  # the step trains
        p = run('verify', self.path('run_dp_reshardable'), self.path('run_fully_reshardable'))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        cases = []
        for name, source, world, tp, ep, layout in (('ep1', 'fully', 2, 1, 1, 'fully_reshardable'),
                                                    ('ep1_dp', 'fully', 2, 1, 1, 'dp_reshardable'),
                                                    ('tp2_ep2', 'fully', 4, 2, 2, 'fully_reshardable'),
                                                    ('from_dp_ep1', 'dp', 2, 1, 1, 'fully_reshardable'),
                                                    ('from_dp_ep1_dp', 'dp', 2, 1, 1, 'dp_reshardable')):
            p = run('convert', self.path(f'run_{source}_reshardable'), self.path('resume_' + name), '--tp', str(tp),
                    '--ep', str(ep), '--dp', str(world // tp), '--optimizer-layout', layout)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            cases.append([world, f'/data/resume_{name}/iter_0000001', f'/data/resume_{name}_resaved',
                          f'/data/resume_{name}.json', tp, ep, layout])
        self.megatron(MC_MODEL, (), train, RESUME % json.dumps(cases))
        for world, folder, _, record, tp, ep, layout in cases:
            name = folder.split('/')[2]
            with self.subTest(output=name):
                with open(self.path(os.path.basename(record))) as f:
                    got = json.load(f)
                self.assertNotIn('error', got)
                print(f'{self.FAMILY} {name} (TP {tp}, EP {ep}, {layout}): step loss {got["losses"][0]!r}, after it '
                      f'{got["losses"][1]!r}; the source run: {want[0]!r}, {want[1]!r}', file=sys.stderr)
                if tp == 1:
                    self.assertEqual(got['losses'], want)
                for g, w in zip(got['losses'], want):
                    self.assertAlmostEqual(g, w, delta=1e-3)


class MixtralTest(MoeFamilyTest, support.FixtureTestCase):
    FAMILY = 'mixtral'

    def test_a_run_with_experts_whole_at_tp_2_resumes_from_its_fully_reshardable_save(self):
        """A run at TP 2 whose experts are whole on their EP rank (expert TP 1, EP 2; 4 ranks): its
        fully_reshardable save converts to TP 1 × EP 1, which Megatron-Core resumes on the run's losses (within
        1e-3: the run summed at TP 2); its dp_reshardable save, whose experts' buckets reshard reads only at an
        expert TP of TP, is refused in one line naming the save to read instead."""
        train = WHOLE + megatron_core_pypi.LOSS_OF + TRAIN % json.dumps(M)
        self.megatron(MC_MODEL, (), train, SAVE_OPTIMIZER % [4, 2, 2, 1, 'etp1'])
        with open(self.path('etp1_losses.json')) as f:
            want = json.load(f)[1:]
        out = self.path('etp1_refused')
        self.assertRefused(run('convert', self.path('etp1_dp_reshardable'), out, '--tp', '1', '--ep', '1'),
                           "args record expert_tensor_parallel_size 1 at TP 2, and reshard reads the experts' "
                           "dp_reshardable state split over TP as the dense layers; read it from the run's "
                           "fully_reshardable save", out)
        p = run('convert', self.path('etp1_fully_reshardable'), self.path('etp1_ep1'), '--tp', '1', '--ep', '1',
                '--dp', '2')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        case = [2, '/data/etp1_ep1/iter_0000001', '/data/etp1_ep1_resaved', '/data/etp1_ep1.json', 1, 1,
                'fully_reshardable']
        self.megatron(MC_MODEL, (), train, RESUME % json.dumps([case]))
        with open(self.path('etp1_ep1.json')) as f:
            got = json.load(f)
        self.assertNotIn('error', got)
        print(f'{self.FAMILY} expert TP 1 run at TP 1, EP 1: step loss {got["losses"][0]!r}, after it '
              f'{got["losses"][1]!r}; the run: {want[0]!r}, {want[1]!r}', file=sys.stderr)
        for g, w in zip(got['losses'], want):
            self.assertAlmostEqual(g, w, delta=1e-3)


class Qwen3MoeTest(MoeFamilyTest, support.FixtureTestCase):
    FAMILY = 'qwen3-moe'


class Qwen2MoeTest(MoeFamilyTest, support.FixtureTestCase):
    FAMILY = 'qwen2-moe'


if __name__ == '__main__':
    support.main()
