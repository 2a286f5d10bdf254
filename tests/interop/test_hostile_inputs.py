"""Checkpoints crafted to attack reshard or whoever loads what it writes: each is refused.

Every case holds the refusal contract of test_cli_errors.py (exit 2, one ``reshard: error:`` line
naming the file and the problem, nothing on stdout, nothing written, the input byte-for-byte
unchanged) for ``lint``, ``inspect`` and ``convert``, except where lint reports a checkpoint's
inconsistency as an error finding (exit 1):

  * pickles whose allowed calls compose into ``eval`` when torch.load replays them
    (``getattr`` of a function's ``__globals__``; ``_rebuild_from_type_v2`` calling what it is
    handed), placed in the mp_rank files' ``args``; the payload would create a file, which must
    never appear; and a call of ``os.system`` that ``--allow-class`` lets reshard read, which no
    command writes (convert refuses it by name, lint with the same line; export --to megatron
    drops it, and what it and an export keeping no pickled metadata write loads in torch without
    running it);
  * a storage declaring 2**62 + 16 float32 elements over a 64-byte record (the byte count wraps
    to 64 in 64 bits), and one whose record is shorter than its elements;
  * counts in ``args`` that would be allocated (``num_layers`` = 2**62) or whose product wraps
    to a zero divisor (``make_vocab_size_divisible_by`` = 2**62 at TP 4);
  * a valid DEFLATE-compressed zip, which torch.load reads but whose records are not the
    storages' bytes; a damaged byte inside a record, which `lint --deep` finds by its CRC-32;
  * two file names of one rank (``mp_rank_000`` beside ``mp_rank_00``, ``layer_003`` beside
    ``layer_03``), and a stray rank number of 2e9 (counted, not enumerated);
  * ``latest`` naming ``..``, ``.`` or a path instead of a tag folder;
  * files that are not regular files (a FIFO, a link to ``/dev/zero``) where a checkpoint file, an
    HF weight file, a manifest's file or a tokenizer file is expected: refused by name, never a hang;
  * manifest names leaving the output folder (``..``, absolute paths, a link out of it);
  * HF folders whose tensors or counts disagree with config.json (every tensor's shape is checked,
    a layer count of 1e9 is compared with the folder's blocks before anything is sized by it);
  * ``--tokenizer`` files that cannot be copied or are links out of the tokenizer's repository;
  * a flipped byte in a layer file's tensor or an optimizer shard: the CRC-32 of every record a
    run reads whole is checked as it is read (``--no-check-crc`` opts out).
  * a flipped byte in a tensor item of a Distributed Checkpoint's ``.distcp`` file, for each DCP
    flavour (Megatron-Core 0.19 and 0.14 ``torch_dist``, plain ``dcp.save``, torchtitan): every
    item is a torch.save archive with CRC-32s, checked as it is read and by ``lint --deep``;
  * a Megatron-Core save's broken metadata: a ``common.pt`` missing, a FIFO, a link to
    ``/dev/zero`` or a pickle gadget; a ``metadata.json`` that is not Megatron-Core's (not JSON,
    empty, an array, another backend or version, a FIFO, ``/dev/zero``); a gadget in 0.19's
    ``common_state`` item or in ``.metadata``'s save plans: each refused naming the file, never
    read as plain DCP;
  * a ``.metadata`` that is a FIFO, a device, a folder, empty or cut short; a Megatron-LM tracker
    naming no iteration; a ``model_optim_rng.pt`` that is a gadget: each named for what it is.

This script never unpickles the malicious files itself.

Run by ctest as ``/usr/bin/python3 tests/interop/test_hostile_inputs.py --reshard BIN`` with
PYTHONPATH=tests.
"""

import builtins
import glob
import io
import json
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import zipfile

import torch

