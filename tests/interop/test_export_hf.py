"""`reshard export --to hf`: a Hugging Face transformers folder from a Megatron-DeepSpeed checkpoint.

Sources are fixture checkpoints (microsoft GPT-2 style, LLaMA style, BigScience BLOOM) at several
layouts (TP 1/2/3/4, PP 1/2, padded vocabularies). Two independent oracles:

* the fixture's canonical tensors (separate q, k, v, gate, up: the fixture builds the fused
  Megatron layouts from them), mapped here by the documented HF conventions: GPT-2's Conv1D
  weights transposed and c_attn = [q; k; v]; Llama's q/k/v/gate/up as they are. The export must
  equal them bit for bit (bf16 weights by default, fp32 masters with --from masters);
* logits: a Megatron-semantics forward on the source's own layer files (TP shards merged the way
  Megatron's ranks hold them: fused QKV per head or per KV group, SwiGLU halves per rank, padded
  vocabulary) against a forward written from the HF architectures' definitions (GPT2LMHeadModel:
  LayerNorm, Conv1D, gelu_new; LlamaForCausalLM: RMSNorm, non-interleaved rotary, repeat_kv,
  SwiGLU; BloomForCausalLM: embedding LayerNorm, ALiBi with HF's slopes for 12 heads, which are
  not a power of two) on the exported folder, reading its config.json. Both run in float64, so they agree to
  ~1e-13 and the tolerance (1e-9) is far below what a mistake moves: negative controls swap q/k,
  k/v or gate/up, reorder QKV, change the activation, the norm epsilon, the rotary base, the
  ALiBi slopes or the residual in a copy and must move the logits by more than 1e-6.

Also: a Llama through torchtitan and back (its config recorded beside the torchtitan checkpoint,
read back with no --set; without the record, every command names torchtitan's defaults in one
note); config.json fields; shards with an index and {"format": "pt"}; --tokenizer copies only
tokenizer files; replicated drift under --replicated; refusals (a family without an HF
architecture, a value the checkpoint does not record, a condition the architecture needs)
exit 2 and write nothing.

Run: cd tests/interop && PYTHONPATH=../ /usr/bin/python3 test_export_hf.py --reshard ../../build/reshard
"""
import json
import math
import os

import torch
import torch.nn.functional as F

from fixtures import megatron_fixture as mf

import interop_support as support
from interop_support import FixtureTestCase, make_fixture, read_safetensors, rewrite

run = support.reshard
GPT2 = support.FAMILIES['ms_gpt2']
LLAMA = support.FAMILIES['ms_llama']
BLOOM = dict(support.FAMILIES['bs_bloom'], ffn=4 * support.SIZES['h'])  # HF BLOOM's MLP is 4 x hidden
TOLERANCE = 1e-9   # float64 forwards of the same weights
MOVED = 1e-6       # what a negative control must move the logits by, at least
TOKENS = torch.tensor([3, 17, 99, 42, 0, 63, 7, 88, 25, 51, 12, 76])


# ---- the expected HF tensors, from the fixture's canonical tensors --------------------------------

def renamed(canon, c, h, pairs, kinds=('weight', 'bias')):
    """{h + hf.kind: canon[c + mg.kind]} for the (hf, mg) module pairs."""
    return {f'{h}{hf}.{k}': canon[f'{c}{mg}.{k}'] for hf, mg in pairs for k in kinds}


def expected_gpt2(canon, L):
    """GPT2LMHeadModel's state dict (without the tied lm_head) from canonical tensors."""
    out = {'transformer.wte.weight': canon['embedding.word_embeddings.weight'],
           'transformer.wpe.weight': canon['embedding.position_embeddings.weight'],
           **renamed(canon, '', 'transformer.', [('ln_f', 'final_norm')])}
    for i in range(L):
        c, h = f'layers.{i}.', f'transformer.h.{i}.'
        out.update(renamed(canon, c, h, [('ln_1', 'input_layernorm'), ('ln_2', 'post_attention_layernorm')]))
        qkv = [canon[c + f'attn.{p}.weight'] for p in 'qkv']
        out[h + 'attn.c_attn.weight'] = torch.cat(qkv, 0).t().contiguous()  # Conv1D: [in, out]
        out[h + 'attn.c_attn.bias'] = torch.cat([canon[c + f'attn.{p}.bias'] for p in 'qkv'], 0)
        for hf, mg in (('attn.c_proj', 'attn.o'), ('mlp.c_fc', 'mlp.fc'), ('mlp.c_proj', 'mlp.down')):
            out[h + hf + '.weight'] = canon[c + mg + '.weight'].t().contiguous()
            out[h + hf + '.bias'] = canon[c + mg + '.bias']
    return out


