"""Golden outputs: the exact bytes `reshard` writes today, pinned case by case.

What this protects
------------------
The other interop tests check that reshard's outputs are *correct* (the oracle reads them back
as the canonical model, round trips give the source back).  This one checks that they do not
*change*: for a fixed list of named cases it builds a deterministic source checkpoint with the
fixture generators, runs one reshard command, and compares

  * the sha256 of every file the command wrote, relative to the output's parent folder (so
    `latest` and `latest_checkpointed_iteration.txt` are pinned with the tag folder), and that
    it wrote nothing else (dry runs: nothing at all);
  * for `--dry-run`, `verify`, `inspect` and `lint`: the sha256 of stdout, after the
    normalisation below, and the exit status;
  * that the command left its source checkpoint untouched,

with `golden_outputs.json` next to this file.  A refactor of the engine (planning, executor,
pickle writer, optimizer code) must leave every one of these bytes unchanged; a mismatch names
the case and the files that differ.  Re-record only for an intended difference, and explain it
in the commit that changes the JSON -- the diff of the JSON then shows exactly which cases
and files moved (and, for stdout, the text itself: the normalised stdout is stored too).

Re-recording
------------
  cd /work/main && PYTHONPATH=tests /usr/bin/python3 tests/interop/test_golden_outputs.py \\
      --reshard build/reshard --record

`--record` runs every case twice, in two different temporary folders with sources generated
twice, refuses to record if the two runs differ in any byte (a nondeterministic output cannot
be pinned), then rewrites the JSON; the comparisons then run against the new file.

Determinism (what was checked when this test was written)
----------------------------------------------------------
* The fixtures are byte-for-byte reproducible: generating a checkpoint twice, in folders of
  different names, in processes with different PYTHONHASHSEED, gives identical files
  (torch.save of python3-torch 1.13 writes no timestamps and names the zip archive after the
  file, not its folder).  Their bytes do depend on torch's serializer, so the JSON records a
  digest of every source: if a source differs, the fixture generator or torch changed, not
  reshard, and the case says so instead of blaming the output.
* reshard's written files depend neither on the output folder's path, nor on --threads (two
  `layout/threads*` cases repeat a conversion with 1 and 4 threads instead of 2 and must write
  the same bytes), nor on run-to-run timing.  Every command passes --threads explicitly,
  because the default (the number of cores) is printed in dry-run output.
* The binary reads its built-in rule sets at run time from the source tree it was built from
  (<repo>/rules, or $RESHARD_RULES_DIR when set): editing rules/*.yaml changes outputs as much
  as editing the engine, and is caught here too.
* What is pinned is today's behaviour, oddities included: e.g. a ZeRO-3 dry run announces
  "would write 0 files, 0 bytes of tensors" while its plan lists 2*DP files.  A fix of such a
  figure is an intended difference: re-record and say so.
* stdout: paths of the temporary folder are replaced by `<TMP>`; on the final `dry run:` line
  (and only there) two figures vary from run to run and are normalised:
      DRY_RUN_FIGURES: `memory about <number> <unit>` -> `memory about <MEM>` (the estimate adds
      the process's measured high-water mark, VmHWM, which moves by ~0.5 MiB per run) and
      `planned in <number> s` -> `planned in <T> s` (wall time).
  Everything else printed (the plan, per-tensor sources, notes, byte counts, budget) is pinned.
  The summary of a real conversion (timings, rates, peak memory) is not hashed.

Run: /usr/bin/python3 tests/interop/test_golden_outputs.py --reshard build/reshard  (PYTHONPATH=tests)
"""
import dataclasses
import difflib
import hashlib
import json
import os
import re
import sys
import tempfile
import unittest
from typing import Optional, Tuple

import torch

from fixtures import deepspeed_nonpipe as dn
from fixtures import megatron_fixture as mf

import interop_support as support
from interop_support import FAMILIES, rewrite

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'golden_outputs.json')
RECORD = False  # set by --record (taken off sys.argv before unittest sees it)
TAG = 'global_step10'  # every fixture's iteration is 10

# The only run-to-run varying figures of the stdout we pin (see the module docstring).
DRY_RUN_LINE = 'dry run: '
DRY_RUN_FIGURES = ((re.compile(r'memory about [0-9.]+ [A-Za-z]+'), 'memory about <MEM>'),
                   (re.compile(r'planned in [0-9.]+ s'), 'planned in <T> s'))


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
    kind: str                      # 'megatron' (fixtures.megatron_fixture) or 'nonpipe'
    options: Tuple = ()            # (key, value) pairs of the fixture configuration
    family: Optional[str] = None   # megatron: a FAMILIES key
    layout: Tuple[int, int, int] = (1, 1, 1)
    mutate: Optional[str] = None   # name of a MUTATIONS entry applied to the tag folder


