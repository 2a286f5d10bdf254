"""Optimizer-state reshaping through `reshard convert`, checked with real PyTorch.

Sources are faithful checkpoints written with torch.save by the fixture generator:
BF16_Optimizer shards (bs_bloom, bs_gpt GLU, ms_gpt2, ms_llama), fp16 ZeRO-1 shards with a
loss scaler, DeepSpeed 0.6.5 BF16 shards (no param_slice_mappings, `groups_padding`) and
FP16_Optimizer state inside the mp_rank files (fp16 without ZeRO).  For every conversion A -> B:

  * B's optimizer state, reassembled by the fixture's independent oracle, is the canonical
    fp32 master / exp_avg / exp_avg_sq; vocabulary padding rows of the master follow the
    weight's (kept rows keep A's values, new rows are 0) and new rows have zero moments;
  * B passes the oracle's structural checks (slice mappings cover every stage parameter
    exactly once, group paddings, partition lengths, bf16(master) == weight, ...);
  * B's optimizer files (or mp_rank optimizer state) are exactly what DeepSpeed writes for B's
    layout: they equal, bit for
    bit and key for key, the files the fixture generator writes at B's layout (param_shapes,
    group order and membership, 2*DP alignment, paddings, partition_count, mappings, hyper-
    parameters, step, loss scaler), except where the two legitimately differ (vocabulary padding
    rows B adds, and the last stage's unused tied position-embedding copy, which reshard fills
    from stage 0) -- those regions are checked separately;
  * every flat padding element is zero, every optimizer tensor is a compact fp32 tensor;
  * B -> A gives every optimizer file of A back bit for bit (same exceptions, plus padding rows
    that B had no room for);
  * the last stage's copy of the tied word embedding (fp32, exp_avg, exp_avg_sq) equals stage 0's.

Layouts: TP, PP and DP changing at once, expansion and shrinking, non-divisor TP changes, odd
DP (3, 5), DP >= 10, a BF16 group padding longer than one partition, uneven PP (6 blocks on 4
stages), PP 1 <-> > 1 with tied embeddings, a custom --layers-per-stage, --vocab-pad-value.
Also: `reshard verify` on converted checkpoints and after perturbing one moment element,
replicated fp32 masters that drift across TP ranks (refused by default and listed by `lint`, like
drifted weights; `average` keeps bf16(master) == weight), extra per-parameter state tensors and
per-group scalars.

Run: /usr/bin/python3 tests/interop/test_optimizer.py --reshard build/reshard  (PYTHONPATH=tests)
"""
import collections
import dataclasses
import math
import os
import re
import tempfile
import unittest

import torch

from fixtures import megatron_fixture as mf

import interop_support as support
from interop_support import FAMILIES, differences, load, mp_file, rewrite

ERROR_PREFIX = 'reshard: error: '

ZERO_RE = re.compile(r'^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$')
STATE_KEYS = ('fp32', 'exp_avg', 'exp_avg_sq')


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

run = support.reshard


def run_ok(*args):
    proc = run(*args)
    if proc.returncode != 0:
        raise AssertionError(f'reshard {" ".join(map(str, args))} failed ({proc.returncode}): {proc.stderr}')
    return proc


def convert(src, dst_tag, layout, *extra):
    tp, pp, dp = layout
    return run_ok('convert', src, dst_tag, '--tp', tp, '--pp', pp, '--dp', dp, '-q', *extra)


def make_cfg(family, layout, **options):
    tp, pp, dp = layout
    return mf.FixtureConfig(tp=tp, pp=pp, dp=dp, **dict(FAMILIES[family], **options))


def at_layout(cfg, layout):
    """The same model and options at another (TP, PP, DP)."""
    tp, pp, dp = layout
    return dataclasses.replace(cfg, tp=tp, pp=pp, dp=dp, global_batch=None)


def zero_files(tag):
    """{(dp rank, mp index): file name} of a tag folder."""
    out = {}
    for name in os.listdir(tag):
        m = ZERO_RE.match(name)
        if m:
            out[(int(m[2]), int(m[3]))] = name
    return out


def group_offsets(group):
    """{name: (flat offset, numel)} of one param_shapes group."""
    out, offset = {}, 0
    for name, shape in group.items():
        n = math.prod(shape)
        out[name] = (offset, n)
        offset += n
    return out


def nozero_group_shapes(cfg, layout, mm):
    """Without ZeRO (FP16_Optimizer, a torch optimizer) there are no param_shapes: the groups of
    stage mm as DeepSpeed builds them (the fixture's stage partition and grouping rules)."""
    here = at_layout(cfg, layout)
    p, t = divmod(mm, here.tp)
    params = mf._stage_params(mf._Layout.of(here), p)
    shapes = {sp.pipe_name: mf._local_shape(here, sp.entry, here.tp) for sp in params}
    return [collections.OrderedDict((sp.pipe_name, shapes[sp.pipe_name]) for sp in g['members'])
            for g in mf._param_groups(here, params, shapes)]