import interop_support as support
from interop_support import layer_file, mp_file, rewrite
from test_cli_errors import SYSTEM, ReshardTestCase, _RunsSystem
import test_export_hf as hf
import test_import_hf as hf_import
from megatron_core_data import config_of, sizes

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

    def test_an_allowed_class_is_read_and_never_written(self):
        """--allow-class lets reshard read a call of posix.system in args, never write it: convert
        refuses, naming the class and its place, and lint says the same line; export --to megatron,
        which keeps only what Megatron-LM can unpickle, drops it (a note names it), and what that and
        an export keeping no pickled metadata write loads in torch without running the call."""
        tag = self.bloom()
        pwned = self.path('pwned')

        def add(sd):
            sd['args'].evil = _RunsSystem(f'touch {pwned}')
        for mp in range(4):
            rewrite(mp_file(tag, mp), add)
        allow = ['--allow-class', SYSTEM]
        refusal = (f'args.evil is {SYSTEM}, which --allow-class let reshard read; reshard writes no call it '
                   'does not know to be data')
        out = self.path('out', 'global_step10')
        line = self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, *allow],
                                  ['mp_rank_00_model_states.pt', refusal], watch=[self.path('src')], out=out)
        lint = support.reshard('lint', tag, *allow)
        self.assertEqual(lint.returncode, 1, lint.stdout + lint.stderr)
        self.assertIn('error: ' + line[len('reshard: error: '):], lint.stdout.splitlines())
        loaded = 0
        for to, extra, note in (('megatron', ['--tp', 1, '--pp', 1], 'evil'),
                                ('consolidated', ['--format', 'pt'], None)):
            written = self.path(to)
            p = support.reshard('export', tag, written, '--to', to, *extra, *allow)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            if note:
                self.assertIn(f"dropped 1 field(s) NVIDIA Megatron-LM cannot unpickle or rebuilds itself "
                              f"(tensors, fork-only classes): {note}", p.stdout)
            for folder, _, names in os.walk(written):
                for name in names:
                    if name.endswith('.bin') or name.endswith('.pt'):
                        torch.load(os.path.join(folder, name), weights_only=False)
                        loaded += 1
        self.assertGreater(loaded, 1)
        self.assertFalse(os.path.exists(pwned), 'a file reshard wrote ran code when torch.load read it')

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


# ---------------------------------------------------------------------------------------------
# Files that are not regular files, manifests leaving their folder, HF folders that disagree
# with their config, tokenizer files, damaged records
# ---------------------------------------------------------------------------------------------

