"""Checkpoints that record less than the rules read, and lint agreeing with convert.

A pipeline checkpoint saved by DeepSpeed without Megatron's client state has no ``args`` and no
``universal_checkpoint_info``: the head count, the true vocabulary size and the vocabulary
divisor the rules read are missing. They can be given three ways -- the checkpoint's metadata,
a fallback in the rule file, ``--set`` on the command line -- and every message about a missing
value names the other two. Covered here:

* auto-detection explains each rule set's first failed condition and how to force one;
* ``--set`` fills in what is missing, for lint and convert alike; the converted checkpoint
  round-trips bit-exactly (weights and optimizer state) at TP 2 -> 1 and 2 -> 3 with PP and DP
  changes; a rule file with the values written in as fallbacks needs no ``--set``;
* a ``--set`` that contradicts the checkpoint or that no rule reads is refused;
* ``zero_to_fp32.py`` in the source root is copied beside the output, an existing one left;
* lint ok => convert does not refuse, over a corpus of clean and broken checkpoints, each with
  the options lint was given.

Run: /usr/bin/python3 tests/interop/test_unrecorded_values.py --reshard build/reshard
"""
import glob
import os
import re

from fixtures import megatron_fixture as mf

import interop_support as support
from interop_support import FixtureTestCase, make_fixture, rewrite

run = support.reshard
RULES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'rules')
MODEL = dict(support.FAMILIES['ms_gpt2'], optimizer='bf16_zero', tp=2, pp=2, dp=1)
# What the stripped checkpoint no longer records, as --set arguments.
VALUES = ['--set', f'num_attention_heads={MODEL["n"]}', '--set', f'make_vocab_size_divisible_by={MODEL["mvsdb"]}',
          '--set', f'universal_checkpoint_info.original_vocab_size={MODEL["V"]}']


def strip_megatron_state(tag):
    """Removes Megatron's client state from every mp_rank file, as a DeepSpeed-only save has it."""
    def strip(sd):
        sd.pop('args', None)
        sd.pop('universal_checkpoint_info', None)
    for path in glob.glob(os.path.join(tag, 'mp_rank_*_model_states.pt')):
        rewrite(path, strip)


