#!/usr/bin/python3
"""Load universal checkpoints with DeepSpeed's own loading code and check every slice.

Local tool, not run in CI.  For each source checkpoint written by the fixture generator, the
universal checkpoint is produced by ``reshard export --to universal`` and, for comparison, by
DeepSpeed's ``ds_to_universal``; the committed ``tests/data/ds_universal`` cases (DeepSpeed's
output, see its README) are checked too.  Each universal folder is then loaded the way a
DeepSpeed engine loads it:

  * ``deepspeed/checkpoint/universal_checkpoint.py`` from a fetched source tree, imported as
    tools/ds_crosscheck.py imports ``ds_to_universal`` (no DeepSpeed installed, no GPU);
  * every parameter gets a bf16 low-precision tensor of its local shape at the target TP, made
    loadable with DeepSpeed's ``enable_universal_checkpoint``, and a stand-in for its
    ``_hp_mapping`` (``lp_fragment_address``, ``get_hp_fragment()``, ``optim_fragment``: what
    ``load_hp_checkpoint_state`` touches).  A parameter is cut into two fragments, as when it
    straddles two DP partitions, so ``lp_fragment_address.start`` is not always 0;
  * ``param.load_hp_checkpoint_state(zero/<name>, tp_rank, tp_world_size)`` for every TP rank of
    target TP 1, 2 and 4: fp32 comes back in the fp32 fragment, exp_avg / exp_avg_sq in
    ``optim_fragment``.

Each slice must equal, bit for bit, the fixture's canonical state (fp32 = master, exp_avg =
0.1 * master, exp_avg_sq = master**2 + 1e-8) cut by the fixture's own TP sharding function for
that tensor at the target TP (megatron_fixture._shard_entry, format doc section 18.3) --
vocabulary rows included, with the padding rows zero, as DeepSpeed pads them.  The step the
loader returns is reported (``none`` when there is no step.pt).

A universal checkpoint of a TP 1 source is where the producers differ: Megatron-DeepSpeed
declares its row-parallel patterns only at TP > 1, so ds_to_universal tags
``self_attention.dense.weight`` / ``mlp.dense_4h_to_h.weight`` with ``cat_dim 0`` and the loader
then cuts them on the wrong dimension at TP > 1; reshard writes ``cat_dim 1`` from its rules.

Usage (PYTHONPATH must reach the repository's tests/ folder):

    PYTHONPATH=tests /usr/bin/python3 tools/ds_universal_load_check.py --reshard build/reshard \
        --deepspeed-src SRC [--source NAME ...] [--no-data] [-v]

Exit status 0 when every slice loaded from reshard's output (and from the committed data, whose
sources are TP 2 or TP 1 with ZeRO-1 at target TP 1/2) is right; ds_to_universal rows are
reported and do not decide the status, except that they must load at all.  Negative controls
(a tampered copy of reshard's gpt2-tp2 output: one row-parallel tensor retagged ``cat_dim 0``, one
ulp changed in the word embeddings' exp_avg_sq) must be DETECTED, or the status is 1 as well.
"""

import argparse
import collections
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import ds_crosscheck as dc  # noqa: E402  (also puts tests/ and tests/interop on sys.path)
from fixtures import megatron_fixture as mf  # noqa: E402
from interop_support import FAMILIES  # noqa: E402

TARGET_TPS = (1, 2, 4)
STATES = ('fp32', 'exp_avg', 'exp_avg_sq')
STATE_FN = {'fp32': lambda x: x, 'exp_avg': mf._adam_m, 'exp_avg_sq': mf._adam_v}
DATA = os.path.join(REPO, 'tests', 'data', 'ds_universal')


@dataclasses.dataclass
class Source:
    name: str
    family: str
    layout: Tuple[int, int, int]          # (TP, PP, DP)
    overrides: Dict = dataclasses.field(default_factory=dict)


