"""Every command README.md, docs/ and tests/README.md show runs as written, on the samples the
repository ships, and prints what they show.

The pages mark each fenced block by its first word (the info string):

  ```sh       commands, run in order as one bash script (set -e -o pipefail): each must succeed.
  ```console  a transcript: `$ ` starts a command (a line ending in `\\` continues it); the lines after
              it, up to the next `$ `, are output it must print (stdout and stderr), in that order,
              other lines allowed between them; `...` in a line stands for any text. A command whose
              shown output starts with `reshard: error:` is a refusal and must exit 2.
  ```pycon    a Python session (`>>> `), run as a doctest (ELLIPSIS, NORMALIZE_WHITESPACE).
  ```LANG no-run   any of these, not run: it needs what no clone has (a cluster, a GPU, the network,
              the user's own checkpoint). The test lists and counts them, so none is skipped silently.
  ```text, yaml, json, python, c++, ...: not commands, not run. A block without a language, and a
              `$ ` line outside a console block, are errors: every command must be in a block that runs
              or says it does not.

Each page's blocks run in order, in a temporary folder of its own holding `tests/` (the repository's,
read only), `examples/` with what `make demo` writes into `examples/out/` (examples/demo.sh is run
first), `build/` (the build folder of the binary under test, for `build/python`), and on PATH
`reshard` (the binary under test) and `python3` (Debian's, as `make demo` uses).

Run: /usr/bin/python3 tests/interop/test_docs_commands.py --reshard build/reshard  (PYTHONPATH=tests)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import interop_support as support

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = {'sh', 'console', 'pycon'}
NOT_COMMANDS = {'text', 'yaml', 'json', 'python', 'c++', 'diff'}
TIMEOUT = 600


class Block:
    def __init__(self, page, line, lang, no_run, body):
        self.page, self.line, self.lang, self.no_run, self.body = page, line, lang, no_run, body

    def where(self):
        return f'{self.page}:{self.line}'


def parse_blocks(page, text):
    """The fenced blocks of `text`, and the errors of the convention (a block without a language,
    an unknown language, a `$ ` line outside a console block)."""
    blocks, errors = [], []
    lines = text.split('\n')
    i = 0
    while i < len(lines):
        m = re.match(r'^(\s*)(```+)(.*)$', lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).split()
        start = i + 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        lang = info[0] if info else ''
        no_run = 'no-run' in info[1:]
        if not lang:
            errors.append(f'{page}:{start}: a fenced block without a language (sh, console, pycon, or text ...)')
            continue
        if lang not in RUN and lang not in NOT_COMMANDS:
            errors.append(f'{page}:{start}: unknown block language {lang!r}')
            continue
        if lang != 'console' and any(l.startswith('$ ') for l in body):
            errors.append(f'{page}:{start}: a `$ ` command in a {lang} block: make it a console block')
        blocks.append(Block(page, start, lang, no_run, body))
    return blocks, errors


def console_commands(body):
    """[(command, [shown output lines])] of a console block."""
    out = []
    lines = iter(body)
    for line in lines:
        if line.startswith('$ '):
            command = line[2:]
            while command.endswith('\\'):
                command = command[:-1] + ' ' + next(lines, '').strip()
            out.append((command, []))
        elif out:
            out[-1][1].append(line)
    return out


def line_pattern(shown):
    return re.compile('.*'.join(re.escape(part) for part in shown.strip().split('...')))


def missing_output(shown, actual):
    """The first shown line not found, in order, in `actual` (None: all found)."""
    got = [l.rstrip() for l in actual.split('\n')]
    at = 0
    for want in shown:
        if not want.strip() or want.strip() == '...':
            continue
        pattern = line_pattern(want)
        while at < len(got) and not pattern.fullmatch(got[at].strip()):
            at += 1
        if at == len(got):
            return want
        at += 1
    return None


PYCON_RUNNER = r'''
import doctest, sys
text = open(sys.argv[1]).read()
test = doctest.DocTestParser().get_doctest(text, {'__name__': '__main__'}, sys.argv[2], sys.argv[2], 0)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
runner.run(test)
sys.exit(1 if runner.failures else 0)
'''


class Workspace:
    """A temporary folder laid out as a checkout after `make demo`, and the environment to run in."""

    def __init__(self, reshard):
        self.dir = tempfile.mkdtemp(prefix='reshard-docs-')
        bindir = os.path.join(self.dir, '.bin')
        os.makedirs(bindir)
        os.symlink(reshard, os.path.join(bindir, 'reshard'))
        os.symlink('/usr/bin/python3', os.path.join(bindir, 'python3'))
        os.symlink(os.path.join(ROOT, 'tests'), os.path.join(self.dir, 'tests'))
        os.symlink(os.path.dirname(reshard), os.path.join(self.dir, 'build'))
        examples = os.path.join(self.dir, 'examples')
        os.makedirs(examples)
        for name in os.listdir(os.path.join(ROOT, 'examples')):
            if name != 'out':
                os.symlink(os.path.join(ROOT, 'examples', name), os.path.join(examples, name))
        self.env = dict(os.environ, PATH=bindir + ':/usr/bin:/bin', PYTHONDONTWRITEBYTECODE='1',
                        PYTHONPATH=os.path.join(os.path.dirname(reshard), 'python'))
        demo = subprocess.run(['sh', os.path.join(ROOT, 'examples', 'demo.sh'), reshard], cwd=self.dir,
                              env=dict(self.env, DEMO_DIR=os.path.join(examples, 'out')),
                              capture_output=True, text=True, timeout=TIMEOUT)
        if demo.returncode != 0:
            raise AssertionError(f'examples/demo.sh failed:\n{demo.stdout[-3000:]}\n{demo.stderr[-3000:]}')

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def shell(self, script):
        return subprocess.run(['bash', '-e', '-o', 'pipefail', '-c', script], cwd=self.dir, env=self.env,
                              capture_output=True, text=True, timeout=TIMEOUT)

    def run_block(self, block):
        """The failure of `block` (None: it ran as the page says)."""
        body = '\n'.join(block.body)
        if block.lang == 'sh':
            p = self.shell(body)
            if p.returncode != 0:
                return f'exit {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}'
            return None
        if block.lang == 'pycon':
            script = os.path.join(self.dir, '.block.txt')
            with open(script, 'w') as f:
                f.write(body + '\n')
            p = subprocess.run(['/usr/bin/python3', '-c', PYCON_RUNNER, script, block.where()], cwd=self.dir,
                               env=self.env, capture_output=True, text=True, timeout=TIMEOUT)
            return None if p.returncode == 0 else (p.stdout + p.stderr)[-4000:]
        for command, shown in console_commands(block.body):
            p = self.shell(command)
            refusal = any(l.startswith('reshard: error:') for l in shown[:1])
            want_rc = 2 if refusal else 0
            if p.returncode != want_rc:
                return f'$ {command}\nexit {p.returncode} (want {want_rc})\n{p.stdout[-2000:]}{p.stderr[-2000:]}'
            missing = missing_output(shown, p.stdout + p.stderr)
            if missing is not None:
                return f'$ {command}\ndoes not print {missing.strip()!r}; it printed:\n{p.stdout}{p.stderr}'
        return None


def documented_pages():
    pages = ['README.md', os.path.join('tests', 'README.md')]
    for folder, _, files in os.walk(os.path.join(ROOT, 'docs')):
        pages += [os.path.relpath(os.path.join(folder, f), ROOT) for f in sorted(files) if f.endswith('.md')]
    return sorted(p for p in pages if os.path.exists(os.path.join(ROOT, p)))


def snapshot(folder):
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.join(dirpath, f)] = (st.st_size, st.st_mtime_ns)
    return out


class ConventionTest(unittest.TestCase):
    """The parser and the checks the pages are held to: each must be able to fail."""

    def test_blocks_and_errors(self):
        blocks, errors = parse_blocks('p.md', '```\nreshard lint x\n```\n```text\n$ reshard lint x\n```\n'
                                              '```sh no-run\nmpirun -np 4 reshard convert a b\n```\n')
        self.assertEqual(len(errors), 2, errors)
        self.assertTrue(blocks[-1].no_run)

    def test_console_output(self):
        [(command, shown)] = console_commands(['$ reshard verify a \\', '    b', 'verify: ... same model'])
        self.assertEqual(command, 'reshard verify a  b')
        self.assertIsNone(missing_output(shown, 'note: x\nverify: 3 tensors; same model\n'))
        self.assertEqual(missing_output(shown, 'verify: 3 tensors; differ\n'), 'verify: ... same model')
        self.assertEqual(missing_output(['b', 'a'], 'a\nb\n'), 'a')  # in order

    def test_a_failing_command_fails(self):
        ws = Workspace.__new__(Workspace)
        ws.dir = tempfile.mkdtemp(prefix='reshard-docs-')
        ws.env = dict(os.environ, PATH='/usr/bin:/bin')
        try:
            self.assertIsNotNone(ws.run_block(Block('p.md', 1, 'sh', False, ['true', 'false', 'true'])))
            self.assertIsNotNone(ws.run_block(Block('p.md', 1, 'console', False, ['$ echo hi', 'ho'])))
            self.assertIsNotNone(ws.run_block(Block('p.md', 1, 'console', False, ['$ false', 'reshard: error: x'])))
            self.assertIsNone(ws.run_block(Block('p.md', 1, 'console', False, ['$ echo hi there', 'hi ...'])))
            self.assertIsNotNone(ws.run_block(Block('p.md', 1, 'pycon', False, ['>>> 1 + 1', '3'])))
        finally:
            shutil.rmtree(ws.dir)


class DocsCommandsTest(unittest.TestCase):

    def test_every_documented_command(self):
        data = snapshot(os.path.join(ROOT, 'tests', 'data'))
        failures, not_run, ran = [], [], 0
        for page in documented_pages():
            with open(os.path.join(ROOT, page)) as f:
                blocks, errors = parse_blocks(page, f.read())
            failures += errors
            runnable = [b for b in blocks if b.lang in RUN]
            not_run += [b for b in runnable if b.no_run]
            todo = [b for b in runnable if not b.no_run]
            if not todo:
                continue
            ws = Workspace(support.RESHARD)
            try:
                for block in todo:
                    failure = ws.run_block(block)
                    ran += 1
                    if failure is not None:
                        failures.append(f'{block.where()} ({block.lang}): {failure}')
            finally:
                ws.close()
        print(f'\n{ran} command blocks ran; {len(not_run)} marked no-run:', file=sys.stderr)
        for b in not_run:
            print(f'  {b.where()}: {b.body[0] if b.body else ""}', file=sys.stderr)
        self.assertEqual(snapshot(os.path.join(ROOT, 'tests', 'data')), data, 'a documented command wrote into tests/data')
        self.assertFalse(failures, '\n\n'.join(failures))
        self.assertGreater(ran, 0)


class CliDocTest(unittest.TestCase):
    """docs/cli.md names every command and every option that `reshard <command> --help` lists."""

    def test_every_option_is_documented(self):
        with open(os.path.join(ROOT, 'docs', 'cli.md')) as f:
            page = f.read()
        top = support.reshard('--help').stdout
        commands = re.findall(r'^  ([a-z]+)\s{2,}', top.split('Subcommands:')[1], re.M)
        self.assertIn('convert', commands)
        missing = []
        for command in commands:
            if f'reshard {command}' not in page:
                missing.append(f'the command {command}')
            help_text = support.reshard(command, '--help').stdout
            for option in re.findall(r'^\s+(?:-\w,)?(--[a-z][a-z0-9-]*)', help_text, re.M):
                if option != '--help' and f'`{option}' not in page:
                    missing.append(f'{command} {option}')
        self.assertFalse(missing, 'docs/cli.md does not name: ' + ', '.join(missing))

    def test_help_names_every_format_read(self):
        """The first screen says what a CHECKPOINT may be: every format of the README's table."""
        top = support.reshard('--help').stdout.split('Usage:')[0]
        for name in ('DeepSpeed tag folder', 'universal', 'torch_dist', 'Megatron-LM', 'torchtitan', 'DCP',
                     'Hugging Face', 'without config.json', 'latest_checkpointed_iteration.txt'):
            self.assertIn(name, top)


