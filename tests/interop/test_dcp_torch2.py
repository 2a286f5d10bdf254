"""Fresh PyTorch Distributed Checkpoints written by real torch 2.6, read by reshard.

The committed saves (test_dcp_source.py) are fixed; this test makes new ones each run with
`torch.distributed.checkpoint.save` in a Debian trixie chroot (torch2_chroot.py; built once per
machine, skipped with one line when it cannot be):

* `single`: one process, no process group: fp32 (with -0.0 and infinities), bf16, fp16, int64, a 0-d
  tensor, a non-contiguous view, a nested dict, and plain objects;
* `world2`: two processes (gloo): DTensors on a 1-D mesh of 2 cut by row, by column, unevenly
  (7 rows as 4 + 3; 1 row as 1 + 0), replicated, and on a 2x1 mesh as [Shard(0), Shard(1)].

Torch loads each save back with `dcp.load` in one process, checks it against the tensors it saved,
and `torch.save`s them beside it. On the host, `reshard export --to consolidated --format pt` must
give every tensor bit for bit (dtype and shape too), and `reshard inspect` must list every key, with
as many chunks for each DTensor as it has distinct shards.

Run: /usr/bin/python3 tests/interop/test_dcp_torch2.py --reshard build/reshard
"""
import json
import os
import re
import shutil
import sys
import tempfile

import torch

import interop_support as support
from interop_support import FixtureTestCase
import torch2_chroot

run = support.reshard

# Run by torch 2.6 in the chroot, the test's temporary folder at /data. Processes are forked, not
# spawned: `python3 -c` has no main file a spawned child could import its function from.
GENERATE = r'''
import datetime, json, socket, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

def single():
    g = torch.Generator().manual_seed(1)
    fp32 = torch.randn(4, 6, generator=g)
    fp32[0, :3] = torch.tensor([-0.0, float('inf'), -float('inf')])
    return {'fp32': fp32,
            'bf16': torch.randn(5, 3, generator=g).to(torch.bfloat16),
            'fp16': torch.randn(7, generator=g).half(),
            'int64': torch.randint(-2**62, 2**62, (3, 2), generator=g),
            'scalar': torch.tensor(2.5),
            'view': torch.randn(6, 8, generator=g)[1:5, ::3],
            'nested': {'bias': torch.randn(3, generator=g)}}

# key: (shape, dtype, mesh shape, placements)
DTENSORS = {'w_row': ((8, 6), torch.float32, (2,), [Shard(0)]),
            'w_col': ((6, 10), torch.bfloat16, (2,), [Shard(1)]),
            'w_uneven': ((7, 5), torch.float32, (2,), [Shard(0)]),
            'w_one_row': ((1, 3), torch.float32, (2,), [Shard(0)]),
            'w_repl': ((3, 4), torch.float16, (2,), [Replicate()]),
            'w_2d': ((6, 4), torch.bfloat16, (2, 1), [Shard(0), Shard(1)])}

def world2():
    g = torch.Generator().manual_seed(2)
    return {k: torch.randn(shape, generator=g).to(dtype) for k, (shape, dtype, _, _) in DTENSORS.items()}

def rank(r, port):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=r, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    meshes = {s: init_device_mesh('cpu', s) for s in {(2,), (2, 1)}}
    full, state, boxes = world2(), {'step': 7}, {}
    for k, (shape, _, mesh, placements) in DTENSORS.items():
        state[k] = distribute_tensor(full[k], meshes[mesh], placements)
        boxes[k] = [list(v) for v in compute_local_shape_and_global_offset(shape, meshes[mesh], placements)]
    dcp.save(state, checkpoint_id='/data/world2')
    every = [None, None]
    dist.all_gather_object(every, boxes)
    if r == 0:  # a replicated tensor's shards are one box; an empty shard is still a shard
        with open('/data/world2_shards.json', 'w') as f:
            json.dump({k: len({json.dumps(b[k]) for b in every}) for k in DTENSORS}, f)
    end_rank(dist)

def load_back(name, want):
    """dcp.load into zeros in this process (no process group); must give back what was saved."""
    got = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in want.items()}
    dcp.load(got, checkpoint_id='/data/' + name)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f'{name}: dcp.load gave back other values for {bad}'
    torch.save(got, f'/data/{name}_full.pt')

# The two ranks are forked first, while this process has started no threads
# (dcp.save writes through a thread pool, and a child forked after that can
# deadlock on a lock one of them held).
with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
mp.start_processes(rank, args=(port,), nprocs=2, start_method='fork')
load_back('world2', world2())

tensors = single()
dcp.save({**tensors, 'note': 'made by torch ' + torch.__version__, 'step': 7}, checkpoint_id='/data/single')
flat = {k: t for k, t in tensors.items() if k != 'nested'}
flat['nested.bias'] = tensors['nested']['bias']
load_back('single', flat)
print('torch', torch.__version__)
'''

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """The tensor's bits as integers: torch.equal takes -0.0 for 0.0."""
    return t.view(INTS[t.element_size()]) if t.is_floating_point() else t


def chunk_counts(inspect_text):
    """{key: chunk count} from `reshard inspect`'s tensor lines."""
    return {m[1]: int(m[2]) for m in re.finditer(r'^  (\S+) \w+\[[\d, ]*\], (\d+) chunks?:', inspect_text, re.M)}


class DcpTorch2Test(FixtureTestCase):

    @classmethod
    def setUpClass(cls):
        root = torch2_chroot.root_or_skip()
        cls.work = tempfile.mkdtemp(prefix='reshard-torch2-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        p = torch2_chroot.run(root, torch2_chroot.END_RANK + GENERATE, {cls.work: '/data'})
        if p.returncode:
            raise AssertionError('torch 2 could not write the saves:\n' + p.stdout + p.stderr)
        print(p.stdout.strip(), file=sys.stderr)

    def saved(self, name):
        return os.path.join(self.work, name)

    def check_export(self, name):
        out = self.path(name)
        p = run('export', self.saved(name), out, '--to', 'consolidated', '--format', 'pt')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        got = torch.load(os.path.join(out, 'pytorch_model.bin'), map_location='cpu')
        want = torch.load(self.saved(name + '_full.pt'), map_location='cpu')
        self.assertEqual(sorted(got), sorted(want))  # the plain objects are not tensors: left out
        for key in want:
            self.assertEqual(support.differences(got[key], want[key], key), [])
            self.assertTrue(torch.equal(bits(got[key]), bits(want[key])), key)
        print(f'{name}: {len(want)} tensors equal bit for bit', file=sys.stderr)

    def test_one_process_save_exports_bit_for_bit(self):
        self.check_export('single')

    def test_two_process_dtensor_save_exports_bit_for_bit(self):
        self.check_export('world2')

    def test_inspect_lists_every_key_and_each_dtensor_shard(self):
        for name, objects in (('single', ['note', 'step']), ('world2', ['step'])):
            p = run('inspect', self.saved(name))
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            tensors = torch.load(self.saved(name + '_full.pt'))
            self.assertEqual(sorted(chunk_counts(p.stdout)), sorted(tensors), p.stdout)
            for key in objects:
                self.assertRegex(p.stdout, rf'(?m)^  {key}$')
        with open(self.saved('world2_shards.json')) as f:
            shards = json.load(f)
        self.assertEqual(chunk_counts(p.stdout), shards, p.stdout)


if __name__ == '__main__':
    support.main()