class UnrecordedValuesTest(FixtureTestCase):

    def deepspeed_only(self, name='src'):
        tag = make_fixture(self.path(name), **MODEL)
        strip_megatron_state(tag)
        return tag

    def assertOk(self, p):
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_detection_explains_and_says_how_to_force(self):
        p = run('lint', self.deepspeed_only())
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("megatron-gpt2: the metadata has no 'universal_checkpoint_info'", p.stderr)
        self.assertIn('force one with --rules NAME', p.stderr)
        self.assertIn('--set', p.stderr)

    def test_missing_values_name_the_rule_file_and_set(self):
        tag = self.deepspeed_only()
        p = run('lint', tag, '--rules', 'megatron-gpt2')
        self.assertEqual(p.returncode, 1, p.stdout)
        errors = [l for l in p.stdout.splitlines() if l.startswith('error:')]
        self.assertEqual(len(errors), 1, p.stdout)  # once, not once per tensor
        # The fused QKV is cut by KV groups, else by heads: both are named.
        self.assertIn('does not record 2 values every conversion needs: [args.num_key_value_heads, '
                      'args.num_attention_heads] (the block count of layer_02/self_attention.query_key_value.weight) '
                      'and args.num_attention_heads', errors[0])
        self.assertIn('--set args.num_key_value_heads=N --set args.num_attention_heads=N (or as fallbacks in the rule '
                      'file', errors[0])

    def test_one_refusal_names_every_missing_value(self):
        # A TP change of a DeepSpeed-only save lacks four values: one refusal names them all,
        # with a line to paste, where it once took three tries.
        tag = self.deepspeed_only()
        out = self.path('out', 'x')
        p = run('convert', tag, out, '--tp', 1, '--pp', 1, '--rules', 'megatron-gpt2')
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn('the checkpoint does not record 4 values this conversion needs: [args.num_key_value_heads, '
                      'args.num_attention_heads]', p.stderr)
        self.assertIn('--set args.num_key_value_heads=N --set args.num_attention_heads=N '
                      '--set args.make_vocab_size_divisible_by=N --vocab-size N', p.stderr)
        self.assertFalse(os.path.exists(out))
        # The values (--vocab-size standing for the recorded size) convert; the head count alone
        # is the KV group count of a multi-head model.
        given = ['--set', f'num_attention_heads={MODEL["n"]}', '--set', f'make_vocab_size_divisible_by={MODEL["mvsdb"]}',
                 '--vocab-size', MODEL['V']]
        self.assertOk(run('convert', tag, out, '--tp', 1, '--pp', 1, '--rules', 'megatron-gpt2', *given, '-q'))

    def test_lint_with_and_without_a_target(self):
        tag = self.deepspeed_only()
        heads = VALUES[:2]
        # Without a target: convert at the source's TP needs no vocabulary values, so lint is ok and
        # warns of what a TP change would need.
        lint = run('lint', tag, '--rules', 'megatron-gpt2', *heads)
        self.assertEqual(lint.returncode, 0, lint.stdout)
        warnings = [l for l in lint.stdout.splitlines() if l.startswith('warning: a TP change')]
        self.assertEqual(len(warnings), 1, lint.stdout)
        self.assertIn('--set args.make_vocab_size_divisible_by=N --vocab-size N', warnings[0])
        self.assertOk(run('convert', tag, self.path('pp', 'x'), '--tp', 2, '--pp', 1, '--rules', 'megatron-gpt2', *heads))
        self.assertOk(run('lint', tag, '--rules', 'megatron-gpt2', *heads, '--tp', 2, '--pp', 1))
        # With a target that changes TP: an error, as convert refuses it, with the same line.
        lint = run('lint', tag, '--rules', 'megatron-gpt2', *heads, '--tp', 1, '--pp', 1)
        self.assertEqual(lint.returncode, 1, lint.stdout)
        self.assertIn('error: the checkpoint does not record 2 values a conversion to TP 1 needs', lint.stdout)
        convert = run('convert', tag, self.path('out', 'x'), '--tp', 1, '--pp', 1, '--rules', 'megatron-gpt2', *heads)
        self.assertEqual(convert.returncode, 2, convert.stdout + convert.stderr)
        for text in (lint.stdout, convert.stderr):
            self.assertIn('--set args.make_vocab_size_divisible_by=N --vocab-size N', text)
        # A target lint cannot take is refused like convert's: heads that do not divide.
        lint = run('lint', tag, '--rules', 'megatron-gpt2', *VALUES, '--tp', 5, '--pp', 1)
        self.assertEqual(lint.returncode, 1, lint.stdout)
        self.assertIn('do not divide by 5', lint.stdout)
        # A size not given is the source's, as convert keeps it.
        self.assertOk(run('lint', tag, '--rules', 'megatron-gpt2', *heads, '--tp', 2))

    def test_set_values_convert_bit_exact(self):
        tag = self.deepspeed_only()
        self.assertOk(run('lint', tag, '--rules', 'megatron-gpt2', *VALUES))
        cfg = mf.FixtureConfig(**MODEL)
        for tp, pp, dp in ((1, 1, 2), (3, 4, 1)):
            with self.subTest(tp=tp, pp=pp, dp=dp):
                out = self.path(f'out_{tp}{pp}{dp}', 'global_step10')
                self.assertOk(run('convert', tag, out, '--tp', tp, '--pp', pp, '--dp', dp,
                                  '--rules', 'megatron-gpt2', *VALUES, '-q'))
                diffs = mf.compare_with_canonical(mf.load_logical(out, cfg), cfg)
                # The optimizer state of vocabulary padding rows the target adds (TP 3 pads to
                # 120 rows, not 112) is not the oracle's; test_optimizer.py checks those rows.
                self.assertEqual([d for d in diffs if not d.startswith('optimizer ') or '.padding:' not in d], [])

    def test_rule_file_fallbacks_need_no_set(self):
        with open(os.path.join(RULES_DIR, 'megatron-gpt2.yaml')) as f:
            text = f.read()
        text = text.replace('blocks: args.num_attention_heads', f'blocks: [args.num_attention_heads, {MODEL["n"]}]')
        text = text.replace('blocks: [args.num_key_value_heads, args.num_attention_heads]',
                            f'blocks: [args.num_key_value_heads, args.num_attention_heads, {MODEL["n"]}]')
        text = text.replace('original_size: [universal_checkpoint_info.original_vocab_size]',
                            f'original_size: [universal_checkpoint_info.original_vocab_size, {MODEL["V"]}]')
        text = text.replace('divisible_by: [args.make_vocab_size_divisible_by]',
                            f'divisible_by: [args.make_vocab_size_divisible_by, {MODEL["mvsdb"]}]')
        rules = self.path('gpt2-without-args.yaml')
        with open(rules, 'w') as f:
            f.write(text)
        tag = self.deepspeed_only()
        self.assertOk(run('lint', tag, '--rules', rules))
        out = self.path('out', 'global_step10')
        self.assertOk(run('convert', tag, out, '--tp', 1, '--pp', 1, '--rules', rules, '-q'))
        cfg = mf.FixtureConfig(**MODEL)
        self.assertEqual(mf.compare_with_canonical(mf.load_logical(out, cfg), cfg), [])

    def test_contradicting_or_unread_settings_are_refused(self):
        tag = make_fixture(self.path('src'), **MODEL)  # records args
        out = self.path('out', 'x')
        p = run('convert', tag, out, '--tp', 1, '--pp', 1, '--set', 'num_attention_heads=6')
        self.assertEqual(p.returncode, 2)
        self.assertIn('--set args.num_attention_heads=6 contradicts the checkpoint, which records '
                      f'args.num_attention_heads = {MODEL["n"]}; drop the --set', p.stderr)
        p = run('lint', tag, '--set', 'num_heads=12')
        self.assertEqual(p.returncode, 2)
        self.assertIn('--set args.num_heads: rule set megatron-gpt2 reads no such value (--set gives ', p.stderr)
        # The same value as recorded is harmless.
        self.assertOk(run('lint', tag, '--set', f'num_attention_heads={MODEL["n"]}'))
        self.assertFalse(os.path.exists(out))

    def test_zero_to_fp32_is_copied_beside_the_output(self):
        tag = make_fixture(self.path('src'), **MODEL)
        script = os.path.join(os.path.dirname(tag), 'zero_to_fp32.py')
        with open(script, 'w') as f:
            f.write('# the script DeepSpeed copies into every checkpoint root\n')
        out = self.path('out', 'global_step10')
        p = run('convert', tag, out, '--tp', 1, '--pp', 1)
        self.assertOk(p)
        self.assertIn('copied zero_to_fp32.py from the source root beside the output', p.stdout)
        with open(script) as a, open(self.path('out', 'zero_to_fp32.py')) as b:
            self.assertEqual(a.read(), b.read())
        # An existing one is the user's: left as it is, and said so.
        with open(self.path('out', 'zero_to_fp32.py'), 'w') as f:
            f.write('# mine\n')
        # (--overwrite: the root's latest names global_step10, which this run replaces.)
        p = run('convert', tag, self.path('out', 'global_step11'), '--tp', 2, '--pp', 1, '--overwrite')
        self.assertOk(p)
        self.assertIn('zero_to_fp32.py already exists beside the output; left as it is', p.stdout)
        with open(self.path('out', 'zero_to_fp32.py')) as f:
            self.assertEqual(f.read(), '# mine\n')

    def test_lint_ok_means_convert_accepts(self):
        """Over clean and broken checkpoints, each linted and converted with the same options."""
        drifted = make_fixture(self.path('drifted'), tp_drift_eps=0.01, **MODEL)
        no_vocab = self.bloom('no_vocab')

        def drop_vocab(sd):
            sd.pop('checkpoint_info', None)
            sd['args'].make_vocab_size_divisible_by = None
        for path in glob.glob(os.path.join(no_vocab, 'mp_rank_*_model_states.pt')):
            rewrite(path, drop_vocab)
        stripped = self.deepspeed_only('stripped')
        corpus = [
            ('clean', make_fixture(self.path('clean'), **MODEL), []),
            ('drifted', drifted, []),
            ('drifted, averaged', drifted, ['--replicated', 'average']),
            ('drifted, first', drifted, ['--replicated', 'first']),
            ('drifted, weights only', drifted, ['--weights-only', '--replicated', 'first']),
            ('no vocabulary values', no_vocab, ['--rules', 'bigscience-bloom']),
            ('no vocabulary values, given', no_vocab, ['--rules', 'bigscience-bloom', '--vocab-size', 100,
                                                       '--set', 'make_vocab_size_divisible_by=8']),
            ('no Megatron state', stripped, ['--rules', 'megatron-gpt2']),
            ('no Megatron state, heads given', stripped, ['--rules', 'megatron-gpt2'] + VALUES[:2]),
            ('no Megatron state, all given', stripped, ['--rules', 'megatron-gpt2'] + VALUES),
        ]
        verdicts = {}
        for name, tag, options in corpus:
            with self.subTest(case=name):
                # Without a target lint answers for the source's TP (2 here); with one, for that layout.
                untargeted = run('lint', tag, *options)
                self.assertIn(untargeted.returncode, (0, 1), untargeted.stdout + untargeted.stderr)
                for i, (tp, pp) in enumerate(((1, 1), (4, 2), (2, 1))):
                    lint = run('lint', tag, *options, '--tp', tp, '--pp', pp)
                    self.assertIn(lint.returncode, (0, 1), lint.stdout + lint.stderr)
                    verdicts[name, tp, pp] = lint.returncode == 0
                    convert = run('convert', tag, self.path('out', f'{re.sub(r"[^a-z]", "_", name)}_{i}'),
                                  '--tp', tp, '--pp', pp, *options, '-q', '--no-update-latest')
                    self.assertEqual(convert.returncode == 0, lint.returncode == 0,
                                     f'lint --tp {tp} --pp {pp} says {lint.returncode}, convert {convert.returncode}:\n'
                                     f'{lint.stdout}\n{convert.stderr}')
                    if tp == 2 and untargeted.returncode == 0:
                        self.assertEqual(convert.returncode, 0, f'lint ok, convert --tp 2 refused:\n{convert.stderr}')
        # The corpus holds both verdicts, or it proves nothing.
        self.assertEqual(sorted(set(verdicts.values())), [False, True], verdicts)


if __name__ == '__main__':
    support.main()
