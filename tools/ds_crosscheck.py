#!/usr/bin/python3
"""Cross-check reshard's optimizer reshaping with DeepSpeed's own ``ds_to_universal``.

Local tool, not run in CI.  For several (source -> target) layouts it

  1. writes a faithful source checkpoint A with the fixture generator (real ``torch.save``);
  2. converts it with ``reshard convert A B --tp --pp --dp`` (optimizer included);
  3. runs DeepSpeed's ``ds_to_universal`` (imported from a fetched DeepSpeed source tree) on A,
     on B and on a reference C = the same model written by the fixture at TP 1 / PP 1 / DP 1;
  4. compares the universal per-parameter files ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``:
     U(B) must equal U(A) tensor for tensor, bit for bit, including the layout metadata
     (``cat_dim``, ``vocab_tensor``, ``param_n_sub_params``); U(A) must equal U(C) in its tensors
     (metadata differs there legitimately: C is TP 1).  Vocabulary padding rows do not take part:
     ``ds_to_universal`` strips vocabulary tensors to ``original_vocab_size``.
     ``zero/optimizer_state.pt`` (loss scaler, clip_grad, param_groups, ...) is compared too,
     except ``partition_count`` which is the DP degree.

Nothing of DeepSpeed is installed or committed.  Make a source tree from the fetched bare git
directory of deepspeedai/DeepSpeed (GIT_DIR below), into a folder of your choosing (SRC):

    mkdir -p SRC && git --git-dir=GIT_DIR archive HEAD deepspeed | tar -x -C SRC

DeepSpeed's checkpoint package needs no GPU; this script imports it without running
``deepspeed/__init__.py`` (which wants accelerators and compiled ops): the fixture's pickle shims
register a stub ``deepspeed`` package, whose ``__path__`` is then pointed at the source tree so
that ``deepspeed.checkpoint`` is imported from it while ``deepspeed.utils`` / ``deepspeed.runtime``
stay stubs (they only supply the classes pickled in checkpoints, and a logger).  ``tqdm`` is
stubbed when absent.

BS checkpoints carry no ``universal_checkpoint_info`` (DeepSpeed's ``--inject_missing_state`` only
adds a version number, after which every replicated tensor would be concatenated); for them the
script supplies the patterns a BS model would declare, built from the model family alone (the
same info for source, target and reference).  Two DeepSpeed limitations are worked around the
same way on both sides, and the table says so:
  * shards without ``param_slice_mappings`` (DeepSpeed 0.6.5, BS issue #343): ``KeyError``;
    rerun with the mappings rebuilt from ``param_shapes`` and the flattening rule (section 11.3);
  * BF16 group padding longer than one partition (large DP): ``narrow(): length must be
    non-negative``; rerun with ``strip_tensor_paddings=False`` (DS PR #7426's workaround).

``import_ds_to_universal`` and ``run_universal`` are shared with tools/make_ds_universal_data.py
(regenerates tests/data/ds_universal, non-pipeline sources included), tools/ds_universal_compare.py
(compares reshard's ``export --to universal`` with DeepSpeed's output file by file) and
tools/ds_universal_load_check.py (runs DeepSpeed's universal *loading* code on reshard's
``export --to universal`` output).

Usage (PYTHONPATH must reach the repository's tests/ folder):

    PYTHONPATH=tests /usr/bin/python3 tools/ds_crosscheck.py --reshard build/reshard \
        --deepspeed-src SRC [--case NAME ...] [--keep DIR] [-v]
    PYTHONPATH=tests /usr/bin/python3 tools/ds_crosscheck.py --self-test --deepspeed-src SRC
        (B is written by the fixture generator at the target layout instead: checks the harness)

Exit status 0 when every comparison agreed (cases DeepSpeed cannot convert even from the source
are reported N/A), 1 otherwise.
"""

