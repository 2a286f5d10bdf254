#!/usr/bin/python3
"""Compare reshard's ``export --to universal`` with DeepSpeed's ``ds_to_universal``, file by file.

Local tool, not run in CI.  For each committed case of tests/data/ds_universal (DeepSpeed's own
output, see its README) it regenerates the native source from ``case.json`` (``write_nonpipe``
for the ``nonpipe_*`` cases, ``make_fixture`` for the pipeline ones), runs

    reshard export SRC ROOT/global_stepN_universal --to universal

(so that ``latest_universal`` lands beside it under the same name DeepSpeed used) and compares
the two trees:

  * the set of files (parameter folders, state files, model-state copies, ``latest*``);
  * every ``.pt`` file: the type of the saved object (dict / raw tensor / number), dict keys and
    their order, every non-tensor value, and every tensor's dtype, shape, strides, storage size
    (a view saved with more storage than it shows) and values **bit for bit**;
  * objects inside pickles (loss scaler, ZeroStageEnum, ...) by class and attributes;
  * text files by content.

``--pair A B`` compares two universal roots directly (no reshard run).  ``--deepspeed-src`` reruns
DeepSpeed instead of reading the committed data (through tools/make_ds_universal_data.py, which
shares the source writer and the DeepSpeed import with this tool).

Usage (PYTHONPATH must reach the repository's tests/ folder):

    PYTHONPATH=tests /usr/bin/python3 tools/ds_universal_compare.py --reshard build/reshard \
        [--case nonpipe_zero2_bf16_dp2 ...] [--deepspeed-src SRC] [--keep DIR]
    PYTHONPATH=tests /usr/bin/python3 tools/ds_universal_compare.py --pair DS_ROOT OTHER_ROOT

Every difference is printed, one line each, grouped by file; exit status 0 when there are none
(byte-identical files are counted), 1 otherwise, 2 when reshard refuses the source.
"""

import argparse
import collections
import filecmp
import io
import json
import os
import pickletools
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Any, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, 'tests'))
from fixtures import megatron_fixture as mf  # noqa: E402

DATA = os.path.join(REPO, 'tests', 'data', 'ds_universal')
IGNORED = {'case.json'}  # the data's own record, not DeepSpeed output


def describe(x: Any) -> str:
    if torch.is_tensor(x):
        return f'tensor {x.dtype} {tuple(x.shape)}'
    if isinstance(x, dict):
        return f'{type(x).__name__} with {len(x)} keys'
    if isinstance(x, (list, tuple)):
        return f'{type(x).__name__} of {len(x)}'
    return f'{type(x).__module__}.{type(x).__qualname__} {x!r}'[:120]


def storage_bytes(t: torch.Tensor) -> int:
    if hasattr(t, 'untyped_storage'):
        return t.untyped_storage().nbytes()
    st = t.storage()  # torch 1.13: a TypedStorage
    return st.size() * st.element_size()


def tensor_differences(a: torch.Tensor, b: torch.Tensor, where: str) -> List[str]:
    out = []
    if a.dtype != b.dtype:
        out.append(f'{where}: dtype {a.dtype} vs {b.dtype}')
    if tuple(a.shape) != tuple(b.shape):
        out.append(f'{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}')
    if a.is_contiguous() != b.is_contiguous() or (a.numel() > 1 and a.stride() != b.stride()):
        out.append(f'{where}: strides {a.stride()} vs {b.stride()}')
    sa, sb = storage_bytes(a), storage_bytes(b)
    if sa != sb:
        out.append(f'{where}: storage {sa} bytes vs {sb} bytes (shown: {a.numel() * a.element_size()} vs '
                   f'{b.numel() * b.element_size()})')
    if out:
        return out
    if a.numel() == 0:
        return out
    ia, ib = (t.contiguous().reshape(-1).view(torch.uint8).reshape(t.numel(), -1) for t in (a, b))
    bad = (ia != ib).any(dim=1).nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        out.append(f'{where}: {bad.numel()} of {a.numel()} elements differ in bits (first flat index {i}: '
                   f'{a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r})')
    return out


