#!/usr/bin/python3
"""Write reshard's benchmark checkpoint: a ~355M-parameter GPT-2-style model in bf16 with
BF16_Optimizer (ZeRO stage 0) Adam state, at TP 2, PP 2, DP 2 (about 5.6 GB on disk).

The files come from the test fixture generator (tests/fixtures/megatron_fixture.py,
``FixtureConfig`` + ``write_checkpoint``): style ms_gpt2 (microsoft Megatron-DeepSpeed GPT-2:
LayerNorm, biases, absolute positions, tied embeddings), optimizer bf16_zero.  The fixture
builds the canonical fp32 model and writes every shard with real ``torch.save``, so the
result has exactly the keys, shapes, dtypes and pickles of the test fixtures -- only bigger.
At 355M parameters that path took 50 s and 4.2 GB of memory here (2 cores), so no faster
path is needed; the summary printed at the end says how long it took.

Sizes: ``--scale S`` asks for S times the full checkpoint's size by choosing the hidden size
(a multiple of 32; 16 heads, ffn = 4h, L = 24 and the vocabulary kept):
  --scale 1     h=1024, L=24, n=16, ffn=4096, V=50257, S=1024   354.8M params, 5.63 GB
  --scale 0.25  h=448  (the "4x smaller" benchmark checkpoint)   80.9M params, 1.42 GB
  --scale 4     h=2208                                           ~1.5B params, ~23 GB
``--filled`` skips the model: the fixture's shape-only mode writes the same files with every
tensor a fixed pattern of finite values, at disk speed and in little memory (the 4x size).
``--style ms_llama`` writes a Llama of the same size instead (RMSNorm, SwiGLU, GQA with 4 KV
heads, rotary, an untied output layer: at --scale 1, h=1024 and ffn=2752), which
``export --to torchtitan`` takes. ``--hidden H`` sets h directly (h=512 gives 101.9M params, 1.76 GB: 3.2x smaller, because
the 50k-row vocabulary shrinks only linearly); ``--layers`` changes L.

Usage (Debian's python3 with PYTHONPATH=<repo>/tests, or let this script set it):
  /usr/bin/python3 benchmarks/make_checkpoint.py OUT_ROOT [--scale 0.5] [--lint reshard]
writes OUT_ROOT/global_step10/... and OUT_ROOT/latest; ``--lint BIN`` runs ``BIN lint`` on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, 'tests'))

from fixtures import megatron_fixture as mf  # noqa: E402

BASE = dict(style='ms_gpt2', L=24, h=1024, n=16, V=50257, S=1024, mvsdb=128,
            dtype='bf16', optimizer='bf16_zero', tp=2, pp=2, dp=2)


def ffn_of(style: str, h: int) -> int:
    """GPT-2's 4h; a Llama's SwiGLU width, about 8h/3 (a multiple of 64), so that a block holds
    about as many weights as GPT-2's."""
    return 4 * h if style == 'ms_gpt2' else 64 * round(8 * h / 3 / 64)


def config(scale: float = 1.0, hidden: int | None = None, layers: int | None = None,
           tp: int = 2, pp: int = 2, dp: int = 2, filled: bool = False, style: str = 'ms_gpt2') -> mf.FixtureConfig:
    """The benchmark configuration.

    ``scale`` is the wanted size relative to the full checkpoint (h=1024): the hidden size is
    the multiple of 32 (16 heads of an even head dim, ffn = 4h) whose stored elements come
    closest to ``scale`` times the full model's.  ``hidden`` sets h directly instead.
    """
    def make(h: int) -> mf.FixtureConfig:
        fields = dict(BASE, style=style, h=h, ffn=ffn_of(style, h), tp=tp, pp=pp, dp=dp, shape_only=filled,
                      shape_fill=filled)
        if style == 'ms_llama':
            fields['nkv'] = 4  # GQA: 4 KV heads for 16 query heads
        if layers is not None:
            fields['L'] = layers
        return mf.FixtureConfig(**fields)

    if hidden is not None:
        return make(hidden)
    if scale == 1.0:
        return make(BASE['h'])
    full = stored_elements(make(BASE['h']))
    best = min(range(32, 32 * 1024, 32), key=lambda h: abs(stored_elements(make(h)) / full - scale)
               if h <= 4096 * max(1.0, scale) else float('inf'))
    return make(best)


