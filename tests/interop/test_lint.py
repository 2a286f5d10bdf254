"""`reshard lint` findings, plus the read-only companions `rules`, `inspect` and `verify`.

lint exits 0 when convert would accept the checkpoint (warnings allowed), 1 when it found
errors, 2 when the checkpoint or the rule set is unusable.  Findings are printed on stdout as
``error: ...`` / ``warning: ...`` lines followed by a ``lint: ...`` verdict naming the rule set.

Covered: a clean fixture of every style and the rule set auto-detection picks for it; many mp
ranks; many DP ranks with optimizer shards (a warning that names --weights-only); unknown keys;
missing required keys; shapes that differ across TP ranks; mixed iterations; replicated-tensor
drift (errors under --replicated check, warnings when merged; largest first); a wrong --rules family; `reshard rules` (list, validate, broken
file with file:line); `reshard inspect`; `reshard verify` (same model, one tensor changed).

Run by ctest as ``/usr/bin/python3 tests/interop/test_lint.py --reshard BIN`` with
PYTHONPATH=tests.
"""

import os
import re
import shutil

import torch

from fixtures import megatron_fixture as mf
from fixtures.megatron_fixture import FixtureConfig

import interop_support as support
import test_import_hf as hf_import
from interop_support import FixtureTestCase, layer_file, make_fixture, rewrite

RULES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'rules')
BUILTIN_RULE_SETS = ('bigscience-bloom', 'bigscience-glu', 'megatron-core-gpt', 'megatron-core-moe', 'megatron-gpt2', 'megatron-gpt2-moe',
                     'megatron-llama', 'megatron-llama-tied', 'mixtral', 'qwen2', 'qwen2-moe', 'qwen2-tied',
                     'qwen3-moe')


run = support.reshard


def lines_with(prefix, text):
    return [line for line in text.splitlines() if line.startswith(prefix)]


class LintTestCase(FixtureTestCase):

    def lint(self, *args, code):
        """Runs `reshard lint ARGS`, asserts its exit status, returns the process."""
        p = run('lint', *args)
        self.assertEqual(p.returncode, code,
                         f'\n$ reshard lint {" ".join(map(str, args))}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}')
        return p

    def assertVerdict(self, p, ok, rule_set):
        verdict = ("lint: ok, the checkpoint can be converted with rule set '%s'" if ok else
                   "lint: the checkpoint cannot be converted with rule set '%s'") % rule_set
        self.assertEqual(p.stdout.splitlines()[-1], verdict, p.stdout)
        self.assertEqual(p.stderr, '')


# ---------------------------------------------------------------------------------------------
# Clean checkpoints and auto-detection
# ---------------------------------------------------------------------------------------------

