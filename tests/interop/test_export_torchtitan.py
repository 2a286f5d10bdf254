"""`export --to torchtitan --dp-shard N` (engine/formats/hf/torchtitan_export.h): a torchtitan
checkpoint (`OUT/step-N/`, FSDP2 `Shard(0)` over N ranks) with its AdamW state.

Checked:

* a real torch 2.6 torchtitan save (tests/data/torchtitan/fsdp2_w2) exported at --dp-shard 1 and 3
  has the save's model and `optimizer.state` keys with the same global shapes and dtypes, each
  tensor cut as torch.chunk cuts dim 0 (the step one chunk), and the param groups' items; `verify`
  finds it the same model as the save, and its `export --to hf` equals the save's byte for byte;
* real torch 2.6 (the Debian trixie chroot, torch2_chroot.py; skipped with one line when it cannot
  be built) `dcp.load`s the output into the save's own model (tests/fixtures/torchtitan_save.py)
  in one process and under FSDP2 over 2 ranks, with tensors equal to the save's, and one more
  AdamW step from the loaded model and optimizer reaches the loss the save's run reached;
* a Megatron-DeepSpeed Llama with BF16 ZeRO shards -> torchtitan -> convert back at its layout:
  every fp32 master, exp_avg and exp_avg_sq equal the source's (through `export --to universal`),
  the weights are the masters (the source's bf16 weights are those cast), `verify` finds the
  torchtitan folder and the converted one the same model;
* what cannot be written is refused in one line, nothing written.

Run: /usr/bin/python3 tests/interop/test_export_torchtitan.py --reshard build/reshard
"""
import filecmp
import os
import re

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture

run = support.reshard
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'torchtitan')
SAVE = os.path.join(DATA, 'fsdp2_w2', 'step-1')
HEADS = ('--set', 'num_attention_heads=4')
TENSOR_LINE = re.compile(r'^  (\S+) (\w+)\[([0-9, ]*)\], (\d+) chunks?:? ?(.*)$')


def dcp_tensors(folder):
    """{key: (dtype, shape, [(offsets, sizes), ...])} as `inspect --rules none` lists a DCP folder."""
    p = run('inspect', folder, '--rules', 'none')
    assert p.returncode == 0, p.stdout + p.stderr
    out = {}
    for line in p.stdout.splitlines():
        m = TENSOR_LINE.match(line)
        if m:
            shape = [int(d) for d in m.group(3).split(',') if d.strip()]
            chunks = [([int(x) for x in re.findall(r'\d+', at)], [int(x) for x in re.findall(r'\d+', size)])
                      for at, size in re.findall(r'\[([0-9, ]*)\]\+\[([0-9, ]*)\]', m.group(5))]
            out[m.group(1)] = (m.group(2), shape, chunks)
    return out


def saved(key):
    """The keys a torchtitan export carries: the model and the AdamW state."""
    return not key.startswith(('lr_scheduler.', 'train_state.', 'dataloader.'))


def chunk_rows(rows, n):
    """The rows of each non-empty share of torch.chunk over n (what DTensor's Shard(0) holds)."""
    return [len(c) for c in torch.arange(rows).chunk(n)]


