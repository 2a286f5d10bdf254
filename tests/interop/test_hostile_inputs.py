"""Checkpoints crafted to attack reshard or whoever loads what it writes: each is refused.

Every case holds the refusal contract of test_cli_errors.py (exit 2, one ``reshard: error:`` line
naming the file and the problem, nothing on stdout, nothing written, the input byte-for-byte
unchanged) for ``lint``, ``inspect`` and ``convert``, except where lint reports a checkpoint's
inconsistency as an error finding (exit 1):

  * pickles whose allowed calls compose into ``eval`` when torch.load replays them
    (``getattr`` of a function's ``__globals__``; ``_rebuild_from_type_v2`` calling what it is
    handed), placed in the mp_rank files' ``args``; the payload would create a file, which must
    never appear;
  * a storage declaring 2**62 + 16 float32 elements over a 64-byte record (the byte count wraps
    to 64 in 64 bits), and one whose record is shorter than its elements;
  * counts in ``args`` that would be allocated (``num_layers`` = 2**62) or whose product wraps
    to a zero divisor (``make_vocab_size_divisible_by`` = 2**62 at TP 4);
  * a valid DEFLATE-compressed zip, which torch.load reads but whose records are not the
    storages' bytes; a damaged byte inside a record, which `lint --deep` finds by its CRC-32;
  * two file names of one rank (``mp_rank_000`` beside ``mp_rank_00``, ``layer_003`` beside
    ``layer_03``), and a stray rank number of 2e9 (counted, not enumerated);
  * ``latest`` naming ``..``, ``.`` or a path instead of a tag folder.

This script never unpickles the malicious files itself.

Run by ctest as ``/usr/bin/python3 tests/interop/test_hostile_inputs.py --reshard BIN`` with
PYTHONPATH=tests.
"""

import builtins
import io
import os
import pickletools
import shutil
import struct
import subprocess
import zipfile

import torch

import interop_support as support
from interop_support import layer_file, mp_file, rewrite
from test_cli_errors import ReshardTestCase

NEVER_EXECUTES = 'reshard never executes pickled code'