def stage_states(tag, mm, cfg=None, layout=None):
    """{pipe name: {'fp32', 'exp_avg', 'exp_avg_sq'}} of mp index ``mm``, reassembled from the
    DP shards with param_shapes and the flattening rule (independent of the shards' mappings),
    or from the FP16_Optimizer state in the mp_rank file (then ``cfg`` and ``layout`` are needed),
    or a torch state's per-parameter tensors (no 'fp32'; indexed in group order)."""
    files = {d: name for (d, m), name in zero_files(tag).items() if m == mm}
    if not files:
        opt = load(mp_file(tag, mm))['optimizer']
        if 'param_groups' in opt:
            names = [n for group in nozero_group_shapes(cfg, layout, mm) for n in group]
            return {n: {k: x for k, x in opt['state'][i].items() if k != 'step'} for i, n in enumerate(names)}
        out = {}
        for g, group in enumerate(nozero_group_shapes(cfg, layout, mm)):
            flats = {'fp32': opt['fp32_groups_flat'][g], **opt['optimizer_state_dict']['state'][g]}
            for name, (offset, n) in group_offsets(group).items():
                out[name] = {k: flats[k][offset:offset + n].reshape(group[name]).clone() for k in STATE_KEYS}
        return out
    shards = [load(os.path.join(tag, files[d]))['optimizer_state_dict'] for d in range(len(files))]
    out = {}
    for g, group in enumerate(load(mp_file(tag, mm))['param_shapes']):
        flats = {}
        for key in STATE_KEYS:
            parts = []
            for osd in shards:
                state = osd['base_optimizer_state']['state'][g]
                t = osd['single_partition_of_fp32_groups'][g] if key == 'fp32' else state[key]
                part = state['exp_avg'].numel()
                parts.append(torch.cat([t, torch.zeros(part - t.numel())]))  # ZeRO-1 strips fp32 tails
            flats[key] = torch.cat(parts)
        for name, (offset, n) in group_offsets(group).items():
            out[name] = {k: flats[k][offset:offset + n].reshape(group[name]).clone() for k in STATE_KEYS}
    return out


# ---------------------------------------------------------------------------------------------
# Masks: regions of the flat groups where two files may legitimately differ
# ---------------------------------------------------------------------------------------------

VOCAB_NAME = re.compile(r'^(tied_modules\.embed\.word_embeddings\.weight|\d+\.word_embeddings\.weight|\d+\.lm_head\.weight)$')


def mask_rules(cfg, tp, pp, first_free_row):
    """A function (mm, name, shape) -> [(lo, hi)] element ranges of the parameter to ignore:
    vocabulary rows >= ``first_free_row`` (global row index) and the last stage's tied
    position-embedding copy."""
    def rule(mm, name, shape):
        p, t = divmod(mm, tp)
        if VOCAB_NAME.match(name):
            rows, h = shape[0], math.prod(shape[1:])
            r0 = t * rows
            lo = max(first_free_row, r0)
            return [((lo - r0) * h, rows * h)] if lo < r0 + rows else []
        if name == 'tied_modules.embed.position_embeddings.weight' and pp > 1 and p == pp - 1:
            return [(0, math.prod(shape))]
        return []
    return rule


def apply_mask(osd, group_shapes, d, rule, mm):
    """Zero the masked regions of DP shard d's fp32 partition and per-parameter state tensors
    (``osd``: a ZeRO / BF16 optimizer_state_dict, or an FP16_Optimizer state dict with d = 0)."""
    fp16 = 'fp32_groups_flat' in osd
    state = (osd['optimizer_state_dict'] if fp16 else osd['base_optimizer_state'])['state']
    for g, group in enumerate(group_shapes):
        part = state[g]['exp_avg'].numel()
        tensors = [osd['fp32_groups_flat' if fp16 else 'single_partition_of_fp32_groups'][g]]
        tensors += [v for v in state[g].values() if isinstance(v, torch.Tensor) and v.numel() == part]
        for name, (offset, _) in group_offsets(group).items():
            for lo, hi in rule(mm, name, group[name]):
                a, b = max(offset + lo - d * part, 0), min(offset + hi - d * part, part)
                for x in tensors:
                    if a < min(b, x.numel()):
                        x[a:min(b, x.numel())] = 0


def apply_torch_mask(opt, group_shapes, rule, mm):
    """The same for a torch optimizer state_dict: its per-parameter tensors, indexed in group order."""
    names = [(n, group[n]) for group in group_shapes for n in group]
    for index, (name, shape) in enumerate(names):
        for key, x in opt['state'][index].items():
            if key != 'step':
                for lo, hi in rule(mm, name, shape):
                    x.view(-1)[lo:hi] = 0


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------

