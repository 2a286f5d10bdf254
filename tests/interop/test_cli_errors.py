"""Input validation of the reshard command line: refuse cleanly, write nothing, touch nothing.

Every refusal must
  * exit 2 (unusable input or arguments),
  * print exactly one line on stderr, ``reshard: error: <the problem and the fix>``,
  * print nothing on stdout (in particular no "wrote ..." summary),
  * leave no output folder and no ``*.reshard-partial-*`` / ``*.reshard-old-*`` sibling,
  * leave the input checkpoint byte-for-byte unchanged (every file hashed before and after).

Also covered: the success paths right next to each refusal (``--replicated average|first``,
``--weights-only``, ``--overwrite``, ``--allow-class``), ``--dry-run``, where the output goes
(exactly at OUT, ``latest`` / ``latest_checkpointed_iteration.txt`` next to it, or neither with
``--no-update-latest``) and IN given as a root folder versus the tag folder.

Pickles that name unknown classes are built so that executing them would create a file
(``os.system('touch .../pwned')``); the tests check that reshard refuses them by name and that the
file never appears.  This script never unpickles those files itself.

Run by ctest as ``/usr/bin/python3 tests/interop/test_cli_errors.py --reshard BIN`` with
PYTHONPATH=tests.
"""

import glob
import hashlib
import os
import re
import sys
import types

import torch


import interop_support as support
from interop_support import FixtureTestCase, layer_file, make_fixture, mp_file, rewrite

ERROR_PREFIX = 'reshard: error: '


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

run = support.reshard


def snapshot(path):
    """{relative path: sha256 | 'DIR'} of everything under ``path`` (or of the file itself); of a
    manifest, its file list's."""
    def digest(p):
        with open(p, 'rb') as f:
            return hashlib.sha256(f.read()).hexdigest()
    if not os.path.exists(path):
        return {}
    if os.path.isfile(path):
        return {'.': digest(path)}
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), path) + '/'] = 'DIR'
        for f in filenames:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, path)] = support.manifest_files_digest(full) if f == support.MANIFEST else digest(full)
    return out


class _RunsSystem:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


# A class in a throwaway module, as a fork's own enum or config object would be.
THROWAWAY_MODULE = 'reshard_test_throwaway_mod'
_throwaway = types.ModuleType(THROWAWAY_MODULE)
sys.modules[THROWAWAY_MODULE] = _throwaway


class Gizmo:
    def __init__(self, size=3, name='gizmo'):
        self.size = size
        self.name = name


Gizmo.__module__ = THROWAWAY_MODULE
Gizmo.__qualname__ = 'Gizmo'
_throwaway.Gizmo = Gizmo
GIZMO = f'{THROWAWAY_MODULE}.Gizmo'
SYSTEM = f'{os.system.__module__}.{os.system.__name__}'  # 'posix.system' on Linux


