"""The real Megatron-Core saves of tests/data/megatron-core, as the interop tests read them.

Each sample TAG has `TAG/` (the weights), `TAG_config.json` (the model and its layout),
`TAG_full.pt` and the ranks' reference state dicts; README.md there says what each holds.
"""
import glob
import json
import os

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'megatron-core')


def config_of(name):
    """The config of sample `name` ('0.19/w2_tp2')."""
    with open(os.path.join(DATA, name + '_config.json')) as f:
        return json.load(f)


def samples(version='0.*[0-9]'):
    """(folder, config) of every weights save of the dense model (of a Megatron-Core version; '0.19-moe'
    for the MoE model's)."""
    out = []
    for config in sorted(glob.glob(os.path.join(DATA, version, '*_config.json'))):
        with open(config) as f:
            out.append((config[:-len('_config.json')], json.load(f)))
    return out


def sizes(config):
    """The --set values the saves do not record (they were written without Megatron-LM's args)."""
    m = config['model']
    return ['--set', f"num_attention_heads={m['heads']}", '--set', f"num_key_value_heads={m['groups']}",
            '--set', 'make_vocab_size_divisible_by=16', '--vocab-size', str(m['vocab'])]


def llama_hf_tensors(full, m):
    """{HF LlamaForCausalLM name: tensor} of a SwiGLU save's whole tensors `full` ({Megatron-Core key:
    tensor}, layers stacked), m its config's model: the fused QKV per query group [groups,
    heads/groups + 2, hd] split into q, k, v; linear_fc1 [gate; up] into gate_proj, up_proj. Also
    for its exp_avg / exp_avg_sq, which are laid out alike."""
    hidden, heads, groups, ffn = m['hidden'], m['heads'], m['groups'], m['ffn']
    hd = hidden // heads
    out = {'model.embed_tokens.weight': full['embedding.word_embeddings.weight'],
           'model.norm.weight': full['decoder.final_layernorm.weight'],
           'lm_head.weight': full['output_layer.weight']}
    for layer in range(m['layers']):
        p, stacked = f'model.layers.{layer}.', {k[len('decoder.layers.'):]: v[layer] for k, v in full.items()
                                                if k.startswith('decoder.layers.')}
        qkv = stacked['self_attention.linear_qkv.weight'].view(groups, heads // groups + 2, hd, -1)
        fc1 = stacked['mlp.linear_fc1.weight']
        out.update({p + 'self_attn.q_proj.weight': qkv[:, :-2].reshape(-1, hidden),
                    p + 'self_attn.k_proj.weight': qkv[:, -2].reshape(-1, hidden),
                    p + 'self_attn.v_proj.weight': qkv[:, -1].reshape(-1, hidden),
                    p + 'self_attn.o_proj.weight': stacked['self_attention.linear_proj.weight'],
                    p + 'mlp.gate_proj.weight': fc1[:ffn], p + 'mlp.up_proj.weight': fc1[ffn:],
                    p + 'mlp.down_proj.weight': stacked['mlp.linear_fc2.weight'],
                    p + 'input_layernorm.weight': stacked['self_attention.linear_qkv.layer_norm_weight'],
                    p + 'post_attention_layernorm.weight': stacked['mlp.linear_fc1.layer_norm_weight']})
    return out
