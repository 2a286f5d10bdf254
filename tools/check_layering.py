#!/usr/bin/env python3
"""Checks that engine/, cli/ and python/ include only what the layering allows.

The floors of engine/ are listed, lowest first, in tools/layers.txt. A file in
engine/<folder>/ may include its own folder, lower floors and include/reshard/
(the public API); never a higher floor nor another folder of its own floor.
`formats/*` in layers.txt makes every engine/formats/<name>/ a format folder on
the floor of `formats`: it may include formats/format.h (the interface) but no
other format folder, and only the .cc files directly in engine/formats/ (the
OpenCheckpoint registry) may include a format folder. A line
`formats/<name>: a | b c | .` gives a format folder floors of its own: its
sub-folders, lowest first, floors separated by `|`, `.` for the files directly
in it; every sub-folder holding sources must then be listed. A line
`formats: a b | *` puts the shared folders formats/a and formats/b below every
other format folder (`*`): code that formats of one family share, which any
format folder may include; a shared folder includes no format folder (nor a
shared folder on its own floor). The front ends,
cli/ and python/ (the Python module's binding), may include only
include/reshard/. Every folder under engine/ holding sources must be
listed. tests/ and benchmarks/ are not scanned.

  python3 tools/check_layering.py [--root DIR] [--layers FILE]
  python3 tools/check_layering.py --self-test

Prints one line per violation, `file:line: <folder> includes <header> (...)`,
and exits 1; else prints `layering ok: N files, M includes` and exits 0.
Exit 2: layers.txt cannot be read.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
SOURCE_EXTS = (".h", ".cc")
PUBLIC_PREFIX = "reshard/"  # include/reshard/: allowed everywhere
FOLDER_RE = re.compile(r"^[A-Za-z0-9_]+$")
FRONT_ENDS = ("cli", "python")  # over the public API only
SCANNED_TOPS = ("engine",) + FRONT_ENDS


class LayersError(Exception):
    pass


class Layers:
    """tools/layers.txt: folder -> floor (1 = lowest), plus folder families."""

    def __init__(self):
        self.floor = {}        # folder name -> floor number
        self.families = set()  # `x/*` entries: every engine/x/<name>/ is a folder
        self.inner = {}        # folder -> {sub-folder or ".": floor inside it}
        self.shared = {}       # family -> {shared member or "*": floor among its members}

    def floor_of(self, folder):
        if folder in self.floor:
            return self.floor[folder]
        family, _, member = folder.partition("/")
        if member and family in self.families:
            return self.floor[family]
        return None

    def folder_of(self, engine_rel):
        """The folder of a path relative to engine/ (None: directly in engine/)."""
        parts = engine_rel.split("/")
        if len(parts) < 2:
            return None
        if parts[0] in self.families and len(parts) >= 3:
            return parts[0] + "/" + parts[1]
        return parts[0]

    def sub_of(self, engine_rel, folder):
        """The sub-folder of `folder` a path relative to engine/ is in ("." directly in it)."""
        rest = engine_rel[len(folder) + 1:].split("/")
        return rest[0] if len(rest) > 1 else "."


def parse_inner(layers, path, lineno, folder, text):
    """`folder: a | b c | .`: the floors inside a format folder."""
    family, _, member = folder.partition("/")
    if not member or family not in layers.families or not FOLDER_RE.match(member):
        raise LayersError(f"{path}:{lineno}: '{folder}' is not a folder of a `name/*` family listed above")
    if folder in layers.inner:
        raise LayersError(f"{path}:{lineno}: the floors of '{folder}' are listed twice")
    floors = {}
    for number, group in enumerate(text.split("|"), 1):
        for name in group.split():
            if name != "." and not FOLDER_RE.match(name):
                raise LayersError(f"{path}:{lineno}: '{name}' is not a sub-folder name (or .)")
            if name in floors:
                raise LayersError(f"{path}:{lineno}: '{name}' is listed twice in '{folder}'")
            floors[name] = number
    if not floors:
        raise LayersError(f"{path}:{lineno}: '{folder}' lists no sub-folder")
    layers.inner[folder] = floors


def parse_shared(layers, path, lineno, family, text):
    """`family: a b | *`: shared folders of a family, below its other members (`*`)."""
    if family not in layers.families:
        raise LayersError(f"{path}:{lineno}: '{family}' is not a `name/*` family listed above")
    if family in layers.shared:
        raise LayersError(f"{path}:{lineno}: the shared folders of '{family}' are listed twice")
    groups = [group.split() for group in text.split("|")]
    if len(groups) < 2 or groups[-1] != ["*"]:
        raise LayersError(f"{path}:{lineno}: '{family}:' lists shared folders, then `| *` (every other folder)")
    floors = {"*": len(groups)}
    for number, group in enumerate(groups[:-1], 1):
        for name in group:
            if not FOLDER_RE.match(name):
                raise LayersError(f"{path}:{lineno}: '{name}' is not a folder name")
            if name in floors:
                raise LayersError(f"{path}:{lineno}: '{name}' is listed twice in '{family}:'")
            floors[name] = number
    layers.shared[family] = floors


def parse_layers(path):
    layers = Layers()
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise LayersError(f"{path}: cannot read ({e.strerror})")
    number = 0
    for lineno, raw in enumerate(lines, 1):
        text = raw.split("#", 1)[0]
        if ":" in text:
            folder, _, floors = text.partition(":")
            if "/" in folder:
                parse_inner(layers, path, lineno, folder.strip(), floors)
            else:
                parse_shared(layers, path, lineno, folder.strip(), floors)
            continue
        names = text.split()
        if not names:
            continue
        number += 1
        for name in names:
            family = name[:-2] if name.endswith("/*") else None
            base = family if family is not None else name
            if not FOLDER_RE.match(base):
                raise LayersError(f"{path}:{lineno}: '{name}' is not a folder name (or name/*)")
            if family is not None:
                if family not in names:
                    raise LayersError(f"{path}:{lineno}: '{name}' needs '{family}' on the same line")
                if family in layers.families:
                    raise LayersError(f"{path}:{lineno}: '{name}' is listed twice")
                layers.families.add(family)
                continue
            if name in layers.floor:
                raise LayersError(f"{path}:{lineno}: '{name}' is listed twice "
                                  f"(floor {layers.floor[name]} and {number})")
            layers.floor[name] = number
    if not layers.floor:
        raise LayersError(f"{path}: lists no folder")
    return layers


class Violation:
    def __init__(self, path, line, folder, header, reason):
        self.path, self.line, self.folder, self.header, self.reason = (
            path, line, folder, header, reason)

    def key(self):
        return (self.path, self.line, self.folder, self.header)

    def __str__(self):
        if self.header is None:  # a folder or file that has no place
            return f"{self.path}: {self.reason}"
        return f"{self.path}:{self.line}: {self.folder} includes {self.header} ({self.reason})"


def source_files(root):
    """Every .h/.cc under engine/ and the front ends, as sorted '/'-separated paths relative to root."""
    out = []
    for top in SCANNED_TOPS:
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for name in filenames:
                if name.endswith(SOURCE_EXTS):
                    rel = os.path.relpath(os.path.join(dirpath, name), root)
                    out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def resolve(root, including, header, layers):
    """Where `#include "header"` in file `including` lands, as
    ('public', None), ('engine', engine-relative path), ('front end', its folder) or
    ('external', None), searching as the compiler does: the including file's
    folder, then include/, then engine/."""
    rel_dir = os.path.dirname(including)
    local = os.path.normpath(os.path.join(rel_dir, header)).replace(os.sep, "/")
    candidates = []
    if not local.startswith("../") and os.path.isfile(os.path.join(root, local)):
        candidates.append(local)
    if os.path.isfile(os.path.join(root, "include", header)):
        candidates.append("include/" + os.path.normpath(header).replace(os.sep, "/"))
    if os.path.isfile(os.path.join(root, "engine", header)):
        candidates.append("engine/" + os.path.normpath(header).replace(os.sep, "/"))
    if candidates:
        hit = candidates[0]
        if hit.startswith("include/reshard/"):
            return ("public", None)
        if hit.startswith("engine/"):
            return ("engine", hit[len("engine/"):])
        if hit.split("/", 1)[0] in FRONT_ENDS:
            return ("front end", hit.split("/", 1)[0])
        return ("external", None)
    # Not on disk (yet): judge it by the name it is included by.
    if header.startswith(PUBLIC_PREFIX):
        return ("public", None)
    first = header.split("/", 1)[0]
    if "/" in header and (first in layers.floor or first in layers.families):
        return ("engine", os.path.normpath(header).replace(os.sep, "/"))
    return ("external", None)


def inner_violation(layers, path, folder, target_rel):
    """Why `path` may not include `target_rel`, both in `folder`, by the
    folder's own floors; None when it may (or the folder has none)."""
    floors = layers.inner.get(folder)
    if floors is None:
        return None
    src = layers.sub_of(path[len("engine/"):], folder)
    dst = layers.sub_of(target_rel, folder)
    if src == dst:
        return None
    fs, fd = floors.get(src), floors.get(dst)
    if fs is None or fd is None:
        return None  # the unlisted sub-folder is reported once, by check
    if fd < fs:
        return None
    reason = f"{folder}/{src} (its floor {fs}) may not include {folder}/{dst} (its floor {fd})"
    return reason + (": same floor" if fd == fs else "")


