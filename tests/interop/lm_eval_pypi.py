"""Real lm-evaluation-harness (lm-eval) and Transformers from PyPI, for Debian's python3 and its torch
(python3-torch), for the tests that evaluate a model with lm-eval on the host: the reshard Python
module is built for that python3, so these run beside it, not in the torch 2 chroot.

ensure() fetches the pinned wheels once per machine into the PyPI cache as megatron_core_pypi.py
fetches Megatron-Core's (`pip wheel --no-deps`: two pins, sqlitedict and word2number, are source
releases that pip builds), unpacked into one folder; env() puts that folder first on python3's path.
Nothing is installed anywhere. The pins: lm-eval and every package it imports that Debian's
python3, python3-torch and python3-numpy do not bring, at versions that run on torch 1.13 and
numpy 1.24.
"""
import os
import sys
import unittest

import megatron_core_pypi

PINS = ('lm-eval==0.4.5', 'transformers==4.46.3', 'tokenizers==0.20.3', 'huggingface-hub==0.26.5',
        'safetensors==0.4.5', 'accelerate==0.34.2', 'peft==0.13.2', 'evaluate==0.4.3', 'datasets==3.1.0',
        'pyarrow==18.1.0', 'pandas==2.2.3', 'pytz==2024.2', 'tzdata==2024.2', 'dill==0.3.8',
        'multiprocess==0.70.16', 'xxhash==3.5.0', 'fsspec==2024.9.0', 'aiohttp==3.11.10',
        'aiohappyeyeballs==2.4.4', 'aiosignal==1.3.2', 'frozenlist==1.5.0', 'multidict==6.1.0', 'yarl==1.18.3',
        'propcache==0.2.1', 'sqlitedict==2.1.0', 'jinja2==3.1.4', 'markupsafe==3.0.2', 'sacrebleu==2.4.3',
        'portalocker==3.0.0', 'tabulate==0.9.0', 'colorama==0.4.6', 'lxml==5.3.0', 'zstandard==0.23.0',
        'jsonlines==4.0.0', 'packaging==24.2', 'filelock==3.16.1', 'regex==2024.11.6', 'tqdm==4.67.1',
        'more-itertools==10.5.0', 'word2number==1.1', 'pytablewriter==1.2.0', 'DataProperty==1.0.1',
        'mbstrdecoder==1.1.3', 'tabledata==1.3.3', 'tcolorpy==0.1.6', 'typepy==1.3.2', 'pathvalidate==3.2.1',
        'chardet==5.2.0')
MARKER = os.path.join('lm_eval', 'models', 'huggingface.py')


def site_or_skip():
    """The unpacked wheels' folder; else the test (or its class) is skipped with one line saying why."""
    version = '%d.%d' % sys.version_info[:2]
    pip = [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--prefer-binary', *PINS, '--wheel-dir']
    site, why = megatron_core_pypi.cached_site(
        PINS, MARKER, version,
        lambda site: megatron_core_pypi.unpack_wheels(site, pip, 'pip could not fetch lm-eval and what it imports'))
    if site is None:
        print('skipped:', why, file=sys.stderr)
        raise unittest.SkipTest(why)
    return site


def env(site, *paths):
    """The environment for a python3 that imports the pins from `site` (and `paths` before them), with
    no network: the model, its tokenizer and the tasks' data are local, nothing is downloaded, and
    the caches lm-eval's libraries keep go to HF_HOME (set it to a temporary folder)."""
    e = dict(os.environ)
    e['PYTHONPATH'] = os.pathsep.join([*paths, site, e.get('PYTHONPATH', '')]).rstrip(os.pathsep)
    e.update(HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', TRANSFORMERS_OFFLINE='1',
             TRANSFORMERS_NO_ADVISORY_WARNINGS='1', TOKENIZERS_PARALLELISM='false')
    return e