class _Call:
    """Unpickled, this calls ``fn(*args)``: how a crafted pickle chains allowed globals."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _from_type(fn, *args):
    """torch._tensor._rebuild_from_type_v2(fn, torch.Tensor, args, None), which calls fn(*args)."""
    return _Call(torch._tensor._rebuild_from_type_v2, fn, torch.Tensor, args, None)


def getattr_gadget(command):
    """eval(command) reached through getattr of _rebuild_tensor_v2.__globals__ (the issue's chain)."""
    globals_ = _Call(builtins.getattr, torch._utils._rebuild_tensor_v2, '__globals__')
    builtins_ = _from_type(_Call(builtins.getattr, globals_, '__getitem__'), '__builtins__')
    eval_ = _from_type(_Call(builtins.getattr, builtins_, '__getitem__'), 'eval')
    return _from_type(eval_, f'__import__("os").system({command!r})')


def from_type_gadget(command):
    """The same chain with getattr only ever an argument: every call is _rebuild_from_type_v2's."""
    globals_ = _from_type(builtins.getattr, torch._utils._rebuild_tensor_v2, '__globals__')
    builtins_ = _from_type(_from_type(builtins.getattr, globals_, '__getitem__'), '__builtins__')
    eval_ = _from_type(_from_type(builtins.getattr, builtins_, '__getitem__'), 'eval')
    return _from_type(eval_, f'__import__("os").system({command!r})')


# ---------------------------------------------------------------------------------------------
# Rewriting torch.save files at the byte level
# ---------------------------------------------------------------------------------------------

def _records(path):
    with zipfile.ZipFile(path) as z:
        return [(info.filename, z.read(info)) for info in z.infolist()]


def _write_zip(path, records, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, 'w', compression=compression) as z:
        for name, data in records:
            z.writestr(name, data)


def _pickle_int(value):
    """The LONG1 opcode for ``value`` (any size)."""
    data = value.to_bytes((value.bit_length() + 8) // 8, 'little', signed=True)
    return b'\x8a' + bytes([len(data)]) + data


def forge_storage(path, marker, numel=None, record=None):
    """Rewrites the torch.save file ``path``: the storage holding exactly ``marker``'s bytes then
    declares ``numel`` elements and/or its record holds ``record``; nothing else changes."""
    records = _records(path)
    wanted = marker.numpy().tobytes()
    key = next(name.rsplit('/', 1)[1] for name, data in records if '/data/' in name and data == wanted)
    out = []
    for name, data in records:
        if name.endswith('/data.pkl') and numel is not None:
            ops = list(pickletools.genops(data))
            # ('storage', torch.<X>Storage, key, location, numel), with memo PUTs between.
            at = next(i for i, (op, arg, _) in enumerate(ops) if op.name.endswith('UNICODE') and
                      arg == key and 'storage' in [a for _, a, _ in ops[max(0, i - 4):i]])
            at = next(i for i in range(at + 1, len(ops))
                      if ops[i][0].name in ('BININT', 'BININT1', 'BININT2', 'LONG1'))
            begin, end = ops[at][2], ops[at + 1][2]
            data = data[:begin] + _pickle_int(numel) + data[end:]
        elif name.endswith('/data/' + key) and record is not None:
            data = record
        out.append((name, data))
    _write_zip(path, out)


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

class HostileTestCase(ReshardTestCase):

    def assertAllRefuse(self, tag, needles):
        """lint, inspect and convert of ``tag`` each refuse with ``needles`` in their line."""
        out = self.path('out', 'global_step10')
        for command, args in (('lint', []), ('inspect', []), ('convert', [out, '--tp', 1, '--pp', 1])):
            with self.subTest(command=command):
                self.assertRefused([command, tag, *args], needles, watch=[self.path('src')],
                                   out=out if command == 'convert' else None)


class PickleGadgetTests(HostileTestCase):

    def check_gadget(self, gadget, found):
        tag = self.bloom()
        pwned = self.path('pwned')

        def add(sd):
            sd['args'].evil = gadget(f'touch {pwned}')
        for mp in range(4):
            rewrite(mp_file(tag, mp), add)
        self.assertAllRefuse(tag, ['mp_rank_00_model_states.pt', found, NEVER_EXECUTES])
        self.assertFalse(os.path.exists(pwned), 'reshard executed code from a pickle')

    def test_getattr_of_a_functions_globals(self):
        self.check_gadget(getattr_gadget,
                          "pickle calls builtins.getattr(torch._utils._rebuild_tensor_v2, "
                          "'__globals__'), which reshard accepts only as getattr(EnumClass, 'member')")

    def test_rebuild_from_type_calling_another_function(self):
        self.check_gadget(from_type_gadget,
                          'pickle calls torch._tensor._rebuild_from_type_v2(builtins.getattr, '
                          'torch.Tensor, (...), None), which reshard accepts only as '
                          '_rebuild_from_type_v2(torch._utils._rebuild_tensor_v2, torch.Tensor')

    def test_the_fixtures_enum_members_still_load(self):
        # The same files without a gadget: args.position_embedding_type is
        # getattr(megatron.enums.PositionEmbeddingType, 'alibi').
        tag = self.bloom()
        p = support.reshard('lint', tag)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)


class StorageSizeTests(HostileTestCase):

    def forged(self, numel=None, record=None):
        tag = self.bloom()
        marker = torch.arange(16, dtype=torch.float32) + 0.5  # 64 bytes no other storage has

        def add(sd):
            sd['args'].marker = marker
        for mp in range(4):
            rewrite(mp_file(tag, mp), add)
            forge_storage(mp_file(tag, mp), marker, numel=numel, record=record)
        return tag

    def test_element_count_whose_byte_count_wraps(self):
        tag = self.forged(numel=2 ** 62 + 16)
        self.assertAllRefuse(tag, ['mp_rank_00_model_states.pt',
                                   "declares 4611686018427387920 float32 elements, but its record "
                                   "holds 64 bytes; the file is damaged"])

    def test_record_shorter_than_its_storage(self):
        tag = self.forged(record=bytes(32))
        self.assertAllRefuse(tag, ['mp_rank_00_model_states.pt',
                                   'declares 16 float32 elements, but its record holds 32 bytes'])


class MetadataCountTests(HostileTestCase):
    """Counts in ``args`` size what reshard allocates and divides by."""

    def with_args(self, **values):
        tag = self.bloom()

        def change(sd):
            for k, v in values.items():
                setattr(sd['args'], k, v)
        for mp in range(4):
            rewrite(mp_file(tag, mp), change)
        return tag

    def test_absurd_block_count(self):
        tag = self.with_args(num_layers=2 ** 62)  # once expanded into that many layer specs
        needle = 'args.num_layers is 4611686018427387904 but the checkpoint has 4 transformer-block files'
        p = support.reshard('lint', tag)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('error: ' + needle, p.stdout)
        out = self.path('out', 'global_step10')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1], [needle],
                           watch=[self.path('src')], out=out)

    def test_vocabulary_divisor_whose_multiple_wraps(self):
        tag = self.with_args(make_vocab_size_divisible_by=2 ** 62)  # times TP 4: 2**64, 0 in 64 bits
        out = self.path('out', 'global_step10')
        self.assertRefused(['convert', tag, out, '--tp', 4, '--pp', 1],
                           ['padding the vocabulary of 100 rows to a multiple of 4611686018427387904 '
                            'times TP 4 overflows 64 bits'], watch=[self.path('src')], out=out)