def expected_llama(canon, L):
    """LlamaForCausalLM's state dict from canonical tensors."""
    out = {'model.embed_tokens.weight': canon['embedding.word_embeddings.weight'],
           'model.norm.weight': canon['final_norm.weight'],
           'lm_head.weight': canon['lm_head.weight']}
    for i in range(L):
        out.update(renamed(canon, f'layers.{i}.', f'model.layers.{i}.', [
            ('input_layernorm', 'input_layernorm'), ('post_attention_layernorm', 'post_attention_layernorm'),
            ('self_attn.q_proj', 'attn.q'), ('self_attn.k_proj', 'attn.k'), ('self_attn.v_proj', 'attn.v'),
            ('self_attn.o_proj', 'attn.o'), ('mlp.gate_proj', 'mlp.gate'), ('mlp.up_proj', 'mlp.up'),
            ('mlp.down_proj', 'mlp.down')], kinds=('weight',)))
    return out


def expected_bloom(canon, L, n, hd):
    """BloomForCausalLM's state dict (without the tied lm_head): Megatron's own layout."""
    out = {'transformer.word_embeddings.weight': canon['embedding.word_embeddings.weight'],
           **renamed(canon, '', 'transformer.', [('word_embeddings_layernorm', 'embedding.word_embeddings.norm'),
                                                 ('ln_f', 'final_norm')])}
    for i in range(L):
        c, h = f'layers.{i}.', f'transformer.h.{i}.'
        out.update(renamed(canon, c, h, [
            ('input_layernorm', 'input_layernorm'), ('post_attention_layernorm', 'post_attention_layernorm'),
            ('self_attention.dense', 'attn.o'), ('mlp.dense_h_to_4h', 'mlp.fc'), ('mlp.dense_4h_to_h', 'mlp.down')]))
        for kind in ('weight', 'bias'):  # per head [n, 3, hd]
            qkv = [canon[c + f'attn.{p}.{kind}'].reshape(n, hd, -1) for p in 'qkv']
            out[h + 'self_attention.query_key_value.' + kind] = torch.stack(qkv, 1).reshape(3 * n * hd, -1).squeeze(-1)
    return out


# ---- Megatron semantics, on the source's layer files ----------------------------------------------

def megatron_tensors(tag, style, L, tp):
    """{embedding, positions, head, final_norm, layers: [{key: full tensor}]} merged from the TP shards as
    Megatron's ranks hold them, in float64."""
    def shards(layer_id):
        return [support.load(support.layer_file(tag, layer_id, t)) for t in range(tp)]

    def merge(key, parts):
        if key.endswith(('norm.weight', 'norm.bias', 'dense.bias', 'dense_4h_to_h.bias')) or \
                key in ('weight', 'bias', 'position_embeddings.weight'):
            return parts[0]  # replicated
        if key in ('self_attention.dense.weight', 'mlp.dense_4h_to_h.weight'):
            return torch.cat(parts, 1)  # row-parallel
        if key == 'mlp.dense_h_to_4h.weight' and style == 'ms_llama':
            halves = [p.chunk(2, 0) for p in parts]  # every rank holds [gate_t; up_t]
            return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        return torch.cat(parts, 0)  # column- and vocab-parallel

    def layer(layer_id):
        files = shards(layer_id)
        return {k: merge(k, [f[k] for f in files]).double() for k in files[0]}

    first, final = (3, L + 4) if style.startswith('bs_') else (2, L + 2)  # the forks' spec numberings
    emb = layer(1)
    out = {'embedding': emb['word_embeddings.weight'], 'positions': emb.get('position_embeddings.weight'),
           'embedding_norm': (emb.get('word_embeddings.norm.weight'), emb.get('word_embeddings.norm.bias')),
           'layers': [layer(first + i) for i in range(L)], 'final_norm': layer(final)}
    out['head'] = layer(L + 3)['lm_head.weight'] if style == 'ms_llama' else out['embedding']
    return out


def attention(q, k, v, mask_value, bias=0.0):
    """Causal softmax attention of [s, heads, hd] inputs, `bias` [heads, 1, s] added to the scores;
    returns [s, heads * hd]."""
    s, _, hd = q.shape
    scores = torch.einsum('qhd,khd->hqk', q, k) / math.sqrt(hd) + bias
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(causal, mask_value), -1)
    return torch.einsum('hqk,khd->qhd', probs, v).reshape(s, -1)


