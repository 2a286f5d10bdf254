"""Values that must survive a round trip through Megatron-Core's `torch_dist`
(engine/formats/megatron_core/torch_dist/): what the run's args, its optimizer groups and
Megatron-DeepSpeed's metadata record, beside the tensors that verify compares.

Checked:

* the vocabulary padding: a Megatron-DeepSpeed checkpoint at TP 2 (100 rows padded to 112 by
  make_vocab_size_divisible_by 8 x TP 2) written as torch_dist at TP 2 and converted back at TP 1
  has the 104 rows the source's rule gives TP 1 (an import lays the save out at TP 1 with TP 2's
  padding, which a TP 1 target pads again); a divisor given by --set where the source's args lack it
  is written into the torch_dist args, so the way back needs no --set;
* every param group's step: back in Megatron-DeepSpeed's shards, each group records the source's
  step (DeepSpeed's FusedAdam reads it there), as each parameter's state does;
* the universal-checkpoint version: torch_dist has no place for it, and Megatron-DeepSpeed's files
  written from the import record 0.2, as Megatron-DeepSpeed's writer does;
* the weight decay Megatron-Core applies: torchtitan decays its norms, which Megatron-Core keeps in
  its wd_mult 0 group (Megatron-LM's load pairs the saved groups with its own by wd_mult) and its
  scheduler decays by weight_decay x wd_mult; the groups are written as Megatron-Core writes them
  (the run's weight_decay, wd_mult 1 and 0), and a note says the norms' decay is dropped; a
  Megatron-DeepSpeed source, whose no-decay group says so, gets no such note;
* the KV-group count: a Megatron-DeepSpeed GQA run whose args leave num_key_value_heads None
  (given by --set) is written with group_query_attention and num_query_groups 6, read back as GQA,
  and no note suggests --num-query-groups 0.

Run: /usr/bin/python3 tests/interop/test_torch_dist_values.py --reshard build/reshard
"""
import glob
import os
import re

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
from fixtures import megatron_fixture as mf

run = support.reshard
TORCHTITAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'torchtitan')


def ok(test, p):
    test.assertEqual(p.returncode, 0, p.stdout + p.stderr)
    return p.stdout + p.stderr


def mp_rank(folder):
    """The first mp_rank file of a Megatron-DeepSpeed folder, loaded."""
    return support.load(sorted(glob.glob(os.path.join(folder, 'mp_rank_*_model_states.pt')))[0])


def shard_groups(folder):
    """The base optimizer's param groups of every optimizer shard of a Megatron-DeepSpeed folder."""
    groups = []
    for f in sorted(glob.glob(os.path.join(folder, '*optim_states.pt'))):
        groups += support.load(f)['optimizer_state_dict']['base_optimizer_state']['param_groups']
    return groups


def common_state(root):
    """The common state a torch_dist root's save holds (Megatron-Core 0.19's common_state item)."""
    folder = glob.glob(os.path.join(root, 'iter_*'))[0]
    return support.distcp_items(folder)['common_state/shard_0_1'][0][1][0]


def edit_args(tag, **changes):
    """Rewrites the args of every mp_rank file of `tag` (None deletes a field)."""
    for f in glob.glob(os.path.join(tag, 'mp_rank_*_model_states.pt')):
        state = support.load(f)
        for name, value in changes.items():
            if value is None and hasattr(state['args'], name):
                delattr(state['args'], name)
            elif value is not None:
                setattr(state['args'], name, value)
        torch.save(state, f)