import argparse
import contextlib
import dataclasses
import io
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import types
from typing import Any, Dict, List, Optional, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), 'tests'))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), 'tests', 'interop'))
from fixtures import megatron_fixture as mf  # noqa: E402
from interop_support import FAMILIES, differences as obj_diff  # noqa: E402

STATES = ('fp32', 'exp_avg', 'exp_avg_sq', 'step')

@dataclasses.dataclass
class Case:
    name: str
    family: str
    src: Tuple[int, int, int]   # (TP, PP, DP)
    dst: Tuple[int, int, int]
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)


CASES = [
    Case('bloom-3d', 'bs_bloom', (2, 2, 2), (1, 4, 3)),
    Case('bloom-expand', 'bs_bloom', (1, 1, 2), (4, 3, 5)),
    Case('bs-gpt-glu', 'bs_gpt_glu', (2, 2, 2), (4, 1, 3)),
    Case('gpt2-3d', 'ms_gpt2', (2, 2, 2), (3, 4, 5)),
    Case('gpt2-shrink', 'ms_gpt2', (4, 3, 3), (1, 1, 2)),
    Case('gpt2-tp1-to-tp2', 'ms_gpt2', (1, 2, 2), (2, 3, 2)),
    Case('llama-3d', 'ms_llama', (2, 2, 3), (6, 3, 2)),
    Case('llama-dp12', 'ms_llama', (3, 1, 2), (2, 4, 12)),
    Case('zero1-gpt2', 'ms_gpt2', (2, 2, 2), (1, 3, 5), dict(optimizer='zero1')),
    Case('zero1-bloom', 'bs_bloom', (1, 2, 4), (2, 1, 3), dict(optimizer='zero1')),
    Case('pad>partition', 'tiny_bloom', (1, 1, 2), (2, 2, 16)),
    Case('legacy-v065', 'bs_bloom', (2, 2, 2), (1, 2, 3), dict(legacy_v065=True)),
    Case('llama-tp1-to-tp3', 'ms_llama', (1, 2, 1), (3, 1, 4)),
    # ds_to_universal reads only ZeRO / BF16 shard files: expected N/A.
    Case('fp16-no-zero', 'ms_gpt2', (2, 2, 1), (1, 3, 1), dict(optimizer='nozero_fp16')),
]


# ---------------------------------------------------------------------------------------------
# DeepSpeed import without a GPU
# ---------------------------------------------------------------------------------------------

def import_ds_to_universal(src: str):
    """Import deepspeed.checkpoint.ds_to_universal from the source tree ``src``."""
    pkg_dir = os.path.join(os.path.abspath(src), 'deepspeed')
    if not os.path.isfile(os.path.join(pkg_dir, 'checkpoint', 'ds_to_universal.py')):
        raise SystemExit(f'{src}: no deepspeed/checkpoint/ds_to_universal.py (see --help for how to '
                         'make a source tree from the fetched copy)')
    classes = mf.install_pickle_shims()
    ds = sys.modules.get('deepspeed')
    if ds is None or getattr(ds, '__file__', None):
        raise SystemExit('an installed deepspeed package is importable; run without it (this tool '
                         'imports only the fetched source tree\'s checkpoint package)')
    ds.__path__ = [pkg_dir]
    utils = sys.modules['deepspeed.utils']
    if not hasattr(utils, 'logger'):
        utils.logger = logging.getLogger('deepspeed')
    try:
        import tqdm  # noqa: F401
    except ImportError:
        stub = types.ModuleType('tqdm')
        stub.tqdm = lambda iterable, *a, **k: iterable
        sys.modules['tqdm'] = stub
    from deepspeed.checkpoint import ds_to_universal as dtu  # noqa: E402
    return dtu, classes


class Workarounds:
    """How DeepSpeed's extraction is patched (identically for every checkpoint of a case)."""

    def __init__(self):
        self.rebuild_mappings = False
        self.no_strip = False

    def label(self) -> str:
        out = []
        if self.rebuild_mappings:
            out.append('mappings rebuilt from param_shapes')
        if self.no_strip:
            out.append('strip_tensor_paddings=False')
        return ', '.join(out)