class OptimizerTestCase(unittest.TestCase):

    def tmpdir(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        return tmp.name

    def assert_no_problems(self, problems, what):
        if problems:
            self.fail(f'{what}: {len(problems)} problem(s):\n  ' + '\n  '.join(problems[:25]))

    # -- B against the canonical model, through the oracle ----------------------------------------

    def check_canonical(self, tag, cfg, layout, kept_rows, pad_value=0.0):
        """``tag`` (at ``layout``) holds the canonical model and optimizer state; of its vocabulary
        padding rows the first ``kept_rows`` carry the source's values, the rest are new: master
        (and weight) ``pad_value``, moments 0."""
        tp, pp, dp = layout
        logical = mf.load_logical(tag, cfg)
        self.assertEqual((logical.layout['tp'], logical.layout['pp'], logical.layout['dp']), layout)
        self.assertTrue(logical.optimizer, 'no optimizer state in the output')
        diffs = mf.compare_with_canonical(logical, cfg)
        # The oracle's expectation puts pad_fill in every padding row; rows the target adds are
        # checked below instead.
        self.assert_no_problems([d for d in diffs if '.padding:' not in d], f'{tag} vs canonical')
        self.assert_no_problems(mf.structural_problems(tag, cfg), f'{tag} structure')
        # A plain torch state (torch_adamw) has no fp32 masters: the fp32 weights are checked above.
        fp32 = logical.optimizer.get('fp32')
        m, v = logical.optimizer['exp_avg'], logical.optimizer['exp_avg_sq']
        fill = torch.tensor([float(cfg.pad_fill)])
        pad_m, pad_v = mf._adam_m(fill).item(), mf._adam_v(fill).item()  # as the fixture computes them
        for name in [n for n in m if n.endswith('.padding')]:
            rows = mf.padded_vocab(cfg, tp) - cfg.V
            self.assertEqual(m[name].shape[0], rows, name)
            checks = [(logical[name], cfg.pad_fill, pad_value), (m[name], pad_m, 0), (v[name], pad_v, 0)]
            if fp32 is not None:
                self.assertTrue(torch.equal(fp32[name].to(logical[name].dtype), logical[name]),
                                f'{name}: fp32 master padding rows do not follow the weight rows')
                checks.append((fp32[name], cfg.pad_fill, pad_value))
            for x, want, new in checks:
                self.assertTrue(torch.all(x[:kept_rows] == want), f'{name}: kept padding rows changed')
                self.assertTrue(torch.all(x[kept_rows:] == new), f'{name}: new padding rows are not {new}')
        if cfg.optimizer != 'nozero_fp16':  # the oracle reads steps from ZeRO shards and torch states
            self.assertEqual(logical.meta['optimizer_step'], [cfg.iteration])
        return logical

    # -- flat paddings, dtypes, storages, metadata --------------------------------------------

    def check_shards(self, tag, source_tag):
        """Padding elements are zero; tensors compact fp32; scalar metadata equals the source's."""
        src_files = zero_files(source_tag)
        src = load(os.path.join(source_tag, src_files[(0, 0)]))
        src_osd = src['optimizer_state_dict']
        problems = []
        for (d, mm), name in sorted(zero_files(tag).items()):
            where = name
            obj = load(os.path.join(tag, name))
            mp = load(mp_file(tag, mm))
            if list(obj) != list(src):
                problems.append(f'{where}: outer keys {list(obj)} vs source {list(src)}')
                continue
            problems += differences(src['ds_version'], obj['ds_version'], f'{where}:ds_version')
            problems += differences(mp['ds_config'], obj['ds_config'], f'{where}:ds_config (vs its mp_rank file)')
            osd = obj['optimizer_state_dict']
            if list(osd) != list(src_osd):
                problems.append(f'{where}: keys {list(osd)} vs source {list(src_osd)}')
                continue
            for key in osd:
                if key in ('base_optimizer_state', 'single_partition_of_fp32_groups', 'group_paddings',
                           'groups_padding', 'partition_count', 'param_slice_mappings'):
                    continue
                problems += differences(src_osd[key], osd[key], f'{where}:{key}')
            base, src_base = osd['base_optimizer_state'], src_osd['base_optimizer_state']
            problems += differences(list(src_base), list(base), f'{where}:base_optimizer_state keys')
            shapes = mp['param_shapes']
            if len(base['param_groups']) != len(src_base['param_groups']) or len(shapes) != len(base['param_groups']):
                problems.append(f'{where}: {len(base["param_groups"])} param groups, source '
                                f'{len(src_base["param_groups"])}, param_shapes {len(shapes)}')
                continue
            for g, (pg, spg) in enumerate(zip(base['param_groups'], src_base['param_groups'])):
                problems += differences(spg, pg, f'{where}:param_groups[{g}]')
                state, src_state = base['state'][g], src_base['state'][g]
                if list(state) != list(src_state):
                    problems.append(f'{where}: state[{g}] keys {list(state)} vs source {list(src_state)}')
                total = sum(math.prod(s) for s in shapes[g].values())
                part = state['exp_avg'].numel()
                real = max(0, min(part, total - d * part))  # elements of this partition that are parameters
                fp32 = osd['single_partition_of_fp32_groups'][g]
                for key, t in [('fp32', fp32)] + [(k, x) for k, x in state.items() if isinstance(x, torch.Tensor)]:
                    if key != 'step' and t.dtype != torch.float32:
                        problems.append(f'{where}: group {g} {key} is {t.dtype}')
                    if not mf.is_compact(t):
                        problems.append(f'{where}: group {g} {key} storage not compact')
                    if t.dim() == 1 and t.numel() > real and torch.any(t[real:] != 0):
                        problems.append(f'{where}: group {g} {key}: padding elements not zero')
        self.assert_no_problems(problems, f'{tag} shards')

    # -- the files DeepSpeed would write ------------------------------------------------------

    def check_files_equal(self, got_tag, want_tag, cfg, layout, first_free_row, skip_ds_config=False):
        """Every optimizer file of ``got_tag`` equals ``want_tag``'s (same layout) bit for bit,
        outside the masked regions; mp_rank param_shapes are identical."""
        tp, pp, dp = layout
        got_files, want_files = zero_files(got_tag), zero_files(want_tag)
        self.assertEqual(sorted(got_files.values()), sorted(want_files.values()))
        rule = mask_rules(cfg, tp, pp, first_free_row)
        problems = []
        for mm in range(tp * pp):
            want_mp, got_mp = load(mp_file(want_tag, mm)), load(mp_file(got_tag, mm))
            shapes = want_mp['param_shapes']
            problems += differences(shapes, got_mp['param_shapes'], f'mp_rank_{mm:02d}:param_shapes')
            if cfg.optimizer in ('nozero_fp16', 'torch_adamw'):  # the state inside the mp_rank file
                shapes = nozero_group_shapes(cfg, layout, mm)
                want, got = want_mp['optimizer'], got_mp['optimizer']
                for opt in (want, got):
                    if cfg.optimizer == 'nozero_fp16':
                        apply_mask(opt, shapes, 0, rule, mm)
                    else:
                        apply_torch_mask(opt, shapes, rule, mm)
                problems += differences(want, got, f'mp_rank_{mm:02d}:optimizer')
                continue
            for d in range(dp):
                name = want_files[(d, mm)]
                want, got = load(os.path.join(want_tag, name)), load(os.path.join(got_tag, name))
                if skip_ds_config:
                    want.pop('ds_config'), got.pop('ds_config')
                apply_mask(want['optimizer_state_dict'], shapes, d, rule, mm)
                apply_mask(got['optimizer_state_dict'], shapes, d, rule, mm)
                problems += differences(want, got, name)
        self.assert_no_problems(problems, f'{got_tag} vs {want_tag}')

    def check_tied_copies(self, tag, cfg, layout):
        """The last stage's tied embedding state equals stage 0's (fp32 and both moments)."""
        tp, pp, _ = layout
        if not cfg.tied or pp == 1:
            return
        for t in range(tp):
            first, last = (stage_states(tag, mm, cfg, layout) for mm in (t, (pp - 1) * tp + t))
            copies = [n for n in last if n.startswith('tied_modules.embed.')]
            self.assertIn('tied_modules.embed.word_embeddings.weight', copies)
            for name in copies:
                for key in first[name]:
                    self.assertTrue(torch.equal(first[name][key], last[name][key]),
                                    f'{tag} tp {t}: last stage {name} {key} != stage 0')

    def check_fp16_optimizer(self, tag, source_tag, layout):
        """FP16_Optimizer state in every mp_rank file: compact fp32 tensors, the source's scalars
        and hyper-parameters, no ZeRO files."""
        tp, pp, _ = layout
        self.assertEqual(zero_files(tag), {})
        src = load(mp_file(source_tag, 0))['optimizer']
        problems = []
        for mm in range(tp * pp):
            opt = load(mp_file(tag, mm))['optimizer']
            if list(opt) != list(src):
                problems.append(f'mp_rank_{mm:02d}: optimizer keys {list(opt)} vs source {list(src)}')
                continue
            for key in opt:
                if key not in ('optimizer_state_dict', 'fp32_groups_flat'):
                    problems += differences(src[key], opt[key], f'mp_rank_{mm:02d}:optimizer.{key}')
            problems += differences(src['optimizer_state_dict']['param_groups'],
                                    opt['optimizer_state_dict']['param_groups'], f'mp_rank_{mm:02d}:param_groups')
            tensors = list(opt['fp32_groups_flat']) + [
                x for st in opt['optimizer_state_dict']['state'].values() for x in st.values()
                if isinstance(x, torch.Tensor)]
            for x in tensors:
                if x.dtype != torch.float32 or not mf.is_compact(x):
                    problems.append(f'mp_rank_{mm:02d}: optimizer tensor {x.dtype}, compact {mf.is_compact(x)}')
        self.assert_no_problems(problems, f'{tag} FP16_Optimizer state')

    def check_torch_optimizer(self, tag, source_tag, cfg, layout):
        """A torch optimizer state_dict in every mp_rank file, as torch.load gives it back: the
        source's hyperparameters per group, `params` indexing the stage's parameters in group
        order, every parameter with the source's state keys and step; no ZeRO files, no
        param_shapes; dp_world_size the target's DP.  (structural_problems checks compact fp32
        tensors with storages of their own.)"""
        tp, pp, dp = layout
        self.assertEqual(zero_files(tag), {})
        src = load(mp_file(source_tag, 0))['optimizer']
        src_state = src['state'][0]
        hyper = [{k: v for k, v in pg.items() if k != 'params'} for pg in src['param_groups']]
        problems = []
        for mm in range(tp * pp):
            where = f'mp_rank_{mm:02d}'
            mp = load(mp_file(tag, mm))
            if mp['dp_world_size'] != dp or mp['args'].data_parallel_size != dp or mp['param_shapes'] is not None:
                problems.append(f'{where}: dp_world_size {mp["dp_world_size"]}, args DP '
                                f'{mp["args"].data_parallel_size}, param_shapes {mp["param_shapes"]!r}')
            opt = mp['optimizer']
            if list(opt) != list(src):
                problems.append(f'{where}: optimizer keys {list(opt)} vs source {list(src)}')
                continue
            index = 0
            for g, (pg, group) in enumerate(zip(opt['param_groups'], nozero_group_shapes(cfg, layout, mm))):
                problems += differences(hyper[g], {k: v for k, v in pg.items() if k != 'params'},
                                        f'{where}:param_groups[{g}]')
                if list(pg) != list(src['param_groups'][g]) or pg['params'] != list(range(index, index + len(group))):
                    problems.append(f'{where}: param_groups[{g}] keys {list(pg)}, params {pg["params"]}')
                index += len(group)
            if len(opt['param_groups']) != len(hyper) or list(opt['state']) != list(range(index)):
                problems.append(f'{where}: {len(opt["param_groups"])} groups, state indices {list(opt["state"])}')
            for i, state in opt['state'].items():
                if list(state) != list(src_state):
                    problems.append(f'{where}: state[{i}] keys {list(state)} vs source {list(src_state)}')
                else:
                    problems += differences(src_state['step'], state['step'], f'{where}:state[{i}].step')
        self.assert_no_problems(problems, f'{tag} torch optimizer state')

    # -- one conversion, fully checked, and its round trip ------------------------------------

    def convert_and_check(self, family, a_layout, b_layout, round_trip=True, extra=(), pad_value=0.0,
                          reference=True, **options):
        """A (fixture at ``a_layout``) -> B -> A2; every check of this file.  ``extra``: more
        convert arguments for A -> B; ``reference``: compare B with the fixture at B's layout
        (not possible with a custom --layers-per-stage)."""
        cfg = make_cfg(family, a_layout, **options)
        tmp = self.tmpdir()
        a_root, b_root, ref_root, a2_root = (os.path.join(tmp, x) for x in ('a', 'b', 'ref', 'a2'))
        a_tag = mf.write_checkpoint(a_root, cfg)['tag_dir']
        b_tag = os.path.join(b_root, cfg.tag)
        convert(a_tag, b_tag, b_layout, *extra)
        vp_a, vp_b = mf.padded_vocab(cfg, a_layout[0]), mf.padded_vocab(cfg, b_layout[0])
        kept = min(vp_a, vp_b) - cfg.V
        self.check_canonical(b_tag, cfg, b_layout, kept, pad_value)
        if cfg.optimizer == 'nozero_fp16':
            self.check_fp16_optimizer(b_tag, a_tag, b_layout)
        elif cfg.optimizer == 'torch_adamw':
            self.check_torch_optimizer(b_tag, a_tag, cfg, b_layout)
        else:
            self.check_shards(b_tag, a_tag)
        self.check_tied_copies(b_tag, cfg, b_layout)
        if reference:
            # What DeepSpeed writes at B's layout (ds_config: reshard keeps the source's, the
            # fixture derives batch sizes from DP; checked against mp_rank in check_shards).
            ref_tag = mf.write_checkpoint(ref_root, at_layout(cfg, b_layout))['tag_dir']
            self.check_files_equal(b_tag, ref_tag, cfg, b_layout, first_free_row=vp_a, skip_ds_config=True)
        if not round_trip:
            return cfg, a_tag, b_tag
        a2_tag = os.path.join(a2_root, cfg.tag)
        convert(b_tag, a2_tag, a_layout)
        self.check_canonical(a2_tag, cfg, a_layout, kept)
        self.check_tied_copies(a2_tag, cfg, a_layout)
        self.check_files_equal(a2_tag, a_tag, cfg, a_layout, first_free_row=vp_b)
        return cfg, a_tag, b_tag


# ---------------------------------------------------------------------------------------------
# Formats and layouts
# ---------------------------------------------------------------------------------------------

class LayoutTest(OptimizerTestCase):
    """A -> B -> A for every optimizer format, TP/PP/DP changing at once."""

    BF16 = [
        ('bs_bloom', (2, 2, 2), (1, 4, 3), {}),    # all three change; 6 blocks on 4 stages; odd DP
        ('bs_bloom', (1, 1, 1), (4, 3, 12), {}),   # expansion everywhere, DP 12, vocab 104 -> 128 rows
        ('bs_bloom', (3, 3, 5), (2, 1, 2), {}),    # TP 3 -> 2, PP -> 1 (no tied copy), DP 5 -> 2
        ('bs_bloom', (2, 2, 2), (2, 2, 5), {}),    # DP alone
        ('bs_bloom', (2, 2, 2), (1, 4, 3), dict(pp_method='parameters')),
        ('bs_bloom', (1, 3, 2), (2, 4, 3), dict(pp_method='type:transformer|embedding')),
        ('bs_gpt_glu', (2, 2, 2), (4, 1, 3), {}),  # GLU halves, absolute positions (tied copy)
        ('bs_gpt_glu', (2, 2, 2), (1, 3, 3), dict(rotary=True)),  # inv_freq buffers: no state
        ('ms_gpt2', (2, 2, 3), (3, 4, 5), {}),
        ('ms_gpt2', (4, 3, 2), (1, 2, 1), {}),     # shrink to DP 1
        ('ms_gpt2', (1, 1, 4), (6, 2, 3), {}),     # PP 1 -> 2 with a tied copy to create; 104 -> 144 rows
        ('ms_gpt2', (2, 2, 2), (1, 4, 3), dict(numbering='bs')),  # MS before 2023-07 layer numbering
        ('ms_llama', (2, 2, 2), (6, 3, 3), {}),    # untied head, GQA, SwiGLU
        ('ms_llama', (3, 1, 12), (1, 4, 5), {}),   # DP 12 -> 5, uneven PP
        ('ms_llama', (2, 2, 3), (2, 2, 3), {}),    # identity: the files come back unchanged
    ]

    def test_bf16_zero(self):
        for family, a, b, options in self.BF16:
            with self.subTest(family=family, a=a, b=b, **options):
                self.convert_and_check(family, a, b, **options)

    ZERO1 = [
        ('ms_gpt2', (2, 2, 2), (1, 3, 5), {}),
        ('bs_bloom', (1, 2, 4), (2, 1, 3), {}),
        ('tiny_bloom', (1, 1, 2), (1, 2, 16), {}),  # per-rank paddings over several tail ranks
        ('bs_bloom', (2, 2, 2), (1, 3, 3), dict(dtype='bf16')),  # ZeRO-1 with bf16: bf16_ prefix
    ]

    def test_zero1_fp16(self):
        for family, a, b, options in self.ZERO1:
            with self.subTest(family=family, a=a, b=b, **options):
                cfg, a_tag, b_tag = self.convert_and_check(family, a, b, optimizer='zero1', **options)
                names = sorted(zero_files(b_tag).values())
                prefix = 'bf16_zero_pp_rank_' if cfg.dtype == 'bf16' else 'zero_pp_rank_'
                self.assertTrue(all(n.startswith(prefix) for n in names), names[:3])
                src = load(os.path.join(a_tag, zero_files(a_tag)[(0, 0)]))['optimizer_state_dict']
                for name in names:
                    osd = load(os.path.join(b_tag, name))['optimizer_state_dict']
                    for key in ('loss_scaler', 'dynamic_loss_scale', 'overflow', 'zero_stage', 'clip_grad'):
                        self.assertEqual(differences(src[key], osd[key], f'{name}:{key}'), [])

    def test_legacy_v065(self):
        """0.6.5 BF16 shards: the map is rebuilt from param_shapes; the output mirrors the
        source's format (no param_slice_mappings, `groups_padding`)."""
        for a, b in (((2, 2, 2), (1, 2, 3)), ((1, 1, 3), (2, 3, 10))):
            with self.subTest(a=a, b=b):
                cfg, a_tag, b_tag = self.convert_and_check('bs_bloom', a, b, legacy_v065=True)
                for name in zero_files(b_tag).values():
                    osd = load(os.path.join(b_tag, name))['optimizer_state_dict']
                    self.assertNotIn('param_slice_mappings', osd, name)
                    self.assertNotIn('group_paddings', osd, name)
                    self.assertIn('groups_padding', osd, name)

    def test_group_padding_longer_than_a_partition(self):
        """BF16_Optimizer puts a whole group's padding on the last DP rank, even when it is longer
        than a partition (large DP, tiny group)."""
        for a, b in (((1, 1, 2), (2, 2, 16)), ((1, 2, 32), (1, 1, 3)), ((1, 1, 4), (1, 1, 32))):
            with self.subTest(a=a, b=b):
                cfg, a_tag, b_tag = self.convert_and_check('tiny_bloom', a, b)
                tag, dp = (a_tag, a[2]) if a[2] > b[2] else (b_tag, b[2])
                longest = 0
                for (d, mm), name in zero_files(tag).items():
                    if d == dp - 1:
                        osd = load(os.path.join(tag, name))['optimizer_state_dict']
                        for g, pad in enumerate(osd['group_paddings']):
                            part = osd['base_optimizer_state']['state'][g]['exp_avg'].numel()
                            longest = max(longest, pad / part)
                self.assertGreater(longest, 1, 'the case should have a padding longer than a partition')

    def test_tied_copy_created_from_stage0(self):
        """PP 1 -> PP > 1: the last stage's tied copies did not exist in the source."""
        for family in ('bs_bloom', 'ms_gpt2'):
            with self.subTest(family=family):
                cfg, _, b_tag = self.convert_and_check(family, (2, 1, 2), (1, 3, 2), round_trip=False)
                last = stage_states(b_tag, 2)
                self.assertIn('tied_modules.embed.word_embeddings.weight', last)
                if cfg.position == 'absolute':
                    self.assertIn('tied_modules.embed.position_embeddings.weight', last)

    def test_fp16_optimizer_without_zero(self):
        """FP16_Optimizer (fp16, no ZeRO): the state lives in the mp_rank files, whole per stage."""
        for family, a, b in (('ms_gpt2', (2, 2, 1), (1, 3, 1)), ('bs_bloom', (1, 1, 2), (4, 2, 3)),
                             ('ms_llama', (3, 2, 1), (2, 1, 1))):
            with self.subTest(family=family, a=a, b=b):
                self.convert_and_check(family, a, b, optimizer='nozero_fp16')

    def test_vocab_pad_value(self):
        """New vocabulary padding rows: master = the weight's fill value, moments 0."""
        self.convert_and_check('bs_bloom', (1, 2, 2), (4, 2, 3), extra=('--vocab-pad-value', '0.5'),
                               pad_value=0.5, reference=False)

    def test_layers_per_stage(self):
        """A custom stage split: the optimizer follows the weights to the chosen stages."""
        cfg, a_tag, b_tag = self.convert_and_check('ms_gpt2', (2, 2, 2), (1, 3, 3),
                                                   extra=('--layers-per-stage', '1,4,1'), reference=False)
        blocks = [sum(1 for n in load(mp_file(b_tag, mm))['param_shapes'][0]
                      if n.endswith('self_attention.query_key_value.weight')) for mm in range(3)]
        self.assertEqual(blocks, [1, 4, 1])

    def test_universal_metadata_at_the_target_tp(self):
        """MS declares TP-replicated and row-parallel parameter patterns only at TP > 1 (format doc
        9.2); ds_to_universal needs them to merge the optimizer state of a TP > 1 checkpoint (without
        them it concatenates replicated norms on dim 0 and row-parallel weights on the wrong dim).
        A TP 1 source converted to TP > 1 must declare them as MS would at that TP."""
        for family, a, b in (('ms_gpt2', (1, 2, 2), (2, 3, 2)), ('ms_llama', (1, 1, 1), (3, 2, 2))):
            with self.subTest(family=family):
                cfg = make_cfg(family, a)
                tmp = self.tmpdir()
                a_tag = mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']
                b_tag = os.path.join(tmp, 'b', cfg.tag)
                convert(a_tag, b_tag, b)
                want = mf._universal_info(at_layout(cfg, b))
                got = load(mp_file(b_tag, 0))['universal_checkpoint_info']
                # DeepSpeed uses each list as a set of patterns.
                for key in ('tp_replicated_parameter_patterns', 'parameter_with_row_parallelism_patterns'):
                    self.assertEqual(sorted(got.get(key, [])), sorted(want[key]), key)

    def test_default_dp_is_the_sources(self):
        cfg = make_cfg('ms_gpt2', (2, 2, 3))
        tmp = self.tmpdir()
        a_tag = mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']
        b_tag = os.path.join(tmp, 'b', cfg.tag)
        run_ok('convert', a_tag, b_tag, '--tp', 1, '--pp', 3, '-q')
        self.assertEqual({d for d, _ in zero_files(b_tag)}, {0, 1, 2})
        self.check_canonical(b_tag, cfg, (1, 3, 3), mf.padded_vocab(cfg, 1) - cfg.V)


# ---------------------------------------------------------------------------------------------
# Refusals, policies, verify
# ---------------------------------------------------------------------------------------------

EPS = 2.0 ** -20  # master drift far below bf16 resolution near 1.0 (2**-7)


class PolicyTest(OptimizerTestCase):

    def assert_refused(self, proc, *words):
        self.assertEqual(proc.returncode, 2, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertTrue(lines[0].startswith(ERROR_PREFIX), lines[0])
        for word in words:
            self.assertIn(word, lines[0].lower())
        self.assertEqual(proc.stdout, '')

    def drifted_masters(self, eps):
        """A TP 2 checkpoint whose replicated fp32 masters differ across TP ranks by ``eps`` (below
        bf16 resolution, so the bf16 weights stay identical) and whose moments do not."""
        cfg = make_cfg('bs_bloom', (2, 1, 2))
        tmp = self.tmpdir()
        a_tag = mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']
        name = '4.input_layernorm.weight'
        for (d, mm), fname in zero_files(a_tag).items():
            if mm != 1:
                continue
            def change(obj):
                osd = obj['optimizer_state_dict']
                for g, mapping in enumerate(osd['param_slice_mappings']):
                    if name in mapping:
                        f = mapping[name]
                        osd['single_partition_of_fp32_groups'][g][f.start:f.start + f.numel] += eps
            rewrite(os.path.join(a_tag, fname), change)
        self.assertEqual(mf.structural_problems(a_tag, cfg), [], 'the drift must stay below bf16 resolution')
        self.assertGreater(mf.load_logical(a_tag, cfg).optimizer_drift['layers.1.input_layernorm.weight'], 0)
        return cfg, tmp, a_tag

    def test_master_drift_refused_by_default(self):
        cfg, tmp, a_tag = self.drifted_masters(EPS)
        proc = run('convert', a_tag, os.path.join(tmp, 'b', cfg.tag), '--tp', 1, '--pp', 1)
        self.assert_refused(proc, 'input_layernorm', '--replicated')
        # Like drifted weights, `lint` lists what convert would refuse: as errors under the same
        # default policy, as warnings when told to merge.
        for options, tag, code in (((), 'error:', 1), (('--replicated', 'first'), 'warning:', 0)):
            proc = run('lint', a_tag, *options)
            self.assertEqual(proc.returncode, code, proc.stdout + proc.stderr)
            listed = [line for line in proc.stdout.splitlines() if line.startswith(tag)]
            self.assertTrue(any('input_layernorm' in line for line in listed),
                            f'lint {options} does not list the drifted optimizer state:\n{proc.stdout}')

    def test_master_drift_first_and_average(self):
        cfg, tmp, a_tag = self.drifted_masters(EPS)
        b_tag = os.path.join(tmp, 'first', cfg.tag)
        run_ok('convert', a_tag, b_tag, '--tp', 1, '--pp', 1, '--replicated', 'first', '-q')
        self.check_canonical(b_tag, cfg, (1, 1, 2), mf.padded_vocab(cfg, 1) - cfg.V)
        c_tag = os.path.join(tmp, 'average', cfg.tag)
        run_ok('convert', a_tag, c_tag, '--tp', 3, '--pp', 1, '--replicated', 'average', '-q')
        self.assert_no_problems(mf.structural_problems(c_tag, cfg), 'average')
        master = mf.load_logical(c_tag, cfg).optimizer['fp32']['layers.1.input_layernorm.weight']
        canon = mf.canonical_tensors(cfg)['layers.1.input_layernorm.weight']
        mean = ((canon.double() + (canon + EPS).float().double()) / 2)
        self.assertTrue(torch.allclose(master.double(), mean, rtol=0, atol=1e-7), 'average of the masters')

    def test_drifted_fixture(self):
        """tp_drift_eps drifts weights and masters alike: refused by default; `first` gives the
        canonical state; `average` keeps bf16(master) == weight."""
        cfg = make_cfg('ms_gpt2', (2, 2, 2), tp_drift_eps=1e-2)
        tmp = self.tmpdir()
        a_tag = mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']
        self.assertGreater(max(mf.load_logical(a_tag, cfg).optimizer_drift.values()), 0)
        self.assert_refused(run('convert', a_tag, os.path.join(tmp, 'b', cfg.tag), '--tp', 1, '--pp', 2),
                            '--replicated')
        b_tag = os.path.join(tmp, 'first', cfg.tag)
        run_ok('convert', a_tag, b_tag, '--tp', 1, '--pp', 2, '--replicated', 'first', '-q')
        self.check_canonical(b_tag, cfg, (1, 2, 2), mf.padded_vocab(cfg, 1) - cfg.V)
        c_tag = os.path.join(tmp, 'average', cfg.tag)
        run_ok('convert', a_tag, c_tag, '--tp', 1, '--pp', 2, '--replicated', 'average', '-q')
        self.assert_no_problems(mf.structural_problems(c_tag, cfg), 'average: bf16(master) == weight')

    def test_mixed_optimizer_steps_refused(self):
        """Shards whose param_groups disagree on the step come from different iterations (a mixed
        checkpoint): refused like mixed iterations of the weights, not resolved by taking one."""
        cfg = make_cfg('bs_bloom', (2, 2, 2))
        tmp = self.tmpdir()
        a_tag = mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']
        def change(obj):
            for pg in obj['optimizer_state_dict']['base_optimizer_state']['param_groups']:
                pg['step'] += 1
        rewrite(os.path.join(a_tag, zero_files(a_tag)[(1, 3)]), change)
        self.assert_refused(run('convert', a_tag, os.path.join(tmp, 'b', cfg.tag), '--tp', 1, '--pp', 1), 'step')

    def test_round_robin_gradients(self):
        """ZeRO-1/2 with round_robin_gradients flattens each group in DeepSpeed's round-robin order
        for the DP size (stage_1_and_2.py _round_robin_reorder), so a DP change reorders the flat
        buffer.  reshard must refuse such a checkpoint, or write param_shapes in the target's
        round-robin order -- never the plain order under a config that says round robin."""
        cfg = make_cfg('ms_gpt2', (2, 2, 2), optimizer='zero1')
        tmp = self.tmpdir()
        a_tag = mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']
        for fname in os.listdir(a_tag):
            if fname.startswith('mp_rank_') or ZERO_RE.match(fname):
                def change(obj):
                    obj['ds_config']['zero_optimization']['round_robin_gradients'] = True
                    if 'args' in obj:
                        obj['args'].deepspeed_config_dict['zero_optimization']['round_robin_gradients'] = True
                rewrite(os.path.join(a_tag, fname), change)
        b_tag = os.path.join(tmp, 'b', cfg.tag)
        proc = run('convert', a_tag, b_tag, '--tp', 1, '--pp', 1, '--dp', 3, '-q')
        if proc.returncode != 0:
            self.assert_refused(proc, 'round_robin')
            return
        plain = load(mp_file(mf.write_checkpoint(os.path.join(tmp, 'ref'), at_layout(cfg, (1, 1, 3)))['tag_dir'], 0))
        for g, group in enumerate(plain['param_shapes']):
            names = list(group)
            want = [n for j in range(3) for i, n in enumerate(names) if i % 3 == j]
            self.assertEqual(list(load(mp_file(b_tag, 0))['param_shapes'][g]), want,
                             'written in plain order under round_robin_gradients=True')

    def test_extra_state_tensors_and_scalars(self):
        """Per-parameter state beyond Adam's two moments (amsgrad's max_exp_avg_sq) follows the
        parameter's rule; a per-group scalar (torch Adam's `step`) is carried."""
        cfg = make_cfg('bs_bloom', (2, 2, 2))
        tmp = self.tmpdir()
        a_tag = mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']
        for fname in zero_files(a_tag).values():
            def change(obj):
                for g, st in obj['optimizer_state_dict']['base_optimizer_state']['state'].items():
                    st['step'] = torch.tensor(float(cfg.iteration))
                    st['max_exp_avg_sq'] = st['exp_avg_sq'] * 2
            rewrite(os.path.join(a_tag, fname), change)
        b_tag = os.path.join(tmp, 'b', cfg.tag)
        convert(a_tag, b_tag, (1, 3, 5))
        self.check_canonical(b_tag, cfg, (1, 3, 5), mf.padded_vocab(cfg, 1) - cfg.V)
        self.check_shards(b_tag, a_tag)
        for fname in zero_files(b_tag).values():
            for g, st in load(os.path.join(b_tag, fname))['optimizer_state_dict']['base_optimizer_state']['state'].items():
                self.assertEqual(list(st), ['exp_avg', 'exp_avg_sq', 'step', 'max_exp_avg_sq'])
                self.assertEqual(differences(torch.tensor(float(cfg.iteration)), st['step']), [])
                self.assertTrue(torch.equal(st['max_exp_avg_sq'], st['exp_avg_sq'] * 2), fname)
        a2_tag = os.path.join(tmp, 'a2', cfg.tag)
        convert(b_tag, a2_tag, (2, 2, 2))
        self.check_files_equal(a2_tag, a_tag, cfg, (2, 2, 2), first_free_row=mf.padded_vocab(cfg, 1))

    def test_verify(self):
        cfg = make_cfg('ms_llama', (2, 2, 2))
        tmp = self.tmpdir()
        a_tag = mf.write_checkpoint(os.path.join(tmp, 'a'), cfg)['tag_dir']
        b_tag = os.path.join(tmp, 'b', cfg.tag)
        convert(a_tag, b_tag, (3, 1, 5))
        proc = run('verify', a_tag, b_tag)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn('same model', proc.stdout + proc.stderr)
        self.assertEqual(run('lint', b_tag).returncode, 0)
        for key in ('exp_avg', 'exp_avg_sq', 'fp32'):
            with self.subTest(perturbed=key):
                c_tag = os.path.join(tmp, 'c_' + key, cfg.tag)
                convert(b_tag, c_tag, (3, 1, 5))
                name = zero_files(c_tag)[(2, 0)]
                def change(obj):
                    osd = obj['optimizer_state_dict']
                    t = osd['single_partition_of_fp32_groups'][0] if key == 'fp32' else \
                        osd['base_optimizer_state']['state'][0][key]
                    t[7] += 0.5
                rewrite(os.path.join(c_tag, name), change)
                proc = run('verify', a_tag, c_tag)
                self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
                self.assertNotIn('same model', proc.stdout + proc.stderr)


if __name__ == '__main__':
    support.main()
