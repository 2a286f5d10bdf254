"""`reshard export --to megatron`: NVIDIA Megatron-LM's legacy `torch` checkpoint at a chosen TP / PP.

The fixture writes Megatron-DeepSpeed checkpoints from canonical full tensors (q, k, v, gate, up
separate; tests/fixtures/megatron_fixture.py). This test cuts those canonical tensors into
Megatron's per-rank tensors itself, from the reference's TP rules (megatron-deepspeed-format.md
§5, §6.2-6.4, §18.3) -- not with reshard's rules nor the fixture's sharding code -- places them
where Megatron-LM's GPTModel.state_dict_for_save_checkpoint puts them (§5.1, §13) and compares
every file reshard wrote, loaded with real PyTorch, tensor by tensor and bit for bit:

* files iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt for every (TP, PP) rank and
  latest_checkpointed_iteration.txt; each file's keys args, checkpoint_version (3.0), iteration,
  model, and no optimizer;
* `model`: the nested dict with encoder layer ids local to the stage, the embedding only on the
  first stage, the final norm and output layer on the last, word_embeddings_for_head on the last
  stage of a tied model with PP > 1; the vocabulary padded for the target TP (rows the source
  has kept, new rows zero, rows the target has no more dropped);
* `args`: an argparse.Namespace torch.load reads in a Python without any Megatron or DeepSpeed
  module (a subprocess), the layout fields rewritten, BigScience's PositionEmbeddingType made a
  Megatron-LM string, tensors in args dropped, and every field NVIDIA Megatron-LM 0.17's
  --use-checkpoint-args reads of the type and spelling it accepts (megatron_lm_problems, rules
  derived from its load_args_from_checkpoint, validate_args and legacy model), num_query_groups
  also where the source's args already say group_query_attention;
* families bs_bloom, bs_gpt (rotary; GLU), ms_gpt2, ms_llama (GQA); sources at TP 1-2, PP 1-2
  and a universal checkpoint; targets TP 1, 2, 4 and PP 1, 2; the weights (bf16) and
  `--from masters` (fp32);
* negative controls: the naive cuts a converter gets wrong (QKV as [q; k; v] chunks, GLU halves
  cut together) differ from the output, and a changed element is found;
* refusals (one line, exit 2, nothing written): a PP that does not divide the blocks, a TP that
  does not divide the heads, no layout, --tp for another export, an unknown --to, a MoE and a
  rule-less (non-pipeline) checkpoint, --from masters without optimizer state.

Run: /usr/bin/python3 tests/interop/test_export_megatron.py --reshard build/reshard
"""
import os
import pickle
import subprocess
import sys
import zipfile

import torch

from fixtures import deepspeed_nonpipe as dn
from fixtures import megatron_fixture as mf

import interop_support as support
from interop_support import FixtureTestCase, make_fixture, rewrite

run = support.reshard
ITERATION = 10
HERE = os.path.dirname(os.path.abspath(__file__))

FAMILIES = dict(support.FAMILIES)
# 4 KV groups, so that TP 4 keeps whole groups (the shared family has 6).
FAMILIES['ms_llama'] = dict(FAMILIES['ms_llama'], nkv=4)

# Modules a plain PyTorch environment (NVIDIA Megatron-LM's) resolves when it unpickles.
STANDARD_MODULES = {'torch', 'torch._utils', 'collections', 'argparse', 'builtins', '_codecs'}


# ---- What NVIDIA Megatron-LM's argument loading accepts -------------------------------------------
#
# Rules read from Megatron-LM core_v0.17 (the last release with the legacy model), written here in
# our own code: --use-checkpoint-args runs load_args_from_checkpoint (training/checkpointing.py),
# which copies these fields from the checkpoint's args over the parsed ones, then validate_args
# (training/arguments.py); the legacy model (legacy/model/) reads them; and check_checkpoint_args
# compares add_position_embedding with the loader's default True.
INT_FIELDS = ('num_layers', 'hidden_size', 'ffn_hidden_size', 'seq_length', 'num_attention_heads',
              'num_query_groups', 'kv_channels', 'max_position_embeddings', 'rotary_base', 'num_experts')
