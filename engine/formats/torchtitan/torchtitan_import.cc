#include "formats/torchtitan/torchtitan_import.h"

namespace reshard {
namespace {

// torchtitan's folder: the model at the top level (or under `model.`), beside
// what its checkpointer saves of the run.
StateDictKeys TorchtitanKeys() {
  StateDictKeys keys;
  keys.format = "torchtitan";
  keys.label = "torchtitan checkpoint";
  keys.run_states = {"optimizer", "train_state", "lr_scheduler", "dataloader"};
  keys.nested_prefix = "model.";
  keys.optim_prefix = "optimizer.";
  keys.recorded_config = kTorchtitanModelFile;
  return keys;
}

}  // namespace

bool LooksLikeTorchtitan(const DcpTensors& dcp, const std::string& rules_spec) {
  return HoldsSectionModelKey(dcp, TorchtitanKeys(), rules_spec);
}

Result<StateDictImport> ReadTorchtitanImport(const DcpTensors& dcp, const CommonOptions& options) {
  return ReadStateDictImport(dcp, TorchtitanKeys(), options);
}

}  // namespace reshard