def pipe(family, layout, optimizer, **options):
    return Source('megatron', tuple(sorted(dict(options, optimizer=optimizer).items())), family, layout)


def nonpipe(**options):
    return Source('nonpipe', tuple(sorted(options.items())))


ZERO_RE = re.compile(r'^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$')
MASTER_EPS = 2.0 ** -20  # below bf16 resolution near 1.0: the weights stay identical


def drift_masters(tag):
    """TP rank 1's fp32 master of one replicated norm drifts by MASTER_EPS (as in
    test_optimizer.PolicyTest.drifted_masters); the bf16 weights and the moments do not."""
    name = '4.input_layernorm.weight'
    for fname in sorted(os.listdir(tag)):
        m = ZERO_RE.match(fname)
        if not m or int(m[3]) != 1:
            continue

        def change(obj):
            osd = obj['optimizer_state_dict']
            for g, mapping in enumerate(osd['param_slice_mappings']):
                if name in mapping:
                    f = mapping[name]
                    osd['single_partition_of_fp32_groups'][g][f.start:f.start + f.numel] += MASTER_EPS
        rewrite(os.path.join(tag, fname), change)


MUTATIONS = {'drift_masters': drift_masters}

SOURCES = {
    # One per family, with optimizer state (BF16 ZeRO shards) and without.
    'bs_bloom.bf16_zero.t2p2d2': pipe('bs_bloom', (2, 2, 2), 'bf16_zero'),
    'bs_bloom.none.t1p1d1': pipe('bs_bloom', (1, 1, 1), 'none'),
    'bs_gpt_rotary.bf16_zero.t2p2d2': pipe('bs_gpt_rotary', (2, 2, 2), 'bf16_zero'),
    'bs_gpt_rotary.none.t1p1d2': pipe('bs_gpt_rotary', (1, 1, 2), 'none'),
    'bs_gpt_glu.bf16_zero.t2p2d2': pipe('bs_gpt_glu', (2, 2, 2), 'bf16_zero'),
    'bs_gpt_glu.none.t4p3d1': pipe('bs_gpt_glu', (4, 3, 1), 'none'),
    'ms_gpt2.bf16_zero.t2p2d3': pipe('ms_gpt2', (2, 2, 3), 'bf16_zero'),
    'ms_gpt2.none.t1p1d2': pipe('ms_gpt2', (1, 1, 2), 'none'),
    'ms_llama.bf16_zero.t2p2d2': pipe('ms_llama', (2, 2, 2), 'bf16_zero'),
    'ms_llama.none.t6p1d1': pipe('ms_llama', (6, 1, 1), 'none'),
    'tiny_bloom.bf16_zero.t1p1d2': pipe('tiny_bloom', (1, 1, 2), 'bf16_zero'),
    # Other optimizer formats.
    'ms_gpt2.zero1.t2p2d2': pipe('ms_gpt2', (2, 2, 2), 'zero1'),
    'bs_bloom.zero1_bf16.t2p2d2': pipe('bs_bloom', (2, 2, 2), 'zero1', dtype='bf16'),
    'tiny_bloom.zero1.t1p1d2': pipe('tiny_bloom', (1, 1, 2), 'zero1'),
    'bs_bloom.v065.t2p2d2': pipe('bs_bloom', (2, 2, 2), 'bf16_zero', legacy_v065=True),
    'bs_bloom.v065.t1p1d3': pipe('bs_bloom', (1, 1, 3), 'bf16_zero', legacy_v065=True),
    'ms_gpt2.nozero_fp16.t2p2d1': pipe('ms_gpt2', (2, 2, 1), 'nozero_fp16'),
    'bs_bloom.nozero_fp16.t1p1d2': pipe('bs_bloom', (1, 1, 2), 'nozero_fp16'),
    'ms_llama.nozero_fp16.t3p2d1': pipe('ms_llama', (3, 2, 1), 'nozero_fp16'),
    # Layout variants.
    'bs_bloom.bf16_zero.t1p1d1': pipe('bs_bloom', (1, 1, 1), 'bf16_zero'),
    'bs_bloom.bf16_zero.t1p2d2': pipe('bs_bloom', (1, 2, 2), 'bf16_zero'),
    'ms_gpt2.bf16_zero.t2p1d2': pipe('ms_gpt2', (2, 1, 2), 'bf16_zero'),
    'ms_gpt2.bf16_zero_bs_numbering.t2p2d2': pipe('ms_gpt2', (2, 2, 2), 'bf16_zero', numbering='bs'),
    'bs_bloom.bf16_zero_pp_parameters.t2p2d2': pipe('bs_bloom', (2, 2, 2), 'bf16_zero', pp_method='parameters'),
    'bs_bloom.bf16_zero_lprobe_legacy.t1p3d2': pipe('bs_bloom', (1, 3, 2), 'bf16_zero',
                                                    partition_algo='lprobe_legacy'),
    # Replicated tensors that drift across TP ranks.
    'bs_bloom.none_drift.t4p1d1': pipe('bs_bloom', (4, 1, 1), 'none', tp_drift_eps=1e-2),
    'ms_gpt2.bf16_zero_drift.t2p2d2': pipe('ms_gpt2', (2, 2, 2), 'bf16_zero', tp_drift_eps=1e-2),
    'bs_bloom.bf16_zero_master_drift.t2p1d2': dataclasses.replace(
        pipe('bs_bloom', (2, 1, 2), 'bf16_zero'), mutate='drift_masters'),
    # Non-pipeline DeepSpeed (HF Trainer style), ZeRO 1, 2 and 3.
    'np.z1_bf16.d3': nonpipe(zero_stage=1, dtype='bf16', dp=3),
    'np.z1_fp16.d16': nonpipe(zero_stage=1, dtype='fp16', dp=16),
    'np.z2_bf16.d12': nonpipe(zero_stage=2, dtype='bf16', dp=12),
    'np.z2_fp16.d5': nonpipe(zero_stage=2, dtype='fp16', dp=5),
    'np.z2_bf16_tied_frozen.d4': nonpipe(zero_stage=2, dtype='bf16', dp=4, tie_word_embeddings=True,
                                         frozen=('model.layers.0.mlp.up_proj.weight',)),
    'np.z3_bf16.d3': nonpipe(zero_stage=3, dtype='bf16', dp=3),
    'np.z3_bf16_sg40.d3': nonpipe(zero_stage=3, dtype='bf16', dp=3, sub_group_size=40),
    'np.z3_fp16_sg3.d12': nonpipe(zero_stage=3, dtype='fp16', dp=12, sub_group_size=3),
    'np.z3_bf16_sg40.d16': nonpipe(zero_stage=3, dtype='bf16', dp=16, sub_group_size=40),
    'np.z3_bf16_fused_adam.d2': nonpipe(zero_stage=3, dtype='bf16', dp=2, optimizer='ds_fused_adam'),
}