class ReshardTestCase(FixtureTestCase):

    # -- the refusal contract ----------------------------------------------------------------

    def assertRefused(self, args, needles, watch=(), out=None, code=2):
        """Runs reshard ``args`` and checks the refusal contract.

        needles: substrings (str) or compiled regexes that the error line must contain.
        watch: paths (input checkpoint roots, files) that must be byte-for-byte unchanged.
        out: the output folder that must not exist afterwards (or must be unchanged if it did).
        Returns the error line.
        """
        before = {w: snapshot(w) for w in watch}
        out_before = snapshot(out) if out and os.path.exists(out) else None
        parent = os.path.dirname(os.path.abspath(out)) if out else None
        parent_existed = parent is not None and os.path.lexists(parent)
        p = run(*args)
        shown = f'\n$ reshard {" ".join(map(str, args))}\nexit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}'
        self.assertEqual(p.returncode, code, 'wrong exit status' + shown)
        lines = p.stderr.splitlines()
        self.assertEqual(len(lines), 1, 'stderr must be exactly one line' + shown)
        line = lines[0]
        self.assertTrue(line.startswith(ERROR_PREFIX), f'stderr must start with {ERROR_PREFIX!r}' + shown)
        for needle in needles:
            if isinstance(needle, str):
                self.assertIn(needle, line, 'error line does not name the problem' + shown)
            else:
                self.assertRegex(line, needle, 'error line does not name the problem' + shown)
        self.assertEqual(p.stdout, '', 'a refused command must print nothing on stdout' + shown)
        for w in watch:
            self.assertEqual(snapshot(w), before[w], f'{w} changed' + shown)
        if out:
            if out_before is None:
                self.assertFalse(os.path.lexists(out), f'{out} was created' + shown)
            else:
                self.assertEqual(snapshot(out), out_before, f'{out} changed' + shown)
            if not parent_existed:
                self.assertFalse(os.path.lexists(parent), f'{parent} was created' + shown)
            self.assertNoLeftovers(out)
        return line

    def assertNoLeftovers(self, out):
        leftovers = (glob.glob(glob.escape(out) + '.reshard-partial-*')
                     + glob.glob(glob.escape(out) + '.reshard-old-*'))
        parent = os.path.dirname(os.path.abspath(out))
        if os.path.isdir(parent):
            leftovers += [n for n in os.listdir(parent) if '.reshard-' in n]
        self.assertEqual(leftovers, [], 'staging leftovers next to the output folder')

    def assertConverted(self, args, out, watch=()):
        """Runs a convert that must succeed; returns stdout."""
        before = {w: snapshot(w) for w in watch}
        p = run(*args)
        shown = f'\n$ reshard {" ".join(map(str, args))}\nexit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}'
        self.assertEqual(p.returncode, 0, 'convert failed' + shown)
        self.assertIn('wrote ', p.stdout, shown)
        self.assertTrue(os.path.isfile(os.path.join(out, 'mp_rank_00_model_states.pt')), shown)
        for w in watch:
            self.assertEqual(snapshot(w), before[w], f'{w} changed' + shown)
        self.assertNoLeftovers(out)
        return p.stdout


# ---------------------------------------------------------------------------------------------
# Unusable input folders and files
# ---------------------------------------------------------------------------------------------

