"""Shared by the interop tests: the reshard binary under test, and a deep
comparison of unpickled checkpoint files.

Every test script is run as `/usr/bin/python3 tests/interop/test_x.py --reshard BIN`
(with PYTHONPATH=tests) and ends with `interop_support.main()`.
"""
import os
import subprocess
import sys
import enum
import unittest

import numpy
import torch

from fixtures import megatron_fixture as mf

RESHARD = None  # absolute path of the binary under test, set by main()


def reshard(*args, timeout=300):
    """Runs the binary; returns the CompletedProcess (text output)."""
    return subprocess.run([RESHARD, *map(str, args)], capture_output=True, text=True, timeout=timeout)


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