def build_source(src, root):
    """Writes the source checkpoint at ``root`` (root holds `latest` and the tag folder)."""
    options = dict(src.options)
    if src.kind == 'megatron':
        tp, pp, dp = src.layout
        mf.write_checkpoint(root, mf.FixtureConfig(tp=tp, pp=pp, dp=dp, **dict(FAMILIES[src.family], **options)))
    else:
        dn.write_nonpipe(root, dn.NonPipeConfig(**options))
    if src.mutate:
        MUTATIONS[src.mutate](os.path.join(root, TAG))


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One reshard command.  ``args`` tokens: '{src}' the source's root, '{out}' this case's
    output tag folder (OUT/global_step10; given as OUT to `convert`, which writes a root for a
    root in), '{case:NAME}' the output tag folder of case NAME.
    ``same_as``: a case whose written files must be identical (thread-count independence)."""
    name: str
    group: str
    source: str
    args: Tuple[str, ...]
    same_as: Optional[str] = None

    @property
    def command(self):
        return ' '.join(self.args)

    @property
    def pins_stdout(self):
        return self.args[0] in ('verify', 'inspect', 'lint') or '--dry-run' in self.args


def convert(group, name, source, layout, *extra, threads=2, same_as=None):
    tp, pp, dp = layout
    args = ('convert', '{src}', '{out}', '--tp', str(tp), '--pp', str(pp), '--dp', str(dp),
            *map(str, extra), '--threads', str(threads))
    if '--dry-run' not in extra:
        args += ('-q',)
    return Case(f'{group}/{name}', group, source, args, same_as)


def read_only(group, name, source, *args):
    return Case(f'{group}/{name}', group, source, tuple(map(str, args)) + ('--threads', '2'))


CASES = [
    # -- every family, with optimizer state and weights only --------------------------------
    convert('family', 'bs_bloom-optim-t2p2d2-to-t1p4d3', 'bs_bloom.bf16_zero.t2p2d2', (1, 4, 3)),
    convert('family', 'bs_bloom-weights-t1p1d1-to-t4p3d1', 'bs_bloom.none.t1p1d1', (4, 3, 1)),
    convert('family', 'bs_bloom-weights_only_flag-t2p2d2-to-t3p3d2', 'bs_bloom.bf16_zero.t2p2d2', (3, 3, 2),
            '--weights-only'),
    convert('family', 'bs_gpt_rotary-optim-t2p2d2-to-t3p1d2', 'bs_gpt_rotary.bf16_zero.t2p2d2', (3, 1, 2)),
    convert('family', 'bs_gpt_rotary-weights-t1p1d2-to-t2p4d2', 'bs_gpt_rotary.none.t1p1d2', (2, 4, 2)),
    convert('family', 'bs_gpt_glu-optim-t2p2d2-to-t4p1d3', 'bs_gpt_glu.bf16_zero.t2p2d2', (4, 1, 3)),
    convert('family', 'bs_gpt_glu-weights-t4p3d1-to-t2p2d1', 'bs_gpt_glu.none.t4p3d1', (2, 2, 1)),
    convert('family', 'ms_gpt2-optim-t2p2d3-to-t3p4d5', 'ms_gpt2.bf16_zero.t2p2d3', (3, 4, 5)),
    convert('family', 'ms_gpt2-weights-t1p1d2-to-t6p2d2', 'ms_gpt2.none.t1p1d2', (6, 2, 2)),
    convert('family', 'ms_llama-optim-t2p2d2-to-t6p3d3', 'ms_llama.bf16_zero.t2p2d2', (6, 3, 3)),
    convert('family', 'ms_llama-weights-t6p1d1-to-t1p4d1', 'ms_llama.none.t6p1d1', (1, 4, 1)),
    convert('family', 'ms_llama-weights_only_flag-t2p2d2-to-t3p1d1', 'ms_llama.bf16_zero.t2p2d2', (3, 1, 1),
            '--weights-only'),
    convert('family', 'tiny_bloom-optim-t1p1d2-to-t2p2d16', 'tiny_bloom.bf16_zero.t1p1d2', (2, 2, 16)),
    convert('family', 'tiny_bloom-weights_only_flag-t1p1d2-to-t2p1d3', 'tiny_bloom.bf16_zero.t1p1d2', (2, 1, 3),
            '--weights-only'),
    # -- optimizer formats ---------------------------------------------------------------------
    convert('optimizer', 'zero1_fp16-ms_gpt2-t2p2d2-to-t1p3d5', 'ms_gpt2.zero1.t2p2d2', (1, 3, 5)),
    convert('optimizer', 'zero1_fp16-ms_gpt2-weights_only_flag-t2p2d2-to-t2p1d2', 'ms_gpt2.zero1.t2p2d2',
            (2, 1, 2), '--weights-only'),
    convert('optimizer', 'zero1_bf16-bs_bloom-t2p2d2-to-t1p3d3', 'bs_bloom.zero1_bf16.t2p2d2', (1, 3, 3)),
    convert('optimizer', 'zero1_fp16-tiny_bloom-t1p1d2-to-t1p2d16', 'tiny_bloom.zero1.t1p1d2', (1, 2, 16)),
    convert('optimizer', 'v065-bs_bloom-t2p2d2-to-t1p2d3', 'bs_bloom.v065.t2p2d2', (1, 2, 3)),
    convert('optimizer', 'v065-bs_bloom-t1p1d3-to-t2p3d10', 'bs_bloom.v065.t1p1d3', (2, 3, 10)),
    convert('optimizer', 'nozero_fp16-ms_gpt2-t2p2d1-to-t1p3d1', 'ms_gpt2.nozero_fp16.t2p2d1', (1, 3, 1)),
    convert('optimizer', 'nozero_fp16-bs_bloom-t1p1d2-to-t4p2d3', 'bs_bloom.nozero_fp16.t1p1d2', (4, 2, 3)),
    convert('optimizer', 'nozero_fp16-ms_llama-t3p2d1-to-t2p1d1', 'ms_llama.nozero_fp16.t3p2d1', (2, 1, 1)),
    # -- layouts and options -------------------------------------------------------------------
    convert('layout', 'dp_only-bs_bloom-t2p2d2-to-t2p2d5', 'bs_bloom.bf16_zero.t2p2d2', (2, 2, 5)),
    convert('layout', 'identity-ms_llama-t2p2d2', 'ms_llama.bf16_zero.t2p2d2', (2, 2, 2)),
    convert('layout', 'shrink_to_dp1-ms_gpt2-t2p2d3-to-t1p2d1', 'ms_gpt2.bf16_zero.t2p2d3', (1, 2, 1)),
    convert('layout', 'expand_all_dp12-bs_bloom-t1p1d1-to-t4p3d12', 'bs_bloom.bf16_zero.t1p1d1', (4, 3, 12)),
    convert('layout', 'pp1_to_pp3_tied_copy-ms_gpt2-t2p1d2-to-t1p3d2', 'ms_gpt2.bf16_zero.t2p1d2', (1, 3, 2)),
    convert('layout', 'layers_per_stage_1_4_1-ms_gpt2-t2p2d3-to-t1p3d3', 'ms_gpt2.bf16_zero.t2p2d3', (1, 3, 3),
            '--layers-per-stage', '1,4,1'),
    convert('layout', 'vocab_pad_value_0.5-bs_bloom-t1p2d2-to-t4p2d3', 'bs_bloom.bf16_zero.t1p2d2', (4, 2, 3),
            '--vocab-pad-value', '0.5'),
    convert('layout', 'ms_bs_numbering-ms_gpt2-t2p2d2-to-t1p4d3', 'ms_gpt2.bf16_zero_bs_numbering.t2p2d2',
            (1, 4, 3)),
    convert('layout', 'pp_parameters-bs_bloom-t2p2d2-to-t1p4d3', 'bs_bloom.bf16_zero_pp_parameters.t2p2d2',
            (1, 4, 3)),
    convert('layout', 'lprobe_legacy-bs_bloom-t1p3d2-to-t2p4d3', 'bs_bloom.bf16_zero_lprobe_legacy.t1p3d2',
            (2, 4, 3)),
    convert('layout', 'no_update_latest-ms_gpt2-t1p1d2-to-t2p2d2', 'ms_gpt2.none.t1p1d2', (2, 2, 2),
            '--no-update-latest'),
    convert('layout', 'threads1-bs_bloom-t2p2d2-to-t1p4d3', 'bs_bloom.bf16_zero.t2p2d2', (1, 4, 3),
            threads=1, same_as='family/bs_bloom-optim-t2p2d2-to-t1p4d3'),
    convert('layout', 'threads4-ms_llama-t2p2d2-to-t6p3d3', 'ms_llama.bf16_zero.t2p2d2', (6, 3, 3),
            threads=4, same_as='family/ms_llama-optim-t2p2d2-to-t6p3d3'),
    # -- non-pipeline ZeRO-1/2/3: DP changes -------------------------------------------------
    convert('nonpipe', 'z1_bf16-d3-to-d16', 'np.z1_bf16.d3', (1, 1, 16)),
    convert('nonpipe', 'z1_fp16-d16-to-d5', 'np.z1_fp16.d16', (1, 1, 5)),
    convert('nonpipe', 'z2_bf16-d12-to-d3', 'np.z2_bf16.d12', (1, 1, 3)),
    convert('nonpipe', 'z2_fp16-d5-to-d7', 'np.z2_fp16.d5', (1, 1, 7)),
    convert('nonpipe', 'z2_bf16_tied_frozen-d4-to-d3', 'np.z2_bf16_tied_frozen.d4', (1, 1, 3)),
    convert('nonpipe', 'z3_bf16-d3-to-d16', 'np.z3_bf16.d3', (1, 1, 16)),
    convert('nonpipe', 'z3_bf16_sg40-d3-to-d5', 'np.z3_bf16_sg40.d3', (1, 1, 5)),
    convert('nonpipe', 'z3_fp16_sg3-d12-to-d4', 'np.z3_fp16_sg3.d12', (1, 1, 4)),
    convert('nonpipe', 'z3_bf16_sg40-d16-to-d1', 'np.z3_bf16_sg40.d16', (1, 1, 1)),
    convert('nonpipe', 'z3_bf16_fused_adam-d2-to-d3', 'np.z3_bf16_fused_adam.d2', (1, 1, 3)),
    # -- replicated tensors that drift across TP ranks -------------------------------------
    convert('replicated', 'weights_drift-average-bs_bloom-t4p1d1-to-t2p1d1', 'bs_bloom.none_drift.t4p1d1',
            (2, 1, 1), '--replicated', 'average'),
    convert('replicated', 'weights_drift-first-bs_bloom-t4p1d1-to-t2p1d1', 'bs_bloom.none_drift.t4p1d1',
            (2, 1, 1), '--replicated', 'first'),
    convert('replicated', 'optim_drift-average-ms_gpt2-t2p2d2-to-t1p2d2', 'ms_gpt2.bf16_zero_drift.t2p2d2',
            (1, 2, 2), '--replicated', 'average'),
    convert('replicated', 'optim_drift-first-ms_gpt2-t2p2d2-to-t1p2d2', 'ms_gpt2.bf16_zero_drift.t2p2d2',
            (1, 2, 2), '--replicated', 'first'),
    convert('replicated', 'master_drift-average-bs_bloom-t2p1d2-to-t3p1d2', 'bs_bloom.bf16_zero_master_drift.t2p1d2',
            (3, 1, 2), '--replicated', 'average'),
    convert('replicated', 'master_drift-first-bs_bloom-t2p1d2-to-t1p1d2', 'bs_bloom.bf16_zero_master_drift.t2p1d2',
            (1, 1, 2), '--replicated', 'first'),
    # -- dry runs: stdout pinned, nothing written ------------------------------------------
    convert('dry_run', 'bs_bloom-optim-t2p2d2-to-t1p4d3', 'bs_bloom.bf16_zero.t2p2d2', (1, 4, 3), '--dry-run'),
    convert('dry_run', 'ms_gpt2-layers_per_stage-t2p2d3-to-t1p3d3', 'ms_gpt2.bf16_zero.t2p2d3', (1, 3, 3),
            '--layers-per-stage', '1,4,1', '--dry-run'),
    convert('dry_run', 'nozero_fp16-bs_bloom-t1p1d2-to-t4p2d3', 'bs_bloom.nozero_fp16.t1p1d2', (4, 2, 3),
            '--dry-run'),
    convert('dry_run', 'weights_drift-average-bs_bloom-t4p1d1-to-t2p1d1', 'bs_bloom.none_drift.t4p1d1', (2, 1, 1),
            '--replicated', 'average', '--dry-run'),
    convert('dry_run', 'nonpipe-z2_bf16-d12-to-d3', 'np.z2_bf16.d12', (1, 1, 3), '--dry-run'),
    convert('dry_run', 'nonpipe-z3_bf16-d3-to-d16', 'np.z3_bf16.d3', (1, 1, 16), '--dry-run'),
    # -- verify / inspect / lint: stdout pinned ---------------------------------------------
    read_only('read_only', 'verify-bs_bloom-t2p2d2-vs-t1p4d3', 'bs_bloom.bf16_zero.t2p2d2',
              'verify', '{src}', '{case:family/bs_bloom-optim-t2p2d2-to-t1p4d3}'),
    read_only('read_only', 'verify-ms_llama-t2p2d2-vs-t6p3d3', 'ms_llama.bf16_zero.t2p2d2',
              'verify', '{src}', '{case:family/ms_llama-optim-t2p2d2-to-t6p3d3}'),
    read_only('read_only', 'verify-average-bs_bloom_drift-t4p1d1-vs-t2p1d1', 'bs_bloom.none_drift.t4p1d1',
              'verify', '{src}', '{case:replicated/weights_drift-average-bs_bloom-t4p1d1-to-t2p1d1}',
              '--replicated', 'average'),
    read_only('read_only', 'verify-nonpipe-z3_bf16-d3-vs-d16', 'np.z3_bf16.d3',
              'verify', '{src}', '{case:nonpipe/z3_bf16-d3-to-d16}'),
    read_only('read_only', 'inspect-bs_bloom-t2p2d2', 'bs_bloom.bf16_zero.t2p2d2', 'inspect', '{src}'),
    read_only('read_only', 'inspect-converted-ms_llama-t6p3d3', 'ms_llama.bf16_zero.t2p2d2',
              'inspect', '{case:family/ms_llama-optim-t2p2d2-to-t6p3d3}'),
    read_only('read_only', 'inspect-nonpipe-z1_bf16-d3', 'np.z1_bf16.d3', 'inspect', '{src}'),
    read_only('read_only', 'inspect-nonpipe-z3_bf16-d3', 'np.z3_bf16.d3', 'inspect', '{src}'),
    read_only('read_only', 'lint-bs_bloom-t2p2d2', 'bs_bloom.bf16_zero.t2p2d2', 'lint', '{src}'),
    read_only('read_only', 'lint-drifted-ms_gpt2-t2p2d2', 'ms_gpt2.bf16_zero_drift.t2p2d2', 'lint', '{src}'),
]
CASE_BY_NAME = {c.name: c for c in CASES}
GROUPS = ('family', 'optimizer', 'layout', 'nonpipe', 'replicated', 'dry_run', 'read_only')


# ---------------------------------------------------------------------------------------------
# Running the cases
# ---------------------------------------------------------------------------------------------

def sha256_file(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return h.hexdigest()


def tree_hashes(root):
    """{path relative to root: sha256} of every file under root ({} if root does not exist)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            digest = support.manifest_files_digest(path) if name == support.MANIFEST else sha256_file(path)
            out[os.path.relpath(path, root)] = digest
    return out