def label(layers, folder):
    floor = layers.floor_of(folder)
    if floor is None:
        return f"unlisted folder {folder}"
    return f"floor {floor} {folder}"


def check(root, layers_path=None):
    """Returns (violations, files scanned, includes seen). Raises LayersError."""
    root = os.path.abspath(root)
    layers = parse_layers(layers_path or os.path.join(root, "tools", "layers.txt"))
    layers_name = os.path.relpath(layers_path, root) if layers_path else "tools/layers.txt"
    violations = []

    files = source_files(root)
    unlisted = set()
    for path in files:
        if not path.startswith("engine/"):
            continue
        folder = layers.folder_of(path[len("engine/"):])
        if folder is None:
            violations.append(Violation(
                path, 0, None, None,
                f"file outside any folder (move it into a folder listed in {layers_name})"))
        elif layers.floor_of(folder) is None and folder not in unlisted:
            unlisted.add(folder)
            violations.append(Violation(
                f"engine/{folder}/", 0, folder, None,
                f"folder {folder} is not listed in {layers_name} (place it on a floor)"))
        elif folder in layers.inner:
            sub = layers.sub_of(path[len("engine/"):], folder)
            if sub not in layers.inner[folder] and (folder, sub) not in unlisted:
                unlisted.add((folder, sub))
                violations.append(Violation(
                    f"engine/{folder}/{sub}/", 0, folder, None,
                    f"sub-folder {sub} of {folder} is not listed on its line in {layers_name} "
                    f"(place it on one of its floors)"))

    includes = 0
    for path in files:
        if path.split("/", 1)[0] in FRONT_ENDS:
            src = path.split("/", 1)[0]
        else:
            src = layers.folder_of(path[len("engine/"):])
            if src is None or layers.floor_of(src) is None:
                continue  # already reported: it has no floor to judge by
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
        for lineno, text in enumerate(lines, 1):
            m = INCLUDE_RE.match(text)
            if not m:
                continue
            includes += 1
            header = m.group(1)
            kind, target_rel = resolve(root, path, header, layers)
            if kind in ("public", "external"):
                continue
            if kind == "front end":
                if src != target_rel:
                    violations.append(Violation(path, lineno, src, header,
                                                f"{label(layers, src)} may not include {target_rel}"))
                continue
            dst = layers.folder_of(target_rel)
            if dst is None:
                dst = target_rel.split("/", 1)[0]
            if src in FRONT_ENDS:
                violations.append(Violation(
                    path, lineno, src, header,
                    f"{src} may not include {label(layers, dst)}: only include/reshard/ headers"))
                continue
            if dst == src:
                reason = inner_violation(layers, path, src, target_rel)
                if reason is not None:
                    violations.append(Violation(path, lineno, src, header, reason))
                continue
            fs, fd = layers.floor_of(src), layers.floor_of(dst)
            if fd is None:
                continue  # the unlisted folder is reported once, above
            if fd < fs:
                continue
            reason = f"{label(layers, src)} may not include {label(layers, dst)}"
            if fd == fs:
                family_s, _, member_s = src.partition("/")
                family_d, _, member_d = dst.partition("/")
                if member_s and not member_d and family_d == family_s:
                    continue  # a format folder includes its interface
                if (not member_s and member_d and family_d == src
                        and path.endswith(".cc") and path.count("/") == 2):
                    continue  # the registry (engine/formats/*.cc) includes a format folder
                if member_s and member_d and family_s == family_d:
                    shared = layers.shared.get(family_s)
                    if shared and shared.get(member_d, shared["*"]) < shared.get(member_s, shared["*"]):
                        continue  # a format folder includes a shared folder below it
                    reason += ": one format folder may not include another"
                elif not member_s and member_d:
                    reason += f": only the .cc files directly in engine/{src}/ may"
                else:
                    reason += ": same floor"
            violations.append(Violation(path, lineno, src, header, reason))
    return violations, len(files), includes


