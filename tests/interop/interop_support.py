"""Shared by the interop tests: the reshard binary under test, and a deep
comparison of unpickled checkpoint files, and the items of a DCP folder.

Every test script is run as `/usr/bin/python3 tests/interop/test_x.py --reshard BIN`
(with PYTHONPATH=tests) and ends with `interop_support.main()`.
"""
import io
import os
import json
import pickle
import pickletools
import struct
import subprocess
import tempfile
import sys
import enum
import unittest
import zipfile

import numpy
import torch

from fixtures import megatron_fixture as mf

RESHARD = None  # absolute path of the binary under test, set by main()

# The small models the interop tests convert: every TP in 1, 2, 3, 4, 6 divides
# their heads (llama: KV groups 1, 2, 3, 6), and 6 blocks give uneven stages.
SIZES = dict(L=6, h=48, n=12, hd=4, V=100, mvsdb=8)
FAMILIES = {
    'bs_bloom': dict(style='bs_bloom', ffn=96, **SIZES),
    'bs_gpt_rotary': dict(style='bs_gpt', rotary=True, ffn=96, **SIZES),
    'bs_gpt_glu': dict(style='bs_gpt', glu=True, ffn=96, **SIZES),
    'ms_gpt2': dict(style='ms_gpt2', ffn=96, **SIZES),
    'ms_llama': dict(style='ms_llama', nkv=6, ffn=48, **SIZES),
    # Small enough that the no-decay group of a stage is shorter than 2*DP at DP >= 16.
    'tiny_bloom': dict(style='bs_bloom', L=2, h=8, n=2, ffn=16, V=30, mvsdb=4),
}


def reshard(*args, timeout=300):
    """Runs the binary; returns the CompletedProcess (text output)."""
    return subprocess.run([RESHARD, *map(str, args)], capture_output=True, text=True, timeout=timeout)


MANIFEST = 'reshard-manifest.json'


def manifest_files_digest(path):
    """sha256 of a manifest's file list (names, sizes, CRCs): what must not change between runs
    of one conversion; the rest (the command line, the source path) names the run."""
    import hashlib
    import json
    with open(path) as f:
        files = json.load(f)['files']
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def load(path):
    """torch.load of a trusted, test-made file (pickled DeepSpeed stand-ins included)."""
    return torch.load(path, map_location='cpu', weights_only=False)


def rewrite(path, change):
    """Loads a test-made file, applies ``change(obj)`` (which may return a replacement), saves it."""
    obj = load(path)
    result = change(obj)
    torch.save(obj if result is None else result, path)


def make_fixture(root, **kw):
    """Writes a Megatron-DeepSpeed fixture at ``root`` (optimizer-free unless asked); returns its tag folder."""
    kw.setdefault('optimizer', 'none')
    return mf.write_checkpoint(root, mf.FixtureConfig(**kw))['tag_dir']


SAFETENSORS_DTYPES = {'F32': torch.float32, 'BF16': torch.bfloat16, 'F16': torch.float16, 'I64': torch.int64}


def read_safetensors(path):
    """{name: tensor} and the metadata of a .safetensors file."""
    with open(path, 'rb') as f:
        data = f.read()
    (n,) = struct.unpack('<Q', data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop('__metadata__', {})
    body = data[8 + n:]
    out = {}
    for name, info in header.items():
        begin, end = info['data_offsets']
        t = torch.frombuffer(bytearray(body[begin:end]), dtype=SAFETENSORS_DTYPES[info['dtype']]) if end > begin else \
            torch.empty(0, dtype=SAFETENSORS_DTYPES[info['dtype']])
        out[name] = t.reshape(info['shape'])
    return out, meta


SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def tensor_bytes(t):
    t = t.contiguous()
    return (t.view(torch.int16) if t.element_size() == 2 else t).numpy().tobytes()


def write_safetensors(path, tensors):
    """Writes {name: tensor} as a .safetensors file (metadata {"format": "pt"})."""
    header, body = {}, b''
    for name, t in tensors.items():
        data = tensor_bytes(t)
        header[name] = {'dtype': SAFETENSORS_NAMES[t.dtype], 'shape': list(t.shape),
                        'data_offsets': [len(body), len(body) + len(data)]}
        body += data
    header['__metadata__'] = {'format': 'pt'}
    text = json.dumps(header).encode()
    text += b' ' * (-len(text) % 8)
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(text)) + text + body)


def layer_file(tag_dir, layer_id, tp_rank):
    return os.path.join(tag_dir, f'layer_{layer_id:02d}-model_{tp_rank:02d}-model_states.pt')


def mp_file(tag_dir, mp):
    return os.path.join(tag_dir, f'mp_rank_{mp:02d}_model_states.pt')


def pickle_globals(path):
    """(module, name) global references inside a torch.save zip file's data.pkl."""
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith('data.pkl')))
    ops = list(pickletools.genops(data))
    found = set()
    for i, (op, arg, _) in enumerate(ops):
        if op.name == 'GLOBAL':
            found.add(tuple(arg.split(' ', 1)))
        elif op.name == 'STACK_GLOBAL':
            strings = [a for o, a, _ in ops[max(0, i - 6):i] if 'UNICODE' in o.name]
            found.add(tuple(strings[-2:]))
    return found