def parameter_count(cfg: mf.FixtureConfig) -> int:
    """Logical parameters of the model (one copy of the tied embedding, no padding)."""
    return sum(_numel(shape) for _, shape, _ in mf._logical_inventory(cfg))


def stored_elements(cfg: mf.FixtureConfig) -> int:
    """Weight elements stored over all TP ranks (replicated tensors once per rank, vocabulary
    padding, the last stage's tied copy of the embeddings); the optimizer state holds three
    fp32 values for each of them, so the checkpoint is about 14 bytes per stored element."""
    inv = {name: _numel(shape) for name, shape, _ in mf._logical_inventory(cfg)}
    total = sum(inv.values())
    total += (cfg.tp - 1) * sum(inv[n] for n in mf.replicated_names(cfg))
    vp = mf.padded_vocab(cfg)
    total += (vp - cfg.V) * cfg.h
    if cfg.pp > 1:  # the last stage's copy of the tied word and position embeddings
        total += vp * cfg.h + cfg.S * cfg.h
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def folder_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def write(root: str, cfg: mf.FixtureConfig) -> dict:
    """Writes the checkpoint under ``root``; returns a summary with sizes and timing."""
    start = time.monotonic()
    summary = mf.write_checkpoint(root, cfg)
    seconds = time.monotonic() - start
    return {'root': root, 'tag_dir': summary['tag_dir'], 'config': {
        k: getattr(cfg, k) for k in ('style', 'L', 'h', 'n', 'ffn', 'V', 'S', 'dtype', 'optimizer',
                                     'tp', 'pp', 'dp')},
        'parameters': parameter_count(cfg), 'stored_elements': stored_elements(cfg), 'files': len(summary['files']),
        'bytes': folder_bytes(summary['tag_dir']), 'seconds': round(seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('out_root', help='checkpoint root to create (must not hold a non-empty tag folder)')
    ap.add_argument('--scale', type=float, default=1.0,
                    help='size relative to the full benchmark checkpoint (default 1; 0.25 = ~4x smaller)')
    ap.add_argument('--hidden', type=int, default=None, help='hidden size (overrides --scale)')
    ap.add_argument('--layers', type=int, default=None, help='transformer blocks (default 24)')
    ap.add_argument('--tp', type=int, default=2)
    ap.add_argument('--pp', type=int, default=2)
    ap.add_argument('--dp', type=int, default=2)
    ap.add_argument('--filled', action='store_true',
                    help='the fixture\'s shape-only mode with every tensor a fixed pattern of finite values: '
                         'no model is built, so any size fits in memory (for timing; the values are not a model)')
    ap.add_argument('--style', choices=('ms_gpt2', 'ms_llama'), default='ms_gpt2',
                    help='ms_gpt2 (default), or ms_llama: RMSNorm, SwiGLU (ffn about 8h/3), 4 KV heads, '
                         'rotary, an untied output layer (the model torchtitan trains)')
    ap.add_argument('--lint', metavar='RESHARD', help='run RESHARD lint on the result')
    ns = ap.parse_args(argv)
    cfg = config(ns.scale, ns.hidden, ns.layers, ns.tp, ns.pp, ns.dp, ns.filled, ns.style)
    info = write(ns.out_root, cfg)
    print(json.dumps(info, indent=1))
    if ns.lint:
        return subprocess.call([ns.lint, 'lint', ns.out_root])
    return 0


if __name__ == '__main__':
    sys.exit(main())