def flip_byte_in_record(path, min_size=64):
    """Flips one byte inside the first storage record of at least ``min_size`` bytes of ``path``."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if '/data/' in i.filename and i.file_size >= min_size)
    with open(path, 'r+b') as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack('<HH', f.read(4))
        at = info.header_offset + 30 + name_length + extra_length + 17
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    return info.filename


def replace_with_fifo(path):
    os.remove(path)
    os.mkfifo(path)


def replace_with_link(path, target):
    os.remove(path)
    os.symlink(target, path)


class NotRegularFileTests(HostileTestCase):

    def test_a_fifo_or_a_device_as_a_layer_file(self):
        for name, make in (('a FIFO', replace_with_fifo), ('a character device',
                                                           lambda p: replace_with_link(p, '/dev/zero'))):
            with self.subTest(kind=name):
                tag = self.bloom(name.replace(' ', '_'))
                victim = layer_file(tag, 3, 1)
                make(victim)
                self.assertAllRefuse(tag, [victim, f'is {name}', 'not a regular file'])

    def test_a_fifo_as_an_hf_weight_file(self):
        folder = self.path('hf')
        hf_import.write_folder(folder, {'x': torch.zeros(2)}, hf_import.CONFIGS['ms_gpt2'])
        replace_with_fifo(os.path.join(folder, 'model.safetensors'))
        # Only config.json is watched: reading the FIFO to snapshot it would block this test.
        self.assertRefused(['lint', folder], [os.path.join(folder, 'model.safetensors'), 'is a FIFO (named pipe)'],
                           watch=[os.path.join(folder, 'config.json')])

    def converted(self):
        tag = self.bloom()
        out = self.path('out', 'global_step10')
        p = support.reshard('convert', tag, out, '--tp', 1, '--pp', 1, '-q')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return out

    def test_verify_of_a_listed_fifo_or_device(self):
        out = self.converted()
        layer = os.path.join(out, 'layer_03-model_00-model_states.pt')
        for name, make in (('a FIFO', replace_with_fifo), ('a character device',
                                                           lambda p: replace_with_link(p, '/dev/zero'))):
            with self.subTest(kind=name):
                make(layer)
                p = support.reshard('verify', out, timeout=60)
                self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                self.assertIn(f'{layer} is {name}', p.stdout)
                self.assertIn('not a regular file', p.stdout)


class ManifestEscapeTests(HostileTestCase):

    def test_names_outside_the_folder_are_refused(self):
        tag = self.bloom()
        out = self.path('out', 'global_step10')
        self.assertEqual(support.reshard('convert', tag, out, '--tp', 1, '--pp', 1, '-q').returncode, 0)
        manifest_path = os.path.join(out, 'reshard-manifest.json')
        with open(manifest_path) as f:
            manifest = json.load(f)
        outside = self.path('outside.pt')
        shutil.copy(os.path.join(out, manifest['files'][0]['name']), outside)
        for name in ('../../outside.pt', outside, '/dev/zero', 'a/../../outside.pt', './x', 'a//b'):
            with self.subTest(name=name):
                edited = json.loads(json.dumps(manifest))
                edited['files'][0]['name'] = name
                with open(manifest_path, 'w') as f:
                    json.dump(edited, f)
                self.assertRefused(['verify', out], [manifest_path, f"lists '{name}', which is not a file inside "
                                                     'its folder'], watch=[out])
        with open(manifest_path, 'w') as f:
            json.dump(manifest, f)
        first = os.path.join(out, manifest['files'][0]['name'])
        replace_with_link(first, outside)  # the same bytes, through a link leading out
        p = support.reshard('verify', out, timeout=60)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn(f"{manifest['files'][0]['name']} is a link that leads outside the folder", p.stdout)


class HfConfigDisagreementTests(HostileTestCase):
    """GPT-2 folders whose tensors disagree with config.json: every tensor's shape is checked."""

    def folder(self, change):
        canon = hf_import.mf.canonical_tensors(hf_import.mf.FixtureConfig(**hf.GPT2))
        tensors = {k: v.to(torch.bfloat16) for k, v in hf_import.EXPECTED['ms_gpt2'](canon).items()}
        config = dict(hf_import.CONFIGS['ms_gpt2'])
        change(tensors, config)
        path = self.path('hf')
        hf_import.write_folder(path, tensors, config)
        return path

    def assertRefusedEverywhere(self, folder, needles):
        out = self.path('out', 'global_step0')
        for args in (['lint', folder], ['inspect', folder],
                     ['convert', folder, out, '--tp', 1, '--pp', 1]):
            with self.subTest(command=args[0]):
                self.assertRefused(args, needles, watch=[folder], out=out if args[0] == 'convert' else None)

    def test_tensor_shapes_that_the_config_does_not_give(self):
        h, ffn = hf_import.S['h'], hf.GPT2['ffn']

        def small_norm(t, c):
            t['transformer.h.0.ln_1.weight'] = t['transformer.h.0.ln_1.weight'][:h // 2].clone()

        def narrow_fc(t, c):
            t['transformer.h.1.mlp.c_fc.weight'] = t['transformer.h.1.mlp.c_fc.weight'][:, :ffn // 2].clone()
            t['transformer.h.1.mlp.c_fc.bias'] = t['transformer.h.1.mlp.c_fc.bias'][:ffn // 2].clone()

        def inner(t, c):
            c['n_inner'] = ffn // 2
        for change, needle in ((small_norm, 'layers.0.input_layernorm.weight of shape'),
                               (narrow_fc, 'layers.1.mlp.dense_h_to_4h.weight of shape'),
                               (inner, 'mlp.dense_h_to_4h.weight of shape')):
            with self.subTest(needle=needle):
                self.assertRefusedEverywhere(self.folder(change), [needle, 'the architecture does not compute'])
                shutil.rmtree(self.path('hf'))

    def test_config_vocab_larger_than_the_embedding(self):
        folder = self.folder(lambda t, c: c.update(vocab_size=hf_import.S['V'] * 2))
        self.assertRefusedEverywhere(folder, [f"has vocab_size {hf_import.S['V'] * 2}, more than the"])

    def test_a_layer_count_of_a_billion_is_compared_first(self):
        folder = self.folder(lambda t, c: c.update(n_layer=1000000000))
        self.assertRefusedEverywhere(folder, ['gives 1000000000 layers', 'the folder holds the tensors of '
                                              f"{hf_import.S['L']} blocks"])

    def test_a_vocabulary_divisor_of_zero_is_called_invalid(self):
        folder = self.folder(lambda t, c: None)
        out = self.path('out', 'global_step0')
        self.assertRefused(['convert', folder, out, '--tp', 2, '--pp', 1, '--set', 'make_vocab_size_divisible_by=0'],
                           ['make_vocab_size_divisible_by, which is 0', 'must be 1 or more'], watch=[folder], out=out)


class TokenizerTests(HostileTestCase):

    def export(self, tokenizer, code):
        out = self.path('hfout')
        p = support.reshard('export', self.src_tag, out, '--to', 'hf', '--tokenizer', tokenizer, '-q', timeout=120)
        self.assertEqual(p.returncode, code, p.stdout + p.stderr)
        if code != 0:
            self.assertFalse(os.path.exists(out))
            self.assertEqual(len(p.stderr.splitlines()), 1, p.stderr)
        return p, out

    def setUp(self):
        super().setUp()
        self.src_tag = self.bloom()

    def tokenizer(self, make):
        folder = self.path('tok')
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
            f.write('{}')
        make(os.path.join(folder, 'tokenizer.json'))
        return folder

    def test_files_that_cannot_be_copied_are_errors(self):
        cases = (('fifo', os.mkfifo, 'is a FIFO (named pipe)'),
                 ('dangling', lambda p: os.symlink(self.path('nowhere'), p), 'No such file'),
                 ('device', lambda p: os.symlink('/dev/zero', p), 'is a character device'),
                 ('outside', lambda p: os.symlink('/etc/passwd', p), 'is a link to /etc/passwd, outside the '
                                                                     "tokenizer's folder"))
        for name, make, needle in cases:
            with self.subTest(case=name):
                folder = self.tokenizer(make)
                p, _ = self.export(folder, 2)
                self.assertIn('--tokenizer: cannot copy tokenizer.json', p.stderr)
                self.assertIn(needle, p.stderr)
                shutil.rmtree(folder)

    def test_hub_cache_links_into_its_blobs_are_copied(self):
        repo = self.path('models--org--name')
        os.makedirs(os.path.join(repo, 'blobs'))
        snapshot = os.path.join(repo, 'snapshots', 'abc123')
        os.makedirs(snapshot)
        with open(os.path.join(repo, 'blobs', 'f00d'), 'w') as f:
            f.write('{"version": "1.0"}')
        os.symlink('../../blobs/f00d', os.path.join(snapshot, 'tokenizer.json'))
        _, out = self.export(snapshot, 0)
        with open(os.path.join(out, 'tokenizer.json')) as f:
            self.assertEqual(f.read(), '{"version": "1.0"}')

    def test_a_tokenizer_argument_that_is_no_folder_exits_2(self):
        for bad in (self.path('missing'), '/etc/hostname'):
            with self.subTest(tokenizer=bad):
                p, _ = self.export(bad, 2)
                self.assertIn('is not a folder', p.stderr)


class DamagedRecordTests(HostileTestCase):

    def test_a_flipped_byte_in_a_layer_file_is_refused(self):
        tag = self.bloom()
        path = layer_file(tag, 3, 1)
        record = flip_byte_in_record(path)
        out = self.path('out', 'global_step10')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, '--replicated', 'first', '-q'],
                           [f'{path}: record {record} does not have the CRC-32', 'nothing was published',
                            '--no-check-crc'], watch=[self.path('src')], out=out)
        p = support.reshard('convert', tag, out, '--tp', 1, '--pp', 1, '--replicated', 'first', '--no-check-crc',
                            '-q')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_a_flipped_byte_in_an_optimizer_shard_is_refused(self):
        tag = self.bloom(optimizer='zero1')
        shard = sorted(f for f in os.listdir(tag) if 'optim_states' in f)[0]
        path = os.path.join(tag, shard)
        record = flip_byte_in_record(path, min_size=256)
        out = self.path('out', 'global_step10')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, '-q'],
                           [f'{path}: record {record} does not have the CRC-32'],
                           watch=[self.path('src')], out=out)