BOOL_FIELDS = ('group_query_attention', 'add_position_embedding', 'use_rotary_position_embeddings',
               'rotary_interleaved', 'add_bias_linear', 'add_qkv_bias', 'squared_relu', 'swiglu',
               'untie_embeddings_and_output_weights', 'apply_layernorm_1p', 'apply_query_key_layer_scaling')
NUMBER_FIELDS = ('rotary_percent', 'attention_dropout', 'hidden_dropout')
NORMALIZATIONS = ('LayerNorm', 'RMSNorm')  # legacy get_norm refuses the rest
# --position-embedding-type's choices; validate_args lets BigScience's 'alibi' through (the legacy
# model then adds no positions: Megatron-LM does not compute ALiBi, which the README says).
POSITION_TYPES = ('learned_absolute', 'rope', 'mrope', 'relative', 'none', 'alibi')


def megatron_lm_problems(args, tp):
    """What Megatron-LM 0.17's --use-checkpoint-args, validate_args, legacy model and
    check_checkpoint_args would reject in `args` at TP `tp` (an empty list: accepted)."""
    problems = []
    fields = vars(args)
    for name in INT_FIELDS:
        if name in fields and fields[name] is not None and type(fields[name]) is not int:
            problems.append(f'{name} = {fields[name]!r} is not an int or None')
    for name in BOOL_FIELDS:
        if name in fields and type(fields[name]) is not bool:
            problems.append(f'{name} = {fields[name]!r} is not a bool')
    for name in NUMBER_FIELDS:
        if name in fields and type(fields[name]) not in (int, float):
            problems.append(f'{name} = {fields[name]!r} is not a number')
    if fields.get('normalization', 'LayerNorm') not in NORMALIZATIONS:
        problems.append(f"normalization {fields['normalization']!r} is not one of {NORMALIZATIONS}")
    position = fields.get('position_embedding_type', 'learned_absolute')
    if position not in POSITION_TYPES:
        problems.append(f'position_embedding_type {position!r} is not one of {POSITION_TYPES}')
    if fields.get('add_position_embedding', True) is not True:
        problems.append('add_position_embedding is not True: check_checkpoint_args compares it with the default '
                        'True, and validate_args refuses False with a type other than rope')
    if fields.get('group_query_attention'):
        groups, heads = fields.get('num_query_groups'), fields.get('num_attention_heads')
        if type(groups) is not int or heads % groups or groups % tp:
            problems.append(f'num_query_groups {groups!r} with {heads} heads at TP {tp}')
    if 'num_key_value_heads' in fields and fields['num_key_value_heads'] not in (None, fields.get('num_attention_heads')):
        if not fields.get('group_query_attention') or fields.get('num_query_groups') != fields['num_key_value_heads']:
            problems.append('the fork\'s num_key_value_heads is not group_query_attention / num_query_groups, '
                            'which the legacy ParallelAttention reads')
    return problems


# ---- The expected files, cut independently from the canonical tensors -------------------------

def chunk(x, tp, t, dim=0):
    return x.chunk(tp, dim)[t]


def fused_qkv(cfg, q, k, v):
    """The full fused QKV Megatron shards by dim-0 chunks: per KV group, its g query heads, then
    k, then v ([nkv, g + 2, hd]); with nkv = n that is the per-head [n, 3, hd] layout."""
    g = cfg.n // cfg.nkv
    rest = q.shape[1:]
    return torch.cat([q.reshape(cfg.nkv, g, cfg.hd, *rest), k.reshape(cfg.nkv, 1, cfg.hd, *rest),
                      v.reshape(cfg.nkv, 1, cfg.hd, *rest)], 1).reshape(-1, *rest)