# The interop tests' sizes; llama with 4 KV heads instead of 6 so that TP 4 is a valid target.
SOURCES = [
    Source('gpt2-tp2', 'ms_gpt2', (2, 2, 2)),
    Source('llama-tp2', 'ms_llama', (2, 2, 2), dict(nkv=4)),
    Source('gpt2-tp1', 'ms_gpt2', (1, 2, 2)),
    Source('llama-tp1', 'ms_llama', (1, 1, 2), dict(nkv=4)),
    Source('gpt2-zero1-tp2', 'ms_gpt2', (2, 2, 2), dict(optimizer='zero1')),
]


def source_config(src: Source) -> mf.FixtureConfig:
    fields = dict(FAMILIES[src.family], optimizer='bf16_zero')
    fields.update(src.overrides)
    tp, pp, dp = src.layout
    return mf.FixtureConfig(tp=tp, pp=pp, dp=dp, **fields)


# ---------------------------------------------------------------------------------------------
# DeepSpeed's loader, with the engine-side objects it touches stood in for
# ---------------------------------------------------------------------------------------------

def import_loader(deepspeed_src: str):
    dtu, classes = dc.import_ds_to_universal(deepspeed_src)
    from deepspeed.checkpoint import universal_checkpoint  # noqa: E402  (the fetched tree's)
    return dtu, classes, universal_checkpoint


class HpMapping:
    """Stand-in for deepspeed.utils.tensor_fragment.tensor_fragment: one fragment of a parameter
    in this rank's fp32 partition."""

    def __init__(self, fragment_cls, start: int, numel: int):
        self.lp_fragment_address = fragment_cls(numel=numel, start=start)
        self.hp_fragment = torch.full((numel,), float('nan'), dtype=torch.float32)
        self.optim_fragment = {}

    def get_hp_fragment(self, optim_state_key=None):
        return self.hp_fragment if optim_state_key is None else self.optim_fragment[optim_state_key]


def ds_load(uc, fragment_cls, folder: str, local_shape, tp_rank: int, tp_world: int):
    """{state: local tensor} and the step, as DeepSpeed's load_hp_checkpoint_state restores them."""
    numel = 1
    for d in local_shape:
        numel *= d
    cut = max(1, numel // 3) if numel > 1 else numel
    pieces = {s: [] for s in STATES}
    steps = []
    for start, length in ((0, cut), (cut, numel - cut)):
        if length == 0:
            continue
        lp = torch.zeros(local_shape, dtype=torch.bfloat16)
        lp._hp_mapping = HpMapping(fragment_cls, start, length)
        uc.enable_universal_checkpoint([lp])
        steps.append(lp.load_hp_checkpoint_state(folder, tp_rank, tp_world))
        pieces['fp32'].append(lp._hp_mapping.hp_fragment)
        for s in ('exp_avg', 'exp_avg_sq'):
            pieces[s].append(lp._hp_mapping.optim_fragment[s])
    return {s: torch.cat(v).view(local_shape) for s, v in pieces.items()}, steps


# ---------------------------------------------------------------------------------------------
# What every slice must be: the fixture's canonical state cut by its own sharding functions
# ---------------------------------------------------------------------------------------------

def universal_entries(cfg: mf.FixtureConfig) -> Dict[str, mf.Entry]:
    """{engine parameter name: the fixture's layer-file entry} over all pipeline stages."""
    layout = mf._Layout.of(cfg)
    out = collections.OrderedDict()
    for p in range(cfg.pp):
        for sp in mf._stage_params(layout, p):
            if not sp.tied_copy:
                out.setdefault(sp.pipe_name, sp.entry)
    return out


class Expected:
    def __init__(self, cfg: mf.FixtureConfig):
        self.cfg = cfg
        canon = mf.canonical_tensors(cfg)
        self.full = {s: {k: fn(v) for k, v in canon.items()} for s, fn in STATE_FN.items()}

    def target_config(self, tp: int) -> Optional[mf.FixtureConfig]:
        try:
            return dataclasses.replace(self.cfg, tp=tp)
        except ValueError:
            return None

    def local(self, cfg_t: mf.FixtureConfig, entry: mf.Entry, state: str, t: int) -> torch.Tensor:
        full = dict(self.full[state])
        if entry.rule == mf.VOCAB:  # DeepSpeed pads the stripped vocabulary with zero rows
            name = entry.names[0]
            rows = mf.padded_vocab(cfg_t) - full[name].shape[0]
            full[name] = torch.cat([full[name], torch.zeros(rows, full[name].shape[1])], 0)
        return mf._shard_entry(cfg_t, entry, full, cfg_t.tp, t)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype == torch.float32 and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)))


