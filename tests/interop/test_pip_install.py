"""`pip install .` (pyproject.toml, scikit-build-core) in a fresh venv gives a working reshard.

A copy of the checkout (its tracked and untracked-but-not-ignored files) is installed with
`pip install` into a venv made by `python3 -m venv --system-site-packages` (Debian's torch), with
pip fetching scikit-build-core from PyPI; the build folder is in the copy, so the checkout is never
written. Then the copy and its build folder are removed, and from an empty
folder, with no RESHARD_* variable set:

* `reshard --help` (the venv's console command) and `python -m reshard --help` print the CLI's help;
* `import reshard` is the venv's package, whose built-in rule sets are the files it carries (not the
  checkout's), and `reshard.open` of a shipped torchtitan save reads its tensors (a tensor equals
  the build tree's `export --to consolidated` of it);
* the venv's `reshard convert` of that save writes the files the build's binary writes, byte for byte.

Where PyPI cannot be reached (scikit-build-core cannot be downloaded) or a venv cannot be made, the
test is skipped with one line saying why. With ccache installed the build compiles through it as
CMakeLists.txt sets it up, in the tested build's place in the copy, so that it reuses the tested
build's objects; the time pip took is printed.

Run: PYTHONPATH=tests:tests/interop /usr/bin/python3 tests/interop/test_pip_install.py --reshard build/reshard
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import interop_support as support

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = os.path.join(CHECKOUT, 'tests', 'data', 'torchtitan', 'fsdp2_tp_w4', 'step-1')
HEADS = 'num_attention_heads=4'  # torchtitan records no head count


def run(argv, timeout=3600, **kw):
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout, **kw)


def checkout_files():
    """The checkout's files as git lists them (tracked, and new files not ignored); every file
    without git."""
    p = run(['git', '-C', CHECKOUT, 'ls-files', '-z', '--cached', '--others', '--exclude-standard'])
    if p.returncode == 0:
        return [f for f in p.stdout.split('\0') if f and os.path.isfile(os.path.join(CHECKOUT, f))]
    return [os.path.relpath(os.path.join(d, n), CHECKOUT) for d, _, names in os.walk(CHECKOUT) for n in names]


def copy_checkout(dest):
    for rel in checkout_files():
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(os.path.join(CHECKOUT, rel), os.path.join(dest, rel))


def tested_compilers():
    """{CC, CXX}: the compilers the tested build's CMakeCache.txt names, where it has them."""
    cache = os.path.join(os.path.dirname(os.path.abspath(support.RESHARD)), 'CMakeCache.txt')
    out = {}
    if os.path.exists(cache):
        with open(cache) as f:
            for line in f:
                m = re.match(r'CMAKE_(C|CXX)_COMPILER:FILEPATH=(.+)', line.strip())
                if m:
                    out['CC' if m.group(1) == 'C' else 'CXX'] = m.group(2)
    return out