def padded_vocab(cfg, tp):
    multiple = cfg.mvsdb * tp
    return -(-cfg.V // multiple) * multiple


def target_vocab(cfg, matrix, tp, stripped=False):
    """The vocabulary matrix of a target TP: the source's rows (its padding rows are pad_fill;
    none when the source stripped them), zero rows beyond them, cut to the target's padded size."""
    src_rows, rows = cfg.V if stripped else padded_vocab(cfg, cfg.tp), padded_vocab(cfg, tp)
    pad = torch.full((src_rows - cfg.V, cfg.h), float(cfg.pad_fill))
    zeros = torch.zeros((max(0, rows - src_rows), cfg.h))
    return torch.cat([matrix, pad, zeros], 0)[:rows]


def rank_tensors(cfg, canon, tp, t, naive=False, stripped=False):
    """{(role, block or None, module-local key): tensor} of TP rank t, fp32. `naive` cuts the
    fused QKV as [q; k; v] and GLU matrices as [gate; up] before chunking (what Megatron does not)."""
    out = {}
    emb = target_vocab(cfg, canon['embedding.word_embeddings.weight'], tp, stripped)
    out[('embedding', None, 'word_embeddings.weight')] = chunk(emb, tp, t)
    for part in ('weight', 'bias'):
        name = f'embedding.word_embeddings.norm.{part}'
        if name in canon:
            out[('embedding', None, f'word_embeddings.norm.{part}')] = canon[name]
    if 'embedding.position_embeddings.weight' in canon:
        out[('embedding', None, 'position_embeddings.weight')] = canon['embedding.position_embeddings.weight']
    for i in range(cfg.L):
        p = f'layers.{i}.'
        for part in ('weight', 'bias'):
            if p + 'attn.q.' + part not in canon:
                continue
            q, k, v = (canon[p + f'attn.{x}.' + part] for x in 'qkv')
            full = torch.cat([q, k, v], 0) if naive else fused_qkv(cfg, q, k, v)
            out[('block', i, 'self_attention.query_key_value.' + part)] = chunk(full, tp, t)
        out[('block', i, 'self_attention.dense.weight')] = chunk(canon[p + 'attn.o.weight'], tp, t, 1)
        if p + 'mlp.fc.weight' in canon:
            out[('block', i, 'mlp.dense_h_to_4h.weight')] = chunk(canon[p + 'mlp.fc.weight'], tp, t)
            out[('block', i, 'mlp.dense_h_to_4h.bias')] = chunk(canon[p + 'mlp.fc.bias'], tp, t)
        else:
            for part in ('weight', 'bias'):
                if p + 'mlp.gate.' + part not in canon:
                    continue
                gate, up = canon[p + 'mlp.gate.' + part], canon[p + 'mlp.up.' + part]
                # Microsoft's SwiGLU activates the first half, BigScience's GLU the second.
                first, second = (gate, up) if cfg.glu_kind == 'ms' else (up, gate)
                out[('block', i, 'mlp.dense_h_to_4h.' + part)] = (
                    chunk(torch.cat([first, second], 0), tp, t) if naive
                    else torch.cat([chunk(first, tp, t), chunk(second, tp, t)], 0))
        out[('block', i, 'mlp.dense_4h_to_h.weight')] = chunk(canon[p + 'mlp.down.weight'], tp, t, 1)
        replicated = {'input_layernorm.weight': 'input_layernorm.weight',
                      'input_layernorm.bias': 'input_layernorm.bias',
                      'post_attention_layernorm.weight': 'post_attention_layernorm.weight',
                      'post_attention_layernorm.bias': 'post_attention_layernorm.bias',
                      'attn.o.bias': 'self_attention.dense.bias', 'mlp.down.bias': 'mlp.dense_4h_to_h.bias',
                      'attn.inv_freq': 'self_attention.rotary_emb.inv_freq'}
        for name, key in replicated.items():
            if p + name in canon:
                out[('block', i, key)] = canon[p + name]
    for part in ('weight', 'bias'):
        if 'final_norm.' + part in canon:
            out[('final_norm', None, part)] = canon['final_norm.' + part]
    if 'lm_head.weight' in canon:
        out[('head', None, 'weight')] = chunk(target_vocab(cfg, canon['lm_head.weight'], tp, stripped), tp, t)
    return out


def expected_model(cfg, canon, tp, pp, t, p, dtype, naive=False, stripped=False):
    """{path: tensor} of the `model` dict of rank (t, p), as Megatron-LM nests it."""
    per_stage = cfg.L // pp
    out = {}
    for (role, block, key), value in rank_tensors(cfg, canon, tp, t, naive, stripped).items():
        value = value.to(torch.bfloat16 if key.endswith('inv_freq') else dtype)  # a buffer has no master
        if role == 'embedding':
            if p == 0:
                module, param = key.split('.', 1)
                out[f'language_model/embedding/{module}/{param}'] = value
            if p == pp - 1 and pp > 1 and cfg.tied and key == 'word_embeddings.weight':
                out['word_embeddings_for_head/weight'] = value
        elif role == 'block':
            if block // per_stage == p:
                out[f'language_model/encoder/layers.{block % per_stage}.{key}'] = value
        elif p == pp - 1:
            out['language_model/encoder/final_layernorm.' + key if role == 'final_norm'
                else 'language_model/output_layer/' + key] = value
    return out


# Megatron-Core's module names (local layer spec) for the legacy model's.
MCORE_BLOCK = {'input_layernorm.': 'input_layernorm.', 'self_attention.query_key_value.': 'self_attention.linear_qkv.',
               'self_attention.dense.': 'self_attention.linear_proj.', 'post_attention_layernorm.': 'pre_mlp_layernorm.',
               'mlp.dense_h_to_4h.': 'mlp.linear_fc1.', 'mlp.dense_4h_to_h.': 'mlp.linear_fc2.'}
MCORE_LINEARS = ('self_attention.linear_qkv', 'self_attention.linear_proj', 'mlp.linear_fc1', 'mlp.linear_fc2')


def mcore_key(path):
    """The key of Megatron-Core's GPTModel for a path of the legacy model's nested `model`."""
    if path.startswith('language_model/embedding/'):
        return 'embedding.' + path[len('language_model/embedding/'):].replace('/', '.')
    if path.startswith('language_model/encoder/layers.'):
        layer, rest = path[len('language_model/encoder/layers.'):].split('.', 1)
        old = next(o for o in MCORE_BLOCK if rest.startswith(o))
        return f'decoder.layers.{layer}.{MCORE_BLOCK[old]}{rest[len(old):]}'
    if path.startswith('language_model/encoder/final_layernorm.'):
        return 'decoder.' + path[len('language_model/encoder/'):]
    assert path in ('language_model/output_layer/weight', 'word_embeddings_for_head/weight'), path
    return 'output_layer.weight'


def expected_mcore_model(cfg, canon, tp, pp, t, p, dtype):
    """{key: tensor} of Megatron-Core's `model` of rank (t, p), and its `_extra_state` keys."""
    tensors = {mcore_key(path): v for path, v in expected_model(cfg, canon, tp, pp, t, p, dtype).items()}
    layers = {k.split('.')[2] for k in tensors if k.startswith('decoder.layers.')}
    extra = [f'decoder.layers.{l}.{m}._extra_state' for l in layers for m in MCORE_LINEARS]
    return tensors, extra + (['output_layer._extra_state'] if p == pp - 1 else [])


def flatten(model, prefix=''):
    out = {}
    for key, value in model.items():
        path = prefix + key
        if isinstance(value, dict):
            out.update(flatten(value, path + '/'))
        else:
            out[path] = value
    return out


def tensor_differences(got, want):
    if sorted(got) != sorted(want):
        return [f'paths: only written {sorted(set(got) - set(want))}, only expected {sorted(set(want) - set(got))}']
    problems = []
    for path, value in want.items():
        if got[path].dtype != value.dtype or got[path].shape != value.shape:
            problems.append(f'{path}: {got[path].dtype}{tuple(got[path].shape)} vs {value.dtype}{tuple(value.shape)}')
        elif not torch.equal(got[path], value):
            problems.append(f'{path}: values differ')
    return problems


def file_name(tp_rank, pp_rank, pp):
    rank = f'mp_rank_{tp_rank:02d}' if pp == 1 else f'mp_rank_{tp_rank:02d}_{pp_rank:03d}'
    return os.path.join(f'iter_{ITERATION:07d}', rank, 'model_optim_rng.pt')


def pickled_modules(path):
    return {module for module, _ in support.pickle_globals(path)}


def load_without_shims(paths):
    """torch.load of `paths` in a fresh Python that has no Megatron or DeepSpeed module (the
    test process has the fixture's stand-ins registered); returns its stderr on failure."""
    code = ('import sys, torch\n'
            'for p in sys.argv[1:]:\n'
            '    torch.load(p, map_location="cpu", weights_only=False)\n'
            'assert not [m for m in sys.modules if m.split(".")[0] in ("megatron", "deepspeed")]\n')
    p = subprocess.run([sys.executable, '-c', code, *paths], capture_output=True, text=True,
                       env={'PATH': os.environ.get('PATH', '')}, cwd='/')
    return '' if p.returncode == 0 else p.stderr


# ---- Tests -------------------------------------------------------------------------------------

class ExportMegatronTest(FixtureTestCase):

    def source(self, family, tp, pp, **kw):
        cfg = mf.FixtureConfig(**dict(FAMILIES[family], tp=tp, pp=pp, dp=kw.pop('dp', 1),
                                      iteration=ITERATION, optimizer=kw.pop('optimizer', 'none'), **kw))
        tag = mf.write_checkpoint(self.path(f'{family}_tp{tp}_pp{pp}'), cfg)['tag_dir']
        return cfg, tag

    def export(self, src, out, *options, code=0, layer_spec='legacy'):
        spec = ['--layer-spec', layer_spec] if layer_spec else []
        p = run('export', src, out, '--to', 'megatron', *spec, *map(str, options))
        self.assertEqual(p.returncode, code, p.stdout + p.stderr)
        return p

    def check_export(self, cfg, out, tp, pp, dtype=torch.bfloat16, stripped=False):
        """Every file of `out` against the expected Megatron-LM checkpoint; returns the loaded files."""
        want_files = sorted([file_name(t, p, pp) for p in range(pp) for t in range(tp)] +
                            ['latest_checkpointed_iteration.txt', support.MANIFEST])
        got_files = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
        self.assertEqual(got_files, want_files)
        with open(os.path.join(out, 'latest_checkpointed_iteration.txt')) as f:
            self.assertEqual(f.read(), str(ITERATION))
        paths = [os.path.join(out, file_name(t, p, pp)) for p in range(pp) for t in range(tp)]
        self.assertEqual(load_without_shims(paths), '')
        canon = mf.canonical_tensors(cfg)
        loaded = {}
        for p in range(pp):
            for t in range(tp):
                path = os.path.join(out, file_name(t, p, pp))
                self.assertLessEqual(pickled_modules(path), STANDARD_MODULES, path)
                sd = support.load(path)
                self.assertEqual(list(sd), ['args', 'checkpoint_version', 'iteration', 'model'])
                self.assertEqual(sd['checkpoint_version'], 3.0)
                self.assertIsInstance(sd['checkpoint_version'], float)
                self.assertEqual(sd['iteration'], ITERATION)
                self.check_args(cfg, sd['args'], tp, pp)
                problems = tensor_differences(flatten(sd['model']),
                                              expected_model(cfg, canon, tp, pp, t, p, dtype, stripped=stripped))
                self.assertEqual(problems, [], f'{path}')
                loaded[(t, p)] = sd
        return loaded

    def check_args(self, cfg, args, tp, pp):
        self.assertEqual(type(args).__module__ + '.' + type(args).__name__, 'argparse.Namespace')
        self.assertEqual(args.tensor_model_parallel_size, tp)
        self.assertEqual(args.pipeline_model_parallel_size, pp)
        self.assertEqual(args.data_parallel_size, cfg.dp)
        self.assertEqual(args.world_size, tp * pp * cfg.dp)
        self.assertEqual(args.padded_vocab_size, padded_vocab(cfg, tp))
        self.assertEqual(args.num_layers, cfg.L)
        for name, value in vars(args).items():
            self.assertNotIsInstance(value, torch.Tensor, name)
        self.assertEqual(megatron_lm_problems(args, tp), [])
        want = {'alibi': 'alibi', 'rotary': 'rope', 'absolute': 'learned_absolute'}[cfg.position]
        self.assertEqual(args.position_embedding_type, want)
        if cfg.fork == 'ms':  # the fork's spellings, as Megatron-LM reads them
            self.assertEqual(args.normalization, 'LayerNorm' if cfg.layernorm else 'RMSNorm')
            self.assertIsNone(args.num_experts)
            self.assertEqual(args.group_query_attention, cfg.nkv != cfg.n)
            self.assertEqual(args.num_query_groups, cfg.nkv if cfg.nkv != cfg.n else None)

    def test_megatron_lm_acceptance_rules_catch_the_forks_args(self):
        # Negative control: the fork's own args, as reshard once wrote them, break the rules.
        cfg, src = self.source('ms_llama', 2, 2)
        problems = megatron_lm_problems(support.load(support.mp_file(src, 0))['args'], 2)
        for needle in ('num_experts = [1]', "normalization 'rmsnorm'", 'add_position_embedding is not True',
                       'num_key_value_heads'):
            self.assertTrue(any(needle in p for p in problems), (needle, problems))
        out = self.path('flags')
        p = self.export(src, out, '--tp', 2, '--pp', 1)
        self.assertIn('megatron: load with --use-checkpoint-args, or give the architecture on the command line: '
                      '--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention '
                      f'--num-query-groups {cfg.nkv} --untie-embeddings-and-output-weights --disable-bias-linear',
                      p.stdout)

    def test_families_and_layouts(self):
        """Each family from a TP > 1 or PP > 1 source to targets TP 1 / 2 / 4 and PP 1 / 2."""
        cases = [
            ('ms_gpt2', (2, 2), [(1, 1), (2, 2), (4, 2), (4, 1)]),
            ('ms_llama', (2, 2), [(1, 1), (4, 2)]),
            ('bs_bloom', (2, 2), [(4, 2), (1, 1)]),   # vocabulary 112 -> 128 (zero rows) and -> 104 (cut)
            ('bs_gpt_glu', (1, 2), [(2, 1), (4, 2)]),
            ('bs_gpt_rotary', (2, 1), [(1, 2), (2, 1)]),
        ]
        for family, (stp, spp), targets in cases:
            cfg, src = self.source(family, stp, spp)
            for tp, pp in targets:
                with self.subTest(family=family, source=(stp, spp), target=(tp, pp)):
                    out = self.path(f'out_{family}_{tp}_{pp}')
                    p = self.export(src, out, '--tp', tp, '--pp', pp)
                    self.assertIn('--no-load-optim --no-load-rng', p.stdout)
                    loaded = self.check_export(cfg, out, tp, pp)
                    last = loaded[(0, pp - 1)]['model']
                    self.assertEqual('word_embeddings_for_head' in last, pp > 1 and cfg.tied)
                    self.assertEqual(run('verify', out).returncode, 0)

    def test_megatron_core_keys_by_default(self):
        """Without --layer-spec: Megatron-Core's GPTModel, local spec, one flat key per tensor, the
        stage's own layer index, None `_extra_state` for its linear layers."""
        cfg, src = self.source('ms_llama', 2, 2)
        canon = mf.canonical_tensors(cfg)
        for tp, pp in ((1, 1), (4, 2), (2, 3)):
            with self.subTest(target=(tp, pp)):
                out = self.path(f'mcore_{tp}_{pp}')
                p = self.export(src, out, '--tp', tp, '--pp', pp, layer_spec=None)
                self.assertIn('Megatron-Core GPTModel keys, local layer spec; load with --transformer-impl local',
                              p.stdout)
                self.assertEqual(load_without_shims([os.path.join(out, file_name(0, 0, pp))]), '')
                for stage in range(pp):
                    for t in range(tp):
                        sd = support.load(os.path.join(out, file_name(t, stage, pp)))
                        self.assertEqual(list(sd), ['args', 'checkpoint_version', 'iteration', 'model'])
                        self.check_args(cfg, sd['args'], tp, pp)
                        tensors, extra = expected_mcore_model(cfg, canon, tp, pp, t, stage, torch.bfloat16)
                        got = sd['model']
                        self.assertEqual(sorted(got), sorted(list(tensors) + extra))
                        self.assertEqual(tensor_differences({k: got[k] for k in tensors}, tensors), [])
                        self.assertEqual([got[k] for k in extra], [None] * len(extra))
                self.assertEqual(run('verify', out).returncode, 0)
        # A family whose rule set names no Megatron-Core keys keeps the legacy ones, saying so.
        cfg, src = self.source('bs_gpt_glu', 1, 1)
        out = self.path('glu_default')
        p = self.export(src, out, '--tp', 2, '--pp', 1, layer_spec=None)
        self.assertIn('megatron: rule set bigscience-glu names no Megatron-Core keys (it has no torch_dist section), '
                      "so the files hold the legacy GPTModel's", p.stdout)
        self.check_export(cfg, out, 2, 1)

    def test_fp32_masters(self):
        cfg, src = self.source('ms_gpt2', 2, 2, optimizer='bf16_zero', dp=2)
        out = self.path('masters')
        self.export(src, out, '--tp', 4, '--pp', 2, '--from', 'masters')
        self.check_export(cfg, out, 4, 2, dtype=torch.float32)
        # Cast to bf16 the masters are the weights (the fixture's weights are its masters in bf16).
        out = self.path('masters_bf16')
        self.export(src, out, '--tp', 4, '--pp', 2, '--from', 'masters', '--dtype', 'bf16')
        self.check_export(cfg, out, 4, 2)

    def test_universal_source(self):
        """From reshard's universal checkpoint: the masters cast to bf16, the vocabulary (stored
        without padding) padded with zero rows."""
        cfg, src = self.source('ms_gpt2', 2, 2, optimizer='bf16_zero', dp=2)
        universal = self.path('universal', 'global_step10_universal')
        self.assertEqual(run('export', src, universal, '--to', 'universal').returncode, 0)
        out = self.path('from_universal')
        self.export(universal, out, '--tp', 2, '--pp', 2)
        self.check_export(cfg, out, 2, 2, stripped=True)

    def test_negative_controls(self):
        """The comparison finds the cuts Megatron does not make, and one changed element."""
        for family, tp in (('ms_gpt2', 2), ('ms_llama', 2), ('bs_gpt_glu', 2)):
            cfg, src = self.source(family, 1, 1)
            out = self.path(f'control_{family}')
            self.export(src, out, '--tp', tp, '--pp', 1)
            sd = support.load(os.path.join(out, file_name(0, 0, 1)))
            got = flatten(sd['model'])
            canon = mf.canonical_tensors(cfg)
            naive = expected_model(cfg, canon, tp, 1, 0, 0, torch.bfloat16, naive=True)
            self.assertTrue(tensor_differences(got, naive), family)
            right = expected_model(cfg, canon, tp, 1, 0, 0, torch.bfloat16)
            self.assertEqual(tensor_differences(got, right), [])
            changed = dict(got)
            name = 'language_model/encoder/layers.0.mlp.dense_4h_to_h.weight'
            changed[name] = got[name].clone()
            changed[name][0, 0] += 1
            self.assertEqual(tensor_differences(changed, right), [f'{name}: values differ'])

    def test_args_that_already_say_group_query_attention(self):
        """A GQA source whose args record Megatron-LM's group_query_attention beside the fork's
        num_key_value_heads (and no num_query_groups): the written args hold the groups the
        weights were cut with, and the flags name them."""
        cfg, src = self.source('ms_llama', 1, 1)
        for mp in range(cfg.tp * cfg.pp):
            rewrite(support.mp_file(src, mp), lambda sd: setattr(sd['args'], 'group_query_attention', True))
        out = self.path('gqa')
        p = self.export(src, out, '--tp', 2, '--pp', 1)
        self.assertIn(f'--group-query-attention --num-query-groups {cfg.nkv} ', p.stdout)
        self.assertNotIn('--num-query-groups 0', p.stdout)
        args = self.check_export(cfg, out, 2, 1)[(0, 0)]['args']
        self.assertTrue(args.group_query_attention)
        self.assertEqual(args.num_query_groups, cfg.nkv)

    def test_args_tensors_are_dropped(self):
        """Microsoft's args may hold (CUDA) tensors: dropped, with a note naming them."""
        cfg, src = self.source('ms_gpt2', 1, 1)

        def add_tensors(sd):
            sd['args'].attn_mask = torch.ones(2, 2)
            sd['args'].rotary_pos_emb = [torch.zeros(3)]
        rewrite(support.mp_file(src, 0), add_tensors)
        out = self.path('args')
        p = self.export(src, out, '--tp', 2, '--pp', 1)
        self.assertIn('dropped 2 field(s)', p.stdout)
        self.assertIn('attn_mask, rotary_pos_emb', p.stdout)
        args = support.load(os.path.join(out, file_name(0, 0, 1)))['args']
        self.assertFalse(hasattr(args, 'attn_mask') or hasattr(args, 'rotary_pos_emb'))
        source_args = support.load(support.mp_file(src, 0))['args']
        self.assertEqual(args.deepspeed_config_dict, source_args.deepspeed_config_dict)  # plain values stay

    def test_dry_run_prints_the_plan(self):
        cfg, src = self.source('ms_gpt2', 2, 2)
        out = self.path('dry')
        p = self.export(src, out, '--tp', 4, '--pp', 2, '--dry-run')
        self.assertIn('megatron (legacy GPTModel keys): TP 4, PP 2, iteration 10; 3 blocks per stage; padded '
                      'vocabulary 128', p.stdout)
        self.assertIn(file_name(3, 1, 2), p.stdout)
        self.assertIn('word_embeddings_for_head/weight', p.stdout)
        self.assertIn('dry run: nothing written', p.stdout)
        self.assertFalse(os.path.exists(out))

    def test_refusals(self):
        _, src = self.source('ms_gpt2', 2, 2)
        _, bloom = self.source('bs_bloom', 1, 1)  # its rule set has no torch_dist section
        nonpipe = self.path('nonpipe')
        dn.write_nonpipe(nonpipe, dn.NonPipeConfig(zero_stage=2, dtype='bf16', dp=2, L=2, n_heads=4, n_kv=2,
                                                   head_dim=16, ffn=64, h=64, V=128))
        moe = os.path.join(HERE, '..', 'data', 'deepspeed_moe', 'zero1_fp32_ep2_dp4')
        moe_rules = os.path.join(HERE, '..', 'data', 'deepspeed_moe', 'toy-moe-nonpipe.yaml')
        cases = [
            ((src, '--to', 'megatron', '--tp', 2, '--pp', 4),
             '6 layers do not divide into 4 stages; give --decoder-first-pipeline-num-layers N or '
             '--decoder-last-pipeline-num-layers N, or a --pp that divides 6'),
            ((src, '--to', 'megatron', '--tp', 5, '--pp', 1), 'over 5 TP ranks'),
            ((src, '--to', 'megatron', '--tp', 2), 'needs the target layout: --tp N and --pp N'),
            ((src, '--to', 'consolidated', '--tp', 2, '--pp', 1), '--tp sets the layout of --to deepspeed, megatron, torch_dist'),
            ((src, '--to', 'megatron-lm', '--tp', 2, '--pp', 1), "unknown target format 'megatron-lm'; the formats: deepspeed, "),
            ((src, '--to', 'megatron', '--tp', 2, '--pp', 1, '--from', 'masters'), 'no fp32 masters'),
            ((moe, '--to', 'megatron', '--tp', 1, '--pp', 1, '--rules', moe_rules), 'DeepSpeed MoE experts'),
            ((nonpipe, '--to', 'megatron', '--tp', 1, '--pp', 1), 'is read without one'),
            ((bloom, '--to', 'megatron', '--tp', 1, '--pp', 1, '--layer-spec', 'te'),
             'rule set bigscience-bloom has none; add one (docs/rules.md), or use --layer-spec legacy'),
            ((src, '--to', 'consolidated', '--layer-spec', 'te'), '--layer-spec is an option of --to megatron; --to consolidated'),
        ]
        for i, (args, message) in enumerate(cases):
            with self.subTest(args=args[1:]):
                out = self.path(f'refused{i}')
                p = run('export', args[0], out, *map(str, args[1:]))
                self.assertRefused(p, message, out)


if __name__ == '__main__':
    support.main()
