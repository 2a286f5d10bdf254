#include "api/common.h"

#include <sched.h>

#include <thread>

namespace reshard {

Result<std::unique_ptr<LogicalCheckpoint>> LoadForCommand(CheckpointFiles files,
                                                          const CommonOptions& options) {
  LoadOptions load;
  load.rules = options.rules;
  load.allowed_classes = options.allowed_classes;
  return LoadLogicalCheckpoint(std::move(files), load);
}

int ThreadCount(int requested) {
  if (requested > 0) return requested;
  // The cores this process may run on: mpirun binds each rank to its own.
  cpu_set_t cpus;
  if (::sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return std::max(1, CPU_COUNT(&cpus));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::string LayoutSummary(const LogicalCheckpoint& ckpt) {
  if (!ckpt.pipeline) {
    return "non-pipeline DeepSpeed checkpoint (the whole model in mp_rank files; only DP can "
           "change); TP " + std::to_string(ckpt.tp) + ", DP " + std::to_string(ckpt.dp) +
           "; iteration " + std::to_string(ckpt.iteration) + "; " +
           std::to_string(ckpt.files.optimizer_files.size()) + " optimizer shards";
  }
  int blocks = 0;
  for (const SpecEntry& s : ckpt.specs) blocks += s.role == "block" ? 1 : 0;
  std::string s = "rule set " + ckpt.rules->name() + " (numbering " + ckpt.numbering + "); TP " +
                  std::to_string(ckpt.tp) + ", PP " + std::to_string(ckpt.pp) + ", DP " +
                  std::to_string(ckpt.dp) + "; iteration " + std::to_string(ckpt.iteration) +
                  "; " + std::to_string(blocks) + " blocks; " +
                  std::to_string(ckpt.layers.size() * ckpt.tp) + " layer files, " +
                  std::to_string(ckpt.metadata.size()) + " mp_rank files, " +
                  std::to_string(ckpt.files.optimizer_files.size()) + " optimizer shards";
  if (ckpt.vocab.padded_rows > 0) {
    s += "; vocabulary " + std::to_string(ckpt.vocab.padded_rows) + " padded rows";
    if (ckpt.vocab.original_size) s += " (true size " + std::to_string(*ckpt.vocab.original_size) + ")";
  }
  return s;
}

}  // namespace reshard