class InputFolderTests(ReshardTestCase):

    def test_bogus_path(self):
        bogus = self.path('no', 'such', 'checkpoint')
        out = self.path('out', 'global_step10')
        self.assertRefused(['convert', bogus, out, '--tp', 1, '--pp', 1],
                           ['no such checkpoint folder', bogus], watch=[self.tmp], out=out)

    def test_bogus_path_lint(self):
        bogus = self.path('nothing-here')
        self.assertRefused(['lint', bogus], ['no such checkpoint folder', bogus], watch=[self.tmp])

    def test_file_instead_of_folder(self):
        f = self.path('model.pt')
        with open(f, 'wb') as fh:
            fh.write(b'not a folder\n')
        out = self.path('out')
        self.assertRefused(['convert', f, out, '--tp', 1, '--pp', 1],
                           [f, 'is a file'], watch=[f], out=out)

    def test_empty_folder(self):
        empty = self.path('empty')
        os.makedirs(empty)
        out = self.path('out')
        self.assertRefused(['convert', empty, out, '--tp', 1, '--pp', 1],
                           [empty, 'empty folder'], watch=[empty], out=out)

    def test_folder_without_mp_rank_files(self):
        tag = self.bloom()
        for name in os.listdir(tag):
            if name.startswith('mp_rank_'):
                os.remove(os.path.join(tag, name))
        out = self.path('out', 'global_step10')
        for given in (tag, os.path.dirname(tag)):  # the tag folder, and the root via `latest`
            with self.subTest(input=given):
                self.assertRefused(['convert', given, out, '--tp', 1, '--pp', 1],
                                   ['mp_rank_', 'not a DeepSpeed checkpoint'],
                                   watch=[self.path('src')], out=out)

    def test_folder_of_tags_without_latest_hints_at_them(self):
        tag = self.bloom()
        os.remove(os.path.join(os.path.dirname(tag), 'latest'))
        out = self.path('out')
        self.assertRefused(['convert', os.path.dirname(tag), out, '--tp', 1, '--pp', 1],
                           ["root without the 'latest' file", 'pass ' + tag], watch=[self.path('src')], out=out)

    def test_mp_rank_files_but_no_layer_files(self):
        tag = self.bloom()
        for name in os.listdir(tag):
            if name.startswith('layer_'):
                os.remove(os.path.join(tag, name))
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                           ['no layer_', 'layer_*-model_*-model_states.pt'],
                           watch=[self.path('src')], out=out)

    def test_missing_layer_tp_rank_file(self):
        tag = self.bloom()
        os.remove(layer_file(tag, 4, 1))
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                           [re.compile(r'layer[ _]0?4\b.*missing TP rank file\(s\) 1'), 'incomplete'],
                           watch=[self.path('src')], out=out)

    def test_missing_mp_rank_file(self):
        tag = self.bloom()
        os.remove(mp_file(tag, 1))
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                           [re.compile(r'mp_rank file\(s\) 1 of 4 are missing'), 'incomplete'],
                           watch=[self.path('src')], out=out)

    def test_missing_last_mp_rank_file(self):
        # The last file leaves no gap in the numbering; the count still cannot be right.
        tag = self.bloom()
        os.remove(mp_file(tag, 3))
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1], ['mp_rank'],
                           watch=[self.path('src')], out=out)

    def test_inconsistent_shapes_across_tp_ranks(self):
        tag = self.bloom()
        key = 'mlp.dense_h_to_4h.weight'

        def shrink(sd):
            sd[key] = sd[key][:-2].clone()  # [32, 16] -> [30, 16] on TP rank 1 only
        rewrite(layer_file(tag, 4, 1), shrink)
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                           ['inconsistent shapes', f'layer_04/{key}', '[32, 16]', '[30, 16]'],
                           watch=[self.path('src')], out=out)

    def test_mixed_iterations(self):
        tag = self.bloom()

        def later(sd):
            sd['iteration'] = 20
        rewrite(mp_file(tag, 2), later)
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                           ['mixed iterations', '10', '20'], watch=[self.path('src')], out=out)

    def test_truncated_layer_file(self):
        for keep in ('half', 'none'):
            with self.subTest(keep=keep):
                tag = self.bloom(name=f'src_{keep}')
                victim = layer_file(tag, 4, 1)
                with open(victim, 'rb') as f:
                    data = f.read()
                with open(victim, 'wb') as f:
                    f.write(data[:len(data) // 2] if keep == 'half' else b'')
                out = self.path(f'out_{keep}')
                self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                                   ['layer_04-model_01-model_states.pt', 'torch.save'],
                                   watch=[self.path(f'src_{keep}')], out=out)

    def test_random_bytes_named_like_a_layer_file(self):
        tag = self.bloom()
        with open(layer_file(tag, 4, 1), 'wb') as f:
            f.write(bytes(range(256)) * 12)  # deterministic, not a zip
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                           ['layer_04-model_01-model_states.pt', 'not a torch.save zip file'],
                           watch=[self.path('src')], out=out)

    def test_random_bytes_lint_and_inspect_refuse_too(self):
        tag = self.bloom()
        with open(layer_file(tag, 3, 0), 'wb') as f:
            f.write(b'\x80\x02garbage' * 50)
        for command in ('lint', 'inspect'):
            with self.subTest(command=command):
                self.assertRefused([command, tag], ['layer_03-model_00-model_states.pt'],
                                   watch=[self.path('src')])


