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


def samples(version='*'):
    """(folder, config) of every weights save (of a Megatron-Core version)."""
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
