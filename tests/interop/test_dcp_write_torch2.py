"""Distributed Checkpoints written by reshard, loaded by real torch 2.6.

The unit test PlanWriterTest.WritesADistributedCheckpointForTorch writes, through the plan writer,
two folders (run with RESHARD_DCP_WRITE_DIR): `dcp`, two `.distcp` files and their `.metadata`
(fp32 rows cut unevenly, 5 as 3 + 2; bf16 columns; a 3-d tensor cut on its last axis; fp16, int64
and 0-d tensors whole; a plain int, a float saved from a nested dict, a dict of a list), and
`dcp_zip64`, the same with every tensor record written as ZIP64's. Torch 2.6, in a Debian trixie
chroot (torch2_chroot.py; skipped with one line when it cannot be built), must then:

* `pickle.load` the `.metadata` into a Metadata, and read it with `FileSystemReader.read_metadata`:
  every key, dtype, size and chunk as written;
* `dcp.load` it in one process into preallocated tensors: every value equal to the pattern
  written (`torch.arange(numel) * scale + shift`), the objects too;
* convert it with `format_utils.dcp_to_torch_save`, nesting the float under its planner path.

Run: /usr/bin/python3 tests/interop/test_dcp_write_torch2.py --reshard build/reshard
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import interop_support as support
import torch2_chroot

# Run by torch 2.6 in the chroot with the written folders under /data; FOLDER is set before it.
CHECK = r'''
import pickle, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

def pattern(shape, dtype, scale, shift):
    """What reshard's PatternProducer wrote: element i of the whole tensor is i * scale + shift."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) * scale + shift).to(dtype).reshape(shape)

TENSORS = {'w_uneven': pattern((5, 7), torch.float32, 1, 0),
           'w_col': pattern((6, 10), torch.bfloat16, 1, -30),
           'cube': pattern((2, 3, 4), torch.float32, 0.25, 0),
           'half': pattern((3, 4), torch.float16, 0.5, 0),
           'ids': torch.arange(4, dtype=torch.int64) * 2**40 - 10**12,
           'scalar': torch.tensor(2.5)}
OBJECTS = {'step': 7, 'optim.lr': 0.001, 'note': {'list': [1, 2.5, 'x', None, (3, 4)]}}
CHUNKS = {'w_uneven': [([0, 0], [3, 7]), ([3, 0], [2, 7])], 'w_col': [([0, 0], [6, 5]), ([0, 5], [6, 5])],
          'cube': [([0, 0, 0], [2, 3, 2]), ([0, 0, 2], [2, 3, 2])], 'half': [([0, 0], [3, 4])],
          'ids': [([0], [4])], 'scalar': [([], [])]}

with open(FOLDER + '/.metadata', 'rb') as f:
    raw = pickle.load(f)
assert isinstance(raw, Metadata), type(raw)
meta = FileSystemReader(FOLDER).read_metadata()
assert sorted(meta.state_dict_metadata) == sorted([*TENSORS, *OBJECTS]), sorted(meta.state_dict_metadata)
for k, t in TENSORS.items():
    m = meta.state_dict_metadata[k]
    assert isinstance(m, TensorStorageMetadata), (k, m)
    assert m.size == t.shape and m.properties.dtype == t.dtype, (k, m)
    chunks = sorted((list(c.offsets), list(c.sizes)) for c in m.chunks)
    assert chunks == sorted(CHUNKS[k]), (k, chunks)
for k in OBJECTS:
    assert isinstance(meta.state_dict_metadata[k], BytesStorageMetadata), k
assert meta.planner_data['optim.lr'] == ('optim', 'lr'), meta.planner_data

state = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in TENSORS.items()}
state.update({'step': 0, 'optim': {'lr': 0.0}, 'note': None})
dcp.load(state, checkpoint_id=FOLDER)  # no process group: one process
for k, t in TENSORS.items():
    assert state[k].dtype == t.dtype and torch.equal(state[k], t), (k, state[k], t)
assert (state['step'], state['optim'], state['note']) == (7, {'lr': 0.001}, OBJECTS['note']), state

dcp_to_torch_save(FOLDER, FOLDER + '.pt')
full = torch.load(FOLDER + '.pt', weights_only=False)
assert sorted(full) == sorted([*TENSORS, 'step', 'optim', 'note']), sorted(full)
for k, t in TENSORS.items():
    assert full[k].dtype == t.dtype and torch.equal(full[k], t), k
assert (full['step'], full['optim'], full['note']) == (7, {'lr': 0.001}, OBJECTS['note']), full
print(f'torch {torch.__version__}, {FOLDER}: pickle.load, read_metadata, dcp.load and dcp_to_torch_save '
      f'give {len(TENSORS)} tensors and {len(OBJECTS)} objects as written')
'''


class DcpWriteTorch2Test(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.root = torch2_chroot.root_or_skip()
        # The unit tests are built beside the binary: build/tests/unit_tests.
        unit_tests = os.path.join(os.path.dirname(support.RESHARD), 'tests', 'unit_tests')
        cls.work = tempfile.mkdtemp(prefix='reshard-dcp-write-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        p = subprocess.run([unit_tests, '--gtest_filter=PlanWriterTest.WritesADistributedCheckpointForTorch'],
                           env={**os.environ, 'RESHARD_DCP_WRITE_DIR': cls.work}, capture_output=True, text=True,
                           timeout=120)
        if p.returncode or not os.path.exists(os.path.join(cls.work, 'dcp', '.metadata')):
            raise AssertionError(f'{unit_tests} did not write the checkpoints:\n' + p.stdout + p.stderr)

    def check(self, folder):
        p = torch2_chroot.run(self.root, f'FOLDER = {"/data/" + folder!r}\n' + CHECK, {self.work: '/data'})
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        print(p.stdout.strip(), file=sys.stderr)

    def test_torch_loads_what_reshard_wrote(self):
        self.check('dcp')

    def test_torch_reads_zip64_items(self):
        self.check('dcp_zip64')


if __name__ == '__main__':
    support.main()