class _Record:
    """Any class of DCP's .metadata, read as a plain record."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


class _MetadataReader(pickle.Unpickler):
    # torch.distributed's classes, and pathlib's (torch 2.6 under Python 3.13 records the save's
    # checkpoint_id, a pathlib._local.PosixPath older Pythons lack)
    def find_class(self, module, name):
        if module.startswith(('torch.distributed', 'pathlib')):
            return type(name, (_Record,), {})
        return super().find_class(module, name)


def dcp_metadata(folder):
    """The `.metadata` of a DCP folder, torch's classes read as plain records (the machine's torch
    1.13 has no torch.distributed.checkpoint of torch 2's)."""
    with open(os.path.join(folder, '.metadata'), 'rb') as f:
        return _MetadataReader(f).load()


def distcp_items(folder):
    """{fqn: [(chunk offsets, object)]} of a DCP folder (torch_dist, torchtitan): every item torch.load-ed
    from the window .metadata gives it in its .distcp file (the machine's torch 1.13 has no dcp.load)."""
    items = {}
    for index, where in dcp_metadata(folder).storage_data.items():
        with open(os.path.join(folder, where.relative_path), 'rb') as f:
            f.seek(where.offset)
            data = f.read(where.length)
        offsets = list(index.offset) if getattr(index, 'offset', None) is not None else []
        items.setdefault(index.fqn, []).append((offsets, torch.load(io.BytesIO(data))))
    return items


def whole(chunks, size):
    """The global tensor of `size` the chunks tile."""
    out = torch.empty(size, dtype=chunks[0][1].dtype)
    for offsets, t in chunks:
        out[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
    return out


class FixtureTestCase(unittest.TestCase):
    """A test with its own temporary folder and a BLOOM-style fixture at hand."""
    maxDiff = 4000

    def setUp(self):
        tmp = tempfile.TemporaryDirectory(prefix='reshard-test-')
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def path(self, *parts):
        return os.path.join(self.tmp, *parts)

    def assertRefused(self, p, message, out):
        """Exit 2 with one line on stderr that says `message`, and nothing written at `out`."""
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn(message, p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertFalse(os.path.exists(out))

    def bloom(self, name='src', **kw):
        """bs_bloom TP 2, PP 2: layer ids 1 (embedding), 3-6 (blocks), 8 (final norm)."""
        kw.setdefault('style', 'bs_bloom')
        kw.setdefault('tp', 2)
        kw.setdefault('pp', 2)
        return make_fixture(self.path(name), **kw)


def layer_file_differences(want, got, vocab):
    """Differences between two folders' layer files ({name: state dict}, as torch.load gives them)
    in the true vocabulary rows: the padding rows are re-made (zeros) where the TP changes, so
    only the first `vocab` rows over the TP ranks are the model's."""
    out = [] if sorted(got) == sorted(want) else [f'layer files {sorted(got)} vs {sorted(want)}']
    for layer, tensors in want.items():
        rank = int(layer.split('-model_')[1][:2])
        theirs = dict(got.get(layer, {}))
        tensors = dict(tensors)
        for key in ('word_embeddings.weight', 'lm_head.weight'):
            if key in tensors and key in theirs:
                rows = max(0, min(vocab - rank * len(tensors[key]), len(tensors[key])))
                tensors[key], theirs[key] = tensors[key][:rows], theirs[key][:rows]
        out += differences(theirs, tensors, layer)
    return out


def differences(a, b, where=''):
    """Structural + bitwise differences of two unpickled objects (tensors: dtype, shape, bits;
    dicts: key order; objects: class and vars())."""
    if type(a) is not type(b):
        return [f'{where}: {type(a).__name__} vs {type(b).__name__}']
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f'{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}']
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            return [f'{where}: {len(bad)} elements differ, first at {bad[0].tolist()}: '
                    f'{a[tuple(bad[0])].item()!r} vs {b[tuple(bad[0])].item()!r}']
        return []
    if isinstance(a, enum.Enum):
        return [] if a is b else [f'{where}: {a!r} vs {b!r}']
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f'{where}: keys {list(a)} vs {list(b)}']
        return [d for k in a for d in differences(a[k], b[k], f'{where}.{k}')]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f'{where}: lengths {len(a)} vs {len(b)}']
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f'{where}[{i}]')]
    if isinstance(a, numpy.ndarray):
        return [] if numpy.array_equal(a, b) else [f'{where}: arrays differ']
    if hasattr(a, '__dict__') and not isinstance(a, type):
        return differences(vars(a), vars(b), where)
    return [] if a == b else [f'{where}: {a!r} vs {b!r}']


def main():
    """Takes `--reshard BIN` (or $RESHARD) off the command line and runs the tests."""
    global RESHARD
    path, rest = os.environ.get('RESHARD'), [sys.argv[0]]
    args = iter(sys.argv[1:])
    for arg in args:
        if arg == '--reshard':
            path = next(args, None)
        elif arg.startswith('--reshard='):
            path = arg.split('=', 1)[1]
        else:
            rest.append(arg)
    if not path or not os.access(path, os.X_OK):
        sys.exit(f'usage: {sys.argv[0]} --reshard /path/to/reshard [unittest args] (got {path!r})')
    RESHARD = os.path.abspath(path)
    mf.install_pickle_shims()
    unittest.main(argv=rest, verbosity=2)