# ---------------------------------------------------------------------------------------------
# One universal folder at one target TP
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    source: str
    family: str
    layout: Tuple[int, int, int]
    producer: str
    target_tp: int
    decides: bool = True        # counts for the exit status
    params: int = 0
    slices: int = 0
    tensors: int = 0
    elements: int = 0
    wrong: int = 0              # wrong (param, rank) slices
    errors: int = 0             # (param, rank) loads that raised
    steps: str = ''
    result: str = ''
    wrong_params: List[str] = dataclasses.field(default_factory=list)
    detail: List[str] = dataclasses.field(default_factory=list)


def kind_of(name: str) -> str:
    """Parameter name with the layer number dropped, for grouping failures."""
    return re.sub(r'^\d+\.', '<L>.', name)


def check_folder(uc, fragment_cls, universal: str, cfg: mf.FixtureConfig, expected: Expected,
                 row: Row) -> Row:
    cfg_t = expected.target_config(row.target_tp)
    if cfg_t is None:
        row.result = 'SKIP'
        row.detail.append(f'TP {row.target_tp} is not a valid layout of this model')
        return row
    entries = universal_entries(cfg)
    zero = os.path.join(universal, 'zero')
    found = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    if set(found) != set(entries):
        row.detail.append(f'parameter folders: missing {sorted(set(entries) - set(found))[:4]}, '
                          f'unexpected {sorted(set(found) - set(entries))[:4]}')
        row.errors += 1
    steps = set()
    wrong = collections.Counter()
    for name, entry in entries.items():
        if name not in found:
            continue
        row.params += 1
        shape = tuple(mf._local_shape(cfg_t, entry, row.target_tp))
        for t in range(row.target_tp):
            row.slices += 1
            try:
                got, st = ds_load(uc, fragment_cls, os.path.join(zero, name), shape, t, row.target_tp)
            except Exception as e:  # noqa: BLE001 -- DeepSpeed's assertion is the finding
                row.errors += 1
                wrong[kind_of(name)] += 1
                if len(row.detail) < 6:
                    row.detail.append(f'{name} rank {t}: {dc.describe_exc(e)}')
                continue
            steps.update(st)
            bad = [s for s in STATES if not bits_equal(got[s], expected.local(cfg_t, entry, s, t))]
            row.tensors += len(STATES)
            row.elements += len(STATES) * got['fp32'].numel()
            if bad:
                row.wrong += 1
                wrong[kind_of(name)] += 1
                if len(row.detail) < 6:
                    e = expected.local(cfg_t, entry, bad[0], t)
                    diff = (got[bad[0]] != e).sum().item()
                    row.detail.append(f'{name} rank {t}: {"/".join(bad)} differ '
                                      f'({diff} of {e.numel()} {bad[0]} elements)')
    row.steps = ','.join(sorted('none' if s is None else str(s) for s in steps)) or '-'
    if row.steps not in ('none', str(cfg.iteration)):
        row.detail.append(f'steps returned: {row.steps}')
        row.errors += 1
    row.wrong_params = [f'{k} x{v}' for k, v in sorted(wrong.items())]
    row.result = 'PASS' if not (row.wrong or row.errors) else 'FAIL'
    return row


# ---------------------------------------------------------------------------------------------
# Producers
# ---------------------------------------------------------------------------------------------

