"""Nothing machine-specific in the tracked files: no absolute path of a developer's machine, no
package-archive host name.

A clone runs on another machine: an absolute path under a developer's work, root or home folder names
a folder that is not there, and a fixed Debian, Ubuntu, PyPI or conda archive host overrides the
mirror the machine's own apt or pip configuration names (tests/interop/torch2_chroot.py takes the
archive from the machine's apt sources). Each hit fails with its file and line.

Allowed, by design: /tmp/ (it exists on every POSIX machine, names no one's, and is where the
benchmarks' scratch folder defaults to), and paths inside a chroot the tests build (they are under
/data, not a host path). Files are the tracked ones (`git ls-files`); where the checkout has no git
metadata, every file under the root but build folders. Binary files (a NUL byte) are skipped.

Run: /usr/bin/python3 tests/interop/test_no_machine_paths.py --reshard build/reshard  (PYTHONPATH=tests)
"""
import os
import re
import subprocess
import tempfile
import unittest

import interop_support as support

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# An absolute path starts the token: at the line's start or after a quote, space, '=', '(' ...
_START = r'(?:^|[\s\'"`=(\[{:,;])'
FORBIDDEN = [
    ('an absolute path of a machine', re.compile(_START + r'/(?:work|root|(?:home|Users)/[A-Za-z0-9_.-]+)/')),
    ('a package-archive host', re.compile(r'\b(?:[a-z0-9-]+\.)*(?:debian\.org|ubuntu\.com|pypi\.org|pythonhosted\.org|'
                                         r'download\.pytorch\.org|anaconda\.org|conda\.anaconda\.org)\b', re.I)),
]


def tracked_files(root):
    try:
        out = subprocess.run(['git', '-C', root, 'ls-files', '-z'], capture_output=True, check=True).stdout
        return [f for f in out.decode().split('\0') if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d != '.git' and not d.startswith('build')]
            files += [os.path.relpath(os.path.join(folder, n), root) for n in names]
        return files


def findings(root, files):
    """['file:line: what: the line'] for every forbidden string in `files` (relative to `root`)."""
    out = []
    for name in files:
        path = os.path.join(root, name)
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        with open(path, 'rb') as f:
            data = f.read()
        if b'\0' in data:
            continue
        for number, line in enumerate(data.decode('utf-8', 'replace').split('\n'), 1):
            for what, pattern in FORBIDDEN:
                m = pattern.search(line)
                if m:
                    out.append(f'{name}:{number}: {what} ({m.group(0).strip()}): {line.strip()[:160]}')
    return out


class NoMachinePathsTest(unittest.TestCase):

    def test_tracked_files(self):
        found = findings(ROOT, tracked_files(ROOT))
        self.assertFalse(found, '\n'.join(found))

    def test_the_check_finds_them(self):
        """Each kind of path and host is found, with its file and line; what is allowed is not."""
        with tempfile.TemporaryDirectory() as d:
            lines = {
                # Spelt in pieces, so that this file holds none of them.
                'a.py': "OUT = '/" + "work/ckpts'\n",
                'b.md': 'see /' + 'home/alice/data\n',
                'c.sh': 'cd /' + 'root/src && make\n',
                'd.py': "MIRROR = 'http" + "://" + '.'.join(['deb', 'debian', 'org']) + "/debian'\n",
                'e.md': 'pip install --index-url http' + 's://' + '.'.join(['pypi', 'org']) + '/simple x\n',
                'ok.md': 'scratch in /tmp/reshard-bench; tests/data/x; the chroot sees /data/out; a/work/b\n',
            }
            for name, text in lines.items():
                with open(os.path.join(d, name), 'w') as f:
                    f.write('first line\n' + text)
            found = findings(d, sorted(lines))
        self.assertEqual(sorted(f.split(':')[0] for f in found), ['a.py', 'b.md', 'c.sh', 'd.py', 'e.md'], found)
        self.assertTrue(all(f.split(':')[1] == '2' for f in found), found)


if __name__ == '__main__':
    support.main()
