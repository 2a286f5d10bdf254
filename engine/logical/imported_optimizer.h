// The optimizer state of a model another format read (a Megatron-Core
// torch_dist checkpoint's distributed optimizer), as plain data: per
// canonical tensor, Adam's fp32 master and moments whole, as runs of the
// source's bytes, and the optimizer's param groups and step.
//
// The reading format fills it; every target takes the states from it
// (formats/imported/), DeepSpeed's into its own optimizer shards
// (formats/deepspeed/optimizer/imported_state.h). Neither needs to know the
// other: the states are laid out exactly like the
// canonical tensors of the imported LogicalCheckpoint (TP 1, PP 1).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "logical/source_shard.h"
#include "pickle/value.h"
#include "pickle/dtype.h"

namespace reshard {

struct ImportedOptimizer {
  // The per-element states torch names them by ("exp_avg", "exp_avg_sq"),
  // after the fp32 master.
  std::vector<std::string> moments;
  // fp32 beside fp32 masters (Megatron's distributed optimizer; an FSDP
  // run's fp32 parameters are their own). A run whose torch AdamW steps its
  // bf16 parameters themselves keeps its moments in bf16, and no master.
  DType moments_dtype = DType::kFloat32;
  bool masters() const { return moments_dtype == DType::kFloat32; }
  struct Param {
    SourceShard master;                // the fp32 master, whole, in row-major order (unset without masters)
    std::vector<SourceShard> moments;  // one per `moments` entry, the same way
  };
  std::map<std::string, Param> params;  // by canonical name
  // The torch param groups' hyperparameters as the optimizer saved them (no
  // `params` lists), decayed groups first.
  std::vector<Value> param_groups;
  std::optional<Value> step;  // the optimizer step, where it records one
  std::string what;           // "Megatron-Core's distributed optimizer (fully_reshardable)"
  // The reading format's name for how the state was laid out
  // ("dp_reshardable"): a writer of that format keeps it unless told otherwise.
  std::string layout;
};

}  // namespace reshard