class DocsLinksTest(unittest.TestCase):
    """Every relative link of the pages names a file of the checkout (and a heading of it, for #anchors)."""

    @staticmethod
    def anchors(path):
        out = set()
        in_fence = False
        with open(path) as f:
            for line in f:
                if line.lstrip().startswith('```'):
                    in_fence = not in_fence
                m = not in_fence and re.match(r'^#+\s+(.*)$', line)
                if m:
                    slug = re.sub(r'[^\w\- ]', '', m.group(1).strip().lower()).replace(' ', '-')
                    out.add(slug)
        return out

    def test_links(self):
        broken = []
        for page in documented_pages():
            with open(os.path.join(ROOT, page)) as f:
                text = re.sub(r'```.*?```', '', f.read(), flags=re.S)
            for target in re.findall(r'\]\(([^)\s]+)\)', text):
                if re.match(r'^[a-z]+:', target):
                    continue
                path, _, anchor = target.partition('#')
                full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
                if not os.path.exists(full):
                    broken.append(f'{page}: {target} (no such file)')
                elif anchor and full.endswith('.md') and anchor not in self.anchors(full):
                    broken.append(f'{page}: {target} (no such heading)')
        self.assertFalse(broken, '\n'.join(broken))


if __name__ == '__main__':
    support.main()
