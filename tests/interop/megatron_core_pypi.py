"""Real Megatron-Core from PyPI, run in the torch 2.6 chroot (torch2_chroot.py), for the tests that
need the framework itself to write a checkpoint or to load one.

ensure() downloads the pinned wheels once per machine (`pip download --no-deps`, for the chroot's
Python) into a cache under $RESHARD_PYPI_CACHE (default /var/cache/reshard/pypi), one folder per set
of pins, and unpacks them there; run() runs a python3 script in the chroot with them first on its
path. Nothing is installed into the chroot or anywhere else.

The pins: Megatron-Core itself, and the pure-Python packages it imports that Debian's python3-torch
does not bring (torch.utils.cpp_extension, which Megatron-Core imports, imports setuptools).
Megatron-Core's wheel holds one compiled module (its dataset helpers), which these tests never load.
"""
import fcntl
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile

import interop_support as support
from interop_support import FixtureTestCase
import torch2_chroot

PINS = ('megatron-core==0.19.1', 'setuptools==80.9.0', 'packaging==25.0')
CACHE = os.environ.get('RESHARD_PYPI_CACHE', '/var/cache/reshard/pypi')
INSIDE = '/megatron-core-site'  # where run() mounts the unpacked wheels in the chroot

# Run first by every script: the unpacked wheels on the path, and what a CPU-only host lacks.
# * Megatron-Core's pipeline schedules import the MoE paged-stash kernels, which import triton (a
#   GPU compiler that is no pure-Python wheel): a stand-in module, whose kernels refuse to run.
# * Megatron-Core moves tensors to the GPU where it all-reduces them (a tied model's last stage
#   copies the word embedding so; dist_checkpointing.save agrees on failures so) and waits for the
#   GPU before writing: without CUDA, .cuda() keeps a tensor where it is, the current device is
#   the CPU and there is nothing to wait for, so gloo does the collectives on the CPU.
# * Megatron-Core 0.19's load reads the common state (and its tensors) with torch's
#   `dcp.load(..., no_dist=True)`, each rank alone, a keyword torch 2.6's dcp.load lacks: it goes
#   to torch 2.6's own one-process reader (`_load_state_dict(no_dist=True)`), which dcp.load calls
#   for such plain state dicts.
# * dist_checkpointing.save (synchronous in every script here) writes in the rank's own process and hands
#   the write results back through a queue kept by a spawned multiprocessing manager: a fresh Python that
#   imports torch to unpickle them, seconds per rank on this host. The results never leave the process, so
#   an in-process queue carries them.
PRELUDE = r'''
import sys, types
sys.path.insert(0, %r)
import torch
_stash = types.ModuleType('megatron.core.transformer.moe.ops.paged_stash')
_stash.GLOBAL_BLOCK_SIZE = 1024
def _needs_triton(*args, **kwargs):
    raise RuntimeError('the MoE paged stash kernels need triton, which this CPU-only run lacks')
_stash.paged_stash_copy_kernel = _stash.paged_stash_pop_kernel = _needs_triton
sys.modules[_stash.__name__] = _stash
import inspect
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint import state_dict_loader as _dcp_loader
if 'no_dist' not in inspect.signature(_dcp_loader.load).parameters:
    def _dcp_load(state_dict, storage_reader=None, planner=None, *, no_dist=False, **kwargs):
        if not no_dist:
            return _dcp_loader.load(state_dict, storage_reader=storage_reader, planner=planner, **kwargs)
        return _dcp_loader._load_state_dict(state_dict, storage_reader=storage_reader, planner=planner, no_dist=True)
    _dcp.load = _dcp_load
if not torch.cuda.is_available():
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: 'cpu'
    torch.cuda.synchronize = lambda *args, **kwargs: None
import queue
from megatron.core.dist_checkpointing.strategies import filesystem_async as _filesystem_async
_write_results = queue.Queue()
_filesystem_async.get_write_results_queue = lambda *args, **kwargs: _write_results
''' % INSIDE


def _python_version(root):
    """The chroot's Python as pip's --python-version wants it ('3.13'), or None."""
    found = sorted(glob.glob(os.path.join(root, 'usr', 'lib', 'python3.*')))
    return os.path.basename(found[-1])[len('python'):] if found else None


def site_or_skip(root):
    """The unpacked wheels' folder for the chroot at `root`; else the test (or its class) is skipped
    with one line saying why."""
    import unittest
    site, why = ensure(root)
    if site is None:
        print('skipped:', why, file=sys.stderr)
        raise unittest.SkipTest(why)
    return site


def ensure(root, pins=PINS, marker=os.path.join('megatron', 'core', '__init__.py')):
    """(folder of the unpacked pinned wheels, None), or (None, one line saying why they cannot be had).
    `pins` and `marker` (a file of the unpacked folder that shows it complete) are Megatron-Core's by
    default; another framework's tests pass their own."""
    version = _python_version(root)
    if version is None:
        return None, f'the torch 2 chroot {root} has no python3.N library folder'
    return cached_site(pins, marker, version, lambda site: _download(site, version, pins))


