#!/usr/bin/env python3
"""The fixed cost of a reshard run: wall time and user+sys CPU time of each command given,
the median of --warm runs from a warm page cache and of --cold runs after `sync` and dropping
the page cache (root only). CPU time is the steadier figure on a busy machine.

    sudo python3 benchmarks/startup.py --reshard build/reshard -- '--help' \\
        'inspect tests/data/deepspeed_moe/pipe_pp2_ep2_dp2 --rules tests/data/deepspeed_moe/toy-moe-pipe.yaml'

See benchmarks/README.md, "Start-up".
"""
from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from typing import List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import drop_caches  # noqa: E402


def once(command: List[str], cold: bool) -> Tuple[float, float]:
    """(wall seconds, user+sys CPU seconds) of one run of `command`."""
    if cold and not drop_caches():
        sys.exit('startup.py: dropping the page cache needs root')
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run(command, stdout=subprocess.DEVNULL, check=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--reshard', required=True, help='the reshard binary')
    ap.add_argument('--warm', type=int, default=11, help='warm runs of each command (default 11)')
    ap.add_argument('--cold', type=int, default=5, help='cold runs of each command (default 5; 0: none)')
    ap.add_argument('commands', nargs='+', help="reshard's arguments, one quoted string per command")
    ns = ap.parse_args()
    print(f'| command | warm wall | warm CPU | cold wall | cold CPU |  (medians: {ns.warm} warm, '
          f'{ns.cold} cold runs; load average {os.getloadavg()[0]:.1f})')
    for line in ns.commands:
        args = shlex.split(line)
        command = [ns.reshard, *args]
        once(command, cold=False)  # fill the page cache
        row = []
        for runs, cold in ((ns.warm, False), (ns.cold, True)):
            results = [once(command, cold) for _ in range(runs)] or [(float('nan'), float('nan'))]
            row += [statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)]
        print(f'| `reshard {" ".join(args)}` | ' + ' | '.join(f'{x:.3f} s' for x in row) + ' |', flush=True)


if __name__ == '__main__':
    main()