# ---------------------------------------------------------------------------------------------
# Checkpoints reshard cannot convert as they are
# ---------------------------------------------------------------------------------------------

class ContentTests(ReshardTestCase):

    def add_unknown_key(self, tag):
        def add(sd):
            sd['self_attention.q_norm.weight'] = torch.ones(4, dtype=torch.bfloat16)
        for t in range(2):
            rewrite(layer_file(tag, 4, t), add)

    def test_unknown_key_auto_detected_rules(self):
        # Without --rules the only candidate rule set is bigscience-bloom; the message must still
        # say which key is unexplained and how to explain it.
        tag = self.bloom()
        self.add_unknown_key(tag)
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                           ['self_attention.q_norm.weight', 'layer_04', 'rule'],
                           watch=[self.path('src')], out=out)

    def test_unknown_key_named_rules(self):
        tag = self.bloom()
        self.add_unknown_key(tag)
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, '--rules', 'bigscience-bloom'],
                           ['unknown key', 'layer_04/self_attention.q_norm.weight',
                            'add one under layers.block', 'bigscience-bloom.yaml'],
                           watch=[self.path('src')], out=out)

    def drifted(self):
        """bs_bloom TP 2 with every replicated tensor drifted by ~0.01 and one by 0.25 more."""
        tag = self.bloom(tp_drift_eps=0.01)

        def bump(sd):
            sd['self_attention.dense.bias'] = (sd['self_attention.dense.bias'].float() + 0.25).to(torch.bfloat16)
        rewrite(layer_file(tag, 5, 1), bump)
        return tag

    def test_drift_refused_under_check(self):
        tag = self.drifted()
        out = self.path('out')
        for extra in ([], ['--replicated', 'check']):
            with self.subTest(args=extra):
                self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, *extra],
                                   ['differ across TP ranks',
                                    re.compile(r'largest: layer_05/self_attention\.dense\.bias: max \|diff\| 0\.2\d'),
                                    '--replicated average', '--replicated first'],
                                   watch=[self.path('src')], out=out)

    def test_drift_average_and_first_succeed(self):
        tag = self.drifted()
        r0 = torch.load(layer_file(tag, 5, 0))['self_attention.dense.bias']
        r1 = torch.load(layer_file(tag, 5, 1))['self_attention.dense.bias']
        expected = {'first': r0, 'average': ((r0.float() + r1.float()) / 2).to(torch.bfloat16)}
        for policy in ('average', 'first'):
            with self.subTest(policy=policy):
                out = self.path(f'out_{policy}', 'global_step10')
                stdout = self.assertConverted(['convert', tag, out, '--tp', 1, '--pp', 1,
                                               '--replicated', policy], out, watch=[self.path('src')])
                self.assertIn('layer_05/self_attention.dense.bias', stdout)  # the merge note
                got = torch.load(layer_file(out, 5, 0))['self_attention.dense.bias']
                self.assertTrue(torch.equal(got, expected[policy]),
                                f'{policy}: {got} != {expected[policy]}')

    def test_weights_only_leaves_optimizer_shards_out(self):
        tag = self.bloom(dp=2, optimizer='bf16_zero')
        out = self.path('out', 'global_step10')
        stdout = self.assertConverted(['convert', tag, out, '--tp', 1, '--pp', 1, '--weights-only'],
                                      out, watch=[self.path('src')])
        self.assertIn('weights only: the 8 optimizer shard files were not converted', stdout)
        self.assertFalse([n for n in os.listdir(out) if 'optim_states' in n])

    def test_fp16_optimizer_state_inside_mp_rank_is_converted_or_left_out(self):
        tag = make_fixture(self.path('src'), style='ms_gpt2', tp=2, pp=1, optimizer='nozero_fp16')
        out = self.path('out', 'global_step10')
        stdout = self.assertConverted(['convert', tag, out, '--tp', 1, '--pp', 1], out,
                                      watch=[self.path('src')])
        self.assertIn('FP16_Optimizer state inside the mp_rank files is reshaped', stdout)
        self.assertIsNotNone(torch.load(os.path.join(out, 'mp_rank_00_model_states.pt'))['optimizer'])
        weights_only = self.path('weights', 'global_step10')
        self.assertConverted(['convert', tag, weights_only, '--tp', 1, '--pp', 1, '--weights-only', '-q'],
                             weights_only, watch=[self.path('src')])
        self.assertIsNone(torch.load(os.path.join(weights_only, 'mp_rank_00_model_states.pt'))['optimizer'])


