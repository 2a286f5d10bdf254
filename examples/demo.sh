#!/bin/sh
# The built-in example: a small BLOOM-style checkpoint trained at TP 2, PP 2,
# DP 2 with bf16 ZeRO shards and drifted layernorms (as BLOOM's were), written
# with real torch.save, then linted, inspected, reshaped with its optimizer state to
# TP 4, PP 3 (uneven stages) and verified against the source, then exported
# as consolidated weights and as a Megatron-LM checkpoint.
set -eu
RESHARD=${1:-build/reshard}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${DEMO_DIR:-$HERE/out}
rm -rf "$WORK" && mkdir -p "$WORK"

step() { printf '\n== %s\n$ %s\n' "$1" "$2"; }

step "make the example checkpoint" "python3 -m fixtures.megatron_fixture --style bs_bloom --tp 2 --pp 2 --dp 2 --drift 0.001 --L 6 $WORK/ckpt"
PYTHONPATH="$HERE/../tests" /usr/bin/python3 -m fixtures.megatron_fixture --style bs_bloom \
  --tp 2 --pp 2 --dp 2 --drift 0.001 --L 6 "$WORK/ckpt" >/dev/null

step "lint: can it be reshaped? Not as it is: its replicas drifted" "reshard lint $WORK/ckpt | tail -4"
"$RESHARD" lint "$WORK/ckpt" | tail -4 || true

step "lint with the policy convert will be given" "reshard lint $WORK/ckpt --replicated average | tail -2"
"$RESHARD" lint "$WORK/ckpt" --replicated average | tail -2

step "inspect" "reshard inspect $WORK/ckpt | head -25"
"$RESHARD" inspect "$WORK/ckpt" | head -25

step "a bogus path gets one line and exit 2" "reshard convert /no/such/ckpt $WORK/x --tp 2 --pp 1"
"$RESHARD" convert /no/such/ckpt "$WORK/x" --tp 2 --pp 1 || echo "(exit $?)"

step "the default refuses drifted replicas" "reshard convert $WORK/ckpt $WORK/tp4pp3 --tp 4 --pp 3 --dp 3"
"$RESHARD" convert "$WORK/ckpt" "$WORK/tp4pp3" --tp 4 --pp 3 --dp 3 || echo "(exit $?)"

step "plan it" "reshard convert ... --replicated average --dry-run"
"$RESHARD" convert "$WORK/ckpt" "$WORK/tp4pp3" --tp 4 --pp 3 --dp 3 \
  --replicated average --dry-run | head -12

step "convert to TP 4, PP 3, DP 3 with the optimizer state" "reshard convert $WORK/ckpt $WORK/tp4pp3 --tp 4 --pp 3 --dp 3 --replicated average -q"
"$RESHARD" convert "$WORK/ckpt" "$WORK/tp4pp3" --tp 4 --pp 3 --dp 3 \
  --replicated average -q
ls "$WORK/tp4pp3/global_step10" | sed -n '1,3p;$p'

step "verify every weight and optimizer state, replicas compared by their mean" "reshard verify $WORK/ckpt $WORK/tp4pp3 --replicated average"
"$RESHARD" verify "$WORK/ckpt" "$WORK/tp4pp3" --replicated average | tail -2

step "to TP 1, PP 4, DP 8 with rank 0's replicas, then verify against the source" "reshard convert ... --replicated first && reshard verify"
"$RESHARD" convert "$WORK/ckpt" "$WORK/tp1pp4" --tp 1 --pp 4 --dp 8 \
  --replicated first -q
"$RESHARD" verify "$WORK/ckpt" "$WORK/tp1pp4" | tail -2

step "consolidated weights: every fp32 master whole, in one safetensors file" "reshard export $WORK/ckpt $WORK/model --to consolidated --replicated average -q"
"$RESHARD" export "$WORK/ckpt" "$WORK/model" --to consolidated --replicated average -q
ls -l "$WORK/model" | tail -n +2

step "a Megatron-LM (torch format) checkpoint at TP 4, PP 2" "reshard export $WORK/ckpt $WORK/megatron --to megatron --tp 4 --pp 2 --replicated average -q"
"$RESHARD" export "$WORK/ckpt" "$WORK/megatron" --to megatron --tp 4 --pp 2 --replicated average -q
(cd "$WORK/megatron" && find . -type f | sort)