def run(root, layers_path=None, out=sys.stdout, err=sys.stderr):
    try:
        violations, nfiles, nincludes = check(root, layers_path)
    except LayersError as e:
        print(f"check_layering: {e}", file=err)
        return 2
    for v in violations:
        print(v, file=out)
    if violations:
        print(f"layering: {len(violations)} violation(s) in {nfiles} files, "
              f"{nincludes} includes", file=err)
        return 1
    print(f"layering ok: {nfiles} files, {nincludes} includes", file=out)
    return 0


# ---- --self-test -------------------------------------------------------------

SELF_TEST_LAYERS = """\
# the floors, as in tools/layers.txt
util
pickle
container
rules
logical
plan
exec cluster   # same floor
formats formats/*
api
formats/alpha: low | sub | .   # floors inside a format folder
formats: shared | *             # shared by the format folders
"""

CLEAN_TREE = {
    "include/reshard/status.h": "#pragma once\n",
    "include/reshard/reshard.h": '#pragma once\n#include "reshard/status.h"\n',
    "engine/util/u.h": '// #include "api/x.h" is a comment, not an include\n'
                       '#include "reshard/status.h"\n#include <string>\n',
    "engine/util/u.cc": '#include "util/u.h"\n',
    "engine/pickle/p.h": '#include "util/u.h"\n',
    "engine/pickle/p.cc": '#include "p.h"\n',
    "engine/container/k.h": '#include "pickle/p.h"\n#include "../util/u.h"\n',
    "engine/rules/r.h": '#include "pickle/p.h"\n#include "yaml-cpp/yaml.h"\n',
    "engine/logical/l.h": '#include "container/k.h"\n#include "rules/r.h"\n',
    "engine/plan/pl.h": '#include "logical/l.h"\n',
    "engine/exec/e.h": '#include "util/u.h"\n',
    "engine/exec/e.cc": '#include "exec/e.h"\n',
    "engine/cluster/c.h": '#include "reshard/status.h"\n',
    "engine/cluster/c.cc": '#include "cluster/c.h"\n#ifdef WITH_MPI\n#  include "cluster/mpi.h"\n#endif\n',
    "engine/cluster/mpi.h": '#include "cluster/c.h"\n',
    "engine/formats/format.h": '#include "exec/e.h"\n#include "pickle/p.h"\n',
    "engine/formats/format.cc": '#include "formats/format.h"\n'
                                '#include "formats/alpha/a.h"\n#include "formats/beta/b.h"\n',
    "engine/formats/alpha/a.h": '#include "formats/format.h"\n#include "plan/pl.h"\n',
    "engine/formats/alpha/a.cc": '#include "a.h"\n#include "formats/alpha/a.h"\n',
    "engine/formats/alpha/sub/deep.h": '#include "formats/alpha/low/l.h"\n#include "formats/format.h"\n',
    "engine/formats/alpha/low/l.h": '#include "formats/format.h"\n#include "plan/pl.h"\n',
    "engine/formats/beta/b.h": '#include "formats/format.h"\n#include "formats/shared/s.h"\n',
    "engine/formats/shared/s.h": '#include "formats/format.h"\n',
    "engine/api/x.cc": '#include "formats/format.h"\n#include "cluster/c.h"\n'
                       '#include "exec/e.h"\n#include "reshard/reshard.h"\n',
    "cli/main.cc": '#include <CLI/CLI.hpp>\n#include "reshard/reshard.h"\n#include "reshard/new_api.h"\n',
    # exempt: never scanned
    "tests/unit/t.cc": '#include "api/x.cc"\n#include "cluster/c.h"\n',
    "benchmarks/micro/b.cc": '#include "formats/alpha/a.h"\n',
}

