"""Any PyTorch Distributed Checkpoint folder as a source: `inspect`, `lint`, `verify` and
`export --to consolidated`; a Megatron-Core `torch_dist` save read so with `--rules none` (without it,
its family's rules read it: test_torch_dist_import.py).

The sources are real saves (tests/data/dcp: torch 2.6 `dcp.save` in one process and two, DTensors
cut by row, by column, unevenly, replicated; tests/data/megatron-core: Megatron-Core 0.19 and 0.14
`torch_dist` saves at TP 1 / 2 and PP 2, fp32 and bf16, with and without optimizer state). Each
comes with `NAME_full.pt`, every tensor whole as `dcp.load` gives it back, written by torch itself,
not by reshard. Checked:

* the consolidated export (`--format pt`, read back with torch.load) holds every tensor item
  whole, bit for bit and in its dtype, under its key; the bytes items (plain objects) are not
  tensors and are left out;
* a Megatron-LM root (`latest_checkpointed_iteration.txt` beside `iter_0000010/`) opens the
  iteration it names, a `torch_dist` folder (`metadata.json`) says so;
* `inspect` lists every tensor with its chunks; `lint` says convert needs a rule set, and convert
  refuses in one line without writing anything; `verify` finds a save equal to itself and its
  consolidated export's tensors;
* a damaged save (a `.distcp` file cut short) is refused in one line naming the file.

Run: /usr/bin/python3 tests/interop/test_dcp_source.py --reshard build/reshard
"""
import glob
import os
import shutil

import torch

import interop_support as support
from interop_support import FixtureTestCase

run = support.reshard
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data')


def saves():
    """(folder, reference tensors by key) of every real save with a reference."""
    out = []
    for folder in sorted(glob.glob(os.path.join(DATA, 'dcp', '*', '')) +
                         glob.glob(os.path.join(DATA, 'megatron-core', '*', '*', ''))):
        folder = folder.rstrip('/')
        name = os.path.basename(folder)
        for suffix in ('_optim_fully_reshardable', '_optim_dp_reshardable', '_optim_dp_zero_gather_scatter',
                       '_optim_fully_sharded_model_space'):
            if name.endswith(suffix):
                name = name[:-len(suffix)] + '_optim'
        reference = os.path.join(os.path.dirname(folder), name + '_full.pt')
        if os.path.exists(reference):
            out.append((folder, reference))
    return out


def reference_tensors(path):
    """The {key: tensor} a reference holds: flat, or under 'tensors' (torch saves) or 'model'."""
    full = torch.load(path, map_location='cpu')
    for nest in ('tensors', 'model'):
        if nest in full:
            return full[nest]
    return full


class DcpSourceTest(FixtureTestCase):

    def test_every_real_save_exports_its_tensors_whole(self):
        found = saves()
        self.assertGreaterEqual(len(found), 10)
        for folder, reference in found:
            with self.subTest(save=os.path.relpath(folder, DATA)):
                out = self.path(os.path.relpath(folder, DATA).replace('/', '_'))
                p = run('export', folder, out, '--to', 'consolidated', '--format', 'pt', '--rules', 'none')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got = torch.load(os.path.join(out, 'pytorch_model.bin'), map_location='cpu')
                want = reference_tensors(reference)
                compared = 0
                for key, tensor in want.items():
                    if not isinstance(tensor, torch.Tensor):
                        continue
                    self.assertIn(key, got)
                    self.assertEqual(support.differences(got[key], tensor, key), [])
                    compared += 1
                self.assertGreater(compared, 0)
                self.assertTrue(all(isinstance(v, torch.Tensor) for v in got.values()))

    def test_inspect_lint_convert_and_verify(self):
        folder = os.path.join(DATA, 'dcp', 'world2_dtensor')
        p = run('inspect', folder)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('7 tensors in 10 chunks', p.stdout)
        self.assertIn('w_uneven float32[5, 7], 2 chunks: [0, 0]+[3, 7] [3, 0]+[2, 7]', p.stdout)
        self.assertIn('w_col float32[8, 6], 2 chunks: [0, 0]+[8, 3] [0, 3]+[8, 3]', p.stdout)
        self.assertIn('meta.step', p.stdout)
        p = run('lint', folder)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('read without a rule set', p.stdout)
        out = self.path('converted')
        p = run('convert', '--to', 'deepspeed', folder, out, '--tp', 1, '--pp', 1)
        self.assertRefused(p, 'is a Distributed Checkpoint read without a rule set', out)
        p = run('verify', folder, folder)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)

    def test_a_megatron_lm_root_opens_the_iteration_it_names(self):
        root = self.path('root')
        shutil.copytree(os.path.join(DATA, 'megatron-core', '0.19', 'w2_tp2'), os.path.join(root, 'iter_0000010'))
        with open(os.path.join(root, 'latest_checkpointed_iteration.txt'), 'w') as f:
            f.write('10\n')
        p = run('inspect', root, '--rules', 'none')
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('checkpoint: ' + os.path.join(root, 'iter_0000010'), p.stdout)
        self.assertIn('Megatron-Core torch_dist checkpoint; iteration 10; 16 tensors in 42 chunks', p.stdout)
        p = run('inspect', root)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('Megatron-Core torch_dist checkpoint; iteration 10 (2 .distcp files)', p.stdout)
        p = run('export', root, self.path('whole'), '--to', 'consolidated', '--format', 'pt', '--rules', 'none')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(len(torch.load(self.path('whole', 'pytorch_model.bin'))), 16)

    def test_an_export_that_needs_rules_says_why_none_read_the_save(self):
        # A --set no rule set reads makes every family refuse the save: the export names that, as
        # a torch_dist refusal (read as plain DCP, the save would take no --set at all).
        save = os.path.join(DATA, 'megatron-core', '0.19', 'w2_tp2')
        for to, layout in (('hf', ()), ('torch_dist', ('--tp', 1, '--pp', 1)), ('megatron', ('--tp', 1, '--pp', 1))):
            with self.subTest(to=to):
                out = self.path('out_' + to)
                p = run('export', save, out, '--to', to, *layout, '--set', 'no_such_arg=1')
                self.assertRefused(p, '--set args.no_such_arg: rule set megatron-core-gpt reads no such value', out)
                self.assertIn('no built-in rule set reads this torch_dist checkpoint', p.stderr)

    def test_an_iteration_past_int64_in_a_folder_name_is_no_iteration(self):
        folder = self.path('iter_' + '9' * 25)
        shutil.copytree(os.path.join(DATA, 'megatron-core', '0.19', 'w2_tp2'), folder)
        p = run('inspect', folder, '--rules', 'none')
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('Megatron-Core torch_dist checkpoint; 16 tensors', p.stdout)

    def test_a_damaged_save_is_refused_in_one_line(self):
        folder = self.path('cut')
        shutil.copytree(os.path.join(DATA, 'megatron-core', '0.19', 'w2_tp2'), folder)
        data = os.path.join(folder, '__1_0.distcp')
        os.chmod(data, 0o644)
        with open(data, 'r+b') as f:
            f.truncate(os.path.getsize(data) // 2)
        p = run('inspect', folder)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn('__1_0.distcp', p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)


if __name__ == '__main__':
    support.main()