def make_checkpoint_class(dtu, classes, injected_info: Optional[dict], work: Workarounds):
    base = dtu.DeepSpeedCheckpoint
    fragment = classes['fragment_address']

    class PatchedCheckpoint(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            key = dtu.UNIVERSAL_CHECKPOINT_INFO
            if injected_info is not None and self.global_state.get(key) is None:
                self.global_state[key] = injected_info

        def get_zero_checkpoint_state(self, pp_index, tp_index, dp_index, **kw):
            if work.no_strip:  # older DeepSpeed has no such parameter here; ZeROCheckpoint has
                sd = self.zero_checkpoint.get_state_for_rank(pp_index=pp_index, tp_index=tp_index,
                                                             dp_index=dp_index, keys_to_ignore=[dtu.PARAM_SHAPES],
                                                             strip_tensor_paddings=False)
            else:
                sd = super().get_zero_checkpoint_state(pp_index, tp_index, dp_index, **kw)
            osd = sd[dtu.OPTIMIZER_STATE_DICT]
            if work.rebuild_mappings and dtu.PARAM_SLICE_MAPPINGS not in osd:
                mp_file = self.mp_rank_files[pp_index * self.tp_degree + tp_index]
                shapes = torch.load(mp_file, map_location='cpu', weights_only=False)[dtu.PARAM_SHAPES]
                osd[dtu.PARAM_SLICE_MAPPINGS] = [
                    rebuild_mapping(group, osd[dtu.SINGLE_PARTITION_OF_FP32_GROUPS][g].numel(), dp_index, fragment)
                    for g, group in enumerate(shapes)]
            return sd

    return PatchedCheckpoint


def rebuild_mapping(group, part, d, fragment):
    """param_slice_mappings of DP rank d from param_shapes (section 11.3, BF16 partitions)."""
    lo, hi = d * part, (d + 1) * part
    out, offset = {}, 0
    for name, shape in group.items():
        n = math.prod(shape)
        start, end = max(offset, lo), min(offset + n, hi)
        if start < end:
            out[name] = fragment(numel=end - start, start=start - lo)
        offset += n
    return out


def bs_universal_info(cfg: mf.FixtureConfig, tag_dir: str) -> dict:
    """The universal_checkpoint_info a BS model would declare (MS's rules, BS names)."""
    mp0 = torch.load(os.path.join(tag_dir, 'mp_rank_00_model_states.pt'), map_location='cpu', weights_only=False)
    vocab = ['tied_modules.embed.word_embeddings.weight']
    position = ['tied_modules.embed.position_embeddings.weight'] if cfg.position == 'absolute' else []
    rep = list(position)
    if cfg.embed_layernorm:
        rep += ['tied_modules.embed.word_embeddings.norm.weight', 'tied_modules.embed.word_embeddings.norm.bias']
    rep += [r'\d+.input_layernorm.weight', r'\d+.input_layernorm.bias',
            r'\d+.post_attention_layernorm.weight', r'\d+.post_attention_layernorm.bias',
            r'\d+.self_attention.dense.bias', r'\d+.mlp.dense_4h_to_h.bias', r'\d+.weight', r'\d+.bias']
    info = {'universal_checkpoint_version': 0.2,
            'original_vocab_size': mp0['checkpoint_info']['original_vocab_size'],
            'padded_vocab_size': mp0['checkpoint_info']['padded_vocab_size'],
            'vocabulary_parameter_patterns': vocab,
            'pipeline_replicated_parameter_patterns': vocab + position,
            'tp_replicated_parameter_patterns': rep,
            'parameter_with_row_parallelism_patterns': [r'\d+.mlp.dense_4h_to_h.weight',
                                                        r'\d+.self_attention.dense.weight']}
    if cfg.glu_kind:
        info['parameter_with_2_sub_params_cat_dim_0'] = [r'\d+.mlp.dense_h_to_4h.weight',
                                                          r'\d+.mlp.dense_h_to_4h.bias']
    return info


def run_universal(dtu, classes, cfg, tag_dir: str, out_dir: str, work: Workarounds, log,
                  inject_missing_state: bool = False) -> str:
    """ds_to_universal(tag_dir) -> out_dir/global_stepN_universal; returns that folder.

    ``cfg`` is a megatron_fixture.FixtureConfig (BS sources get their universal_checkpoint_info
    supplied, see bs_universal_info) or a deepspeed_nonpipe.NonPipeConfig (nothing supplied).
    ``inject_missing_state`` is ds_to_universal's own ``--inject_missing_state`` option: the
    only way its ZeRO-1/2 path accepts a checkpoint without universal_checkpoint_info (an
    HF-Trainer-style one); it adds nothing but the version number."""
    universal = os.path.join(out_dir, os.path.basename(tag_dir.rstrip('/')) + '_universal')
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    injected = bs_universal_info(cfg, tag_dir) if getattr(cfg, 'fork', None) == 'bs' else None
    saved = dtu.DeepSpeedCheckpoint
    dtu.DeepSpeedCheckpoint = make_checkpoint_class(dtu, classes, injected, work)
    args = argparse.Namespace(input_folder=tag_dir, output_folder=universal, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=inject_missing_state)
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            dtu.main(args)
    finally:
        dtu.DeepSpeedCheckpoint = saved
    return universal


def read_universal(universal: str) -> Tuple[Dict[str, Dict[str, Any]], Any]:
    zero = os.path.join(universal, 'zero')
    params = {}
    for name in sorted(os.listdir(zero)):
        folder = os.path.join(zero, name)
        if not os.path.isdir(folder):
            continue
        params[name] = {s: torch.load(os.path.join(folder, s + '.pt'), map_location='cpu', weights_only=False)
                        for s in STATES if os.path.isfile(os.path.join(folder, s + '.pt'))}
    common = torch.load(os.path.join(zero, 'optimizer_state.pt'), map_location='cpu', weights_only=False)
    return params, common


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Comparison:
    params: int = 0
    tensors: int = 0
    elements: int = 0
    problems: List[str] = dataclasses.field(default_factory=list)
    meta: List[str] = dataclasses.field(default_factory=list)


def compare_universal(ua, ub, tensors_only=False) -> Comparison:
    """Tensors (and step) into ``problems``; layout metadata and optimizer_state.pt into
    ``meta`` (unless ``tensors_only``)."""
    (pa, ca), (pb, cb) = ua, ub
    out = Comparison(params=len(pa))
    if set(pa) != set(pb):
        out.problems.append(f'parameter names: only in first {sorted(set(pa) - set(pb))[:5]}, '
                            f'only in second {sorted(set(pb) - set(pa))[:5]}')
    for name in sorted(set(pa) & set(pb)):
        sa, sb = pa[name], pb[name]
        if list(sa) != list(sb):
            out.problems.append(f'{name}: state files {list(sa)} vs {list(sb)}')
        for state in sa:
            if state not in sb:
                continue
            a, b = sa[state], sb[state]
            if state == 'step':
                out.problems += obj_diff(a, b, f'{name}/step')
                continue
            out.problems += obj_diff(a['param'], b['param'], f'{name}/{state}')
            if not tensors_only:
                out.meta += obj_diff({k: v for k, v in a.items() if k != 'param'},
                                     {k: v for k, v in b.items() if k != 'param'}, f'{name}/{state} metadata')
            out.tensors += 1
            out.elements += a['param'].numel()
    if not tensors_only:
        ca = {k: v for k, v in ca.items() if k != 'partition_count'}
        cb = {k: v for k, v in cb.items() if k != 'partition_count'}
        out.problems += obj_diff(ca, cb, 'optimizer_state.pt')
    return out


def canonical_spot_check(cfg, ua) -> List[str]:
    """U(A) vs the fixture's canonical model for the word embeddings (true rows)."""
    params, _ = ua
    canon = mf.canonical_tensors(cfg)['embedding.word_embeddings.weight']
    key = 'tied_modules.embed.word_embeddings.weight'
    if key not in params:
        key = next((k for k in params if k.endswith('.word_embeddings.weight')), None)
    if key is None:
        return ['no word embeddings in the universal checkpoint']
    got = params[key]
    problems = []
    for state, want in (('fp32', canon), ('exp_avg', 0.1 * canon), ('exp_avg_sq', canon * canon + 1e-8)):
        if not torch.equal(got[state]['param'], want):
            problems.append(f'U(source) {key}/{state} != canonical')
    return problems


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    case: Case
    result: str = ''
    detail: str = ''
    params: int = 0
    tensors: int = 0
    elements: int = 0
    workaround: str = ''
    problems: List[str] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)