# Added to the clean tree: path -> text, and the violations they must produce.
DIRTY_FILES = {
    # upward: floor 1 includes floor 5; and a relative path going upward
    "engine/util/up.cc": '#include "util/u.h"\n#include "logical/l.h"\n',
    "engine/container/rel.cc": '#include "container/k.h"\n#include "../logical/l.h"\n',
    # same floor, both directions
    "engine/exec/uses_cluster.cc": '#include "exec/e.h"\n#include "cluster/c.h"\n',
    "engine/cluster/uses_exec.h": '#pragma once\n#include "exec/e.h"\n',
    # one format folder includes another; the interface header includes a format
    "engine/formats/beta/b.cc": '#include "formats/beta/b.h"\n#include "formats/alpha/a.h"\n',
    "engine/formats/registry.h": '#include "formats/beta/b.h"\n',
    # a new format folder is placed by formats/*: not a violation by itself
    "engine/formats/gamma/g.h": '#include "formats/format.h"\n',
    # cli includes engine headers
    "cli/main.cc": '#include <CLI/CLI.hpp>\n#include "reshard/reshard.h"\n'
                   '#include "cluster/c.h"\n#include "util/u.h"\n',
    # the Python binding includes an engine header
    "python/module.cc": '#include <pybind11/pybind11.h>\n#include "reshard/reshard.h"\n#include "api/a.h"\n',
    # a folder nobody placed, and a file outside any folder
    "engine/newthing/n.cc": '#include "util/u.h"\n#include "api/x.cc"\n',
    "engine/stray.cc": '#include "util/u.h"\n',
    # inside a format folder: a lower floor includes a higher one, and a
    # sub-folder its line does not list
    "engine/formats/alpha/low/up.h": '#include "formats/alpha/sub/deep.h"\n#include "formats/alpha/a.h"\n',
    "engine/formats/alpha/odd/o.h": '#include "formats/alpha/low/l.h"\n',
    # a shared folder includes a format folder
    "engine/formats/shared/up.h": '#include "formats/shared/s.h"\n#include "formats/beta/b.h"\n',
}