def cached_site(pins, marker, version, fill):
    """(the cache's folder for `pins` and Python `version`, None), filled once per machine by
    fill(site), which returns None or one line saying why it could not; or (None, that line)."""
    key = hashlib.sha256(' '.join(tuple(pins) + (version, platform.machine())).encode()).hexdigest()[:16]
    site = os.path.join(CACHE, key)
    if os.path.exists(os.path.join(site, marker)):
        return site, None
    try:
        os.makedirs(CACHE, exist_ok=True)
    except OSError as e:
        return None, f'cannot make the PyPI cache {CACHE} ({e}): set RESHARD_PYPI_CACHE'
    # One downloader at a time; a second waits, then finds the folder finished.
    with open(site + '.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(site):
            why = fill(site)
            if why:
                return None, why
    return site, None


def _download(site, version, pins):
    """Downloads the pins' wheels for the chroot's Python and unpacks them into `site`. Returns None,
    or why it failed."""
    machine = platform.machine()
    # Exact pins: pip takes a yanked release (megatron-core 0.19.1 is) only when pinned so.
    argv = [sys.executable, '-m', 'pip', 'download', '--no-deps', '--only-binary=:all:', '--python-version',
            version, '--implementation', 'cp', '--platform', f'manylinux_2_28_{machine}',
            '--platform', f'manylinux2014_{machine}', *pins]
    return unpack_wheels(site, argv + ['--dest'], f'pip could not download {" ".join(pins)} for Python {version}')


def unpack_wheels(site, pip, failure):
    """Runs `pip` (an argv that ends with the option naming the folder the wheels go to), then unpacks
    the wheels into site.partial, renamed to `site` only when complete. Returns None, or `failure`
    and pip's last line."""
    partial, wheels = site + '.partial', site + '.wheels'
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(wheels, ignore_errors=True)
    p = subprocess.run(pip + [wheels], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ['no output'])[-1]
        return f'{failure}: {last}'
    os.makedirs(partial)
    for wheel in sorted(glob.glob(os.path.join(wheels, '*.whl'))):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(partial)
    shutil.rmtree(wheels)
    os.rename(partial, site)
    return None


def run(root, site, script, binds, timeout=300):
    """torch2_chroot.run of PRELUDE + script, with the wheels at `site` mounted where PRELUDE looks."""
    return torch2_chroot.run(root, PRELUDE + script, {**binds, site: INSIDE}, timeout=timeout)


# Run by the scripts of the tests that start Megatron-Core ranks (after torch2_chroot.END_RANK): each
# rank joins a gloo group of `world` (start) and ends once the others have (end_rank(dist)); worlds
# runs fn(rank, port, world, *case) in `world` forked processes for each (world, *case), one world after
# another.
RANKS = r'''
import datetime, gc, socket
import torch.distributed as dist
import torch.multiprocessing as mp
# Every such script builds a GPTModel of the local spec: imported once, before the ranks fork, rather than
# by each rank of each case.
import megatron.core.models.gpt.gpt_layer_specs

def start(r, port, world):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=r, world_size=world,
                            timeout=datetime.timedelta(seconds=120))

def worlds(fn, cases):
    # What the ranks inherit (torch, Megatron-Core, the script) lives as long as they do: kept out of the
    # collections Megatron-Core runs at each optimizer state dict, which would walk it all in every rank.
    gc.freeze()
    for world, *case in cases:
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
        mp.start_processes(fn, args=(port, world, *case), nprocs=world, start_method='fork')
'''

# Run by the scripts that step Megatron-Core's distributed optimizer (torch's Adam, as without Apex or
# Transformer Engine) on this CPU-only host: what it needs of one, and start_adam_state(optimizer).
OPTIMIZER = r'''
import torch
# Megatron-Core's optimizer makes a few buffers on device 'cuda' by name: on this CPU-only host
# they are made on the CPU, as the prelude keeps its other tensors there.
def _on_cpu(factory):
    def make(*args, device=None, **kwargs):
        return factory(*args, device='cpu' if str(device).startswith('cuda') else device, **kwargs)
    return make
for _name in ('tensor', 'zeros', 'ones', 'empty', 'full'):
    setattr(torch, _name, _on_cpu(getattr(torch, _name)))
# And it takes a parameter's type name for its dtype, which names the GPU: a CPU tensor's name is
# given as the GPU's (torch.FloatTensor as torch.cuda.FloatTensor).
_type = torch.Tensor.type
def _type_named_for_gpu(self, *args, **kwargs):
    name = _type(self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or name.startswith('torch.cuda.'):
        return name
    return name.replace('torch.', 'torch.cuda.', 1)
torch.Tensor.type = _type_named_for_gpu
# Its gradient reduction across data-parallel ranks waits for the GPU's current stream, which this host has
# none of: a stand-in whose waits return at once (gloo reduces on the CPU, in order).
if not torch.cuda.is_available():
    class _NoStream:
        def wait_event(self, event):
            pass

        def wait_stream(self, stream):
            pass
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()

# Without Apex or Transformer Engine (as on this CPU host) Megatron-Core steps with torch's Adam,
# which keeps a per-parameter 'step' tensor; its load sets the step from the param groups and
# skips 'step' among the loaded tensors, but then looks it up there: a 'step' of None is skipped.
# (Its dp_reshardable load gives each parameter the fresh optimizer's own 'step', 0, which no
# bucket holds, and would copy it over the groups' step: that one is skipped too.) And that load
# copies into the fp32 masters outside no_grad, where in fp32 training (as here) a master is a view
# of its parameter, a leaf that requires grad, which torch refuses to copy into so: copied under
# no_grad, as its other layouts' loads copy.
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
_set_states = DistributedOptimizer._set_main_param_and_optimizer_states
def _set_states_but_step(self, model_param, tensors):
    with torch.no_grad():
        return _set_states(self, model_param, {**tensors, 'step': None})
DistributedOptimizer._set_main_param_and_optimizer_states = _set_states_but_step
# And it gives every parameter's state one shared 'step' tensor, which torch's Adam then advances once per
# parameter at the next step (a bias correction as of many steps on): each its own, as a step makes them.
_load_state_dict = DistributedOptimizer.load_state_dict
def _load_state_dict_with_own_steps(self, state_dict):
    _load_state_dict(self, state_dict)
    for state in self.optimizer.state.values():
        if torch.is_tensor(state.get('step')):
            state['step'] = state['step'].clone()
DistributedOptimizer.load_state_dict = _load_state_dict_with_own_steps

def start_adam_state(optimizer):
    # Without Apex or Transformer Engine (as on this CPU host) Megatron-Core takes its step from
    # torch Adam's per-parameter state, which a fresh optimizer lacks until its first step: made
    # here as that step makes it, then replaced by the load.
    for chained in getattr(optimizer, 'chained_optimizers', [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for p in group['params']:
                inner.state[p] = {'step': torch.tensor(0.0), 'exp_avg': torch.zeros_like(p),
                                  'exp_avg_sq': torch.zeros_like(p)}
'''

# Run by the scripts that compute a loss (after a BUILD that sets M, the model's sizes): loss_of(model)
# is the loss of a model on one pipeline stage on fixed tokens.
LOSS_OF = r'''
def loss_of(model):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, M['vocab'], (2, 16), generator=g)
    labels = torch.randint(0, M['vocab'], (2, 16), generator=g)
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    return model(tokens, positions, mask, labels=labels).float().mean()
'''

# Run by the scripts that compare losses: losses(model) is loss_of(model) before and after one SGD
# step.
LOSSES = LOSS_OF + r'''
import contextlib

def losses(model):
    # Attention forks the CUDA RNG tracker for its dropout, which this CPU run has no state for; the
    # dropout is 0, so nothing draws from it.
    from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    model.eval()  # no dropout, where the config has some: the loss depends on the weights alone
    before = loss_of(model)
    model.zero_grad()
    before.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return [before.item(), loss_of(model).item()]
'''


class MegatronCoreTestCase(FixtureTestCase):
    """A test class that runs real Megatron-Core: setUpClass finds the chroot and the wheels (else skips
    the class with one line), makes cls.work (mounted as /data in the chroot), and runs SAVE there
    when the class sets it (the saves its tests read); megatron() runs a script the same way."""

    SAVE = None  # a script, without PRELUDE, that writes the class's saves into /data
    TIMEOUT = 400

    @classmethod
    def setUpClass(cls):
        cls.root = torch2_chroot.root_or_skip()
        cls.site = site_or_skip(cls.root)
        cls.work = tempfile.mkdtemp(prefix='reshard-mcore-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        if cls.SAVE is None:
            return
        p = cls.megatron(cls.SAVE)
        if p.returncode:
            raise AssertionError('Megatron-Core could not write the saves:\n' + p.stdout + p.stderr[-4000:])
        print(p.stdout.strip(), file=sys.stderr)

    @classmethod
    def megatron(cls, script):
        return run(cls.root, cls.site, script, {cls.work: '/data'}, timeout=cls.TIMEOUT)

    def saved(self, name):
        return os.path.join(self.work, name)

    def assertLoadedAsItsOwn(self, name, ranks):
        """What Megatron-Core held on each of `ranks` ranks after loading reshard's output `name` equals
        what it held after loading its own save (NAME_loaded_rank<r>.pt: {'held': {'reshard': ...,
        'megatron': ...}, 'loss': ...}); where the ranks recorded it, the loss, before and after a step,
        is the same and falls. Returns the tensors compared and the last rank's record."""
        import torch  # only the tests that read the ranks' records need it
        compared = 0
        for r in range(ranks):
            got = torch.load(self.saved(f'{name}_loaded_rank{r}.pt'))
            held = got['held']
            self.assertEqual(sorted(held['reshard']), sorted(held['megatron']))
            self.assertEqual(support.differences(dict(sorted(held['reshard'].items())),
                                                 dict(sorted(held['megatron'].items())), f'{name} rank {r}'), [])
            compared += len(held['reshard'])
            if got.get('loss'):
                self.assertEqual(got['loss']['reshard'], got['loss']['megatron'])
                self.assertLess(got['loss']['reshard'][1], got['loss']['reshard'][0])
        return compared, got
