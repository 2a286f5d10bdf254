// reshard::Checkpoint: a checkpoint read in place, without writing a
// converted copy.
//
// An evaluation harness or a training script that wants a checkpoint at
// another layout need not convert it first: a Checkpoint gives its tensors
// whole by canonical name, and what any one rank of any TP / PP / DP layout
// would load (that rank's layer files and optimizer shard, made as `Convert`
// would write them), each produced from the memory-mapped source files when
// asked for. The Python module `reshard.open` is this class.
//
//   reshard::OpenOptions options;
//   auto ckpt = reshard::Checkpoint::Open("ckpts/global_step20", options);
//   reshard::RankSpec rank;  // TP 1, PP 1: the whole model on one rank
//   auto weights = (*ckpt)->StateDict(rank);
//
// Methods are safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "reshard/reshard.h"
#include "reshard/status.h"

namespace reshard {

// One tensor's elements, contiguous and row-major. `data` is writable:
// either a buffer of its own or a private copy-on-write mapping of the
// source file's bytes (a tensor stored contiguously is not copied; writing
// to it never reaches the file). `owner` keeps it alive.
struct TensorBytes {
  std::string dtype;  // PyTorch's name: "float32", "bfloat16", "int64", ...
  std::vector<int64_t> shape;
  std::shared_ptr<void> owner;
  uint8_t* data = nullptr;
  int64_t size = 0;  // bytes
  bool mapped = false;  // data maps the source file (no copy was made)
};

// What a tensor of the checkpoint is.
struct TensorMeta {
  std::string name;     // canonical, unique in the checkpoint (Checkpoint::Tensor's key)
  std::string section;  // "weights" or "optimizer"
  std::string param;    // the canonical name of the parameter it is, or is a state of
  std::string state;    // "" for weights; the optimizer state ("fp32", "exp_avg", ...)
  std::string dtype;
  std::vector<int64_t> shape;
  std::string rule;     // how the rule set cuts it ("column split", ...); "" without rules
  // Dim 0 is a padded vocabulary: the rows past the true vocabulary's size
  // (vocab_size, 0 when the checkpoint does not record it) are padding.
  bool vocab = false;
  int64_t vocab_size = 0;
};

// A pickled tree (what torch.load gives for a file), as plain data: Python's
// scalars and containers, tensors, and other objects as their class and the
// state they were pickled with (argparse.Namespace's fields, ...).
struct TreeValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kBytes, kList, kTuple, kDict, kTensor, kObject, kGlobal };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  // kString, kBytes; kObject: its class ("argparse.Namespace"); kGlobal: the
  // class or function it names ("torch.bfloat16")
  std::string text;
  std::vector<TreeValue> items;                          // kList, kTuple; kObject: its arguments
  std::vector<std::pair<TreeValue, TreeValue>> entries;  // kDict; kObject: its state's entries
  TensorBytes tensor;                                    // kTensor
};

// One rank of a target layout: a model-parallel rank (tp_rank, pp_rank) of
// TP `tp` x PP `pp`, and for the optimizer state its DP rank of `dp`. A
// DeepSpeed MoE checkpoint's rank also has an expert-parallel rank of EP
// `ep`, which holds experts ep_rank * E/EP .. (ep_rank + 1) * E/EP - 1 of
// each MoE layer of E experts; DeepSpeed gives DP rank d the EP rank d % ep.
struct RankSpec {
  int tp = 1, pp = 1, dp = 1, ep = 1;
  int tp_rank = 0, pp_rank = 0, dp_rank = 0, ep_rank = 0;
};

// An export in memory: what `Export` would write, without writing it.
struct ExportedFiles {
  // The tensors of its tensor files, by their keys in the files (a
  // safetensors name; a torch.save file's dict keys joined with '.').
  std::vector<std::pair<std::string, TensorBytes>> tensors;
  std::vector<std::pair<std::string, std::string>> texts;   // its text files (config.json, ...) by name
  std::vector<std::pair<std::string, std::string>> copies;  // files it copies (a tokenizer's), their bytes
};

// What opening a checkpoint is told: the rules and values convert is told,
// and how drifted TP replicas are merged.
struct OpenOptions : PreflightOptions {};

class Checkpoint {
 public:
  // Opens the checkpoint at `path` (a tag folder, or a root holding `latest`),
  // any format reshard reads. Refuses what Lint reports as an error.
  static Result<std::unique_ptr<Checkpoint>> Open(const std::string& path, const OpenOptions& options);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  // One line: its kind, layout, iteration and counts (as `inspect` starts).
  const std::string& summary() const;
  // Every tensor, weights first, in the checkpoint's order.
  const std::vector<TensorMeta>& tensors() const;

  // The tensor `name` whole (TP replicas merged by the options' policy), a
  // vocabulary's padding rows as stored.
  Result<TensorBytes> Tensor(const std::string& name) const;

  // The weights rank (rank.tp_rank, rank.pp_rank) of TP rank.tp x PP rank.pp
  // loads: every tensor of its layer files, keyed "layer_NN.<key in the
  // file>", as `Convert` to that layout would write them (the DP size does
  // not matter). A non-pipeline checkpoint's rank loads its mp_rank file's
  // module, keyed as there; a MoE checkpoint's rank (at EP rank.ep) that
  // module and its EP rank's expert files, keyed as there.
  Result<std::vector<std::pair<std::string, TensorBytes>>> StateDict(const RankSpec& rank) const;

  // The optimizer state the rank loads (its ZeRO shard at DP rank.dp; a MoE
  // rank's EP rank must be rank.dp_rank % rank.ep), the tree of the file
  // `Convert` to that layout would write for it.
  Result<TreeValue> OptimizerState(const RankSpec& rank) const;

  // The export `options.to` ("hf", "consolidated", ...) made in memory, as
  // `Export` would write it (the options the checkpoint was opened with in
  // place of `options`' own preflight ones; write options aside): the HF
  // model's tensors under their HF names and its config.json, say. Refuses
  // targets written as Distributed Checkpoint chunks, and an export whose
  // files hold one key twice (a rank file each).
  Result<ExportedFiles> Export(const ExportOptions& options) const;

 private:
  struct Rep;
  explicit Checkpoint(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace reshard