# ---------------------------------------------------------------------------------------------
# Distributed Checkpoint folders: damaged items, broken Megatron-Core metadata, misleading names
# ---------------------------------------------------------------------------------------------

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data')
MC_SIZES = sizes(config_of('0.19/w2_tp2'))  # what the Megatron-Core samples do not record (0.14's are alike)


def distcp_items(path):
    """(start, end, [ZipInfo]) of each item archive of the `.distcp` file ``path``, in order."""
    with open(path, 'rb') as f:
        data = f.read()
    out, start = [], 0
    while True:
        end_record = data.find(b'PK\x05\x06', start)
        if end_record < 0:
            return out
        end = end_record + 22 + struct.unpack('<H', data[end_record + 20:end_record + 22])[0]
        with zipfile.ZipFile(io.BytesIO(data[start:end])) as z:
            out.append((start, end, z.infolist()))
        start = end


def flip_byte_in_distcp(path, first=False):
    """Flips one byte inside a tensor record of an item of ``path``: of the first item holding one
    (``first``), else of the biggest. Returns the record's offset in the file."""
    records = []
    for start, end, infos in distcp_items(path):
        for info in infos:
            if '/data/' in info.filename and info.file_size >= 64:
                records.append((start, info))
    start, info = records[0] if first else max(records, key=lambda r: r[1].file_size)
    with open(path, 'r+b') as f:
        f.seek(start + info.header_offset + 26)
        name_length, extra_length = struct.unpack('<HH', f.read(4))
        at = start + info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    return start