def megatron_bias_gelu(x):
    """megatron/model/fused_bias_gelu.py: the tanh approximation."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def megatron_gpt2_logits(m, ids, n, eps, V):
    x = m['embedding'][ids] + m['positions'][:len(ids)]
    h_size = x.shape[-1]
    for p in m['layers']:
        h = F.layer_norm(x, (h_size,), p['input_layernorm.weight'], p['input_layernorm.bias'], eps)
        mixed = h @ p['self_attention.query_key_value.weight'].t() + p['self_attention.query_key_value.bias']
        q, k, v = mixed.view(len(ids), n, -1).chunk(3, -1)  # per head [q, k, v]
        ctx = attention(q, k, v, -10000.0)
        x = x + ctx @ p['self_attention.dense.weight'].t() + p['self_attention.dense.bias']
        h = F.layer_norm(x, (h_size,), p['post_attention_layernorm.weight'], p['post_attention_layernorm.bias'], eps)
        a = megatron_bias_gelu(h @ p['mlp.dense_h_to_4h.weight'].t() + p['mlp.dense_h_to_4h.bias'])
        x = x + a @ p['mlp.dense_4h_to_h.weight'].t() + p['mlp.dense_4h_to_h.bias']
    x = F.layer_norm(x, (h_size,), m['final_norm']['weight'], m['final_norm']['bias'], eps)
    return (x @ m['head'].t())[:, :V]


def megatron_rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def megatron_rotary(t, theta):
    """megatron/model/rotary_pos_embedding.py: freqs over the whole head dim, rotate_half."""
    s, _, hd = t.shape
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    return t * emb.cos() + rotate_half(t) * emb.sin()


def megatron_llama_logits(m, ids, n, nkv, eps, theta, V):
    x = m['embedding'][ids]
    g, s = n // nkv, len(ids)
    for p in m['layers']:
        h = megatron_rms(x, p['input_layernorm.weight'], eps)
        mixed = (h @ p['self_attention.query_key_value.weight'].t()).view(s, nkv, g + 2, -1)  # per KV group
        hd = mixed.shape[-1]
        q = mixed[:, :, :g].reshape(s, n, hd)
        k, v = mixed[:, :, g], mixed[:, :, g + 1]
        q, k = megatron_rotary(q, theta), megatron_rotary(k, theta)
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        x = x + attention(q, k, v, -10000.0) @ p['self_attention.dense.weight'].t()
        h = megatron_rms(x, p['post_attention_layernorm.weight'], eps)
        gate, up = (h @ p['mlp.dense_h_to_4h.weight'].t()).chunk(2, -1)  # silu(first) * second
        x = x + (F.silu(gate) * up) @ p['mlp.dense_4h_to_h.weight'].t()
    return (megatron_rms(x, m['final_norm']['weight'], eps) @ m['head'].t())[:, :V]


def megatron_alibi_slopes(n):
    """bigscience Megatron-DeepSpeed's get_slopes (megatron/model/transformer.py)."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + megatron_alibi_slopes(2 * closest)[0::2][:n - closest]


def megatron_bloom_logits(m, ids, n, eps, V):
    """BS ParallelTransformer with ALiBi: scores q.k/sqrt(hd) + slope x key position (baddbmm with the
    layer-number scaling undone by the softmax scale), embedding LayerNorm, tanh GeLU, tied head."""
    s = len(ids)
    alibi = torch.tensor(megatron_alibi_slopes(n), dtype=torch.float64)[:, None, None] * \
        torch.arange(s, dtype=torch.float64)[None, None, :]
    x = m['embedding'][ids]
    h_size = x.shape[-1]
    x = F.layer_norm(x, (h_size,), *m['embedding_norm'], eps)
    for p in m['layers']:
        h = F.layer_norm(x, (h_size,), p['input_layernorm.weight'], p['input_layernorm.bias'], eps)
        mixed = h @ p['self_attention.query_key_value.weight'].t() + p['self_attention.query_key_value.bias']
        q, k, v = mixed.view(s, n, -1).chunk(3, -1)
        x = x + attention(q, k, v, -10000.0, alibi) @ p['self_attention.dense.weight'].t() + p['self_attention.dense.bias']
        h = F.layer_norm(x, (h_size,), p['post_attention_layernorm.weight'], p['post_attention_layernorm.bias'], eps)
        a = megatron_bias_gelu(h @ p['mlp.dense_h_to_4h.weight'].t() + p['mlp.dense_h_to_4h.bias'])
        x = x + a @ p['mlp.dense_4h_to_h.weight'].t() + p['mlp.dense_4h_to_h.bias']
    x = F.layer_norm(x, (h_size,), m['final_norm']['weight'], m['final_norm']['bias'], eps)
    return (x @ m['head'].t())[:, :V]


# ---- the HF architectures, on the exported folder -------------------------------------------------

HF_ACT = {'gelu_new': lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3)))),
          'gelu': lambda x: F.gelu(x), 'silu': F.silu}


