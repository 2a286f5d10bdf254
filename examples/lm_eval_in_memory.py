"""Evaluate a training checkpoint with lm-evaluation-harness, with no export on disk.

reshard reads the checkpoint in place (Megatron-DeepSpeed, Megatron-Core torch_dist, torchtitan, ...:
any checkpoint `reshard export --to hf` exports, at any layout it was saved at), hf_in_memory.py
builds the transformers model from the tensors and config.json reshard makes in memory, and lm-eval's
HFLM evaluates that model object with your run's tokenizer. The numbers are lm-eval's on the folder
`reshard export CHECKPOINT OUT --to hf --tokenizer DIR` writes, evaluated in float32
(`lm_eval --model hf --model_args pretrained=OUT,dtype=float32 ...`):

  PYTHONPATH=build/python python3 examples/lm_eval_in_memory.py CHECKPOINT --tokenizer DIR \\
      --tasks hellaswag,arc_easy [--include-path MY_TASKS] [--set num_attention_heads=4] [--limit 100] \\
      [--output results.json]

Needs lm-eval (pip install lm-eval) and what it brings (transformers); prints lm-eval's table, and
with --output writes its results (and each document's responses) as JSON.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_in_memory import hf_model  # noqa: E402 (the example beside this one)


def evaluate(model, tokenizer, tasks, include_path=None, limit=None, batch_size=1):
    """lm-eval's simple_evaluate of the transformers `model` (an object, not a path) on `tasks`."""
    import lm_eval
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=transformers.AutoTokenizer.from_pretrained(tokenizer),
              batch_size=batch_size)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=include_path),
                                   limit=limit, log_samples=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--tokenizer", required=True, help="the folder your run's tokenizer was saved in")
    ap.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    ap.add_argument("--include-path", help="a folder of your own lm-eval task YAML files")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a value the checkpoint does not record, as reshard's --set")
    ap.add_argument("--rules", help="rule set (default: detected)")
    ap.add_argument("--limit", type=int, help="documents per task (default: all)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--output", help="write lm-eval's results and samples here (JSON)")
    args = ap.parse_args()
    from lm_eval.utils import make_table

    values = dict(item.split("=", 1) for item in args.set)
    model = hf_model(args.checkpoint, args.rules, values or None, args.tokenizer)
    out = evaluate(model, args.tokenizer, args.tasks.split(","), args.include_path, args.limit, args.batch_size)
    print(make_table(out))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"results": out["results"], "samples": out["samples"]}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