def build_env():
    """The environment of the pip build: the build type's parallelism, the tested build's compilers
    (else scikit-build-core takes Python's, another name ccache hashes apart), and no launcher or
    ccache path setting of the caller's (its cache folder is kept), so that CMakeLists.txt's own ccache settings apply (the tested
    build's, whose objects a pip build in the same layout then reuses)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith('RESHARD_') and
           k not in ('CCACHE_BASEDIR', 'CCACHE_NOHASHDIR') and not k.endswith('_COMPILER_LAUNCHER')}
    env.setdefault('CMAKE_BUILD_PARALLEL_LEVEL', str(os.cpu_count() or 1))
    env.update(tested_compilers())
    return env


def build_folder(src):
    """The pip build's folder in the copy `src`: where the tested build lies in the checkout (so that
    ccache, which hashes paths relative to the source folder, finds its objects), else src/build."""
    tested = os.path.relpath(os.path.dirname(os.path.abspath(support.RESHARD)), CHECKOUT)
    return os.path.join(src, 'build' if tested.startswith(os.pardir) or tested == os.curdir else tested)


def pinned_backend():
    """The build backend pyproject.toml requires ('scikit-build-core==X')."""
    with open(os.path.join(CHECKOUT, 'pyproject.toml')) as f:
        return re.search(r'requires = \["([^"]+)"\]', f.read()).group(1)


def digests(folder):
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            with open(os.path.join(d, n), 'rb') as f:
                out[os.path.relpath(os.path.join(d, n), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


class PipInstallTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix='reshard-pip-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        cls.venv = os.path.join(cls.work, 'venv')
        p = run([sys.executable, '-m', 'venv', '--system-site-packages', cls.venv])
        if p.returncode:
            cls.skip(f'python3 -m venv cannot make a venv (Debian: python3-venv): {p.stderr.strip()[-200:]}')
        cls.bin = os.path.join(cls.venv, 'bin')
        backend = pinned_backend()
        p = run([os.path.join(cls.bin, 'pip'), 'download', '--no-deps', '-d', os.path.join(cls.work, 'wheels'),
                 backend], timeout=300)
        if p.returncode:
            last = (p.stderr.strip().splitlines() or ['no output'])[-1]
            cls.skip(f'pip cannot fetch {backend} from PyPI: {last}')
        src = os.path.join(cls.work, 'src')
        copy_checkout(src)
        build = build_folder(src)
        start = time.monotonic()
        p = run([os.path.join(cls.bin, 'pip'), 'install', '--no-cache-dir', f'--config-settings=build-dir={build}',
                 src], env=build_env())
        took = time.monotonic() - start
        if p.returncode:
            raise AssertionError(f'pip install failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}')
        print(f'pip install . took {took:.0f} s', file=sys.stderr)
        # Nothing of the copy or its build may be needed at run time.
        shutil.rmtree(src)
        cls.cwd = os.path.join(cls.work, 'empty')
        os.mkdir(cls.cwd)
        cls.env = {k: v for k, v in os.environ.items() if not k.startswith(('RESHARD_', 'PYTHON'))}

    @classmethod
    def skip(cls, why):
        print('skipped:', why, file=sys.stderr)
        raise unittest.SkipTest(why)

    def venv_run(self, *argv):
        p = run([*argv], cwd=self.cwd, env=self.env, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p.stdout

    def test_reshard_command(self):
        help_text = self.venv_run(os.path.join(self.bin, 'reshard'), '--help')
        self.assertIn('convert', help_text)
        self.assertEqual(help_text, support.reshard('--help').stdout)

    def test_python_m_reshard(self):
        help_text = self.venv_run(os.path.join(self.bin, 'python'), '-m', 'reshard', '--help')
        self.assertEqual(help_text, support.reshard('--help').stdout)
        version = self.venv_run(os.path.join(self.bin, 'python'), '-m', 'reshard', '--version')
        self.assertTrue(version.startswith('reshard 0.'), version)

    def test_import_and_open(self):
        script = (
            'import json, reshard\n'
            f'c = reshard.open({SAMPLE!r}, set={{"num_attention_heads": 4}})\n'
            'name = c.keys()[0]\n'
            'print(json.dumps({"file": reshard.__file__, "origins": [r["origin"] for r in reshard.rule_sets()],\n'
            '                  "keys": c.keys(), "name": name, "tensor": c.tensor(name).float().tolist()}))\n')
        import json
        got = json.loads(self.venv_run(os.path.join(self.bin, 'python'), '-c', script))
        package = os.path.dirname(got['file'])
        self.assertTrue(package.startswith(self.venv + os.sep), got['file'])
        self.assertTrue(got['origins'])
        for origin in got['origins']:
            self.assertEqual(os.path.dirname(origin), os.path.join(package, 'rules'))
        rule_files = sorted(f for f in os.listdir(os.path.join(CHECKOUT, 'rules')) if f.endswith('.yaml'))
        self.assertEqual(sorted(os.listdir(os.path.join(package, 'rules'))), rule_files)
        # The tensor against the build's own export of the save.
        whole = os.path.join(self.work, 'consolidated')
        p = support.reshard('export', SAMPLE, whole, '--to', 'consolidated', '--set', HEADS, '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        files = [f for f in os.listdir(whole) if f.endswith('.safetensors')]
        tensors = {}
        for f in files:
            tensors.update(support.read_safetensors(os.path.join(whole, f))[0])
        self.assertIn(got['name'], got['keys'])
        self.assertEqual(got['tensor'], tensors[got['name']].float().tolist())

    def test_convert(self):
        out, ref = os.path.join(self.work, 'venv-out'), os.path.join(self.work, 'build-out')
        args = [SAMPLE, '--tp', '1', '--dp-shard', '3', '--set', HEADS]
        self.venv_run(os.path.join(self.bin, 'reshard'), 'convert', args[0], out, *args[1:])
        p = support.reshard('convert', args[0], ref, *args[1:])
        self.assertEqual(p.returncode, 0, p.stderr)
        got, want = digests(out), digests(ref)
        manifest = [k for k in want if k.endswith(support.MANIFEST)]
        self.assertTrue(any(k.endswith('.distcp') for k in want), want)
        for k in manifest:  # it names the run (its command line), the rest is the conversion
            got.pop(k, None)
            want.pop(k)
        self.assertEqual(got, want)
        self.assertIn('same model', self.venv_run(os.path.join(self.bin, 'reshard'), 'verify', SAMPLE,
                                                  os.path.join(out, 'step-1'), '--set', HEADS))


if __name__ == '__main__':
    support.main()