def describe_exc(e: BaseException) -> str:
    text = f'{type(e).__name__}: {e}'.strip().splitlines()[0]
    return text[:150]


def run_case(case: Case, reshard: str, dtu, classes, tmp: str, verbose: bool) -> Row:
    row = Row(case)
    fields = dict(FAMILIES[case.family], **case.options)
    (tp, pp, dp), (tp2, pp2, dp2) = case.src, case.dst
    cfg = mf.FixtureConfig(tp=tp, pp=pp, dp=dp, **fields)
    ref_cfg = mf.FixtureConfig(tp=1, pp=1, dp=1, **fields)
    a_root, b_root, c_root = (os.path.join(tmp, x) for x in ('a', 'b', 'c'))
    a_tag = mf.write_checkpoint(a_root, cfg)['tag_dir']
    c_tag = mf.write_checkpoint(c_root, ref_cfg)['tag_dir']
    b_tag = os.path.join(b_root, cfg.tag)
    if reshard is None:  # --self-test: B written by the fixture generator at the target layout
        mf.write_checkpoint(b_root, dataclasses.replace(cfg, tp=tp2, pp=pp2, dp=dp2, global_batch=None))
        proc = subprocess.CompletedProcess([], 0)
    else:
        proc = subprocess.run([reshard, 'convert', a_tag, b_tag, '--tp', str(tp2), '--pp', str(pp2),
                               '--dp', str(dp2), '-q'], capture_output=True, text=True)
    if proc.returncode != 0:
        row.result = 'RESHARD REFUSED'
        row.detail = (proc.stderr.strip().splitlines() or [''])[-1][:200]
        return row
    log = io.StringIO()
    work = Workarounds()
    universals = {}
    for _ in range(3):
        label = None
        try:
            universals = {}
            for label, tag, c in (('A', a_tag, cfg), ('B', b_tag, cfg), ('C', c_tag, ref_cfg)):
                universals[label] = read_universal(
                    run_universal(dtu, classes, c, tag, os.path.join(tmp, 'u' + label), work, log))
            break
        except Exception as e:  # noqa: BLE001 -- report whatever DeepSpeed raised
            if isinstance(e, KeyError) and 'param_slice_mappings' in str(e) and not work.rebuild_mappings:
                work.rebuild_mappings = True
                continue
            if (isinstance(e, RuntimeError) and ('narrow' in str(e) or 'length' in str(e))
                    and not work.no_strip):
                work.no_strip = True
                continue
            if label == 'A':
                row.result = 'N/A'
                row.detail = f'DeepSpeed cannot convert the source either: {describe_exc(e)}'
            else:
                row.result, row.detail = f'DS FAILED on {label}', describe_exc(e)
            if verbose:
                traceback.print_exc()
                print(log.getvalue()[-3000:])
            return row
    row.workaround = work.label()
    ab = compare_universal(universals['A'], universals['B'])
    ac = compare_universal(universals['A'], universals['C'], tensors_only=True)
    row.params, row.tensors, row.elements = ab.params, ab.tensors, ab.elements
    row.problems = ([f'U(B) vs U(A): {p}' for p in ab.problems] + [f'U(A) vs U(C): {p}' for p in ac.problems]
                    + canonical_spot_check(cfg, universals['A']))
    if ab.meta:
        if min(tp, tp2) == 1:
            # MS declares TP-replicated / row-parallel patterns only at TP > 1 (section 9.2), so the
            # TP 1 side's universal files carry cat_dim where the other side's have none.
            row.notes.append(f'layout metadata differs in {len(ab.meta)} files (expected: one side is TP 1)')
        else:
            row.problems += [f'U(B) vs U(A): {p}' for p in ab.meta]
    row.result = 'EQUAL' if not row.problems else 'DIFFERENT'
    if row.problems:
        row.notes.append(f'{len(ab.problems) + (len(ab.meta) if min(tp, tp2) > 1 else 0)} B-vs-A, '
                         f'{len(ac.problems)} A-vs-C difference(s)')
    return row