class CleanCheckpointTests(LintTestCase):

    STYLES = [
        ('bs_bloom', {}, 'bigscience-bloom'),
        ('bs_gpt', {'rotary': True}, 'bigscience-bloom'),
        ('bs_gpt', {'glu': True}, 'bigscience-glu'),
        ('ms_gpt2', {}, 'megatron-gpt2'),
        ('ms_llama', {}, 'megatron-llama'),
    ]

    def test_every_style_lints_clean_with_the_expected_rule_set(self):
        for i, (style, opts, rule_set) in enumerate(self.STYLES):
            with self.subTest(style=style, **opts):
                # bf16 ZeRO with DP 1 records param_shapes, so lint also checks the stage layout.
                root = self.path(f'{style}_{i}')
                make_fixture(root, style=style, tp=2, pp=2, dp=1, optimizer='bf16_zero', **opts)
                p = self.lint(root, code=0)
                self.assertVerdict(p, True, rule_set)
                self.assertTrue(p.stdout.startswith(f'rule set {rule_set} '), p.stdout)
                self.assertIn('TP 2, PP 2, DP 1; iteration 10; 4 blocks', p.stdout)
                self.assertEqual(lines_with('error:', p.stdout), [])
                # No drift, no stage mismatch; the optimizer shards' layout is checked.
                self.assertEqual(lines_with('warning:', p.stdout), [], p.stdout)
                self.assertIn('their layout agrees with param_shapes', p.stdout)
                # The same set, named explicitly, gives the same verdict.
                p = self.lint(root, '--rules', rule_set, code=0)
                self.assertVerdict(p, True, rule_set)

    def test_many_mp_ranks(self):
        # 128 mp_rank files (TP 2 x PP 64): mp_rank_100+ must be ordered by number, not by name.
        root = self.path('big')
        make_fixture(root, style='ms_gpt2', tp=2, pp=64, L=64)
        p = self.lint(root, code=0)
        self.assertVerdict(p, True, 'megatron-gpt2')
        self.assertIn('TP 2, PP 64, DP 1', p.stdout)
        self.assertIn('64 blocks; 132 layer files, 128 mp_rank files', p.stdout)
        self.assertEqual(lines_with('error:', p.stdout) + lines_with('warning:', p.stdout), [])

    def test_many_dp_ranks_with_optimizer_shards(self):
        root = self.path('dp12')
        make_fixture(root, style='bs_bloom', tp=1, pp=2, dp=12, optimizer='bf16_zero')
        p = self.lint(root, code=0)
        self.assertVerdict(p, True, 'bigscience-bloom')
        self.assertIn('TP 1, PP 2, DP 12', p.stdout)
        self.assertIn('24 optimizer shards', p.stdout)
        self.assertEqual(lines_with('warning:', p.stdout), [], p.stdout)
        self.assertIn('info: optimizer: 24 shards (BF16 optimizer, 3 groups, states fp32, exp_avg, '
                      'exp_avg_sq); their layout agrees with param_shapes', p.stdout)

    def test_optimizer_shard_that_disagrees_with_param_shapes(self):
        root = self.path('bad')
        tag = make_fixture(root, style='bs_bloom', tp=1, pp=1, dp=2, optimizer='bf16_zero')
        shard = os.path.join(tag, 'bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt')

        def shorten(sd):
            groups = sd['optimizer_state_dict']['single_partition_of_fp32_groups']
            groups[0] = groups[0][:-2].clone()
        rewrite(shard, shorten)
        p = self.lint(root, code=1)
        self.assertRegex(p.stdout, r'error: optimizer: bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: '
                                   r'the fp32 partition of group 0 is not the \d+ elements')


# ---------------------------------------------------------------------------------------------
# Findings
# ---------------------------------------------------------------------------------------------

