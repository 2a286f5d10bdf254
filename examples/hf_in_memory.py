"""Evaluate a Megatron-DeepSpeed checkpoint with Hugging Face transformers, with no export on disk.

reshard reads the checkpoint in place (any TP / PP / DP it was saved at), makes the HF model's
tensors and config.json in memory exactly as `reshard export --to hf` would write them, and the
script loads them into the transformers model class and computes logits: what an evaluation
harness (lm-eval-harness, a notebook) does with a checkpoint in the middle of a run.

  PYTHONPATH=build/python python3 examples/hf_in_memory.py CHECKPOINT [--ids 1 2 3] [--rules NAME]

Needs transformers (pip, or your training environment); reshard itself needs neither transformers
nor a GPU. Prints the logits' shape and their last row's top tokens.
"""
import argparse
import json

import torch

import reshard


def hf_model(checkpoint, rules=None, values=None, tokenizer=None):
    """The transformers model of `checkpoint` (eval mode), built in memory. `values`: what the
    checkpoint does not record ({"num_attention_heads": 4}, as --set); `tokenizer`: the folder whose
    token ids config.json takes (as export's --tokenizer)."""
    import transformers  # only this function needs it

    exported = reshard.open(checkpoint, rules=rules, set=values).export(to="hf", tokenizer=tokenizer)
    config = json.loads(exported["texts"]["config.json"])
    model_type = config.pop("model_type")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **config))
    missing, unexpected = model.load_state_dict(exported["state_dict"], strict=False)
    # Tied heads and buffers the model computes itself are the only keys allowed to be missing.
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", []) and "rotary" not in k]
    if missing or unexpected:
        raise SystemExit(f"the exported tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--ids", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="token ids of the prompt")
    ap.add_argument("--rules", help="rule set (default: detected)")
    args = ap.parse_args()
    model = hf_model(args.checkpoint, args.rules)
    with torch.no_grad():
        logits = model(torch.tensor([args.ids])).logits[0]
    print(f"logits {tuple(logits.shape)}; top tokens after the prompt: {logits[-1].topk(5).indices.tolist()}")


if __name__ == "__main__":
    main()
