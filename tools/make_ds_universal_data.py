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

The ``nonpipe_*`` cases do the same for non-pipeline (HF-Trainer-style) checkpoints written by
tests/fixtures/deepspeed_nonpipe.py: ``write_nonpipe(root, NonPipeConfig(**nonpipe_config))``.
Their ZeRO-1/2 sources carry no ``universal_checkpoint_info`` (no HF model declares one), which
ds_to_universal's ZeRO-1/2 path asserts on; they are converted with its own
``--inject_missing_state`` option (it adds only the version number, in memory).  Its ZeRO-3
path reads no such info and runs with ``inject_missing_state=False``.

Nothing of DeepSpeed is committed: only its output.  Make the source tree as the docstring of
tools/ds_crosscheck.py says, and pass the commit it was archived from (``git --git-dir=...
rev-parse HEAD``), which is recorded in case.json:

    PYTHONPATH=tests /usr/bin/python3 tools/make_ds_universal_data.py \
        --deepspeed-src SRC --deepspeed-commit SHA [--out tests/data/ds_universal] [--case NAME ...]
    ... --check     regenerate into a temporary folder and compare byte for byte with OUT
                    (exit 1 on any difference); writes nothing
"""

import argparse
import dataclasses
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
from fixtures import deepspeed_nonpipe as dn  # noqa: E402
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

# Non-pipeline sources: the smallest sizes NonPipeConfig accepts (every size >= 1; head_dim even
# for the rotary buffer).  Even so every parameter straddles or fills a ZeRO-1/2 partition
# boundary somewhere, and at ZeRO-3 DP 2 the numel-1 parameters leave rank 1 a padding-only
# partition (a zero-length fragment).  q/k/v biases and the rotary inv_freq buffer are kept.
NONPIPE_MIN = dict(L=1, h=1, n_heads=1, n_kv=1, head_dim=2, ffn=1, V=1)
NONPIPE_CASES = {
    'nonpipe_zero2_bf16_dp2': dict(NONPIPE_MIN, zero_stage=2, dtype='bf16', dp=2),
    'nonpipe_zero3_bf16_dp2': dict(NONPIPE_MIN, zero_stage=3, dtype='bf16', dp=2),
    'nonpipe_zero2_fp16_dp2': dict(NONPIPE_MIN, zero_stage=2, dtype='fp16', dp=2),
}
ALL_CASES = sorted(list(CASES) + list(NONPIPE_CASES))
NONPIPE_SIZE_KEYS = ('L', 'h', 'n_heads', 'n_kv', 'head_dim', 'ffn', 'V')


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


def nonpipe_config(kwargs: dict) -> dict:
    """Every NonPipeConfig field, resolved (so the record does not depend on today's defaults);
    ``NonPipeConfig(**nonpipe_config(kw))`` is the same configuration as ``NonPipeConfig(**kw)``."""
    cfg = dn.NonPipeConfig(**kwargs)
    out = dataclasses.asdict(cfg)
    out['frozen'] = list(out['frozen'])
    return out


def nonpipe_case_record(name: str, kwargs: dict, commit: str) -> dict:
    full = nonpipe_config(kwargs)
    cfg = dn.NonPipeConfig(**full)
    return {
        'case': name,
        'kind': 'nonpipe',
        'generator': 'tests/fixtures/deepspeed_nonpipe.py: write_nonpipe(root, NonPipeConfig(**nonpipe_config))',
        'zero_stage': cfg.zero_stage, 'dp': cfg.dp, 'tp': 1, 'pp': 1,
        'dtype': cfg.dtype,
        'optimizer': cfg.optimizer,
        'seed': cfg.seed,
        'iteration': cfg.iteration,
        'sizes': {k: getattr(cfg, k) for k in NONPIPE_SIZE_KEYS},
        # Every field: write_nonpipe(root, NonPipeConfig(**nonpipe_config)) writes the source again.
        'nonpipe_config': full,
        'source_tag': cfg.tag,
        'universal_folder': cfg.tag + '_universal',
        'producer': 'deepspeed/checkpoint/ds_to_universal.py main(), num_extract_workers=1, '
                    f'num_merge_workers=1, inject_missing_state={cfg.zero_stage < 3}, no patches',
        'deepspeed_commit': commit,
    }


def write_source(name: str, root: str):
    """Writes case ``name``'s native source under root; returns (its tag folder, the config
    run_universal takes, inject_missing_state)."""
    if name in NONPIPE_CASES:
        cfg = dn.NonPipeConfig(**nonpipe_config(NONPIPE_CASES[name]))
        return dn.write_nonpipe(root, cfg)['tag_dir'], cfg, cfg.zero_stage < 3
    cfg = mf.FixtureConfig(**CASES[name])
    return mf.write_checkpoint(root, cfg)['tag_dir'], cfg, False


def run_case(name: str, tmp: str, dtu, classes) -> str:
    """Writes case ``name``'s source under tmp/src and DeepSpeed's conversion of it under tmp/out
    (no workaround allowed); returns tmp/out."""
    tag, cfg, inject = write_source(name, os.path.join(tmp, 'src'))
    out = os.path.join(tmp, 'out')
    work = dc.Workarounds()
    log = io.StringIO()
    try:
        dc.run_universal(dtu, classes, cfg, tag, out, work, log, inject_missing_state=inject)
    except Exception:
        sys.stderr.write(log.getvalue()[-3000:])
        raise
    if work.label():
        raise SystemExit(f'{name}: needed a workaround ({work.label()}); not recording patched output')
    return out


def generate(name: str, dest: str, dtu, classes, commit: str) -> None:
    """Writes OUT/<name>/ afresh (dest is that folder)."""
    with tempfile.TemporaryDirectory(prefix='ds-universal-data-') as tmp:
        out = run_case(name, tmp, dtu, classes)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(out, dest)
    record = (nonpipe_case_record(name, NONPIPE_CASES[name], commit) if name in NONPIPE_CASES
              else case_record(name, CASES[name], commit))
    with open(os.path.join(dest, 'case.json'), 'w') as f:
        json.dump(record, f, indent=2)
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
    ap.add_argument('--case', action='append', choices=ALL_CASES, help='only these cases')
    ap.add_argument('--check', action='store_true', help='compare a regeneration with OUT; write nothing')
    ns = ap.parse_args(argv)
    dtu, classes = dc.import_ds_to_universal(ns.deepspeed_src)
    names = ns.case or ALL_CASES
    bad = 0
    for name in names:
        if ns.check:
            with tempfile.TemporaryDirectory(prefix='ds-universal-check-') as tmp:
                fresh = os.path.join(tmp, name)
                generate(name, fresh, dtu, classes, ns.deepspeed_commit)
                diffs = tree_differences(os.path.join(ns.out, name), fresh)
            print(f'{name}: {"identical" if not diffs else f"{len(diffs)} difference(s)"}')
            for d in diffs[:20]:
                print('   ', d)
            bad += bool(diffs)
        else:
            dest = os.path.join(ns.out, name)
            generate(name, dest, dtu, classes, ns.deepspeed_commit)
            files = sum(len(f) for _, _, f in os.walk(dest))
            size = sum(os.path.getsize(os.path.join(r, x)) for r, _, f in os.walk(dest) for x in f)
            print(f'{name}: {files} files, {size} bytes -> {dest}')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
