#!/usr/bin/python3
"""Run DeepSpeed's own ds_to_universal.py from a DeepSpeed source tree on Debian's torch 1.13.

  /usr/bin/python3 benchmarks/ds_to_universal_launcher.py DEEPSPEED_SRC [ds_to_universal args...]

Importing the ``deepspeed`` package runs its ``__init__``, which loads the training engine and
needs packages (pydantic, hjson, py-cpuinfo, a recent torch, ...) that this machine does not
have.  ds_to_universal only needs ``deepspeed.checkpoint``, which imports nothing but torch, so
the launcher registers ``deepspeed`` as a bare package whose path is the source tree's
``deepspeed/`` folder (its ``__init__`` is skipped; every submodule loads from the source as
usual), registers the stand-ins of tests/fixtures for the classes the checkpoint pickles
(``deepspeed.utils.tensor_fragment.fragment_address``, loss scalers; the real module
``deepspeed.utils`` also pulls in the engine; the stand-in offers its ``logger``), and runs
the script as ``__main__``.  The
conversion code that is timed is DeepSpeed's, unchanged.  ``tqdm`` must be importable
(Debian: python3-tqdm).
"""

import logging
import os
import runpy
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), 'tests'))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    src = os.path.abspath(sys.argv[1])
    script = os.path.join(src, 'deepspeed', 'checkpoint', 'ds_to_universal.py')
    if not os.path.exists(script):
        sys.exit(f'{script} not found: pass the root of a DeepSpeed source tree')
    package = types.ModuleType('deepspeed')
    package.__path__ = [os.path.join(src, 'deepspeed')]
    sys.modules['deepspeed'] = package
    from fixtures.megatron_fixture import install_pickle_shims  # noqa: E402
    install_pickle_shims()
    # The stand-in deepspeed.utils package also has to offer the logger that
    # deepspeed.checkpoint.autoep_universal imports from the real one.
    sys.modules['deepspeed.utils'].logger = logging.getLogger('DeepSpeed')
    sys.argv = [script] + sys.argv[2:]
    runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
    main()