# ---------------------------------------------------------------------------------------------
# Output folder and target layout
# ---------------------------------------------------------------------------------------------

class TargetTests(ReshardTestCase):

    def test_non_empty_output_needs_overwrite(self):
        tag = self.bloom()
        out = self.path('out')
        os.makedirs(out)
        with open(os.path.join(out, 'keep.txt'), 'w') as f:
            f.write('precious')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                           [out, 'not empty', '--overwrite'], watch=[self.path('src')], out=out)
        # --overwrite replaces only what a reshard run wrote: the user's file is named and kept.
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, '--overwrite'],
                           [out, 'it holds keep.txt, which no reshard run wrote'], watch=[self.path('src')], out=out)
        os.remove(os.path.join(out, 'keep.txt'))
        self.assertConverted(['convert', tag, out, '--tp', 1, '--pp', 2, '-q'], out, watch=[self.path('src')])
        self.assertConverted(['convert', tag, out, '--tp', 1, '--pp', 1, '--overwrite', '-q'], out,
                             watch=[self.path('src')])
        self.assertFalse(os.path.exists(os.path.join(out, 'mp_rank_01_model_states.pt')),
                         'the earlier output must be replaced')

    def test_output_inside_the_input_tag_folder(self):
        tag = self.bloom()
        for out in (os.path.join(tag, 'converted'), os.path.join(tag, 'a', 'b', 'global_step10'), tag):
            with self.subTest(out=out):
                self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1],
                                   ['overlaps the input'], watch=[self.path('src')],
                                   out=out if out != tag else None)

    def test_output_inside_the_input_root(self):
        # IN given as the root folder holding `latest`: the root is the input. Writing a new tag
        # folder into it would also rewrite the root's `latest` (and so change what IN means).
        for i, sub in enumerate(('global_step20', os.path.join('converted', 'global_step10'))):
            root = os.path.dirname(self.bloom(name=f'src{i}'))
            out = os.path.join(root, sub)
            with self.subTest(out=sub):
                self.assertRefused(['convert', root, out, '--tp', 1, '--pp', 1],
                                   ['overlaps the input'], watch=[root], out=out)

    def test_input_inside_the_output(self):
        tag = self.bloom()
        out = self.path('src')  # the root that holds the input tag folder
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, '--overwrite'],
                           ['overlaps the input'], watch=[self.path('src')], out=out)

    def test_target_tp_the_heads_do_not_divide(self):
        tag = self.bloom()  # 4 attention heads
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 3, '--pp', 1],
                           ['3 TP ranks', 'args.num_attention_heads', 'do not divide by 3'],
                           watch=[self.path('src')], out=out)

    def test_version(self):
        # What every CLI says: the version, the commit built and the build type, exit 0.
        p = run('--version')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        lines = p.stdout.splitlines()
        self.assertEqual(len(lines), 3, p.stdout)
        self.assertRegex(lines[0], r'^reshard \d+\.\d+\.\d+$')
        self.assertRegex(lines[1], r'^commit ([0-9a-f]{12}|unknown)')
        self.assertRegex(lines[2], r'^build type \S+')
        self.assertEqual(p.stderr, '')

    def test_target_tp_the_kv_heads_do_not_divide(self):
        tag = make_fixture(self.path('src'), **dict(support.FAMILIES['ms_llama'], nkv=2, tp=1, pp=1))
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 3, '--pp', 1],
                           ['3 TP ranks', 'its 2 KV heads (args.num_key_value_heads) do not divide by 3'],
                           watch=[self.path('src')], out=out)

    def test_target_pp_larger_than_blocks(self):
        tag = self.bloom()  # 4 blocks
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 5],
                           ['target PP 5', '4 transformer blocks'], watch=[self.path('src')], out=out)

    def test_layers_per_stage_not_summing_to_blocks(self):
        tag = self.bloom()
        out = self.path('out')
        cases = [('2,1', ['--layers-per-stage sums to 3', '4 blocks']),
                 ('2,1,1', ['--layers-per-stage lists 3 stages', 'PP is 2']),
                 ('4,0', ['--layers-per-stage', 'at least one block'])]
        for value, needles in cases:
            with self.subTest(layers_per_stage=value):
                self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 2, '--layers-per-stage', value],
                                   needles, watch=[self.path('src')], out=out)

    def test_bad_target_arguments(self):
        tag = self.bloom()
        out = self.path('out')
        cases = [('--tp 0', ['--tp', 0, '--pp', 1], ['--tp']),
                 ('--tp not a number', ['--tp', 'two', '--pp', 1], ['--tp']),
                 ('bad --replicated', ['--tp', 1, '--pp', 1, '--replicated', 'mean'], ['--replicated']),
                 ('unknown --to', ['--to', 'hff'], ["unknown target format 'hff'; did you mean 'hf'? (the formats: "]),
                 ('--to in capitals', ['--to', 'HF'], ["unknown target format 'HF'; did you mean 'hf'?"]),
                 ('--to without its underscore', ['--to', 'torchdist'], ["did you mean 'torch_dist'?"])]
        for name, args, needles in cases:
            with self.subTest(case=name):
                self.assertRefused(['convert', tag, out, *args], needles, watch=[self.path('src')], out=out)
        # export and lint name the formats alike, in one line.
        for command in (['export', tag, out, '--to', 'HF'], ['lint', tag, '--to', 'HF']):
            with self.subTest(command=command[0]):
                self.assertRefused(command, ["unknown target format 'HF'; did you mean 'hf'? (the formats: deepspeed, "],
                                   watch=[self.path('src')], out=out)


