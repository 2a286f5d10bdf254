"""lm-evaluation-harness on a checkpoint through the in-memory HF model equals lm-eval on the export.

examples/lm_eval_in_memory.py evaluates the real torchtitan save of tests/data (a tiny Llama 3, at
FSDP2 2 x TP 2) with real lm-eval (lm_eval_pypi.py's pinned wheels) on the transformers model
reshard builds in memory; `reshard export --to hf --tokenizer DIR` writes the same checkpoint as a
folder, and lm-eval's own command (`python3 -m lm_eval --model hf --model_args
pretrained=OUT,dtype=float32`) evaluates that. Every metric of both tasks and every document's
log-likelihoods must be equal. Everything is local (HF_HUB_OFFLINE, no download): the tokenizer is
a word-level one the test makes with `tokenizers` and saves as a folder, and the tasks are lm-eval
task YAML files over JSON lines the test writes (a multiple-choice task, acc and acc_norm, and a
rolling log-likelihood task, word and byte perplexity). Control: the export evaluated in bf16 gives
other numbers, so equal numbers are not a metric too coarse to see a difference.

Where the pinned wheels cannot be fetched, the test is skipped with one line saying why.

Run: PYTHONPATH=tests:tests/interop /usr/bin/python3 tests/interop/test_lm_eval.py --reshard build/reshard
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import interop_support as support
import lm_eval_pypi

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = os.path.join(CHECKOUT, 'tests', 'data', 'torchtitan', 'fsdp2_tp_w4', 'step-1')
EXAMPLE = os.path.join(CHECKOUT, 'examples', 'lm_eval_in_memory.py')
HEADS = 'num_attention_heads=4'  # torchtitan records no head count
TASKS = 'reshard_choice,reshard_text'

WORDS = ('the a cat dog sat on mat ran to park is red blue sky grass green what color of and '
         'bird sang tree big small house we saw').split()

TOKENIZER = r'''
import sys
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
words = ["<unk>", "<eos>"] + sys.argv[2].split()
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(sys.argv[1])
'''

CHOICES = [
    ('the sky is', ['blue', 'green', 'red'], 0),
    ('the grass is', ['blue', 'green', 'big'], 1),
    ('the cat sat on the', ['mat', 'sky', 'bird'], 0),
    ('the dog ran to the', ['tree', 'park', 'color'], 1),
    ('what color is the sky', ['blue', 'small'], 0),
    ('we saw a big', ['house', 'of'], 0),
]
TEXTS = ['the cat sat on the mat and the dog ran to the park',
         'the bird sang in the big tree',
         'we saw a small red house and a big blue sky']

CHOICE_TASK = '''task: reshard_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
'''
TEXT_TASK = '''task: reshard_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
'''

NUMBER = re.compile(r'-?\d+\.\d+(?:[eE][-+]?\d+)?')


def log_likelihoods(samples):
    """{doc_id: every number of its responses}, from the samples however lm-eval wrote them (numbers,
    or their text)."""
    return {s['doc_id']: [float(x) for x in NUMBER.findall(json.dumps(s['resps']))] for s in samples}


def metrics(results):
    return {task: {k: v for k, v in r.items() if k != 'alias'} for task, r in results.items()}


class LmEvalTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.site = lm_eval_pypi.site_or_skip()
        cls.work = tempfile.mkdtemp(prefix='reshard-lm-eval-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        module = os.path.join(os.path.dirname(support.RESHARD), 'python')
        cls.env = lm_eval_pypi.env(cls.site, module)
        cls.env['HF_HOME'] = os.path.join(cls.work, 'hf-home')  # the datasets cache lm-eval fills
        cls.tokenizer = os.path.join(cls.work, 'tokenizer')
        cls.python(None, '-c', TOKENIZER, cls.tokenizer, ' '.join(WORDS))
        cls.tasks = os.path.join(cls.work, 'tasks')
        os.mkdir(cls.tasks)
        cls.write_task('choice', CHOICE_TASK, [dict(context=c, choices=ch, label=y) for c, ch, y in CHOICES])
        cls.write_task('text', TEXT_TASK, [dict(text=t) for t in TEXTS])
        cls.hf = os.path.join(cls.work, 'hf')
        p = support.reshard('export', SAMPLE, cls.hf, '--to', 'hf', '--set', HEADS, '--tokenizer', cls.tokenizer, '-q')
        assert p.returncode == 0, p.stderr

    @classmethod
    def python(cls, cwd, *argv):
        p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=cls.env, timeout=600,
                           cwd=cwd or cls.work, stdin=subprocess.DEVNULL)
        if p.returncode:
            raise AssertionError(f'{argv[0]} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}')
        return p.stdout

    @classmethod
    def write_task(cls, name, yaml, docs):
        data = os.path.join(cls.tasks, f'{name}.jsonl')
        with open(data, 'w') as f:
            f.writelines(json.dumps(d) + '\n' for d in docs)
        with open(os.path.join(cls.tasks, f'{name}.yaml'), 'w') as f:
            f.write(yaml.format(data=data))

    def lm_eval_on_export(self, dtype):
        """lm-eval's command on the exported folder: (results, {task: log-likelihoods by document})."""
        out = os.path.join(self.work, f'disk-{dtype}')
        self.python(None, '-m', 'lm_eval', '--model', 'hf', '--model_args', f'pretrained={self.hf},dtype={dtype}',
                    '--tasks', TASKS, '--include_path', self.tasks, '--device', 'cpu', '--batch_size', '1',
                    '--output_path', out, '--log_samples')
        [results] = glob.glob(os.path.join(out, '**', 'results_*.json'), recursive=True)
        with open(results) as f:
            results = json.load(f)['results']
        samples = {}
        for task in TASKS.split(','):
            [path] = glob.glob(os.path.join(out, '**', f'samples_{task}_*.jsonl'), recursive=True)
            with open(path) as f:
                samples[task] = log_likelihoods(json.loads(line) for line in f)
        return results, samples

    def test_in_memory_equals_export(self):
        output = os.path.join(self.work, 'in-memory.json')
        table = self.python(None, EXAMPLE, SAMPLE, '--tokenizer', self.tokenizer, '--tasks', TASKS,
                            '--include-path', self.tasks, '--set', HEADS, '--output', output)
        self.assertIn('reshard_choice', table)
        with open(output) as f:
            memory = json.load(f)
        results, samples = self.lm_eval_on_export('float32')
        got = metrics(memory['results'])
        self.assertEqual(set(got), set(TASKS.split(',')))
        self.assertIn('acc,none', got['reshard_choice'])
        self.assertIn('word_perplexity,none', got['reshard_text'])
        self.assertEqual(got, metrics(results))
        for task in TASKS.split(','):
            memory_lls = log_likelihoods(memory['samples'][task])
            self.assertEqual(len(memory_lls), len(CHOICES) if task == 'reshard_choice' else len(TEXTS))
            self.assertTrue(all(memory_lls.values()), memory_lls)
            self.assertEqual(memory_lls, samples[task], task)
        # Control: the same folder in bf16 moves the numbers.
        bf16, bf16_samples = self.lm_eval_on_export('bfloat16')
        self.assertNotEqual(metrics(bf16)['reshard_text'], got['reshard_text'])
        self.assertNotEqual(bf16_samples['reshard_choice'], log_likelihoods(memory['samples']['reshard_choice']))


if __name__ == '__main__':
    support.main()
