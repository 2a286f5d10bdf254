#!/usr/bin/python3
"""Regenerate tests/data/ds_universal/: universal checkpoints written by DeepSpeed's own converter.

Local tool, not run in CI (it needs a fetched DeepSpeed source tree).  For every case it

  1. writes a small source checkpoint with the fixture generator (``FixtureConfig(**fixture)``,
     the same thing ``make_fixture(root, **fixture)`` of tests/interop/interop_support.py writes);
  2. runs DeepSpeed's ``ds_to_universal`` on it, imported from the source tree the way
     tools/ds_crosscheck.py does (no DeepSpeed installed, no GPU; the functions are shared);
  3. puts the result under ``OUT/<case>/``: ``latest_universal`` and ``global_step10_universal/``
     (``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``, ``zero/optimizer_state.pt`` and the
     ``mp_rank_*_model_states.pt`` files ds_to_universal copies), plus ``case.json`` with the
     generator parameters and the DeepSpeed commit, so a test can regenerate the native source.

Nothing of DeepSpeed is committed: only its output.  Make the source tree as the docstring of
tools/ds_crosscheck.py says, and pass the commit it was archived from (``git --git-dir=...
rev-parse HEAD``), which is recorded in case.json:

    PYTHONPATH=tests /usr/bin/python3 tools/make_ds_universal_data.py \
        --deepspeed-src /tmp/ds-src --deepspeed-commit SHA [--out tests/data/ds_universal] [--case NAME ...]
    ... --check     regenerate into a temporary folder and compare byte for byte with OUT
                    (exit 1 on any difference); writes nothing
"""

import argparse
import filecmp
import io
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import ds_crosscheck as dc  # noqa: E402  (also puts tests/ and tests/interop on sys.path)
from fixtures import megatron_fixture as mf  # noqa: E402

# The smallest models that still show what matters: vocabulary padding rows (V=10 -> Vp 16 at
# TP 2, 12 at TP 1), a multi-head fused QKV, GQA with two query heads per KV head, SwiGLU,
# every pipeline stage holding one block.
GPT2 = dict(style='ms_gpt2', L=2, h=8, n=4, hd=2, ffn=8, V=10, mvsdb=4, S=4)
LLAMA = dict(style='ms_llama', L=2, h=8, n=4, nkv=2, hd=2, ffn=4, V=10, mvsdb=4)
COMMON = dict(seed=1234, iteration=10)

CASES = {
    'gpt2_bf16_tp2_pp2_dp2': dict(GPT2, tp=2, pp=2, dp=2, optimizer='bf16_zero', **COMMON),
    'llama_bf16_tp2_pp1_dp2': dict(LLAMA, tp=2, pp=1, dp=2, optimizer='bf16_zero', **COMMON),
    'gpt2_zero1_tp1_pp2_dp2': dict(GPT2, tp=1, pp=2, dp=2, optimizer='zero1', **COMMON),
}
SIZE_KEYS = ('L', 'h', 'n', 'nkv', 'hd', 'ffn', 'V', 'mvsdb', 'S')


def case_record(name: str, fixture: dict, commit: str) -> dict:
    cfg = mf.FixtureConfig(**fixture)
    return {
        'case': name,
        'family': fixture['style'],
        'tp': cfg.tp, 'pp': cfg.pp, 'dp': cfg.dp,
        'optimizer': cfg.optimizer,
        'dtype': cfg.dtype,
        'seed': cfg.seed,
        'iteration': cfg.iteration,
        'sizes': {k: getattr(cfg, k) for k in SIZE_KEYS},
        'padded_vocab_size': cfg.Vp,
        # Exactly the keyword arguments: make_fixture(root, **fixture) writes the source again.
        'fixture': fixture,
        'source_tag': cfg.tag,
        'universal_folder': cfg.tag + '_universal',
        'producer': 'deepspeed/checkpoint/ds_to_universal.py main(), num_extract_workers=1, '
                    'num_merge_workers=1, inject_missing_state=False, no patches',
        'deepspeed_commit': commit,
    }


def generate(name: str, fixture: dict, dest: str, dtu, classes, commit: str) -> None:
    """Writes OUT/<name>/ afresh (dest is that folder)."""
    cfg = mf.FixtureConfig(**fixture)
    work = dc.Workarounds()
    log = io.StringIO()
    with tempfile.TemporaryDirectory(prefix='ds-universal-data-') as tmp:
        tag = mf.write_checkpoint(os.path.join(tmp, 'src'), cfg)['tag_dir']
        out = os.path.join(tmp, 'out')
        try:
            dc.run_universal(dtu, classes, cfg, tag, out, work, log)
        except Exception:
            sys.stderr.write(log.getvalue()[-3000:])
            raise
        if work.label():
            raise SystemExit(f'{name}: needed a workaround ({work.label()}); not recording patched output')
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(out, dest)
    with open(os.path.join(dest, 'case.json'), 'w') as f:
        json.dump(case_record(name, fixture, commit), f, indent=2)
        f.write('\n')


def tree_differences(a: str, b: str) -> list:
    out = []
    cmp = filecmp.dircmp(a, b)

    def walk(c, rel):
        for x in c.left_only:
            out.append(f'only in {a}: {os.path.join(rel, x)}')
        for x in c.right_only:
            out.append(f'only in {b}: {os.path.join(rel, x)}')
        for x in c.common_files:
            if not filecmp.cmp(os.path.join(c.left, x), os.path.join(c.right, x), shallow=False):
                out.append(f'differs: {os.path.join(rel, x)}')
        for sub, c2 in c.subdirs.items():
            walk(c2, os.path.join(rel, sub))
    walk(cmp, '')
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--deepspeed-src', required=True, help='folder holding deepspeed/checkpoint/')
    ap.add_argument('--deepspeed-commit', required=True, help='the DeepSpeed commit the tree was archived from')
    ap.add_argument('--out', default=os.path.join(REPO, 'tests', 'data', 'ds_universal'))
    ap.add_argument('--case', action='append', choices=sorted(CASES), help='only these cases')
    ap.add_argument('--check', action='store_true', help='compare a regeneration with OUT; write nothing')
    ns = ap.parse_args(argv)
    dtu, classes = dc.import_ds_to_universal(ns.deepspeed_src)
    names = ns.case or list(CASES)
    bad = 0
    for name in names:
        if ns.check:
            with tempfile.TemporaryDirectory(prefix='ds-universal-check-') as tmp:
                fresh = os.path.join(tmp, name)
                generate(name, CASES[name], fresh, dtu, classes, ns.deepspeed_commit)
                diffs = tree_differences(os.path.join(ns.out, name), fresh)
            print(f'{name}: {"identical" if not diffs else f"{len(diffs)} difference(s)"}')
            for d in diffs[:20]:
                print('   ', d)
            bad += bool(diffs)
        else:
            dest = os.path.join(ns.out, name)
            generate(name, CASES[name], dest, dtu, classes, ns.deepspeed_commit)
            files = sum(len(f) for _, _, f in os.walk(dest))
            size = sum(os.path.getsize(os.path.join(r, x)) for r, _, f in os.walk(dest) for x in f)
            print(f'{name}: {files} files, {size} bytes -> {dest}')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