def reshard_universal(reshard: str, tag: str, out_root: str) -> str:
    out = os.path.join(out_root, os.path.basename(tag) + '_universal')
    os.makedirs(out_root, exist_ok=True)
    proc = subprocess.run([reshard, 'export', tag, out, '--to', 'universal', '-q'],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f'reshard export failed: {proc.stderr.strip()[-300:]}')
    return out


def ds_universal(dtu, classes, cfg, tag: str, out_root: str) -> str:
    log = io.StringIO()
    work = dc.Workarounds()
    out = dc.run_universal(dtu, classes, cfg, tag, out_root, work, log)
    if work.label():
        raise RuntimeError(f'ds_to_universal needed {work.label()}')
    return out


def run_source(src: Source, reshard: str, dtu, classes, uc, tmp: str) -> List[Row]:
    cfg = source_config(src)
    tag = mf.write_checkpoint(os.path.join(tmp, 'src'), cfg)['tag_dir']
    expected = Expected(cfg)
    fragment_cls = classes['fragment_address']
    rows = []
    for producer in ('reshard export', 'ds_to_universal'):
        try:
            if producer == 'reshard export':
                universal = reshard_universal(reshard, tag, os.path.join(tmp, 'reshard'))
            else:
                universal = ds_universal(dtu, classes, cfg, tag, os.path.join(tmp, 'ds'))
        except Exception as e:  # noqa: BLE001
            rows.append(Row(src.name, src.family, src.layout, producer, 0, result='NO OUTPUT',
                            detail=[dc.describe_exc(e)]))
            continue
        for tp in TARGET_TPS:
            row = Row(src.name, src.family, src.layout, producer, tp, decides=producer == 'reshard export')
            rows.append(check_folder(uc, fragment_cls, universal, cfg, expected, row))
    return rows


def tamper(universal: str, cfg: mf.FixtureConfig) -> List[str]:
    """Negative controls on a copy of a universal folder: a row-parallel tensor retagged cat_dim 0
    (what ds_to_universal writes for a TP 1 source) and one element of the word embeddings'
    exp_avg_sq changed by one ulp.  Returns the parameters that must now fail."""
    zero = os.path.join(universal, 'zero')
    row_param = next(n for n in sorted(os.listdir(zero)) if n.endswith('self_attention.dense.weight'))
    for s in STATES:
        path = os.path.join(zero, row_param, s + '.pt')
        d = torch.load(path, weights_only=False)
        d['cat_dim'] = 0
        torch.save(d, path)
    vocab_param = next(n for n in sorted(os.listdir(zero)) if n.endswith('word_embeddings.weight'))
    path = os.path.join(zero, vocab_param, 'exp_avg_sq.pt')
    d = torch.load(path, weights_only=False)
    p = d['param'].clone()
    p.view(-1)[p.numel() - 1] = torch.nextafter(p.view(-1)[-1], torch.tensor(1.0))
    d['param'] = p
    torch.save(d, path)
    return [kind_of(row_param), kind_of(vocab_param)]


def run_control(src: Source, reshard: str, classes, uc, tmp: str) -> List[Row]:
    """reshard's output of ``src``, tampered: every target TP > 1 must flag exactly the
    tampered parameters (at TP 1 the retagged tensor is whole and must still pass)."""
    cfg = source_config(src)
    tag = mf.write_checkpoint(os.path.join(tmp, 'src'), cfg)['tag_dir']
    universal = reshard_universal(reshard, tag, os.path.join(tmp, 'reshard'))
    must_fail = tamper(universal, cfg)
    expected = Expected(cfg)
    rows = []
    for tp in TARGET_TPS:
        row = check_folder(uc, classes['fragment_address'], universal, cfg, expected,
                           Row(src.name, src.family, src.layout, 'control: tampered copy', tp))
        flagged = sorted({w.split(' x')[0] for w in row.wrong_params})
        want = sorted(must_fail if tp > 1 else must_fail[1:])
        row.result = 'DETECTED' if flagged == want and not row.errors else 'MISSED'
        row.detail.insert(0, f'must flag {want}, flagged {flagged}')
        rows.append(row)
    return rows