class ZipContainerTests(HostileTestCase):

    def test_deflate_compressed_file(self):
        tag = self.bloom()
        victim = layer_file(tag, 4, 1)
        _write_zip(victim, _records(victim), compression=zipfile.ZIP_DEFLATED)
        support.load(victim)  # torch.load reads it (our own fixture's data, safe to load)
        self.assertAllRefuse(tag, ['layer_04-model_01-model_states.pt', 'is compressed (method 8)',
                                   're-save the file with torch.save'])

    def test_local_header_disagreeing_with_the_directory(self):
        tag = self.bloom()
        victim = layer_file(tag, 4, 1)
        with open(victim, 'rb') as f:
            data = bytearray(f.read())
        with zipfile.ZipFile(victim) as z:
            info = z.getinfo(next(n for n in z.namelist() if n.endswith('/data/0')))
        # Give the local header of data/0 a method of its own (8, deflate): a zip reader that
        # trusts it reads other bytes than one that trusts the directory.
        data[info.header_offset + 8:info.header_offset + 10] = struct.pack('<H', 8)
        with open(victim, 'wb') as f:
            f.write(data)
        self.assertAllRefuse(tag, ['layer_04-model_01-model_states.pt', "data/0' does not match its "
                                   'local header'])

    def test_a_damaged_byte_is_found_by_lint_and_verify_deep(self):
        tag = self.bloom()
        intact = self.path('intact')
        shutil.copytree(tag, intact)
        path = layer_file(tag, 3, 1)
        with zipfile.ZipFile(path) as z:
            info = next(i for i in z.infolist() if '/data/' in i.filename and i.file_size >= 64)
        with open(path, 'r+b') as f:  # the record's data follows its 30-byte header, name and extra
            f.seek(info.header_offset + 26)
            name_length, extra_length = struct.unpack('<HH', f.read(4))
            at = info.header_offset + 30 + name_length + extra_length + 17
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))
        self.assertEqual(support.reshard('lint', tag, '--replicated', 'first').returncode, 0)  # CRCs not read
        p = support.reshard('lint', tag, '--replicated', 'first', '--deep')
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn(f'error: {path}: record {info.filename} does not have the CRC-32 its zip directory '
                      'records; its bytes are damaged', p.stdout)
        self.assertEqual(support.reshard('verify', intact, intact, '--deep').returncode, 0)
        p = support.reshard('verify', intact, tag, '--deep')
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn(f'{path}: record {info.filename} does not have the CRC-32 its zip directory records',
                      p.stderr)


    def test_lint_deep_has_libtorch_read_every_file(self):
        """`lint --deep` has LibTorch's reader (libreshard_torch_check.so, next to the binary)
        read every file too. Without its `version` record a file is one reshard reads, but
        PyTorchStreamReader (and torch.load) does not: only that cross-check finds it."""
        tag = self.bloom()
        path = layer_file(tag, 3, 1)
        with open(path, 'rb') as f:
            data = f.read()
        self.assertEqual(data.count(b'/version'), 2)  # the local header and the directory entry
        with open(path, 'wb') as f:
            f.write(data.replace(b'/version', b'/versiom'))
        self.assertEqual(support.reshard('lint', tag, '--replicated', 'first').returncode, 0)
        p = support.reshard('lint', tag, '--replicated', 'first', '--deep')
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        errors = [line for line in p.stdout.splitlines() if line.startswith('error:')]
        self.assertEqual(len(errors), 1, p.stdout)
        self.assertTrue(errors[0].startswith(f"error: {path}: LibTorch's reader (PyTorchStreamReader) "
                                             'refuses it: '), errors[0])
        self.assertIn('version', errors[0])
        self.assertNotIn('note:', p.stdout)

    def test_lint_deep_says_when_the_libtorch_module_is_missing(self):
        tag = self.bloom()
        missing = self.path('nowhere', 'libreshard_torch_check.so')
        env = dict(os.environ, RESHARD_TORCH_CHECK_MODULE=missing)
        p = subprocess.run([support.RESHARD, 'lint', tag, '--replicated', 'first', '--deep'],
                           capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        notes = [line for line in p.stdout.splitlines() if line.startswith('note:')]
        self.assertEqual(notes, ['note: the LibTorch cross-check was skipped: libreshard_torch_check.so '
                                 f'is not installed (looked for {missing})'])


class FileNameTests(HostileTestCase):

    def test_two_names_of_one_mp_rank(self):
        tag = self.bloom()
        shutil.copy(mp_file(tag, 0), os.path.join(tag, 'mp_rank_000_model_states.pt'))
        self.assertAllRefuse(tag, [f'{tag} holds both mp_rank_000_model_states.pt and '
                                   'mp_rank_00_model_states.pt, which are the same rank file'])

    def test_two_names_of_one_layer_file(self):
        tag = self.bloom()
        shutil.copy(layer_file(tag, 3, 0), os.path.join(tag, 'layer_003-model_00-model_states.pt'))
        self.assertAllRefuse(tag, ['holds both layer_003-model_00-model_states.pt and '
                                   'layer_03-model_00-model_states.pt, which are the same rank file '
                                   '(layer_03-model_00-model_states.pt)'])

    def test_a_stray_rank_number_is_counted_not_enumerated(self):
        # An empty file naming rank 2e9 must not make reshard list 2e9 missing ranks.
        tag = self.bloom()
        open(os.path.join(tag, 'mp_rank_2000000000_model_states.pt'), 'w').close()
        self.assertAllRefuse(tag, ['mp_rank file(s) 4, 5, 6, 7, 8 and 1999999991 more of 2000000001 '
                                   'are missing'])


class LatestTests(HostileTestCase):

    def test_latest_naming_no_tag_folder(self):
        tag = self.bloom()
        root = os.path.dirname(tag)
        for name in ('..', '.', 'global_step10/..', '../src', os.path.abspath(tag)):
            with self.subTest(latest=name):
                with open(os.path.join(root, 'latest'), 'w') as f:
                    f.write(name + '\n')
                self.assertAllRefuse(root, [os.path.join(root, 'latest'), f"names '{name}', which is "
                                            'not a tag folder name'])


if __name__ == '__main__':
    support.main()