class ExportTorchtitanTest(FixtureTestCase):

    def export(self, src, out, n, *extra):
        p = run('export', src, out, '--to', 'torchtitan', '--dp-shard', n, *extra)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def test_a_torchtitan_save_round_trips_at_any_world_size(self):
        want = {k: v for k, v in dcp_tensors(SAVE).items() if saved(k)}
        hf_src = self.path('hf_src')
        p = run('export', SAVE, hf_src, '--to', 'hf', *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for n in (1, 3):
            with self.subTest(dp_shard=n):
                out = self.path(f'tt{n}')
                self.export(SAVE, out, n, *HEADS)
                self.assertEqual(sorted(os.listdir(os.path.join(out, 'step-1'))),
                                 ['.metadata'] + [f'__{r}_0.distcp' for r in range(n)])
                got = dcp_tensors(os.path.join(out, 'step-1'))
                self.assertEqual(sorted(got), sorted(want))
                for key, (dtype, shape, chunks) in got.items():
                    self.assertEqual((dtype, shape), want[key][:2], key)
                    if not shape:  # a step: one 0-d chunk
                        self.assertEqual(len(chunks), 1, key)
                        continue
                    self.assertEqual([size[0] for at, size in chunks], chunk_rows(shape[0], n), key)
                    self.assertEqual([at[0] for at, size in chunks],
                                     [sum(chunk_rows(shape[0], n)[:i]) for i in range(len(chunks))], key)
                p = run('inspect', os.path.join(out, 'step-1'), '--rules', 'none')
                groups = set(re.findall(r'optimizer\.param_groups\.tok_embeddings\.weight\.(\w+)', p.stdout))
                self.assertEqual(groups, {'lr', 'initial_lr', 'betas', 'eps', 'weight_decay', 'amsgrad', 'foreach',
                                          'maximize', 'capturable', 'differentiable', 'fused'})
                p = run('verify', SAVE, os.path.join(out, 'step-1'), *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                hf_out = self.path(f'hf{n}')
                p = run('export', os.path.join(out, 'step-1'), hf_out, '--to', 'hf', *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                for name in ('model.safetensors', 'config.json'):
                    self.assertTrue(filecmp.cmp(os.path.join(hf_src, name), os.path.join(hf_out, name), shallow=False),
                                    name)
        print(f'\n[ torchtitan ] {len(want)} keys, shapes, dtypes and torch.chunk shares at dp_shard 1 and 3; '
              f'same model; HF export byte-equal')

    def test_megatron_deepspeed_to_torchtitan_and_back(self):
        src = make_fixture(self.path('ms'), **dict(FAMILIES['ms_llama'], tp=2, pp=2, dp=1, optimizer='bf16_zero'))
        tt = self.path('tt')
        p = self.export(src, tt, 2)
        self.assertIn('39 of 39 tensors from the fp32 masters', p.stdout + p.stderr)
        step = os.path.join(tt, 'step-10')
        heads = ('--set', 'num_attention_heads=12')
        back = self.path('back')
        p = run('convert', step, back, '--tp', 2, '--pp', 2, '--dp', 1, '--no-update-latest', *heads,
                '--set', 'make_vocab_size_divisible_by=8')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', step, back, *heads)
        self.assertIn('same model', p.stdout, p.stdout + p.stderr)
        # The weights: the masters, which the source's bf16 weights are cast from.
        for name, folder, extra in (('c_src', src, ()), ('c_back', back, ('--dtype', 'bf16'))):
            p = run('export', folder, self.path(name), '--to', 'consolidated', '--from', 'weights', *extra)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertTrue(filecmp.cmp(self.path('c_src', 'model.safetensors'), self.path('c_back', 'model.safetensors'),
                                    shallow=False))
        # Every optimizer state, through the universal export (the true vocabulary rows: the
        # source's padding rows are not the model's).
        for name, folder in (('u_src', src), ('u_back', back)):
            p = run('export', folder, self.path(name), '--to', 'universal')
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        params = sorted(p for p in os.listdir(self.path('u_src', 'zero')) if os.path.isdir(self.path('u_src', 'zero', p)))
        self.assertEqual(params, sorted(p for p in os.listdir(self.path('u_back', 'zero'))
                                        if os.path.isdir(self.path('u_back', 'zero', p))))
        compared = 0
        for param in params:
            for state in ('fp32', 'exp_avg', 'exp_avg_sq'):
                a = support.load(self.path('u_src', 'zero', param, state + '.pt'))['param']
                b = support.load(self.path('u_back', 'zero', param, state + '.pt'))['param']
                if 'word_embeddings' in param:
                    a, b = a[:100], b[:100]
                self.assertTrue(torch.equal(a, b), f'{param} {state}')
                compared += 1
        self.assertEqual(compared, 3 * len(params))
        print(f'\n[ fixture ] Megatron-DeepSpeed -> torchtitan -> Megatron-DeepSpeed: {compared} optimizer '
              f'states equal, weights the masters')

    def test_refusals(self):
        out = self.path('refused')
        p = run('export', SAVE, out, '--to', 'torchtitan', *HEADS)
        self.assertRefused(p, 'needs --dp-shard N', out)
        p = run('export', SAVE, out, '--to', 'torchtitan', '--dp-shard', 2, '--tp', 2, *HEADS)
        self.assertRefused(p, 'leave out --tp and --pp', out)
        p = run('export', SAVE, out, '--to', 'hf', '--dp-shard', 2, *HEADS)
        self.assertRefused(p, '--dp-shard chooses the FSDP2 sharding of --to torchtitan', out)
        p = run('export', SAVE, out, '--to', 'torchtitan', '--dp-shard', 2, '--dtype', 'bf16', *HEADS)
        self.assertRefused(p, 'add --weights-only', out)
        gpt = make_fixture(self.path('gpt'), **dict(FAMILIES['ms_gpt2'], tp=1, pp=1, dp=1))
        p = run('export', gpt, out, '--to', 'torchtitan', '--dp-shard', 2)
        self.assertRefused(p, 'has none', out)
        # Weights only: no optimizer key.
        self.export(SAVE, out, 2, '--weights-only', *HEADS)
        self.assertFalse([k for k in dcp_tensors(os.path.join(out, 'step-1')) if k.startswith('optimizer.')])


if __name__ == '__main__':
    support.main()