def print_table(rows: List[Row]) -> None:
    head = ('case', 'family', 'A (tp,pp,dp)', 'B (tp,pp,dp)', 'params', 'tensors', 'elements', 'result', 'note')
    lines = [head]
    for r in rows:
        fmt = lambda t: '({},{},{})'.format(*t)  # noqa: E731
        note = '; '.join(x for x in [r.workaround and f'both sides: {r.workaround}', r.detail, *r.notes] if x)
        opts = ','.join(f'{k}={v}' for k, v in r.case.options.items())
        lines.append((r.case.name, r.case.family + (f' [{opts}]' if opts else ''), fmt(r.case.src),
                      fmt(r.case.dst), str(r.params), str(r.tensors), str(r.elements), r.result, note))
    print_aligned(lines)


def print_aligned(lines) -> None:
    """Prints rows of strings (the first one the heading) in aligned columns; the last column free."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    for i, line in enumerate(lines):
        print('  '.join(c.ljust(w) for c, w in zip(line, widths)) + '  ' + line[-1])
        if i == 0:
            print('  '.join('-' * w for w in widths) + '  ' + '-' * 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--reshard', help='the reshard binary')
    ap.add_argument('--self-test', action='store_true',
                    help='instead of running reshard, write B with the fixture generator at the target '
                         'layout (checks this harness and the fixtures against DeepSpeed)')
    ap.add_argument('--deepspeed-src', required=True, help='folder holding deepspeed/checkpoint/')
    ap.add_argument('--case', action='append', help='run only these cases (by name)')
    ap.add_argument('--keep', help='keep the checkpoints of every case under this folder')
    ap.add_argument('-v', '--verbose', action='store_true', help='print every difference and DS tracebacks')
    ns = ap.parse_args(argv)
    if bool(ns.reshard) == ns.self_test:
        ap.error('pass exactly one of --reshard BIN and --self-test')
    reshard = os.path.abspath(ns.reshard) if ns.reshard else None
    dtu, classes = import_ds_to_universal(ns.deepspeed_src)
    cases = [c for c in CASES if not ns.case or c.name in ns.case]
    if not cases:
        ap.error(f'no such case; known: {[c.name for c in CASES]}')
    rows = []
    for case in cases:
        if ns.keep:
            tmp = os.path.join(ns.keep, case.name)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            rows.append(run_case(case, reshard, dtu, classes, tmp, ns.verbose))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(run_case(case, reshard, dtu, classes, tmp, ns.verbose))
        print(f'{case.name}: {rows[-1].result} {rows[-1].detail}', file=sys.stderr)
    print(f'DeepSpeed source: {os.path.abspath(ns.deepspeed_src)}')
    print_table(rows)
    for r in rows:
        if r.problems:
            print(f'\n{r.case.name}:')
            for p in r.problems[:None if ns.verbose else 12]:
                print('   ', p)
            if not ns.verbose and len(r.problems) > 12:
                print(f'    ... {len(r.problems) - 12} more (-v)')
    return 0 if all(r.result in ('EQUAL', 'N/A') for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