class FindingTests(LintTestCase):

    def add_unknown_key(self, tag):
        def add(sd):
            sd['self_attention.q_norm.weight'] = torch.ones(4, dtype=torch.bfloat16)
        for t in range(2):
            rewrite(layer_file(tag, 4, t), add)

    def test_unknown_key_named_rules(self):
        tag = self.bloom()
        self.add_unknown_key(tag)
        p = self.lint(tag, '--rules', 'bigscience-bloom', code=1)
        self.assertVerdict(p, False, 'bigscience-bloom')
        errors = lines_with('error:', p.stdout)
        self.assertEqual(len(errors), 1, p.stdout)
        self.assertIn('unknown key layer_04/self_attention.q_norm.weight', errors[0])
        self.assertIn('add one under layers.block', errors[0])

    def test_an_unknown_key_in_every_block_is_one_finding_with_its_escaped_pattern(self):
        # bloom TP 2 has blocks in layers 3-6; a key with an index, in every block file, is one
        # finding: its first file, how many more, and a rule to paste that explains every index.
        tag = self.bloom()
        for layer in range(3, 7):
            def add(sd, layer=layer):
                sd[f'mlp.experts.{layer}.w1.weight'] = torch.ones(4, dtype=torch.bfloat16)
            for t in range(2):
                rewrite(layer_file(tag, layer, t), add)
        p = self.lint(tag, '--rules', 'bigscience-bloom', code=1)
        errors = lines_with('error:', p.stdout)
        self.assertEqual(len(errors), 1, p.stdout)
        self.assertIn("unknown key layer_03/mlp.experts.3.w1.weight (a block file; also in 3 more block files): "
                      "no rule of 'bigscience-bloom' matches it", errors[0])
        # A built-in rule file is copied, not edited: an upgrade replaces it.
        self.assertRegex(errors[0], r'add one under layers\.block of a copy of \S+bigscience-bloom\.yaml \(give the '
                                    r'copy a name: of its own and pass it with --rules FILE\)')
        self.assertIn(r"e.g. `- key: 'mlp\.experts\.\d+\.w1\.weight'` with split or replicated", errors[0])

    def test_a_copied_rule_file_that_keeps_the_builtin_name_is_noted(self):
        tag = self.bloom()
        copy = self.path('my-bloom.yaml')
        shutil.copy(os.path.join(RULES_DIR, 'bigscience-bloom.yaml'), copy)
        for command in ('lint', 'inspect'):
            with self.subTest(command=command):
                p = support.reshard(command, tag, '--rules', copy)
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertIn(f"rule file {copy} keeps the name 'bigscience-bloom' of the built-in rule set ",
                              p.stdout + p.stderr)
                self.assertIn('give it a name: of its own', p.stdout + p.stderr)
        with open(copy) as f:
            text = f.read()
        with open(copy, 'w') as f:
            f.write(re.sub(r'^name: .*$', 'name: my-bloom', text, count=1, flags=re.M))
        renamed = support.reshard('lint', tag, '--rules', copy)
        self.assertEqual(renamed.returncode, 0, renamed.stderr)
        self.assertNotIn('keeps the name', renamed.stdout + renamed.stderr)
        builtin = support.reshard('lint', tag, '--rules', 'bigscience-bloom')
        self.assertNotIn('keeps the name', builtin.stdout + builtin.stderr)

    def test_unknown_key_auto_detected(self):
        # bigscience-bloom is the only rule set whose detection and layer numbering fit; lint must
        # report the key it does not explain as a finding rather than give up on detection.
        tag = self.bloom()
        self.add_unknown_key(tag)
        p = self.lint(tag, code=1)
        self.assertIn('unknown key layer_04/self_attention.q_norm.weight', p.stdout + p.stderr)

    def delete_key(self, tag, layer_id, key, tp):
        def drop(sd):
            del sd[key]
        for t in range(tp):
            rewrite(layer_file(tag, layer_id, t), drop)

    def test_missing_key_named_rules(self):
        tag = make_fixture(self.path('src'), style='ms_llama', tp=2, pp=2)  # blocks are layers 2-5
        self.delete_key(tag, 3, 'post_attention_layernorm.weight', 2)
        p = self.lint(tag, '--rules', 'megatron-llama', code=1)
        self.assertVerdict(p, False, 'megatron-llama')
        errors = lines_with('error:', p.stdout)
        self.assertEqual(len(errors), 1, p.stdout)
        self.assertRegex(errors[0], r'missing key: layer_0?3\b.*post_attention_layernorm\\?\.weight')

    def test_missing_key_auto_detected(self):
        tag = make_fixture(self.path('src'), style='ms_llama', tp=2, pp=2)
        self.delete_key(tag, 3, 'post_attention_layernorm.weight', 2)
        p = self.lint(tag, code=1)
        self.assertRegex(p.stdout + p.stderr, r'missing key: layer_0?3\b.*post_attention_layernorm\\?\.weight')

    def test_missing_key_covered_by_an_alternation_rule(self):
        # bigscience-bloom has one rule for 'post_attention_layernorm\.(weight|bias)'; a block
        # that lost its bias is as damaged as one that lost a single-key rule's tensor.
        tag = self.bloom()
        self.delete_key(tag, 5, 'post_attention_layernorm.bias', 2)
        p = self.lint(tag, '--rules', 'bigscience-bloom', code=1)
        self.assertVerdict(p, False, 'bigscience-bloom')
        self.assertRegex(p.stdout, r'error: missing key: layer_0?5\b.*post_attention_layernorm')

    def test_optional_key_missing_from_one_block(self):
        # inv_freq is optional (only rotary models have it), but a rotary model
        # whose block lost it is damaged: every block file holds the same keys.
        tag = make_fixture(self.path('src'), style='bs_gpt', rotary=True, tp=2, pp=1)
        self.delete_key(tag, 5, 'self_attention.rotary_emb.inv_freq', 2)
        p = self.lint(tag, code=1)
        self.assertRegex(p.stdout, r'error: layer_05 \(a block file\) lacks '
                                   r'self_attention\.rotary_emb\.inv_freq, which layer_03 has')

    def test_inconsistent_shapes(self):
        tag = self.bloom()

        def shrink(sd):
            sd['mlp.dense_h_to_4h.weight'] = sd['mlp.dense_h_to_4h.weight'][:-2].clone()
        rewrite(layer_file(tag, 4, 1), shrink)
        p = self.lint(tag, code=1)
        self.assertVerdict(p, False, 'bigscience-bloom')
        errors = lines_with('error:', p.stdout)
        self.assertEqual(len(errors), 1, p.stdout)
        self.assertIn('inconsistent shapes across TP ranks: layer_04/mlp.dense_h_to_4h.weight', errors[0])
        self.assertIn('[32, 16] on rank 0', errors[0])
        self.assertIn('[30, 16] on rank 1', errors[0])

    def test_mixed_iterations(self):
        tag = self.bloom()

        def later(sd):
            sd['iteration'] = 20
        rewrite(os.path.join(tag, 'mp_rank_03_model_states.pt'), later)
        p = self.lint(tag, code=1)
        self.assertRegex(p.stdout, r'error: mixed iterations: .*10.*20')

    def test_replicated_drift_errs_or_warns_by_policy_largest_first(self):
        # Every replicated tensor drifts by ~0.01 between the two TP ranks; one by 0.25 more.
        tag = self.bloom(tp_drift_eps=0.01)

        def bump(sd):
            sd['self_attention.dense.bias'] = (sd['self_attention.dense.bias'].float() + 0.25).to(torch.bfloat16)
        rewrite(layer_file(tag, 5, 1), bump)
        replicated = mf.replicated_names(FixtureConfig(style='bs_bloom', tp=2, pp=2))
        # Under the default --replicated check, convert refuses the drift: lint errs alike.
        p = self.lint(tag, code=1)
        self.assertVerdict(p, False, 'bigscience-bloom')
        errors = lines_with('error:', p.stdout)
        self.assertRegex(errors[0], rf'error: {len(replicated)} replicated tensor\(s\) differ across TP ranks')
        self.assertEqual(len(lines_with('error: drift: ', p.stdout)), 11, p.stdout)
        # Told to merge (as convert would be), the drifts are warnings.
        p = self.lint(tag, '--replicated', 'average', code=0)
        self.assertVerdict(p, True, 'bigscience-bloom')
        self.assertEqual(lines_with('error:', p.stdout), [])
        warnings = lines_with('warning:', p.stdout)
        self.assertRegex(warnings[0], rf'warning: {len(replicated)} replicated tensor\(s\) differ across TP ranks')
        self.assertIn('--replicated average', warnings[0])
        self.assertIn('--replicated first', warnings[0])
        drifts = lines_with('warning: drift: ', p.stdout)
        self.assertEqual(len(drifts), 11, p.stdout)  # the default 10, then '... and N more'
        self.assertRegex(drifts[0], r'^warning: drift: layer_05/self_attention\.dense\.bias: max \|diff\| 0\.2\d')
        self.assertEqual(drifts[-1], f'warning: drift: ... and {len(replicated) - 10} more')
        sizes = [float(re.search(r'max \|diff\| (\S+)', d).group(1)) for d in drifts[:-1]]
        self.assertEqual(sizes, sorted(sizes, reverse=True), 'drifts must be listed largest first')
        p = self.lint(tag, '--replicated', 'first', '--max-drift-lines', 3, code=0)
        drifts = lines_with('warning: drift: ', p.stdout)
        self.assertEqual(len(drifts), 4, p.stdout)
        self.assertIn('layer_05/self_attention.dense.bias', drifts[0])

    def test_wrong_rule_family(self):
        tag = self.bloom()
        p = run('lint', tag, '--rules', 'megatron-llama')
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertNotIn('lint: ok', p.stdout)
        self.assertRegex(p.stderr, r"^reshard: error: .*do not match rule set 'megatron-llama'")
        self.assertIn('layer ids', p.stderr)
        # A closer family fails on the keys it cannot explain.
        p = self.lint(tag, '--rules', 'megatron-gpt2', code=1)
        self.assertVerdict(p, False, 'megatron-gpt2')
        self.assertIn('error: unknown key layer_01/word_embeddings.norm.weight', p.stdout)
        # A name that is no rule set.
        p = run('lint', tag, '--rules', 'no-such-set')
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("unknown rule set 'no-such-set'", p.stderr)


