"""`verify` compares any two checkpoints of one model, whatever their formats.

One source with optimizer state (a real Megatron-Core torch_dist save, its unrecorded values given once
at the conversions; a Megatron-DeepSpeed fixture, which records them) is converted into every format
reshard writes; then every pair of the outputs, and each against the source, must be the same model:

* weights always, optimizer state where both sides carry it (a weights-only side is a note);
* run state one side does not record (an HF folder's iteration, a torch_dist save's scheduler and
  counters) is a note naming it, not a difference;
* one element of one tensor changed in one output: DIFFERENT, naming that tensor.

Run: /usr/bin/python3 tests/interop/test_verify_formats.py --reshard build/reshard
"""
import itertools
import json
import os
import struct

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
from megatron_core_data import DATA

run = support.reshard
TORCH_DIST = os.path.join(DATA, '0.19', 'w2_tp2_swiglu_optim_fully_reshardable')
# What the torch_dist save does not record; verify of a side that does not record them either needs them.
TORCH_DIST_VALUES = ('--set', 'args.num_attention_heads=4', '--set', 'args.num_key_value_heads=2',
                     '--set', 'max_position_embeddings=8', '--set', 'layernorm_epsilon=1e-5')
# Every format reshard writes, with the layout sizes it needs.
TARGETS = {
    'deepspeed': ('--tp', 1, '--pp', 1, '--no-update-latest'),
    'universal': (),
    'megatron': ('--tp', 1, '--pp', 1),
    'torch_dist': ('--tp', 1, '--pp', 1),
    'torchtitan': ('--dp-shard', 1),
    'hf': (),
    'consolidated': (),
}
WEIGHTS_ONLY = ('hf', 'consolidated')


class VerifyFormatsTest(FixtureTestCase):

    def outputs(self, src, *values):
        """{format: folder} of `src` converted into every format."""
        out = {}
        for to, extra in TARGETS.items():
            folder = self.path(to)
            p = run('convert', src, folder, '--to', to, *extra, *values)
            self.assertEqual(p.returncode, 0, to + ': ' + p.stdout + p.stderr)
            out[to] = folder
        return out

    def assertEveryPairSame(self, checkpoints, *values):
        """Every pair of {label: folder} is the same model; returns how many pairs were compared."""
        pairs = 0
        for (la, a), (lb, b) in itertools.combinations(sorted(checkpoints.items()), 2):
            with self.subTest(a=la, b=lb):
                p = run('verify', a, b, *values)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                if (la in WEIGHTS_ONLY) != (lb in WEIGHTS_ONLY):
                    self.assertIn('optimizer not compared', p.stdout)
                else:
                    self.assertNotIn('optimizer not compared', p.stdout)
                pairs += 1
        return pairs

    def test_a_torch_dist_save_in_every_format(self):
        # The targets at TP 1 pad the vocabulary for TP 1 (the save's is TP 2's): its divisor too.
        outputs = self.outputs(TORCH_DIST, *TORCH_DIST_VALUES, '--set', 'make_vocab_size_divisible_by=16',
                               '--vocab-size', 64)
        p = run('verify', outputs['hf'], TORCH_DIST, *TORCH_DIST_VALUES)
        self.assertIn("iteration not compared: only B records it (hf does not)", p.stdout)
        self.assertNotIn('differs', p.stdout)
        p = run('verify', outputs['deepspeed'], outputs['torch_dist'], *TORCH_DIST_VALUES)
        self.assertIn('lr_scheduler, global_samples, skipped_steps not compared: only A records them '
                      '(torch_dist does not)', p.stdout)
        pairs = self.assertEveryPairSame(dict(outputs, source=TORCH_DIST), *TORCH_DIST_VALUES)
        print(f'\n[ torch_dist ] {pairs} pairs of {len(outputs) + 1} checkpoints: same model')
        self.assertChangedElementIsFound(outputs['hf'], outputs['torch_dist'], *TORCH_DIST_VALUES)

    def test_a_megatron_deepspeed_run_in_every_format(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        outputs = self.outputs(src)
        pairs = self.assertEveryPairSame(dict(outputs, source=src))
        print(f'\n[ Megatron-DeepSpeed ] {pairs} pairs of {len(outputs) + 1} checkpoints: same model')

    def assertChangedElementIsFound(self, hf, other, *values):
        """One element of one tensor of the HF folder changed: verify against `other` says DIFFERENT
        and names that tensor."""
        path = os.path.join(hf, 'model.safetensors')
        with open(path, 'r+b') as f:
            (n,) = struct.unpack('<Q', f.read(8))
            header = json.loads(f.read(n))
            begin, _ = header['model.norm.weight']['data_offsets']
            f.seek(8 + n + begin)
            (x,) = struct.unpack('<f', f.read(4))
            f.seek(8 + n + begin)
            f.write(struct.pack('<f', x + 1.0))
        p = run('verify', hf, other, *values)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('DIFFERENT', p.stdout)
        self.assertIn('final_layernorm.weight', p.stdout)
        self.assertIn('1 of 16 elements differ', p.stdout)


if __name__ == '__main__':
    support.main()
