"""Real Hugging Face Accelerate and Transformers from PyPI, run in the torch 2.6 chroot
(torch2_chroot.py) on the CPU with gloo, for the tests that need Accelerate's own FSDP save and load.

The wheels are fetched once per machine into the PyPI cache as megatron_core_pypi.py fetches
Megatron-Core's (its ensure(), with these pins), and mounted on the path of the chroot's Python;
nothing is installed into the chroot or anywhere else. The pins: accelerate and transformers, and
what they import that Debian's python3-torch does not bring (numpy, PyYAML, psutil, requests,
packaging and filelock are the chroot's own).
"""
import sys

import megatron_core_pypi
import torch2_chroot

PINS = ('accelerate==1.6.0', 'transformers==4.51.3', 'huggingface-hub==0.30.2', 'tokenizers==0.21.1',
        'safetensors==0.5.3', 'regex==2024.11.6', 'tqdm==4.67.1')
MARKER = 'accelerate/utils/fsdp_utils.py'
INSIDE = '/accelerate-site'  # where run() mounts the unpacked wheels in the chroot

# Run first by every script: the unpacked wheels on the path, and no network (a tiny model is
# built from its config, nothing is downloaded).
PRELUDE = r'''
import os, sys
sys.path.insert(0, %r)
os.environ['HF_HUB_OFFLINE'] = '1'
os.environ['TRANSFORMERS_NO_ADVISORY_WARNINGS'] = '1'
''' % INSIDE


def site_or_skip(root):
    """The unpacked wheels' folder for the chroot at `root`; else the test (or its class) is skipped
    with one line saying why."""
    import unittest
    site, why = megatron_core_pypi.ensure(root, PINS, MARKER)
    if site is None:
        print('skipped:', why, file=sys.stderr)
        raise unittest.SkipTest(why)
    return site


def run(root, site, script, binds, timeout=300):
    """torch2_chroot.run of PRELUDE + script, with the wheels at `site` mounted where PRELUDE looks."""
    return torch2_chroot.run(root, PRELUDE + script, {**binds, site: INSIDE}, timeout=timeout)
