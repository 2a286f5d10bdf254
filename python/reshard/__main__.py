"""``python -m reshard ARGS``, and the ``reshard`` command of a pip-installed package: runs the
reshard binary that ``pip install .`` puts beside this module, with ARGS.

The process becomes the binary (exec), so its signals, output and exit status are the CLI's own.
"""
import os
import sys


def main():
    binary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reshard")
    if not os.access(binary, os.X_OK):
        sys.exit(f"reshard: no reshard binary beside {__file__}; install the package with `pip install .` "
                 "from a reshard checkout, or run the build's own binary (build/reshard)")
    os.execv(binary, ["reshard"] + sys.argv[1:])


if __name__ == "__main__":
    main()