# ---------------------------------------------------------------------------------------------
# lint refuses exactly where convert refuses
# ---------------------------------------------------------------------------------------------

class LintConvertAgreementTests(LintTestCase):
    """Without a target lint checks the conversion to the source's own layout, as convert plans it:
    where convert refuses, lint says convert's line as its error, and where the fix is
    --weights-only the line says so."""

    def assertSameRefusal(self, tag, *options, own=('--tp', 2, '--pp', 2)):
        """convert to the source's layout refuses; lint (no target) errs with the same line. Returns it."""
        out = self.path(f'out{len(os.listdir(self.tmp))}', 'global_step10')
        convert = run('convert', tag, out, *own, *options)
        self.assertEqual(convert.returncode, 2, convert.stdout + convert.stderr)
        self.assertFalse(os.path.exists(out))
        line = convert.stderr.strip()
        self.assertTrue(line.startswith('reshard: error: '), line)
        line = line[len('reshard: error: '):]
        p = self.lint(tag, *options, code=1)
        self.assertEqual(lines_with('error:', p.stdout), ['error: ' + line], p.stdout)
        return line

    def test_a_block_parameter_the_optimizer_shards_lack(self):
        # A q norm in every block's layer files, which a rule set explains, but no optimizer shard holds.
        tag = make_fixture(self.path('src'), style='bs_bloom', tp=2, pp=2, dp=1, optimizer='bf16_zero')
        for layer in range(3, 7):
            for t in range(2):
                rewrite(layer_file(tag, layer, t),
                        lambda sd: sd.__setitem__('self_attention.q_norm.weight', torch.ones(4, dtype=torch.bfloat16)))
        with open(os.path.join(RULES_DIR, 'bigscience-bloom.yaml')) as f:
            text = f.read()
        block = "  block:\n"
        self.assertIn(block, text)
        rules = self.path('bloom-qnorm.yaml')
        with open(rules, 'w') as f:
            f.write(text.replace('name: bigscience-bloom', 'name: bloom-qnorm').replace(
                block, block + "    - key: 'self_attention\\.q_norm\\.weight'\n"
                               "      name: 'layers.{block}.self_attention.q_norm.weight'\n"
                               "      replicated: true\n", 1))
        line = self.assertSameRefusal(tag, '--rules', rules)
        self.assertIn('has no optimizer state in the source shards', line)
        self.assertIn('pass --weights-only', line)
        # And what the line says is the fix: both accept it.
        p = self.lint(tag, '--rules', rules, '--weights-only', code=0)
        self.assertVerdict(p, True, 'bloom-qnorm')
        out = self.path('weights', 'global_step10')
        p = run('convert', tag, out, '--tp', 2, '--pp', 2, '--rules', rules, '--weights-only', '-q')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_a_vocabulary_divisor_convert_refuses(self):
        # An HF folder records no divisor: convert to its layout (TP 1, PP 1) pads the vocabulary by --set's.
        canon = hf_import.mf.canonical_tensors(hf_import.mf.FixtureConfig(**support.FAMILIES['ms_gpt2']))
        folder = self.path('hf')
        hf_import.write_folder(folder, {k: v.to(torch.bfloat16) for k, v in hf_import.EXPECTED['ms_gpt2'](canon).items()},
                               dict(hf_import.CONFIGS['ms_gpt2']))
        for divisor in (0, -128):
            with self.subTest(divisor=divisor):
                line = self.assertSameRefusal(folder, '--set', f'make_vocab_size_divisible_by={divisor}',
                                              own=('--tp', 1, '--pp', 1))
                self.assertIn(f'make_vocab_size_divisible_by, which is {divisor}', line)