# ---------------------------------------------------------------------------------------------
# Pickles naming classes reshard does not know
# ---------------------------------------------------------------------------------------------

class UnknownClassTests(ReshardTestCase):

    def test_code_execution_payload_is_refused_and_never_run(self):
        tag = self.bloom()
        pwned = self.path('pwned')
        payload = _RunsSystem(f'touch {pwned}')

        def add(sd):
            sd['extra'] = payload  # pickled as GLOBAL posix.system + REDUCE
        for t in range(2):
            rewrite(layer_file(tag, 4, t), add)
        out = self.path('out')
        for command, args in (('convert', [out, '--tp', 1, '--pp', 1]), ('lint', []), ('inspect', [])):
            with self.subTest(command=command):
                self.assertRefused([command, tag, *args],
                                   [f"class '{SYSTEM}'", 'layer_04-model_00-model_states.pt',
                                    f'--allow-class {SYSTEM}'],
                                   watch=[self.path('src')], out=out if command == 'convert' else None)
                self.assertFalse(os.path.exists(pwned), 'reshard executed code from a pickle')
        # Even when allowed, the call is carried as data, never made: the entry is not a tensor,
        # so it is an unknown key (lint: error finding, exit 1; convert: refused).
        p = run('lint', tag, '--allow-class', SYSTEM, '--rules', 'bigscience-bloom')
        self.assertFalse(os.path.exists(pwned), 'reshard executed code from a pickle')
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('unknown key layer_04/extra', p.stdout)
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, '--allow-class', SYSTEM,
                            '--rules', 'bigscience-bloom'],
                           ['layer_04/extra'], watch=[self.path('src')], out=out)
        self.assertFalse(os.path.exists(pwned), 'reshard executed code from a pickle')

    def test_unknown_class_in_metadata_is_refused_then_read_with_allow_class(self):
        tag = self.bloom()

        def add(sd):
            sd['args'].custom_gizmo = Gizmo(7, 'carried')
        for mp in range(4):
            rewrite(mp_file(tag, mp), add)
        out = self.path('out', 'global_step10')
        for command, args in (('convert', [out, '--tp', 1, '--pp', 1]), ('lint', []), ('inspect', [])):
            with self.subTest(command=command):
                self.assertRefused([command, tag, *args],
                                   [f"class '{GIZMO}'", 'mp_rank_00_model_states.pt', f'--allow-class {GIZMO}'],
                                   watch=[self.path('src')], out=out if command == 'convert' else None)
        # Allowed, it is read: inspect shows the checkpoint, lint checks it ...
        before = snapshot(self.path('src'))
        p = run('inspect', tag, '--allow-class', GIZMO)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('layer files', p.stdout)
        self.assertEqual(snapshot(self.path('src')), before)
        # ... but never written (torch.load of the output would call the class): convert refuses
        # by name, and lint, which refuses exactly where convert does, says the same line.
        line = self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, '--allow-class', GIZMO],
                                  ['mp_rank_00_model_states.pt: args.custom_gizmo', GIZMO,
                                   'which --allow-class let reshard read'], watch=[self.path('src')], out=out)
        p = run('lint', tag, '--allow-class', GIZMO)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('error: ' + line[len(ERROR_PREFIX):].lstrip(), p.stdout.splitlines())

    def test_allowed_class_as_a_layer_file_entry(self):
        # Allowed, the object loads fine, but a layer file entry that is not a tensor is an
        # unknown key: lint reports it (exit 1), inspect shows it as a problem, convert refuses.
        tag = self.bloom()

        def add(sd):
            sd['extra'] = Gizmo()
        for t in range(2):
            rewrite(layer_file(tag, 4, t), add)
        before = snapshot(self.path('src'))
        p = run('lint', tag, '--allow-class', GIZMO, '--rules', 'bigscience-bloom')
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('error: unknown key layer_04/extra', p.stdout)
        self.assertNotIn(GIZMO, p.stderr)
        p = run('inspect', tag, '--allow-class', GIZMO, '--rules', 'bigscience-bloom')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('problem: unknown key layer_04/extra', p.stdout)
        self.assertEqual(snapshot(self.path('src')), before)
        out = self.path('out')
        self.assertRefused(['convert', tag, out, '--tp', 1, '--pp', 1, '--allow-class', GIZMO,
                            '--rules', 'bigscience-bloom'],
                           ['unknown key layer_04/extra'], watch=[self.path('src')], out=out)