def differences(a: Any, b: Any, where: str) -> List[str]:
    """Every difference between two unpickled objects, bit-exact for tensors and floats."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return [f'{where}: {describe(a)} vs {describe(b)}']
        return tensor_differences(a, b, where)
    if type(a) is not type(b):
        return [f'{where}: {describe(a)} vs {describe(b)}']
    if isinstance(a, dict):
        out = []
        ka, kb = list(a), list(b)
        only_a, only_b = [k for k in ka if k not in b], [k for k in kb if k not in a]
        if only_a:
            out.append(f'{where}: keys only in the first: {only_a}')
        if only_b:
            out.append(f'{where}: keys only in the second: {only_b}')
        common_a, common_b = [k for k in ka if k in b], [k for k in kb if k in a]
        if common_a != common_b:
            out.append(f'{where}: key order {common_a} vs {common_b}')
        for k in common_a:
            out += differences(a[k], b[k], f'{where}[{k!r}]')
        return out
    if isinstance(a, (list, tuple)):
        out = []
        if len(a) != len(b):
            out.append(f'{where}: length {len(a)} vs {len(b)}')
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f'{where}[{i}]')
        return out
    if isinstance(a, (set, frozenset)):
        return [] if a == b else [f'{where}: {sorted(map(repr, a))} vs {sorted(map(repr, b))}']
    if isinstance(a, float):
        same = (a == b and str(a) == str(b)) or (a != a and b != b)
        return [] if same else [f'{where}: {a!r} vs {b!r}']
    if a is None or isinstance(a, (bool, int, str, bytes, torch.dtype, torch.Size)):
        return [] if a == b else [f'{where}: {a!r} vs {b!r}']
    if isinstance(a, int):  # int enums (ZeroStageEnum) and other int subclasses
        return [] if (int(a), repr(a)) == (int(b), repr(b)) else [f'{where}: {a!r} vs {b!r}']
    if hasattr(a, '__dict__'):  # pickled objects (loss scaler, fragment addresses): by attributes
        return differences(vars(a), vars(b), f'{where}.__dict__')
    return [] if a == b else [f'{where}: {a!r} vs {b!r}']


MEMO_OPS = {'PUT', 'BINPUT', 'LONG_BINPUT', 'MEMOIZE'}


def pickle_ops(data: bytes, strip_memo: bool) -> List[str]:
    out = []
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        if strip_memo and op.name in MEMO_OPS:
            continue
        out.append(f'{op.name} {arg!r}' if arg is not None else op.name)
    return out


def byte_differences(pa: str, pb: str) -> List[str]:
    """Why two .pt files that unpickle to the same objects differ in bytes (zip records, pickle)."""
    try:
        za, zb = zipfile.ZipFile(pa), zipfile.ZipFile(pb)
    except zipfile.BadZipFile:
        return ['not both zip archives (legacy torch.save format?)']
    na, nb = za.namelist(), zb.namelist()
    out = []
    if na != nb:
        out.append(f'zip records {na} vs {nb}')
    for name in (n for n in na if n in nb):
        ra, rb = za.read(name), zb.read(name)
        if ra == rb:
            continue
        if name.endswith('data.pkl'):
            if pickle_ops(ra, True) == pickle_ops(rb, True):
                ca = sum(op in MEMO_OPS for op in (o.split()[0] for o in pickle_ops(ra, False)))
                cb = sum(op in MEMO_OPS for op in (o.split()[0] for o in pickle_ops(rb, False)))
                out.append(f'{name}: same pickle opcodes except memo opcodes (BINPUT etc.: {ca} vs {cb}); '
                           f'{len(ra)} vs {len(rb)} bytes')
            else:
                oa, ob = pickle_ops(ra, True), pickle_ops(rb, True)
                i = next((k for k, (x, y) in enumerate(zip(oa, ob)) if x != y), min(len(oa), len(ob)))
                gets = [sum(o.split()[0] in ('GET', 'BINGET', 'LONG_BINGET') for o in ops) for ops in (oa, ob)]
                appends = [sum(o == 'APPEND' for o in ops) for ops in (oa, ob)]
                out.append(f'{name}: pickles differ from opcode {i} ({oa[i] if i < len(oa) else "<end>"} vs '
                           f'{ob[i] if i < len(ob) else "<end>"}); memo references (objects pickled once and '
                           f'shared) {gets[0]} vs {gets[1]}, single APPENDs {appends[0]} vs {appends[1]}; '
                           f'{len(ra)} vs {len(rb)} bytes')
        else:
            out.append(f'{name}: record bytes differ ({len(ra)} vs {len(rb)} bytes)')
    if not out:
        offsets = ([i.header_offset for i in za.infolist()], [i.header_offset for i in zb.infolist()])
        out.append(f'zip records equal, laid out differently (offsets {offsets[0]} vs {offsets[1]})')
    return out


def list_files(root: str) -> List[str]:
    out = []
    for r, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(r, f), root)
            if rel not in IGNORED:
                out.append(rel)
    return sorted(out)


def load(path: str) -> Any:
    return torch.load(path, map_location='cpu', weights_only=False)


def compare_roots(a: str, b: str, names=('DeepSpeed', 'reshard')) -> dict:
    """Compares universal roots a and b (each holding latest_universal and the universal folder)."""
    mf.install_pickle_shims()
    fa, fb = list_files(a), list_files(b)
    report = {'only_a': [f for f in fa if f not in fb], 'only_b': [f for f in fb if f not in fa],
              'identical': [], 'differences': {}}
    for rel in (f for f in fa if f in fb):
        pa, pb = os.path.join(a, rel), os.path.join(b, rel)
        if filecmp.cmp(pa, pb, shallow=False):
            report['identical'].append(rel)
            continue
        if rel.endswith('.pt'):
            diffs = differences(load(pa), load(pb), '<top>')
            if not diffs:
                diffs = ['same objects, different bytes: ' + '; '.join(byte_differences(pa, pb))]
        else:
            with open(pa, 'rb') as x, open(pb, 'rb') as y:
                diffs = [f'content {x.read()!r} vs {y.read()!r}']
        report['differences'][rel] = diffs
    return report


def print_report(report: dict, names=('DeepSpeed', 'reshard')) -> int:
    a, b = names
    n = len(report['identical']) + len(report['differences'])
    print(f'  files in both: {n} ({len(report["identical"])} byte-identical, {len(report["differences"])} '
          f'differing); only in {a}: {len(report["only_a"])}; only in {b}: {len(report["only_b"])}')
    for f in report['only_a']:
        print(f'  only in {a}: {f}')
    for f in report['only_b']:
        print(f'  only in {b}: {f}')
    groups = collections.OrderedDict()  # files with the very same differences, listed together
    for rel, diffs in sorted(report['differences'].items()):
        groups.setdefault(tuple(diffs), []).append(rel)
    for diffs, files in groups.items():
        print(f'  {len(files)} file(s) ({a} vs {b}):')
        for d in diffs:
            print(f'      {d}')
        for f in files:
            print(f'        - {f}')
    return int(bool(report['only_a'] or report['only_b'] or report['differences']))


def write_source(case: str, spec: dict, root: str) -> str:
    """The native source of a committed case; returns its checkpoint root."""
    if spec.get('kind') == 'nonpipe':
        from fixtures import deepspeed_nonpipe as dn
        dn.write_nonpipe(root, dn.NonPipeConfig(**spec['nonpipe_config']))
        return root
    sys.path.insert(0, os.path.join(REPO, 'tests', 'interop'))
    from interop_support import make_fixture
    fixture = dict(spec['fixture'])
    return make_fixture(root, **fixture)


def run_case(case: str, reshard: str, tmp: str, ds_src=None, commit=None) -> int:
    with open(os.path.join(DATA, case, 'case.json')) as f:
        spec = json.load(f)
    print(f'{case}:')
    ds_root = os.path.join(DATA, case)
    if ds_src:
        import make_ds_universal_data as mk
        import ds_crosscheck as dc
        dtu, classes = dc.import_ds_to_universal(ds_src)
        ds_root = os.path.join(tmp, 'ds')
        mk.generate(case, ds_root, dtu, classes, commit or spec['deepspeed_commit'])
    src = write_source(case, spec, os.path.join(tmp, 'src'))
    out_root = os.path.join(tmp, 'reshard')
    os.makedirs(out_root)
    proc = subprocess.run([reshard, 'export', src, os.path.join(out_root, spec['universal_folder']),
                           '--to', 'universal', '-q'], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f'  reshard refused (exit {proc.returncode}): {proc.stderr.strip()}')
        return 2
    return print_report(compare_roots(ds_root, out_root))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--reshard', help='the reshard binary')
    ap.add_argument('--case', action='append', help='committed cases to compare (default: nonpipe_zero2_*)')
    ap.add_argument('--deepspeed-src', help='rerun DeepSpeed from this source tree instead of reading the data')
    ap.add_argument('--keep', help='keep the sources and outputs under this folder')
    ap.add_argument('--pair', nargs=2, metavar=('A', 'B'), help='compare two universal roots and exit')
    ns = ap.parse_args(argv)
    if ns.pair:
        return print_report(compare_roots(*ns.pair), names=('A', 'B'))
    if not ns.reshard:
        ap.error('--reshard BIN is needed (or --pair A B)')
    reshard = os.path.abspath(ns.reshard)
    cases = ns.case or sorted(c for c in os.listdir(DATA) if c.startswith('nonpipe_zero2_'))
    status = 0
    for case in cases:
        if ns.keep:
            tmp = os.path.join(ns.keep, case)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            status = max(status, run_case(case, reshard, tmp, ns.deepspeed_src))
        else:
            with tempfile.TemporaryDirectory(prefix='ds-universal-compare-') as tmp:
                status = max(status, run_case(case, reshard, tmp, ns.deepspeed_src))
    return status


if __name__ == '__main__':
    sys.exit(main())
