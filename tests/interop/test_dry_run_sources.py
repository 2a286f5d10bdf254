"""`--dry-run` says where every planned tensor comes from, for every target and source kind.

Each planned tensor line of a dry run (`    KEY DTYPE[SHAPE]: FROM`) names its source: the
canonical tensor, its TP policy and the source boxes it is cut from; a DCP chunk of
dp_reshardable buckets names the parameter piece (or the alignment zeros) it holds; a ZeRO
partition's tensors point at the group lines that lay it out. Cases: a Megatron-DeepSpeed
source (TP 2, PP 2, DP 2, bf16 ZeRO) to deepspeed, universal, megatron, torch_dist (both 0.19
layouts and 0.14's), consolidated; a Megatron-Core 0.19 save to torchtitan and hf; DeepSpeed MoE
with an EP and a TP change; non-pipeline ZeRO-2 and ZeRO-3 with a DP change.

Run: /usr/bin/python3 tests/interop/test_dry_run_sources.py --reshard build/reshard
"""
import os
import re

import interop_support as support
from interop_support import FixtureTestCase, make_fixture
from fixtures import deepspeed_nonpipe as dn
from megatron_core_data import DATA, sizes, config_of

TENSOR_LINE = re.compile(r'^    (\S.*) [a-z]+[0-9]*\[[0-9, ]*\](?:: (.+))?$')
MOE = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'deepspeed_moe')


class DryRunSourcesTest(FixtureTestCase):
    def dry_run(self, src, *args):
        """{tensor key: its source} of the dry run of `convert SRC OUT *args`, at least one tensor."""
        p = support.reshard('convert', src, self.path('out'), *args, '--dry-run')
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertFalse(os.path.exists(self.path('out')))
        tensors = {}
        for line in p.stdout.splitlines():
            m = TENSOR_LINE.match(line)
            if m:
                tensors.setdefault(m.group(1), m.group(2))
        self.assertTrue(tensors, p.stdout)
        unsaid = [key for key, source in tensors.items() if not source]
        self.assertEqual(unsaid, [], f'convert {src} {" ".join(args)}: tensors whose source the plan does not say')
        return tensors

    def test_megatron_deepspeed_to_every_target(self):
        src = make_fixture(self.path('src'), **dict(support.FAMILIES['ms_gpt2'], optimizer='bf16_zero',
                                                     tp=2, pp=2, dp=2))
        self.dry_run(src, '--tp', '1', '--pp', '1')
        self.dry_run(src, '--to', 'universal')
        self.dry_run(src, '--to', 'megatron', '--tp', '1', '--pp', '1')
        self.dry_run(src, '--to', 'consolidated')
        full = self.dry_run(src, '--to', 'torch_dist', '--tp', '1', '--pp', '1')
        self.assertRegex(full['embedding.word_embeddings.weight'],
                         r'^embedding\.word_embeddings\.weight \(vocab\): \[0,\d+\) <- tp0\[0,\d+\), \[\d+,\d+\) <- tp1')
        buckets = self.dry_run(src, '--to', 'torch_dist', '--tp', '1', '--pp', '1',
                               '--optimizer-layout', 'dp_reshardable')
        bucket_sources = [s for k, s in buckets.items() if k.startswith('optimizer.distributed.')]
        self.assertTrue(any(s == 'zeros (bucket alignment)' for s in bucket_sources), bucket_sources)
        self.assertTrue(any(re.search(r'\(optimizer fp32\), elements \[\d+,\d+\)$', s) for s in bucket_sources))
        self.dry_run(src, '--to', 'torch_dist', '--tp', '2', '--pp', '1', '--megatron-core-version', '0.14')

    def test_megatron_core_to_torchtitan_and_hf(self):
        args = [os.path.join(DATA, '0.19', 'w2_tp2_swiglu_optim_fully_reshardable')] + sizes(config_of('0.19/w2_tp2_swiglu'))
        titan = self.dry_run(*args, '--to', 'torchtitan', '--dp-shard', '2')
        wq = [source for key, source in titan.items() if key.startswith('layers.0.attention.wq.weight')]
        self.assertTrue(wq and all(source.endswith(', heads interleaved') for source in wq), wq)
        self.dry_run(*args, '--to', 'hf', '--set', 'max_position_embeddings=32', '--set', 'layernorm_epsilon=1e-5')

    def test_moe_expert_and_tensor_parallel_changes(self):
        src, rules = os.path.join(MOE, 'pipe_pp2_ep2_dp2'), os.path.join(MOE, 'toy-moe-pipe.yaml')
        same_tp = self.dry_run(src, '--rules', rules, '--ep', '1')
        self.assertTrue(all(s.startswith('mp_rank_0') or s.startswith('layer_') or s.startswith('the optimizer')
                            or s.startswith('as ') for s in same_tp.values()), same_tp)
        cut = self.dry_run(src, '--rules', rules, '--tp', '2')
        self.assertTrue(any('<- tp0' in s for s in cut.values()), cut)

    def test_non_pipeline_dp_changes(self):
        for stage in (2, 3):
            with self.subTest(zero_stage=stage):
                src = self.path(f'zero{stage}')
                dn.write_nonpipe(src, dn.NonPipeConfig(zero_stage=stage, dp=2))
                tensors = self.dry_run(src, '--dp', '1')
                if stage == 3:
                    flats = [s for k, s in tensors.items() if 'fp32_flat_groups' in k]
                    self.assertTrue(flats and all(s.startswith('optimizer fp32: slice 0 of 1 of each of ')
                                                  for s in flats), flats)


if __name__ == '__main__':
    support.main()