# ---------------------------------------------------------------------------------------------
# Where convert writes (and what --dry-run does not write)
# ---------------------------------------------------------------------------------------------

LAYER_OR_MP = re.compile(r'^(layer_\d+-model_\d+-model_states\.pt|mp_rank_\d+_model_states\.pt|reshard-manifest\.json)$')


class OutputPlacementTests(ReshardTestCase):

    def test_dry_run_writes_nothing_and_prints_the_plan(self):
        tag = self.bloom()
        parent = self.path('never')
        out = os.path.join(parent, 'global_step10')
        before = snapshot(self.path('src'))
        p = run('convert', tag, out, '--tp', 1, '--pp', 2, '--dry-run')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('dry run: nothing written', p.stdout)
        self.assertIn('layer_03-model_00-model_states.pt', p.stdout)
        self.assertIn('mp_rank_01_model_states.pt', p.stdout)
        self.assertNotIn('wrote ', p.stdout)
        self.assertFalse(os.path.lexists(parent), 'dry run created the output parent')
        self.assertEqual(snapshot(self.path('src')), before)
        self.assertEqual(sorted(os.listdir(self.tmp)), ['src'])

    def test_output_is_exactly_out_and_latest_names_it_ms(self):
        tag = make_fixture(self.path('src'), style='ms_gpt2', tp=2, pp=2, iteration=7)
        parent = self.path('converted')
        out = os.path.join(parent, 'tp1pp1')  # not the tag's name: latest must say basename(OUT)
        self.assertConverted(['convert', tag, out, '--tp', 1, '--pp', 1, '-q'], out, watch=[self.path('src')])
        names = sorted(os.listdir(out))
        self.assertTrue(names and all(LAYER_OR_MP.match(n) for n in names), names)
        self.assertEqual(sorted(os.listdir(parent)), ['latest', 'latest_checkpointed_iteration.txt', 'tp1pp1'])
        with open(os.path.join(parent, 'latest')) as f:
            self.assertEqual(f.read().strip(), 'tp1pp1')
        with open(os.path.join(parent, 'latest_checkpointed_iteration.txt')) as f:
            self.assertEqual(f.read().strip(), '7')

    def test_output_is_exactly_out_bs_has_no_iteration_file(self):
        tag = self.bloom()
        out = self.path('converted', 'global_step10')
        self.assertConverted(['convert', tag, out, '--tp', 1, '--pp', 1, '-q'], out, watch=[self.path('src')])
        self.assertFalse(os.path.exists(os.path.join(out, 'global_step10')), 'OUT/global_stepN was nested')
        self.assertTrue(all(LAYER_OR_MP.match(n) for n in os.listdir(out)), os.listdir(out))
        self.assertEqual(sorted(os.listdir(self.path('converted'))), ['global_step10', 'latest'])
        with open(self.path('converted', 'latest')) as f:
            self.assertEqual(f.read().strip(), 'global_step10')

    def test_no_update_latest(self):
        tag = make_fixture(self.path('src'), style='ms_gpt2', tp=2, pp=2, iteration=7)
        out = self.path('converted', 'global_step7')
        self.assertConverted(['convert', tag, out, '--tp', 1, '--pp', 1, '-q', '--no-update-latest'], out,
                             watch=[self.path('src')])
        self.assertEqual(os.listdir(self.path('converted')), ['global_step7'])

    def test_root_in_gives_root_out(self):
        # A tag in: the tag folder exactly at OUT, `latest` beside it. A root in: a root out, OUT/<tag>
        # and OUT/latest, with the root's iteration file and zero_to_fp32.py. The same files either way.
        tag = make_fixture(self.path('src'), style='ms_gpt2', tp=2, pp=2, iteration=7)
        root = os.path.dirname(tag)
        with open(os.path.join(root, 'zero_to_fp32.py'), 'w') as f:
            f.write('# the script DeepSpeed copies into a root\n')
        outs = {}
        for name, given, out in (('from_tag', tag, self.path('from_tag', 'global_step7')),
                                 ('from_root', root, self.path('from_root'))):
            p = run('convert', given, out, '--tp', 1, '--pp', 2, '-q')
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            outs[name] = snapshot(self.path(name))
        self.assertEqual(outs['from_root'], outs['from_tag'])
        self.assertEqual(sorted(os.listdir(self.path('from_root'))),
                         ['global_step7', 'latest', 'latest_checkpointed_iteration.txt', 'zero_to_fp32.py'])
        with open(self.path('from_root', 'latest')) as f:
            self.assertEqual(f.read().strip(), 'global_step7')
        # The tag folder of a root out is checked like OUT: a second run is refused, OUT's other tags kept.
        self.assertRefused(['convert', root, self.path('from_root'), '--tp', 1, '--pp', 1],
                           ['global_step7'], watch=[root], out=self.path('from_root', 'global_step7'))


if __name__ == '__main__':
    support.main()
