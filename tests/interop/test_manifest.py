"""The manifest every output carries, and `reshard verify OUT` alone.

* convert, export --to universal and export --to consolidated write reshard-manifest.json into
  their output: the tool, the command line, the source, and every file with its size and the
  CRC-32 computed while it was written -- checked here against the files on disk (zlib), so
  nothing is missing, added or miscounted; the same under `mpirun -np 2`, where each process
  writes part of the files;
* `reshard verify OUT` accepts what reshard wrote and reports, one line each, a changed byte
  inside a tensor (same size), a truncated file, a missing and an added file, with exit 1;
  a folder without a manifest is refused with exit 2.

Run: /usr/bin/python3 tests/interop/test_manifest.py --reshard build/reshard
"""
import json
import os
import shutil
import subprocess
import zlib

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture

run = support.reshard
LAYOUT = ('--tp', 1, '--pp', 4, '--dp', 4)


def files_under(folder):
    out = set()
    for dirpath, _, names in os.walk(folder):
        out.update(os.path.relpath(os.path.join(dirpath, n), folder) for n in names)
    return out


class ManifestTest(FixtureTestCase):

    def setUp(self):
        super().setUp()
        self.src = make_fixture(self.path('in'), tp=2, pp=2, dp=2, **dict(FAMILIES['ms_gpt2'], optimizer='bf16_zero'))

    def assert_manifest_describes(self, folder, command):
        with open(os.path.join(folder, 'reshard-manifest.json')) as f:
            manifest = json.load(f)
        self.assertTrue(manifest['tool'].startswith('reshard '), manifest['tool'])
        self.assertIn(command, manifest['command'])
        self.assertEqual(manifest['source'], os.path.realpath(self.src))
        listed = {f['name']: f for f in manifest['files']}
        self.assertEqual(set(listed), files_under(folder) - {'reshard-manifest.json'})
        for name, entry in listed.items():
            with open(os.path.join(folder, name), 'rb') as f:
                data = f.read()
            self.assertEqual(entry['bytes'], len(data), name)
            self.assertEqual(entry['crc32'], f'{zlib.crc32(data):08x}', name)
        p = run('verify', folder)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn(f'{len(listed)} files', p.stdout)

    def test_every_output_carries_a_true_manifest(self):
        out = self.path('out', 'global_step10')
        self.assertEqual(run('convert', self.src, out, *LAYOUT, '-q').returncode, 0)
        self.assert_manifest_describes(out, 'convert')
        self.assertIn('and consistent', run('verify', self.path('out')).stdout)  # the root's latest is followed
        universal = self.path('out', 'global_step10_universal')
        self.assertEqual(run('export', self.src, universal, '--to', 'universal', '-q').returncode, 0)
        self.assert_manifest_describes(universal, '--to universal')
        consolidated = self.path('model')
        self.assertEqual(run('export', self.src, consolidated, '--to', 'consolidated', '--max-shard-size', '200KB',
                             '-q').returncode, 0)
        self.assert_manifest_describes(consolidated, '--to consolidated')

    def test_processes_of_an_mpi_run_share_one_manifest(self):
        out = self.path('mpi', 'global_step10')
        p = subprocess.run(['mpirun', '--allow-run-as-root', '--oversubscribe', '-np', '2', support.RESHARD,
                            'convert', self.src, out, *map(str, LAYOUT), '-q'], capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assert_manifest_describes(out, 'convert')

    def test_verify_reports_each_change(self):
        out = self.path('out', 'global_step10')
        self.assertEqual(run('convert', self.src, out, *LAYOUT, '-q').returncode, 0)
        damaged = self.path('damaged', 'global_step10')
        shutil.copytree(out, damaged)
        layer = os.path.join(damaged, 'layer_03-model_00-model_states.pt')
        with open(layer, 'r+b') as f:  # one byte inside a tensor record: same size, another CRC
            f.seek(os.path.getsize(layer) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        with open(os.path.join(damaged, 'layer_04-model_00-model_states.pt'), 'r+b') as f:
            f.truncate(100)
        os.remove(os.path.join(damaged, 'mp_rank_03_model_states.pt'))
        with open(os.path.join(damaged, 'notes.txt'), 'w') as f:
            f.write('added')
        p = run('verify', damaged)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('layer_03-model_00-model_states.pt: its CRC-32 differs from the manifest', p.stdout)
        self.assertIn('layer_04-model_00-model_states.pt has 100 bytes', p.stdout)
        self.assertIn('mp_rank_03_model_states.pt is missing', p.stdout)
        self.assertIn('notes.txt is not in the manifest', p.stdout)
        self.assertIn('DIFFERENT', p.stdout)

    def test_a_folder_without_manifest_is_refused(self):
        p = run('verify', self.src)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn('has no reshard-manifest.json', p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1)


if __name__ == '__main__':
    support.main()