DIRTY_EXPECTED = {
    ("engine/util/up.cc", 2, "util", "logical/l.h"),
    ("engine/container/rel.cc", 2, "container", "../logical/l.h"),
    ("engine/exec/uses_cluster.cc", 2, "exec", "cluster/c.h"),
    ("engine/cluster/uses_exec.h", 2, "cluster", "exec/e.h"),
    ("engine/formats/beta/b.cc", 2, "formats/beta", "formats/alpha/a.h"),
    ("engine/formats/registry.h", 1, "formats", "formats/beta/b.h"),
    ("cli/main.cc", 3, "cli", "cluster/c.h"),
    ("cli/main.cc", 4, "cli", "util/u.h"),
    ("python/module.cc", 3, "python", "api/a.h"),
    ("engine/newthing/", 0, "newthing", None),
    ("engine/stray.cc", 0, None, None),
    ("engine/formats/alpha/low/up.h", 1, "formats/alpha", "formats/alpha/sub/deep.h"),
    ("engine/formats/alpha/low/up.h", 2, "formats/alpha", "formats/alpha/a.h"),
    ("engine/formats/alpha/odd/", 0, "formats/alpha", None),
    ("engine/formats/shared/up.h", 2, "formats/shared", "formats/beta/b.h"),
}


def write_tree(root, files, layers_text):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    os.makedirs(os.path.join(root, "tools"), exist_ok=True)
    with open(os.path.join(root, "tools", "layers.txt"), "w", encoding="utf-8") as f:
        f.write(layers_text)