def hf_gpt2_logits(t, c, ids):
    """transformers' GPT2LMHeadModel (eval): Conv1D is x @ W + b with W [in, out]."""
    t = {k: v.double() for k, v in t.items()}
    n, e = c['n_head'], c['n_embd']
    x = t['transformer.wte.weight'][ids] + t['transformer.wpe.weight'][torch.arange(len(ids))]
    for i in range(c['n_layer']):
        p = f'transformer.h.{i}.'
        h = F.layer_norm(x, (e,), t[p + 'ln_1.weight'], t[p + 'ln_1.bias'], c['layer_norm_epsilon'])
        q, k, v = (h @ t[p + 'attn.c_attn.weight'] + t[p + 'attn.c_attn.bias']).split(e, -1)
        heads = [z.view(len(ids), n, e // n) for z in (q, k, v)]
        x = x + attention(*heads, torch.finfo(torch.float64).min) @ t[p + 'attn.c_proj.weight'] + t[p + 'attn.c_proj.bias']
        h = F.layer_norm(x, (e,), t[p + 'ln_2.weight'], t[p + 'ln_2.bias'], c['layer_norm_epsilon'])
        a = HF_ACT[c['activation_function']](h @ t[p + 'mlp.c_fc.weight'] + t[p + 'mlp.c_fc.bias'])
        x = x + a @ t[p + 'mlp.c_proj.weight'] + t[p + 'mlp.c_proj.bias']
    x = F.layer_norm(x, (e,), t['transformer.ln_f.weight'], t['transformer.ln_f.bias'], c['layer_norm_epsilon'])
    assert c['tie_word_embeddings']
    return x @ t['transformer.wte.weight'].t()


def hf_rms(x, w, eps):
    """LlamaRMSNorm."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def hf_llama_logits(t, c, ids):
    """transformers' LlamaForCausalLM (eval): LlamaRotaryEmbedding, repeat_kv, LlamaMLP."""
    t = {k: v.double() for k, v in t.items()}
    n, nkv, e = c['num_attention_heads'], c['num_key_value_heads'], c['hidden_size']
    hd, s, eps = e // n, len(ids), c['rms_norm_eps']
    inv_freq = 1.0 / (c['rope_theta'] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    x = t['model.embed_tokens.weight'][ids]
    for i in range(c['num_hidden_layers']):
        p = f'model.layers.{i}.'
        h = hf_rms(x, t[p + 'input_layernorm.weight'], eps)
        q = (h @ t[p + 'self_attn.q_proj.weight'].t()).view(s, n, hd)
        k = (h @ t[p + 'self_attn.k_proj.weight'].t()).view(s, nkv, hd)
        v = (h @ t[p + 'self_attn.v_proj.weight'].t()).view(s, nkv, hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = n // nkv  # repeat_kv: [s, nkv, hd] -> [s, nkv, rep, hd] -> [s, n, hd]
        k, v = (z[:, :, None, :].expand(s, nkv, rep, hd).reshape(s, n, hd) for z in (k, v))
        x = x + attention(q, k, v, torch.finfo(torch.float64).min) @ t[p + 'self_attn.o_proj.weight'].t()
        h = hf_rms(x, t[p + 'post_attention_layernorm.weight'], eps)
        mlp = HF_ACT[c['hidden_act']](h @ t[p + 'mlp.gate_proj.weight'].t()) * (h @ t[p + 'mlp.up_proj.weight'].t())
        x = x + mlp @ t[p + 'mlp.down_proj.weight'].t()
    assert not c['tie_word_embeddings']
    return hf_rms(x, t['model.norm.weight'], eps) @ t['lm_head.weight'].t()


def hf_bloom_alibi(n, s):
    """transformers' build_alibi_tensor (in float64 here; HF computes the slopes in float32)."""
    closest = 2 ** math.floor(math.log2(n))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = torch.tensor(base, dtype=torch.float64) ** torch.arange(1, 1 + closest, dtype=torch.float64)
    if closest != n:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        extra = torch.arange(1, 1 + 2 * min(closest, n - closest), 2, dtype=torch.float64)
        slopes = torch.cat([slopes, torch.tensor(extra_base, dtype=torch.float64) ** extra])
    return slopes[:, None, None] * torch.arange(s, dtype=torch.float64)[None, None, :]


def hf_bloom_logits(t, c, ids, alibi=hf_bloom_alibi):
    """transformers' BloomForCausalLM (eval): fused QKV viewed [s, n, 3, hd], ALiBi, BloomGelu."""
    t = {k: v.double() for k, v in t.items()}
    n, e, eps, s = c['n_head'], c['hidden_size'], c['layer_norm_epsilon'], len(ids)
    bias = alibi(n, s)
    x = t['transformer.word_embeddings.weight'][ids]
    x = F.layer_norm(x, (e,), t['transformer.word_embeddings_layernorm.weight'],
                     t['transformer.word_embeddings_layernorm.bias'], eps)
    for i in range(c['n_layer']):
        p = f'transformer.h.{i}.'
        h = F.layer_norm(x, (e,), t[p + 'input_layernorm.weight'], t[p + 'input_layernorm.bias'], eps)
        residual = h if c['apply_residual_connection_post_layernorm'] else x
        fused = (h @ t[p + 'self_attention.query_key_value.weight'].t() + t[p + 'self_attention.query_key_value.bias'])
        q, k, v = fused.view(s, n, 3, e // n).unbind(2)
        x = residual + attention(q, k, v, torch.finfo(torch.float64).min, bias) @ \
            t[p + 'self_attention.dense.weight'].t() + t[p + 'self_attention.dense.bias']
        h = F.layer_norm(x, (e,), t[p + 'post_attention_layernorm.weight'], t[p + 'post_attention_layernorm.bias'], eps)
        residual = h if c['apply_residual_connection_post_layernorm'] else x
        a = HF_ACT['gelu_new'](h @ t[p + 'mlp.dense_h_to_4h.weight'].t() + t[p + 'mlp.dense_h_to_4h.bias'])
        x = residual + a @ t[p + 'mlp.dense_4h_to_h.weight'].t() + t[p + 'mlp.dense_4h_to_h.bias']
    x = F.layer_norm(x, (e,), t['transformer.ln_f.weight'], t['transformer.ln_f.bias'], eps)
    assert c['tie_word_embeddings']
    return x @ t['transformer.word_embeddings.weight'].t()


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_folder(out):
    """(tensors, config) of an exported folder, shards joined through the index when there is one."""
    config = read_json(os.path.join(out, 'config.json'))
    index = os.path.join(out, 'model.safetensors.index.json')
    files = sorted(set(read_json(index)['weight_map'].values())) if os.path.exists(index) else ['model.safetensors']
    tensors = {}
    for name in files:
        got, meta = read_safetensors(os.path.join(out, name))
        assert meta == {'format': 'pt'}, meta
        tensors.update(got)
    return tensors, config


HF_LOGITS = {'ms_gpt2': hf_gpt2_logits, 'ms_llama': hf_llama_logits, 'bs_bloom': hf_bloom_logits}


def megatron_logits(family, tag, tp):
    """The source's logits by Megatron's semantics (eps 1e-5 and rotary base 10000, as the fixture's args)."""
    m = megatron_tensors(tag, family['style'], family['L'], tp)
    if family['style'] == 'ms_gpt2':
        return megatron_gpt2_logits(m, TOKENS, family['n'], 1e-5, family['V'])
    if family['style'] == 'bs_bloom':
        return megatron_bloom_logits(m, TOKENS, family['n'], 1e-5, family['V'])
    return megatron_llama_logits(m, TOKENS, family['n'], family['nkv'], 1e-5, 10000.0, family['V'])


class ExportHfTest(FixtureTestCase):

    def source(self, name, family, **kw):
        """A fixture checkpoint; returns (tag folder, canonical fp32 tensors)."""
        cfg = dict(family, **kw)
        tag = make_fixture(self.path(name), **cfg)
        cfg.pop('optimizer', None)
        return tag, mf.canonical_tensors(mf.FixtureConfig(**cfg))

    def export(self, tag, out, *options, code=0):
        p = run('export', tag, out, '--to', 'hf', *options)
        self.assertEqual(p.returncode, code, p.stdout + p.stderr)
        return p

    def refused(self, tag, *options, says):
        out = self.path('refused')
        p = self.export(tag, out, *options, code=2)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn(says, p.stderr)
        self.assertFalse(os.path.exists(out))
        return p.stderr

    def exported(self, name, family, tp, pp):
        """Exports a fixture at (tp, pp); returns (canonical, exported tensors, config, Megatron logits),
        having checked that the HF forward on the folder gives those logits."""
        tag, canon = self.source(name, family, tp=tp, pp=pp)
        out = self.path(name + '_hf')
        self.export(tag, out)
        self.assertEqual(sorted(os.listdir(out)), ['config.json', 'model.safetensors', support.MANIFEST])
        tensors, config = read_folder(out)
        megatron = megatron_logits(family, tag, tp)
        self.assertLogitsClose(HF_LOGITS[family['style']](tensors, config, TOKENS), megatron)
        return canon, tensors, config, megatron

    def assertSameTensors(self, got, want, dtype):
        self.assertEqual(sorted(got), sorted(want))
        for name, value in want.items():
            self.assertEqual(got[name].dtype, dtype, name)
            self.assertEqual(tuple(got[name].shape), tuple(value.shape), name)
            self.assertTrue(torch.equal(got[name], value.to(dtype)), name)

    def assertExportsAt(self, layouts, family, expected, config):
        """At each (tp, pp): the exported tensors are expected(canonical) bit for bit, config.json is
        `config`, and the logits agree (`exported` checks them)."""
        for tp, pp in layouts:
            with self.subTest(tp=tp, pp=pp):
                canon, tensors, got, _ = self.exported(f'{family["style"]}_{tp}{pp}', family, tp, pp)
                self.assertSameTensors(tensors, expected(canon), torch.bfloat16)
                self.assertEqual(got, config)

    def assertLogitsClose(self, a, b):
        self.assertLess((a - b).abs().max().item(), TOLERANCE)

    def assertLogitsMoved(self, a, b):
        self.assertGreater((a - b).abs().max().item(), MOVED)

    # -- GPT-2 ------------------------------------------------------------------------------------

    def test_gpt2_tensors_config_and_logits(self):
        self.assertExportsAt(((1, 1), (2, 2), (3, 2)), GPT2, lambda canon: expected_gpt2(canon, GPT2['L']), {
            'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2', 'n_embd': 48, 'n_layer': 6,
            'n_head': 12, 'n_inner': 96, 'n_positions': 32, 'layer_norm_epsilon': 1e-5,
            'activation_function': 'gelu_new', 'scale_attn_by_inverse_layer_idx': False,
            'reorder_and_upcast_attn': False, 'tie_word_embeddings': True, 'vocab_size': 100,
            'torch_dtype': 'bfloat16'})

    def test_gpt2_matrices_past_a_piece(self):
        """Matrices of more than 1 MiB (c_attn 1.5 MiB, c_fc 2 MiB in bf16) are transposed through a
        scratch file in the output's folder, which leaves nothing there."""
        wide = dict(GPT2, L=2, h=512, n=8, hd=64, ffn=2048)
        canon, tensors, _, _ = self.exported('gpt2_wide', wide, 2, 1)
        self.assertGreater(tensors['transformer.h.0.mlp.c_fc.weight'].numel() * 2, 1 << 20)
        self.assertSameTensors(tensors, expected_gpt2(canon, wide['L']), torch.bfloat16)

    def test_gpt2_negative_controls(self):
        _, tensors, config, megatron = self.exported('gpt2', GPT2, 2, 2)
        e = config['n_embd']
        swapped = dict(tensors)  # q and k exchanged in every c_attn
        for name in [n for n in tensors if n.endswith('attn.c_attn.weight')]:
            w = tensors[name]
            swapped[name] = torch.cat([w[:, e:2 * e], w[:, :e], w[:, 2 * e:]], 1)
        self.assertLogitsMoved(hf_gpt2_logits(swapped, config, TOKENS), megatron)
        exact = dict(config, activation_function='gelu')  # what --no-bias-gelu-fusion trains
        self.assertLogitsMoved(hf_gpt2_logits(tensors, exact, TOKENS), megatron)
        per_head = dict(tensors)  # c_attn left in Megatron's per-head [n, 3, hd] order
        for name in [n for n in tensors if 'c_attn' in n]:
            per_head[name] = tensors[name].reshape(-1, 3, GPT2['n'], GPT2['hd']).transpose(1, 2).reshape(tensors[name].shape) \
                if name.endswith('weight') else tensors[name].view(3, GPT2['n'], -1).transpose(0, 1).reshape(-1)
        self.assertLogitsMoved(hf_gpt2_logits(per_head, config, TOKENS), megatron)

    def test_gpt2_exact_gelu_recorded(self):
        """--no-bias-gelu-fusion (args.bias_gelu_fusion False) exports activation gelu."""
        tag, _ = self.source('gpt2', GPT2, tp=1, pp=1)
        rewrite(support.mp_file(tag, 0), lambda sd: setattr(sd['args'], 'bias_gelu_fusion', False))
        out = self.path('gpt2_hf')
        self.export(tag, out)
        self.assertEqual(read_folder(out)[1]['activation_function'], 'gelu')

    # -- Llama ------------------------------------------------------------------------------------

    def test_llama_tensors_config_and_logits(self):
        self.assertExportsAt(((1, 1), (2, 2), (3, 1)), LLAMA, lambda canon: expected_llama(canon, LLAMA['L']), {
            'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 48,
            'intermediate_size': 48, 'num_hidden_layers': 6, 'num_attention_heads': 12,
            'num_key_value_heads': 6, 'max_position_embeddings': 32, 'rms_norm_eps': 1e-5,
            'rope_theta': 10000, 'rope_scaling': None, 'hidden_act': 'silu', 'attention_bias': False,
            'tie_word_embeddings': False, 'vocab_size': 100, 'torch_dtype': 'bfloat16'})

    def test_llama_negative_controls(self):
        _, tensors, config, megatron = self.exported('llama', LLAMA, 2, 2)

        def exchanged(a, b):
            out = dict(tensors)
            for name in [n for n in tensors if n.endswith(a)]:
                out[name], out[name.replace(a, b)] = tensors[name.replace(a, b)], tensors[name]
            return out

        self.assertLogitsMoved(hf_llama_logits(exchanged('gate_proj.weight', 'up_proj.weight'), config, TOKENS), megatron)
        self.assertLogitsMoved(hf_llama_logits(exchanged('k_proj.weight', 'v_proj.weight'), config, TOKENS), megatron)
        self.assertLogitsMoved(hf_llama_logits(tensors, dict(config, rms_norm_eps=1e-6), TOKENS), megatron)
        self.assertLogitsMoved(hf_llama_logits(tensors, dict(config, rope_theta=500000.0), TOKENS), megatron)
        interleaved = dict(tensors)  # q rows permuted as converters for interleaved rotary do
        for name in [n for n in tensors if n.endswith('q_proj.weight')]:
            w = tensors[name].view(LLAMA['n'], LLAMA['hd'] // 2, 2, -1)
            interleaved[name] = w.transpose(1, 2).reshape(tensors[name].shape)
        self.assertLogitsMoved(hf_llama_logits(interleaved, config, TOKENS), megatron)

    def test_llama_masters_dtype_and_shards(self):
        tag, canon = self.source('llama', LLAMA, tp=2, pp=2, dp=2, optimizer='bf16_zero')
        want = expected_llama(canon, LLAMA['L'])
        out = self.path('masters')
        p = self.export(tag, out, '--from', 'masters', '--max-shard-size', '40KB')
        self.assertIn('hf: 39 of 39 tensors from the fp32 masters', p.stdout)
        shards = sorted(f for f in os.listdir(out) if f.endswith('.safetensors'))
        self.assertGreater(len(shards), 2)
        self.assertEqual(shards, [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))])
        index = read_json(os.path.join(out, 'model.safetensors.index.json'))
        self.assertEqual(sorted(index['weight_map']), sorted(want))
        tensors, config = read_folder(out)
        self.assertSameTensors(tensors, want, torch.float32)
        self.assertEqual(config['torch_dtype'], 'float32')
        out = self.path('weights_fp32')
        self.export(tag, out, '--dtype', 'fp32')
        tensors, config = read_folder(out)
        self.assertSameTensors(tensors, {n: t.to(torch.bfloat16) for n, t in want.items()}, torch.float32)

    # -- through torchtitan, which records no model config ------------------------------------------

    def test_llama_through_torchtitan_keeps_its_config(self):
        """HF -> torchtitan -> HF: torchtitan keeps its model config outside the checkpoint, so the
        export records it in step-N/reshard-model.json and the torchtitan reader reads it back: the
        second HF export needs no --set, its config.json is the first's (rope_theta 10000,
        max_position_embeddings 32, where torchtitan's defaults are 500000.0 and 131072) and its
        logits the Megatron source's. Without the record every command names the defaults it fills,
        in one note."""
        _, _, config, megatron = self.exported('llama', LLAMA, 1, 1)
        tt = self.path('tt')
        p = run('export', self.path('llama_hf'), tt, '--to', 'torchtitan', '--dp-shard', 2)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        step = os.path.join(tt, 'step-0')
        self.assertEqual(sorted(os.listdir(step)), ['.metadata', '__0_0.distcp', '__1_0.distcp', 'reshard-model.json'])
        back = self.path('back')
        p = self.export(step, back)
        self.assertNotIn("torchtitan's defaults", p.stdout)
        tensors, got = read_folder(back)
        self.assertEqual(got, config)
        self.assertLogitsClose(hf_llama_logits(tensors, got, TOKENS), megatron)
        os.remove(os.path.join(step, 'reshard-model.json'))
        heads = ('--set', f'num_attention_heads={LLAMA["n"]}')
        for args in (['export', step, self.path('defaulted'), '--to', 'hf', *heads],
                     ['convert', step, self.path('converted', 'global_step0'), '--to', 'deepspeed', '--tp', 1, '--pp', 1, *heads],
                     ['lint', step, *heads], ['inspect', step, *heads]):
            with self.subTest(command=args[0]):
                p = run(*args)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                notes = [line for line in p.stdout.splitlines() if "torchtitan's defaults" in line]
                self.assertEqual(len(notes), 1, p.stdout)
                self.assertIn('rope_theta 500000.0', notes[0])
                self.assertIn('max_position_embeddings 131072', notes[0])
        self.assertEqual(read_folder(self.path('defaulted'))[1]['rope_theta'], 500000.0)

    # -- BLOOM ------------------------------------------------------------------------------------

    def test_bloom_tensors_config_and_logits(self):
        """12 heads: ALiBi slopes for a head count that is not a power of two."""
        self.assertExportsAt(((1, 1), (2, 2), (4, 2)), BLOOM,
                             lambda canon: expected_bloom(canon, BLOOM['L'], BLOOM['n'], BLOOM['hd']), {
            'architectures': ['BloomForCausalLM'], 'model_type': 'bloom', 'hidden_size': 48,
            'n_layer': 6, 'n_head': 12, 'layer_norm_epsilon': 1e-5,
            'apply_residual_connection_post_layernorm': False, 'pretraining_tp': 1,
            'slow_but_exact': False, 'tie_word_embeddings': True, 'vocab_size': 100,
            'torch_dtype': 'bfloat16'})

    def test_bloom_negative_controls(self):
        _, tensors, config, megatron = self.exported('bloom', BLOOM, 2, 2)
        naive = lambda n, s: torch.tensor([2 ** (-8 * (i + 1) / n) for i in range(n)], dtype=torch.float64)[:, None, None] \
            * torch.arange(s, dtype=torch.float64)[None, None, :]  # the power-of-two formula at any n
        self.assertLogitsMoved(hf_bloom_logits(tensors, config, TOKENS, alibi=naive), megatron)
        as_gpt2 = dict(tensors)  # QKV reordered to [3, n, hd] as GPT-2 wants it
        for name in [n for n in tensors if 'query_key_value' in n]:
            w = tensors[name]
            as_gpt2[name] = w.view(BLOOM['n'], 3, -1).transpose(0, 1).reshape(w.shape)
        self.assertLogitsMoved(hf_bloom_logits(as_gpt2, config, TOKENS), megatron)
        post = dict(config, apply_residual_connection_post_layernorm=True)
        self.assertLogitsMoved(hf_bloom_logits(tensors, post, TOKENS), megatron)

    def test_bloom_mlp_width_is_fixed(self):
        tag, _ = self.source('bloom', support.FAMILIES['bs_bloom'], tp=2, pp=1)
        self.refused(tag, says='BloomForCausalLM needs layers.0.mlp.dense_h_to_4h.weight of shape [192, 48] '
                               '(4*args.hidden_size, args.hidden_size')

    # -- folder, policies and refusals ------------------------------------------------------------

    def test_tokenizer_files_copied(self):
        tag, _ = self.source('gpt2', GPT2)
        tok = self.path('tok')
        os.makedirs(tok)
        for name in ('tokenizer.json', 'tokenizer_config.json', 'vocab.json', 'merges.txt', 'config.json',
                     'model.safetensors'):
            with open(os.path.join(tok, name), 'w') as f:  # JSON where reshard reads the special token ids
                f.write(json.dumps({'from': name}) if name.endswith('.json') else 'from the tokenizer folder: ' + name)
        out = self.path('hf')
        self.export(tag, out, '--tokenizer', tok)
        self.assertEqual(sorted(os.listdir(out)), ['config.json', 'merges.txt', 'model.safetensors', support.MANIFEST,
                                                   'tokenizer.json', 'tokenizer_config.json', 'vocab.json'])
        with open(os.path.join(out, 'vocab.json')) as f:
            self.assertEqual(f.read(), json.dumps({'from': 'vocab.json'}))
        with open(os.path.join(out, 'merges.txt')) as f:
            self.assertEqual(f.read(), 'from the tokenizer folder: merges.txt')
        p = run('verify', out)  # every file, copies included, is in the manifest as written
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(read_folder(out)[1]['architectures'], ['GPT2LMHeadModel'])
        self.refused(tag, '--tokenizer', self.path('gpt2'), says='holds no tokenizer files')

    def test_drifted_replicas_follow_the_policy(self):
        tag, canon = self.source('drift', GPT2, tp=2, pp=1, tp_drift_eps=0.0625)
        self.refused(tag, says='replicated tensor(s) differ across TP ranks')
        out = self.path('first')
        p = self.export(tag, out, '--replicated', 'first')
        self.assertIn('merged by their policy', p.stdout)
        tensors, _ = read_folder(out)
        want = expected_gpt2(canon, GPT2['L'])  # TP rank 0 holds the canonical copy
        self.assertTrue(torch.equal(tensors['transformer.h.0.ln_1.weight'], want['transformer.h.0.ln_1.weight'].bfloat16()))
        out = self.path('average')
        self.export(tag, out, '--replicated', 'average')
        tensors, _ = read_folder(out)
        mean = (want['transformer.ln_f.bias'].bfloat16().double() +
                (want['transformer.ln_f.bias'] + 0.0625).bfloat16().double()) / 2
        self.assertTrue(torch.equal(tensors['transformer.ln_f.bias'], mean.bfloat16()))

    def test_refusals_write_nothing(self):
        glu, _ = self.source('glu', support.FAMILIES['bs_gpt_glu'], tp=2, pp=1)
        self.refused(glu, says='rule set bigscience-glu')
        rotary, _ = self.source('rotary', support.FAMILIES['bs_gpt_rotary'], tp=1, pp=1)
        self.refused(rotary, says='BloomForCausalLM does not compute this model: args.position_embedding_type is not')
        llama, _ = self.source('llama', LLAMA, tp=2, pp=1)
        self.refused(llama, '--from', 'masters', says='no fp32 masters')
        for mp in range(2):
            rewrite(support.mp_file(llama, mp), lambda sd: delattr(sd['args'], 'layernorm_epsilon'))
        self.refused(llama, says='does not record 1 value this conversion needs: config.json rms_norm_eps '
                                 '(args.layernorm_epsilon); give it as the run was trained: --set args.layernorm_epsilon=N')
        out = self.path('given')
        self.export(llama, out, '--set', 'layernorm_epsilon=1e-5')
        self.assertEqual(read_folder(out)[1]['rms_norm_eps'], 1e-5)
        for mp in range(2):
            rewrite(support.mp_file(llama, mp), lambda sd: setattr(sd['args'], 'apply_layernorm_1p', True))
        self.refused(llama, '--set', 'layernorm_epsilon=1e-5',
                     says='LlamaForCausalLM does not compute this model: args.apply_layernorm_1p is true')


if __name__ == '__main__':
    support.main()