class TorchDistValuesTest(FixtureTestCase):

    def setUp(self):
        super().setUp()
        mf.install_pickle_shims()

    def round_trip(self, src, name, *extra_out, tp_out=2, tp_back=1):
        """src -> torch_dist at TP `tp_out` -> Megatron-DeepSpeed at TP `tp_back`, PP 1; (torch_dist, back,
        the export's notes)."""
        td, back = self.path(name + '_td'), self.path(name + '_back')
        notes = ok(self, run('export', src, td, '--to', 'torch_dist', '--tp', tp_out, '--pp', 1, *extra_out))
        ok(self, run('convert', '--to', 'deepspeed', td, back, '--tp', tp_back, '--pp', 1, '--dp', 1,
                     '--no-update-latest'))
        return td, back, notes

    def megatron_deepspeed_round_trip(self):
        """A Megatron-DeepSpeed Llama at TP 2 (iteration 100, BF16_Optimizer shards) -> torch_dist at TP 2
        -> Megatron-DeepSpeed at TP 1: (source, back)."""
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero',
                                                   iteration=100))
        _, back, _ = self.round_trip(src, 'ms')
        return src, back

    def test_the_padding_is_made_for_the_target_tp(self):
        src, back = self.megatron_deepspeed_round_trip()
        self.assertEqual(mp_rank(src)['args'].padded_vocab_size, 112)
        # 100 rows padded to a multiple of 8 x TP 1.
        state = mp_rank(back)
        self.assertEqual(state['args'].padded_vocab_size, 104)
        self.assertEqual(list(state['param_shapes'][0]['1.word_embeddings.weight']), [104, 48])
        self.assertIn('vocabulary 104 padded rows', run('inspect', back).stdout)

    def test_every_group_keeps_its_step(self):
        src, back = self.megatron_deepspeed_round_trip()
        self.assertEqual({g['step'] for g in shard_groups(src)}, {100})
        # In the group (DeepSpeed's FusedAdam) and in each state (torch's Adam).
        self.assertEqual([g.get('step') for g in shard_groups(back)], [100, 100])
        for f in glob.glob(os.path.join(back, '*optim_states.pt')):
            states = support.load(f)['optimizer_state_dict']['base_optimizer_state']['state']
            self.assertEqual({float(s['step']) for s in states.values()}, {100.0})

    def test_the_universal_checkpoint_version_is_written(self):
        src, back = self.megatron_deepspeed_round_trip()
        self.assertEqual(mp_rank(src)['universal_checkpoint_info']['universal_checkpoint_version'], 0.2)
        info = mp_rank(back)['universal_checkpoint_info']
        self.assertEqual((info.get('universal_checkpoint_version'), info['original_vocab_size']), (0.2, 100))

    def test_a_divisor_given_by_set_travels_in_the_args(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=1, dp=1))
        edit_args(src, make_vocab_size_divisible_by=None)
        td, back, _ = self.round_trip(src, 'set', '--set', 'make_vocab_size_divisible_by=8')
        self.assertEqual(common_state(td)['args'].make_vocab_size_divisible_by, 8)
        self.assertEqual(mp_rank(back)['args'].make_vocab_size_divisible_by, 8)
        self.assertEqual(mp_rank(back)['args'].padded_vocab_size, 104)

    def test_a_decay_megatron_core_does_not_apply_is_said(self):
        src = os.path.join(TORCHTITAN, 'fsdp2_w2', 'step-1')
        td, back, notes = self.round_trip(src, 'tt', '--set', 'num_attention_heads=4', tp_out=1, tp_back=1)
        self.assertIn('optimizer: the source decays its norms and biases too (weight_decay 0.1); Megatron-Core keeps '
                      'them in its wd_mult 0 group, whose decay its scheduler sets to weight_decay x wd_mult: a '
                      'resumed run does not decay them', notes)
        # Written as Megatron-Core writes its groups: the run's weight_decay, wd_mult 1 and 0.
        written = common_state(td)['optimizer']['optimizer']['param_groups']
        self.assertEqual([(g['wd_mult'], g['weight_decay']) for g in written], [(1.0, 0.1), (0.0, 0.1)])
        # A source whose groups say what Megatron-Core applies gets no such note.
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=1, pp=1, dp=1, optimizer='bf16_zero'))
        self.assertNotIn('decays its norms', self.round_trip(src, 'ms', tp_out=1)[2])

    def test_the_kv_group_count_is_written_from_every_source_that_knows_it(self):
        src = make_fixture(self.path('gqa'), **dict(FAMILIES['ms_llama'], tp=2, pp=1, dp=1))
        self.assertEqual(mp_rank(src)['args'].num_key_value_heads, 6)
        # A run whose args leave the groups None: --set gives them.
        edit_args(src, num_key_value_heads=None, group_query_attention=True)
        td, back, notes = self.round_trip(src, 'gqa', '--set', 'num_key_value_heads=6')
        self.assertIn('--group-query-attention --num-query-groups 6', notes)
        self.assertNotRegex(notes, r'--num-query-groups (0|None)')
        args = common_state(td)['args']
        self.assertEqual((args.group_query_attention, args.num_query_groups), (True, 6))
        self.assertEqual(mp_rank(back)['args'].num_key_value_heads, 6)
        p = run('verify', src, back, '--set', 'num_key_value_heads=6')
        self.assertEqual(re.findall(r'elements differ.*', p.stdout), [], p.stdout)


if __name__ == '__main__':
    support.main()