# ---------------------------------------------------------------------------------------------
# rules, inspect, verify
# ---------------------------------------------------------------------------------------------

class CompanionCommandTests(LintTestCase):

    def test_rules_lists_the_builtin_sets(self):
        p = run('rules')
        self.assertEqual(p.returncode, 0, p.stderr)
        names = [line.split()[0] for line in p.stdout.splitlines() if line and not line[0].isspace()]
        self.assertEqual(sorted(names), sorted(BUILTIN_RULE_SETS), p.stdout)
        for name in BUILTIN_RULE_SETS:
            self.assertIn(f'{name}.yaml', p.stdout)

    def test_rules_validates_a_file(self):
        p = run('rules', os.path.join(RULES_DIR, 'megatron-llama.yaml'))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("ok (rule set 'megatron-llama')", p.stdout)

    def test_rules_broken_file_reports_file_and_line(self):
        with open(os.path.join(RULES_DIR, 'megatron-llama.yaml')) as f:
            text = f.read()
        lines = text.splitlines()
        target = next(i for i, line in enumerate(lines) if line.strip() == 'split: row')
        lines[target] = lines[target].replace('split:', 'spilt:')
        broken = self.path('broken.yaml')
        with open(broken, 'w') as f:
            f.write('\n'.join(lines) + '\n')
        p = run('rules', broken)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertEqual(p.stdout, '')
        self.assertTrue(p.stderr.startswith('reshard: error: '), p.stderr)
        self.assertIn(f"{broken}:{target + 1}: unknown field 'spilt'", p.stderr)
        self.assertIn("did you mean 'split'", p.stderr)

        bad_yaml = self.path('bad_yaml.yaml')
        with open(bad_yaml, 'w') as f:
            f.write('name: x\n  description: [unclosed\n')
        p = run('rules', bad_yaml)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertRegex(p.stderr, rf'^reshard: error: {re.escape(bad_yaml)}:\d+: ')

    def test_broken_rule_file_as_rules_option(self):
        tag = self.bloom()
        broken = self.path('broken.yaml')
        with open(os.path.join(RULES_DIR, 'bigscience-bloom.yaml')) as f:
            text = f.read()
        with open(broken, 'w') as f:
            f.write(text.replace("replicated: true", "replicated: maybe", 1))
        p = run('lint', tag, '--rules', broken)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertRegex(p.stderr, rf'^reshard: error: {re.escape(broken)}:\d+: ')

    def test_inspect_prints_layout_and_tensors(self):
        tag = self.bloom()
        p = run('inspect', os.path.dirname(tag))  # the root, following `latest`
        self.assertEqual(p.returncode, 0, p.stderr)
        out = p.stdout
        self.assertIn(f'checkpoint: {tag}', out)
        self.assertIn('rule set bigscience-bloom', out)
        self.assertIn('TP 2, PP 2, DP 1; iteration 10; 4 blocks; 12 layer files, 4 mp_rank files', out)
        self.assertIn('vocabulary 112 padded rows (true size 100)', out)
        self.assertIn('metadata (mp_rank_00):', out)
        self.assertRegex(out, r'args \(\d+ fields\):.* num_layers=4')
        self.assertIn('tensor_model_parallel_size=2', out)
        self.assertIn('layer files (full logical shapes):', out)
        for role_line in ('layer_01 embedding', 'layer_03 block', 'layer_06 block', 'layer_08 final_norm'):
            self.assertIn(role_line, out)
        # Full logical shapes (h=16, 4 heads, ffn=64, Vp=112), and each tensor's rule.
        self.assertRegex(out, r'word_embeddings\.weight +bfloat16\[112, 16\] +vocab')
        self.assertRegex(out, r'self_attention\.query_key_value\.weight +bfloat16\[48, 16\] +split dim 0')
        self.assertRegex(out, r'mlp\.dense_4h_to_h\.weight +bfloat16\[16, 64\] +split dim 1')
        self.assertRegex(out, r'post_attention_layernorm\.weight +bfloat16\[16\] +replicated')
        self.assertNotIn('problem:', out)

    def test_verify_same_model_then_one_tensor_changed(self):
        tag = self.bloom()
        out = self.path('out', 'global_step10')
        p = run('convert', tag, out, '--tp', 1, '--pp', 1, '-q')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', tag, out)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertRegex(p.stdout.splitlines()[-1], r'^verify: \d+ tensors, \d+ elements compared; same model$')
        self.assertEqual(lines_with('differs:', p.stdout), [])

        changed = self.path('changed', 'global_step10')
        shutil.copytree(out, changed)

        def poke(sd):
            sd['mlp.dense_4h_to_h.weight'][3, 5] += 1.0
        rewrite(layer_file(changed, 4, 0), poke)
        p = run('verify', tag, changed)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertTrue(p.stdout.rstrip().endswith('DIFFERENT'), p.stdout)
        differs = lines_with('differs:', p.stdout)
        self.assertEqual(len(differs), 1, p.stdout)
        self.assertIn('layer_04/mlp.dense_4h_to_h.weight: 1 of 1024 elements differ', differs[0])


if __name__ == '__main__':
    support.main()
