"""How the CLI shows progress and what -q leaves out.

* On a terminal, convert, verify and lint --deep redraw one line in place (a bar, counts, bytes,
  rate, and the time left or taken as m:ss), cut to the terminal's width, and end it with a newline
  before anything else is printed.
* Not on a terminal, a run shorter than the logging interval prints no progress at all (its summary
  says it all): stderr stays empty.
* `-q` prints the summary and says how many notes it did not show; without `-q` they are shown.
* A message longer than two lines (a rule file's every problem) is cut to its first line and a count
  of the rest; `-v` prints it whole.

Run: /usr/bin/python3 tests/interop/test_progress.py --reshard build/reshard
"""
import fcntl
import os
import pty
import re
import struct
import subprocess
import termios

import interop_support as support
from interop_support import FixtureTestCase

COLUMNS = 72


def run_on_terminal(*args):
    """Runs reshard with stderr on a pseudo-terminal COLUMNS wide: (exit code, stdout, stderr)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack('HHHH', 24, COLUMNS, 0, 0))
    proc = subprocess.Popen([support.RESHARD, *map(str, args)], stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    shown = b''
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal is closed once reshard has exited
            break
        if not chunk:
            break
        shown += chunk
    with proc.stdout:
        stdout = proc.stdout.read().decode()
    proc.wait()
    os.close(leader)
    return proc.returncode, stdout, shown.decode()


class ProgressTest(FixtureTestCase):

    def setUp(self):
        super().setUp()
        self.src = self.bloom(optimizer='bf16_zero', dp=2)

    def assertRedrawnLine(self, shown, unit):
        self.assertTrue(shown.startswith('\r['), repr(shown))
        self.assertTrue(shown.endswith('\r\n'), repr(shown))  # the line is ended (the terminal adds \r)
        draws = [d.split('\x1b[K')[0] for d in shown.rstrip('\r\n').split('\r') if d]
        last = draws[-1]
        self.assertRegex(last, r'^\[#+\] 100% (\d+)/\1 ' + unit + r', ')
        for draw in draws:
            self.assertLess(len(draw), COLUMNS, draw)
        return last

    def test_a_terminal_sees_one_line_redrawn(self):
        out = self.path('out')
        code, stdout, shown = run_on_terminal('convert', self.src, out, '--tp', 1, '--pp', 1, '--dp', 1)
        self.assertEqual(code, 0, stdout + shown)
        self.assertRedrawnLine(shown, 'files')
        self.assertIn('wrote ', stdout)

        code, stdout, shown = run_on_terminal('verify', self.src, out)
        self.assertEqual(code, 0, stdout + shown)
        self.assertRedrawnLine(shown, 'tensors')

        code, stdout, shown = run_on_terminal('lint', self.src, '--deep')
        self.assertEqual(code, 0, stdout + shown)
        self.assertRedrawnLine(shown, 'files')

        code, stdout, shown = run_on_terminal('convert', self.src, self.path('quiet'), '--tp', 1, '--pp', 1, '-q')
        self.assertEqual(code, 0, stdout + shown)
        self.assertEqual(shown, '')

    def test_a_short_run_logs_no_progress(self):
        p = support.reshard('convert', self.src, self.path('out'), '--tp', 1, '--pp', 1, '--dp', 1)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(p.stderr, '')

    def test_quiet_counts_the_notes_it_leaves_out(self):
        loud = support.reshard('convert', self.src, self.path('loud'), '--tp', 4, '--pp', 1)
        self.assertEqual(loud.returncode, 0, loud.stdout + loud.stderr)
        notes = [line for line in loud.stdout.splitlines() if line.startswith('note: ')]
        self.assertTrue(notes, loud.stdout)  # the vocabulary is padded anew for TP 4

        quiet = support.reshard('convert', self.src, self.path('quiet'), '--tp', 4, '--pp', 1, '-q')
        self.assertEqual(quiet.returncode, 0, quiet.stdout + quiet.stderr)
        self.assertNotIn('note: ', quiet.stdout)
        count = len(notes)
        self.assertIn(f'{count} note{"s" if count > 1 else ""} not shown (-q)', quiet.stdout)
        self.assertRegex(quiet.stdout, re.compile(r'^wrote \d+ files', re.M))

    def test_long_messages_are_cut_to_two_lines_unless_verbose(self):
        rules = self.path('bad.yaml')
        with open(rules, 'w') as f:
            f.write('name: bad\npipeline: {specs: [{block: B}]}\nlayers:\n'
                    '  block:\n    - {key: a, split: diagonal}\n    - {key: b, split: sideways}\n'
                    '    - {key: c, split: upward}\n')
        whole = support.reshard('rules', rules, '-v')
        self.assertEqual(whole.returncode, 2, whole.stdout + whole.stderr)
        problems = whole.stderr.splitlines()
        self.assertEqual(len(problems), 3, whole.stderr)
        for split in ('diagonal', 'sideways', 'upward'):
            self.assertIn(split, whole.stderr)

        cut = support.reshard('rules', rules)
        self.assertEqual(cut.returncode, 2, cut.stdout + cut.stderr)
        self.assertEqual(cut.stderr.splitlines(), [problems[0], '  ... and 2 more lines (-v shows them)'])


if __name__ == '__main__':
    support.main()