def torch_save_bytes(pickled):
    """A torch.save-like zip holding the pickle ``pickled`` and no storage."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w') as z:
        z.writestr('archive/data.pkl', pickled)
        z.writestr('archive/byteorder', 'little')
        z.writestr('archive/version', '3\n')
    return buf.getvalue()


def gadget_pickle(command, wrap=lambda g: g):
    return pickle_dumps(wrap(_Call(os.system, command)))


def write(path, data):
    with open(path, 'wb' if isinstance(data, bytes) else 'w') as f:
        f.write(data)


def pickle_dumps(obj):
    return pickle.dumps(obj, protocol=2)


def errors_of(p):
    return [line for line in p.stdout.splitlines() if line.startswith('error:')]


def python_module(binary):
    """The reshard module built beside ``binary``, or None."""
    module_dir = os.path.join(os.path.dirname(binary), 'python')
    if not glob.glob(os.path.join(module_dir, 'reshard', '_reshard*.so')):
        return None
    sys.path.insert(0, module_dir)
    import reshard
    return reshard


class DcpDamagedItemTests(HostileTestCase):
    """One flipped byte inside a tensor record of `__0_0.distcp`: refused wherever it is read."""

    FLAVOURS = {  # name: (sample, the exports that read the damaged tensor, extra args, first record)
        'torch_dist 0.19': ('megatron-core/0.19/w2_tp2', [['--to', 'consolidated'], ['--to', 'megatron', '--tp', 1, '--pp', 1],
                                                         ['--to', 'megatron', '--tp', 2, '--pp', 1]], MC_SIZES, False),
        'torch_dist 0.14': ('megatron-core/0.14/w2_tp2', [['--to', 'consolidated'], ['--to', 'megatron', '--tp', 1, '--pp', 1],
                                                         ['--to', 'megatron', '--tp', 2, '--pp', 1]], MC_SIZES, False),
        'plain DCP': ('dcp/single_model_optim', [['--to', 'consolidated']], [], False),
        'torchtitan': ('torchtitan/fsdp2_w2/step-1', [['--to', 'consolidated'], ['--to', 'hf']],
                       ['--set', 'num_attention_heads=4'], True),
    }

    def damaged(self, sample, first):
        src = self.path(sample.replace('/', '_'))
        shutil.copytree(os.path.join(DATA, sample), src)
        distcp = sorted(glob.glob(os.path.join(src, '**', '__0_0.distcp'), recursive=True))[0]
        start = flip_byte_in_distcp(distcp, first)
        return src, distcp, start

    def test_a_flipped_byte_in_an_item_is_refused_by_every_reader(self):
        module = python_module(support.RESHARD)
        for flavour, (sample, exports, extra, first) in self.FLAVOURS.items():
            with self.subTest(flavour=flavour):
                src, distcp, start = self.damaged(sample, first)
                damage = [f'{distcp}', f'of the item at bytes {start}-', 'does not have the CRC-32']
                # Without --deep lint reads no CRC (a plain DCP folder's lint has its own error:
                # convert needs a rule set); --deep adds the damaged record's.
                shallow = errors_of(support.reshard('lint', src, *extra))
                p = support.reshard('lint', src, *extra, '--deep')
                self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                errors = [e for e in errors_of(p) if e not in shallow]
                self.assertEqual(len(errors), 1, p.stdout)
                self.assertIn(f'error: {distcp} [bytes {start}-', errors[0])
                self.assertIn('does not have the CRC-32 its zip directory records', errors[0])
                for export in exports:
                    out = self.path('out')
                    self.assertRefused(['export', src, out, *export, *extra, '-q'],
                                       damage + ['nothing was published', '--no-check-crc'],
                                       watch=[src], out=out)
                unchecked = self.path('unchecked', sample.replace('/', '_'))
                p = support.reshard('export', src, unchecked, *exports[0], *extra, '--no-check-crc', '-q')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                if module is not None:
                    self.check_module(module, src, extra, damage)

    def check_module(self, module, src, extra, damage):
        flags = list(zip(extra[::2], extra[1::2]))
        values = dict(value.split('=', 1) for flag, value in flags if flag == '--set')
        vocab = {'vocab_size': int(value) for flag, value in flags if flag == '--vocab-size'}
        ckpt = module.open(src, set=values or None, **vocab)
        errors = []
        for name in ckpt.keys():
            try:
                ckpt.tensor(name)
            except module.Error as e:
                errors.append(str(e))
        self.assertTrue(errors, 'tensor() read the damaged item without a word')
        for needle in damage:
            self.assertIn(needle, errors[0])


class MegatronCoreMetadataTests(HostileTestCase):
    """A torch_dist save's common.pt and metadata.json, broken: refused naming the file, never read
    as a plain DCP folder (which would write the raw keys and lose the args and iteration)."""

    def sample(self, version='0.14', case=''):
        src = self.path('src', version, ''.join(c for c in case if c.isalnum()) or 'intact')
        shutil.copytree(os.path.join(DATA, 'megatron-core', version, 'w2_tp2'), src)
        return src

    def assertEveryCommandRefuses(self, src, needles):
        out = self.path('out')
        for args in (['lint', src], ['inspect', src], ['export', src, out, '--to', 'consolidated'],
                     ['export', src, out, '--to', 'megatron', '--tp', 1, '--pp', 1, *MC_SIZES],
                     ['convert', src, os.path.join(out, 'global_step1'), '--tp', 1, '--pp', 1,
                      *MC_SIZES]):
            with self.subTest(command=args[0], to=args[4] if len(args) > 4 else None):
                self.assertRefused(args, needles, out=out if args[0] in ('export', 'convert') else None)

    def test_the_samples_read_with_their_models(self):
        # The refusals below are not the only answer: the intact samples read as their models.
        for version in ('0.14', '0.19'):
            p = support.reshard('inspect', os.path.join(DATA, 'megatron-core', version, 'w2_tp2'))
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn('rule set', p.stdout)

    def test_a_broken_common_pt(self):
        pwned = self.path('pwned')
        for case, make, needles in (
                ('missing', os.remove, ['has neither common.pt', 'nor a common_state item']),
                ('FIFO', replace_with_fifo, ['common.pt is a FIFO (named pipe), not a regular file']),
                ('/dev/zero', lambda p: replace_with_link(p, '/dev/zero'),
                 ['common.pt is a character device, not a regular file']),
                ('gadget', lambda p: write(p, torch_save_bytes(gadget_pickle(f'touch {pwned}')))
                 , ['common.pt', "pickle refers to class 'posix.system'", 'never runs code']),
                ('gadget args', lambda p: write(p, torch_save_bytes(
                    gadget_pickle(f'touch {pwned}', lambda g: {'args': g, 'iteration': 3}))),
                 ['common.pt', "pickle refers to class 'posix.system'"]),
                ('not a dict', lambda p: write(p, torch_save_bytes(pickle_dumps([1, 2]))),
                 ['common.pt holds [1, 2], not the dict Megatron saves']),
                ('args not a Namespace', lambda p: write(p, torch_save_bytes(pickle_dumps({'args': 7}))),
                 ['common.pt holds args 7, not an argparse.Namespace'])):
            with self.subTest(case=case):
                src = self.sample(case=case)
                make(os.path.join(src, 'common.pt'))
                self.assertEveryCommandRefuses(src, [src] + needles)
                self.assertFalse(os.path.exists(pwned), 'reshard executed code from a pickle')

    def test_a_broken_metadata_json(self):
        for version in ('0.14', '0.19'):
            for case, make, needles in (
                    ('not JSON', lambda p: write(p, '{"sharded_backend": '), ['is not valid JSON']),
                    ('empty', lambda p: write(p, ''), ['is not valid JSON']),
                    ('an array', lambda p: write(p, '["torch_dist"]'), ["holds ['torch_dist'], not a JSON object"]),
                    ('zarr', lambda p: write(p, '{"sharded_backend": "zarr", "sharded_backend_version": 1}'),
                     ["has sharded_backend 'zarr' where Megatron-Core writes 'torch_dist'"]),
                    ('version 99', lambda p: write(p, '{"sharded_backend": "torch_dist", '
                                                                 '"sharded_backend_version": 99}'),
                     ['has sharded_backend_version 99 where Megatron-Core writes 1']),
                    ('FIFO', replace_with_fifo, ['is a FIFO (named pipe), not a regular file']),
                    ('/dev/zero', lambda p: replace_with_link(p, '/dev/zero'), ['is a character device'])):
                with self.subTest(version=version, case=case):
                    src = self.sample(version, case)
                    marker = os.path.join(src, 'metadata.json')
                    make(marker)
                    self.assertEveryCommandRefuses(src, [marker] + needles)

    def test_a_gadget_in_the_common_state_item(self):
        src = self.sample('0.19')
        pwned = self.path('pwned')
        distcp = os.path.join(src, '__0_0.distcp')
        # The common_state item is the one bytes item whose object is [{}] (the samples record no args).
        start, end, _ = next((s, e, i) for s, e, i in distcp_items(distcp)
                             if not any('/data/' in x.filename for x in i) and
                             self.item_pickle(distcp, s, e) == b'\x80\x02]q\x00}q\x01a.')
        with open(distcp, 'r+b') as f:
            f.seek(start)
            f.write(archive_of_length(gadget_pickle(f'touch {pwned}', lambda g: [g]), end - start))
        self.assertEveryCommandRefuses(src, [src, 'common_state', "pickle refers to class 'posix.system'",
                                             'never runs code'])
        self.assertFalse(os.path.exists(pwned), 'reshard executed code from a pickle')

    @staticmethod
    def item_pickle(path, start, end):
        with open(path, 'rb') as f:
            f.seek(start)
            with zipfile.ZipFile(io.BytesIO(f.read(end - start))) as z:
                return z.read('archive/data.pkl')

    def test_a_gadget_in_the_metadata_save_plans(self):
        # 0.14's .metadata holds its ranks' save plans as megatron.core's MCoreSavePlan, read as an
        # inert record; os.system called in its place is refused as in any other pickle.
        src = self.sample('0.14')
        path = os.path.join(src, '.metadata')
        with open(path, 'rb') as f:
            data = f.read()
        plan = b'\x8c1megatron.core.dist_checkpointing.strategies.torch\x94\x8c\rMCoreSavePlan\x94\x93\x94)\x81\x94'
        self.assertIn(plan, data)
        gadget = b'\x8c\x05posix\x94\x8c\x06system\x94\x93\x94\x8c\x0btouch PWNED\x85R\x94'
        # Protocol 4: one FRAME (opcode, 8-byte length) holds the rest of the file.
        self.assertEqual(data[2:3], b'\x95')
        frame = struct.unpack('<Q', data[3:11])[0] - len(plan) + len(gadget)
        with open(path, 'wb') as f:
            f.write(data[:3] + struct.pack('<Q', frame) + data[11:].replace(plan, gadget))
        self.assertEveryCommandRefuses(src, [path, "pickle refers to class 'posix.system'", 'never runs code'])


def archive_of_length(pickled, length):
    """A torch.save-like zip of exactly ``length`` bytes holding ``pickled``, padded by a record."""
    for pad in range(length):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, 'w') as z:
            z.writestr('archive/data.pkl', pickled)
            z.writestr('archive/version', '3\n')
            z.writestr('archive/pad', b'\0' * pad)
        if len(buf.getvalue()) == length:
            return buf.getvalue()
    raise AssertionError(f'no archive of {length} bytes holds the pickle')


class MisleadingInputTests(HostileTestCase):
    """Input refused for what it is, not as a DeepSpeed folder that is not one."""

    def test_a_metadata_that_is_no_regular_file(self):
        for case, make, what in (('FIFO', replace_with_fifo, 'a FIFO (named pipe)'),
                                 ('/dev/zero', lambda p: replace_with_link(p, '/dev/zero'), 'a character device'),
                                 ('folder', lambda p: (os.remove(p), os.mkdir(p)), 'a folder')):
            with self.subTest(case=case):
                src = self.path(case.strip('/'))
                shutil.copytree(os.path.join(DATA, 'dcp', 'single_model_optim'), src)
                path = os.path.join(src, '.metadata')
                make(path)
                for args in (['lint', src], ['export', src, self.path('out'), '--to', 'consolidated']):
                    self.assertRefused(args, [f'{path} is {what}, not a regular file'],
                                       out=self.path('out') if args[0] == 'export' else None)

    def test_an_empty_or_truncated_metadata(self):
        src = self.path('src')
        shutil.copytree(os.path.join(DATA, 'dcp', 'single_model_optim'), src)
        path = os.path.join(src, '.metadata')
        with open(path, 'rb') as f:
            data = f.read()
        for case, cut, needles in (('empty', 0, [f'{path} is empty']),
                                   ('cut short', len(data) // 2, [f'{path} ({len(data) // 2} bytes): malformed pickle'])):
            with self.subTest(case=case):
                with open(path, 'wb') as f:
                    f.write(data[:cut])
                self.assertRefused(['lint', src], needles + ['not a readable Distributed Checkpoint .metadata file'])

    def test_a_megatron_lm_tracker_naming_no_iteration(self):
        for case, make, needles in (
                ('a path', lambda p: write(p, '../../../etc\n'), ["holds '../../../etc', not an iteration"]),
                ('10^40', lambda p: write(p, '1' + '0' * 40), ["holds '1" + '0' * 39]),
                ('-1', lambda p: write(p, '-1\n'), ["holds '-1', not an iteration"]),
                ('FIFO', lambda p: os.mkfifo(p), ['is a FIFO (named pipe), not a regular file'])):
            with self.subTest(case=case):
                root = self.path(case.replace(' ', '_').replace('^', ''))
                os.makedirs(root)
                tracker = os.path.join(root, 'latest_checkpointed_iteration.txt')
                make(tracker)
                for args in (['lint', root], ['export', root, self.path('out'), '--to', 'consolidated']):
                    self.assertRefused(args, [tracker] + needles, out=self.path('out') if args[0] == 'export' else None)

    def test_a_megatron_lm_rank_file_that_is_a_gadget(self):
        root = self.path('mlm')
        p = support.reshard('export', os.path.join(DATA, 'megatron-core', '0.19', 'w2_tp2'), root, '--to', 'megatron',
                            '--tp', 1, '--pp', 1, *MC_SIZES, '-q')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rank_file = glob.glob(os.path.join(root, 'iter_*', 'mp_rank_00', 'model_optim_rng.pt'))[0]
        pwned = self.path('pwned')
        with open(rank_file, 'wb') as f:
            f.write(torch_save_bytes(gadget_pickle(f'touch {pwned}')))
        self.assertRefused(['lint', root], [rank_file, "pickle refers to class 'posix.system'", 'never runs code'])
        self.assertFalse(os.path.exists(pwned), 'reshard executed code from a pickle')


if __name__ == '__main__':
    support.main()