def run_data(classes, uc) -> List[Row]:
    rows = []
    fragment_cls = classes['fragment_address']
    for case in sorted(os.listdir(DATA)):
        meta_file = os.path.join(DATA, case, 'case.json')
        if not os.path.isfile(meta_file):
            continue
        with open(meta_file) as f:
            meta = json.load(f)
        if meta.get('kind') == 'nonpipe':
            continue  # HF-Trainer-style names: this check emulates the pipeline models' loading
        cfg = mf.FixtureConfig(**meta['fixture'])
        expected = Expected(cfg)
        universal = os.path.join(DATA, case, meta['universal_folder'])
        for tp in TARGET_TPS:
            # DeepSpeed's TP 1 output tags row-parallel tensors cat_dim 0: right only at TP 1.
            decides = cfg.tp > 1 or tp == 1
            row = Row(case, meta['family'] + ('' if cfg.optimizer == 'bf16_zero' else f' [{cfg.optimizer}]'),
                      (cfg.tp, cfg.pp, cfg.dp), 'committed DS data', tp, decides=decides)
            rows.append(check_folder(uc, fragment_cls, universal, cfg, expected, row))
    return rows


def print_table(rows: List[Row]) -> None:
    head = ('source', 'family', 'src (tp,pp,dp)', 'universal by', 'target TP', 'params', 'slices',
            'tensors', 'elements', 'wrong', 'errors', 'step', 'result', 'wrong slices by parameter')
    lines = [head]
    for r in rows:
        lines.append((r.source, r.family, '({},{},{})'.format(*r.layout), r.producer, str(r.target_tp),
                      str(r.params), str(r.slices), str(r.tensors), str(r.elements), str(r.wrong),
                      str(r.errors), r.steps, r.result + ('' if r.decides or r.result == 'SKIP' else ' (info)'),
                      ', '.join(r.wrong_params)))
    dc.print_aligned(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--reshard', required=True, help='the reshard binary')
    ap.add_argument('--deepspeed-src', required=True, help='folder holding deepspeed/checkpoint/')
    ap.add_argument('--source', action='append', help='only these sources (by name)')
    ap.add_argument('--no-data', action='store_true', help='skip the committed tests/data/ds_universal cases')
    ap.add_argument('--no-control', action='store_true', help='skip the negative controls')
    ap.add_argument('-v', '--verbose', action='store_true', help='print the first differences of every row')
    ns = ap.parse_args(argv)
    reshard = os.path.abspath(ns.reshard)
    dtu, classes, uc = import_loader(ns.deepspeed_src)
    sources = [s for s in SOURCES if not ns.source or s.name in ns.source]
    rows = []
    for src in sources:
        with tempfile.TemporaryDirectory(prefix='ds-load-check-') as tmp:
            rows += run_source(src, reshard, dtu, classes, uc, tmp)
        print(f'{src.name}: done', file=sys.stderr)
    if not ns.no_data and os.path.isdir(DATA):
        rows += run_data(classes, uc)
    if not ns.no_control:
        with tempfile.TemporaryDirectory(prefix='ds-load-control-') as tmp:
            rows += run_control(SOURCES[0], reshard, classes, uc, tmp)
    print(f'DeepSpeed source: {os.path.abspath(ns.deepspeed_src)} '
          f'(deepspeed/checkpoint/universal_checkpoint.py load_hp_checkpoint_state)')
    print_table(rows)
    for r in rows:
        if r.detail and (ns.verbose or r.result in ('FAIL', 'NO OUTPUT', 'MISSED')):
            print(f'\n{r.source} / {r.producer} / target TP {r.target_tp}:')
            for d in r.detail:
                print('   ', d)
    failed = [r for r in rows if (r.decides and r.result in ('FAIL', 'NO OUTPUT', 'MISSED'))
              or (not r.decides and r.errors)]
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