def tree_digest(hashes):
    return hashlib.sha256(''.join(f'{k}\0{v}\n' for k, v in sorted(hashes.items())).encode()).hexdigest()


def normalise_stdout(text, tmp_paths):
    for path in tmp_paths:
        text = text.replace(path, '<TMP>')
    lines = []
    for line in text.splitlines():
        if line.startswith(DRY_RUN_LINE):
            for regex, replacement in DRY_RUN_FIGURES:
                line = regex.sub(replacement, line)
        lines.append(line)
    return lines


class Runner:
    """Builds sources and runs cases under one temporary folder, each once (memoized)."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.tmp_paths = sorted({tmp, os.path.realpath(tmp)}, key=len, reverse=True)
        self.sources = {}   # name -> (root, {'sha256', 'files'})
        self.results = {}   # case name -> result dict

    def source(self, name):
        if name not in self.sources:
            root = os.path.join(self.tmp, 'src', name)
            build_source(SOURCES[name], root)
            hashes = tree_hashes(root)
            self.sources[name] = (root, {'sha256': tree_digest(hashes), 'files': len(hashes)})
        return self.sources[name]

    def out_root(self, case_name):
        return os.path.join(self.tmp, 'out', case_name.replace('/', '__'))

    def result(self, name):
        if name not in self.results:
            self.results[name] = self._run(CASE_BY_NAME[name])
        return self.results[name]

    def _run(self, case):
        src_root, src_info = self.source(case.source)
        out_root = self.out_root(case.name)
        args = []
        for token in case.args:
            if token == '{src}':
                token = src_root
            elif token == '{out}':
                # A root in (every source is one) gives a root out: convert writes OUT/global_step10.
                token = out_root if case.args[0] == 'convert' else os.path.join(out_root, TAG)
            elif token.startswith('{case:'):
                other = token[len('{case:'):-1]
                self.result(other)
                token = os.path.join(self.out_root(other), TAG)
            args.append(token)
        proc = support.reshard(*args)
        result = {'source': case.source, 'command': case.command, 'exit': proc.returncode}
        if proc.returncode != 0 and not case.pins_stdout:
            result['error'] = proc.stderr.strip()
        result['files'] = tree_hashes(out_root)
        if case.pins_stdout:
            lines = normalise_stdout(proc.stdout, self.tmp_paths)
            result['stdout_sha256'] = hashlib.sha256(('\n'.join(lines) + '\n').encode()).hexdigest()
            result['stdout'] = lines
        after = tree_digest(tree_hashes(src_root))
        if after != src_info['sha256']:
            result['source_changed'] = True  # never recorded: the test fails on it
        return result

    def run_all(self):
        for case in CASES:
            self.result(case.name)
        return self.snapshot()

    def snapshot(self):
        return {'sources': {name: self.source(name)[1] for name in sorted({c.source for c in CASES})},
                'cases': {c.name: self.result(c.name) for c in CASES}}


def record():
    """Runs every case twice (fresh folders, sources generated twice); writes the JSON only if
    both runs agree byte for byte and no command failed."""
    with tempfile.TemporaryDirectory(prefix='reshard-golden-a-') as a, \
            tempfile.TemporaryDirectory(prefix='reshard-golden-b-') as b:
        first, second = Runner(a).run_all(), Runner(b).run_all()
    problems = []
    for name in first['sources']:
        if first['sources'][name] != second['sources'][name]:
            problems.append(f'source {name}: not reproducible (two generations differ)')
    for name, r1 in first['cases'].items():
        r2 = second['cases'][name]
        if r1 != r2:
            problems.append(f'case {name}: two runs differ: ' + '; '.join(describe(name, r1, r2)))
        if r1.get('source_changed'):
            problems.append(f'case {name}: the command modified its source checkpoint')
        if 'error' in r1:
            problems.append(f'case {name}: reshard failed ({r1["exit"]}): {r1["error"]}')
        same_as = CASE_BY_NAME[name].same_as
        if same_as and r1['files'] != first['cases'][same_as]['files']:
            problems.append(f'case {name}: files differ from {same_as}\'s')
    if problems:
        raise AssertionError('not recorded:\n  ' + '\n  '.join(problems))
    golden = {
        '_about': ['Golden outputs of tests/interop/test_golden_outputs.py: per case, the sha256 of every file '
                   'reshard wrote (relative to the output folder\'s parent), and for dry-run / verify / inspect / '
                   'lint the normalised stdout and its sha256.  Re-record only for an intended, explained change:',
                   'PYTHONPATH=tests /usr/bin/python3 tests/interop/test_golden_outputs.py --reshard build/reshard '
                   '--record'],
        'torch': torch.__version__,
        'sources': first['sources'],
        'cases': first['cases'],
    }
    with open(GOLDEN, 'w') as f:
        json.dump(golden, f, indent=1)
        f.write('\n')
    return golden


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------

def short(h):
    return h[:12] if h else None


def describe(name, want, got):
    """Human-readable differences between a golden case entry and a fresh result."""
    out = []
    if want.get('command') != got.get('command'):
        out.append(f'command changed since recording: {want.get("command")!r} -> {got.get("command")!r} '
                   '(re-record if the case list was changed on purpose)')
    if want.get('exit') != got.get('exit'):
        out.append(f'exit status {want.get("exit")} -> {got.get("exit")}')
    if 'error' in got:
        out.append(f'reshard failed: {got["error"]}')
    if got.get('source_changed'):
        out.append('the command modified its source checkpoint')
    wf, gf = want.get('files', {}), got.get('files', {})
    for rel in sorted(set(wf) | set(gf)):
        if rel not in gf:
            out.append(f'missing file {rel} (golden {short(wf[rel])})')
        elif rel not in wf:
            out.append(f'unexpected file {rel} ({short(gf[rel])})')
        elif wf[rel] != gf[rel]:
            out.append(f'file differs: {rel} (golden {short(wf[rel])}, now {short(gf[rel])})')
    if want.get('stdout_sha256') != got.get('stdout_sha256'):
        diff = list(difflib.unified_diff(want.get('stdout', []), got.get('stdout', []),
                                         'golden stdout', 'stdout now', lineterm='', n=1))
        more = f'\n      ... {len(diff) - 40} more diff lines' if len(diff) > 40 else ''
        out.append(f'stdout differs (sha256 golden {short(want.get("stdout_sha256"))}, now '
                   f'{short(got.get("stdout_sha256"))}):\n      ' + '\n      '.join(diff[:40]) + more)
    return out


class GoldenOutputsTest(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        mf.install_pickle_shims()
        if RECORD:
            record()
            print(f'\nrecorded {len(CASES)} cases to {GOLDEN}', file=sys.stderr)
        with open(GOLDEN) as f:
            cls.golden = json.load(f)
        tmp = tempfile.TemporaryDirectory(prefix='reshard-golden-')
        cls.addClassCleanup(tmp.cleanup)
        cls.runner = Runner(tmp.name)

    def check_group(self, group):
        cases = [c for c in CASES if c.group == group]
        self.assertTrue(cases, group)
        for case in cases:
            with self.subTest(case=case.name):
                want = self.golden['cases'].get(case.name)
                if want is None:
                    self.fail(f'case {case.name} is not in {os.path.basename(GOLDEN)}: re-record')
                got = self.runner.result(case.name)
                problems = describe(case.name, want, got)
                if problems:
                    src_want = self.golden['sources'].get(case.source)
                    src_got = self.runner.source(case.source)[1]
                    if src_want != src_got:
                        problems.insert(0, f'NOTE: the source fixture {case.source} itself differs from the '
                                           f'recording ({src_want} -> {src_got}; torch {self.golden.get("torch")} '
                                           f'recorded, {torch.__version__} now): the fixture generator or torch '
                                           'changed, so the outputs cannot be compared')
                    self.fail(f'case {case.name}\n  command: reshard {case.command}  (source {case.source})\n  '
                              + '\n  '.join(problems))
                if case.same_as:
                    self.assertEqual(got['files'], self.runner.result(case.same_as)['files'],
                                     f'{case.name}: the thread count changed the written bytes')

    def test_golden_file_lists_every_case(self):
        self.assertEqual(list(self.golden['cases']), [c.name for c in CASES],
                         'the case list and golden_outputs.json disagree: re-record')
        self.assertGreaterEqual(len(CASES), 28)
        self.assertEqual({c.group for c in CASES}, set(GROUPS))

    def test_sources_are_the_recorded_fixtures(self):
        """Sources built from the fixture generators are byte-identical to the recorded ones."""
        for name, want in self.golden['sources'].items():
            with self.subTest(source=name):
                self.assertEqual(self.runner.source(name)[1], want,
                                 f'source fixture {name} differs from the recording (torch '
                                 f'{self.golden.get("torch")} recorded, {torch.__version__} now)')

    def test_family(self):
        self.check_group('family')

    def test_optimizer_formats(self):
        self.check_group('optimizer')

    def test_layouts(self):
        self.check_group('layout')

    def test_nonpipeline(self):
        self.check_group('nonpipe')

    def test_replicated_policies(self):
        self.check_group('replicated')

    def test_dry_runs(self):
        self.check_group('dry_run')
        for case in CASES:
            if case.group == 'dry_run':
                self.assertEqual(self.runner.result(case.name)['files'], {}, f'{case.name} wrote files')

    def test_verify_inspect_lint(self):
        self.check_group('read_only')


if __name__ == '__main__':
    if '--record' in sys.argv:
        sys.argv.remove('--record')
        RECORD = True
    support.main()