def run_cli(root):
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--root", root],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    return p.returncode, p.stdout.splitlines()


def self_test():
    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    tmp = tempfile.mkdtemp(prefix="check_layering.")
    try:
        clean = os.path.join(tmp, "clean")
        write_tree(clean, CLEAN_TREE, SELF_TEST_LAYERS)
        found, nfiles, nincludes = check(clean)
        expect(not found, "clean tree: unexpected violations:\n  " +
               "\n  ".join(str(v) for v in found))
        expect(nfiles == 23, f"clean tree: scanned {nfiles} files, expected 23")
        rc, out = run_cli(clean)
        expect(rc == 0, f"clean tree: exit {rc}, expected 0")
        expect(out == [f"layering ok: {nfiles} files, {nincludes} includes"],
               f"clean tree: output {out!r}")

        dirty = os.path.join(tmp, "dirty")
        files = dict(CLEAN_TREE)
        files.update(DIRTY_FILES)
        write_tree(dirty, files, SELF_TEST_LAYERS)
        found, _, _ = check(dirty)
        got = {v.key() for v in found}
        for k in sorted(DIRTY_EXPECTED - got, key=str):
            failures.append(f"dirty tree: missed {k}")
        for v in found:
            if v.key() not in DIRTY_EXPECTED:
                failures.append(f"dirty tree: unexpected {v}")
        expect(len(found) == len(got), "dirty tree: a violation was reported twice")
        rc, out = run_cli(dirty)
        expect(rc == 1, f"dirty tree: exit {rc}, expected 1")
        expect(sorted(out) == sorted(str(v) for v in found),
               f"dirty tree: output is not one line per violation: {out!r}")
        expect("engine/exec/uses_cluster.cc:2: exec includes cluster/c.h "
               "(floor 7 exec may not include floor 7 cluster: same floor)" in out,
               "dirty tree: same-floor message format changed")

        # A malformed layers.txt is refused with exit 2, not taken as clean.
        with open(os.path.join(clean, "tools", "layers.txt"), "a", encoding="utf-8") as f:
            f.write("exec\n")
        rc, _ = run_cli(clean)
        expect(rc == 2, f"duplicate folder in layers.txt: exit {rc}, expected 2")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if failures:
        for f in failures:
            print(f"self-test FAILED: {f}")
        return 1
    print(f"self-test ok: clean tree clean, {len(DIRTY_EXPECTED)} known violations found exactly")
    return 0


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.path.dirname(here),
                        help="source tree holding engine/, cli/, tools/layers.txt (default: this repo)")
    parser.add_argument("--layers", help="floor list (default: ROOT/tools/layers.txt)")
    parser.add_argument("--self-test", action="store_true",
                        help="check the checker on temporary trees with known violations")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    return run(args.root, args.layers)


if __name__ == "__main__":
    sys.exit(main())
