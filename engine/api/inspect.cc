// reshard::Inspect: a readable description of a checkpoint.
#include "api/common.h"
#include "formats/registry.h"
#include "reshard/reshard.h"

namespace reshard {
namespace {

// "format: torch_dist, saved at TP 2, PP 1": what convert keeps by default.
std::string FormatLine(const SourceInfo& info) {
  std::string sizes;
  for (const auto& [name, size] : {std::pair<const char*, int>{"TP", info.tp}, {"PP", info.pp}, {"DP", info.dp}}) {
    if (size > 0) sizes += (sizes.empty() ? ", saved at " : ", ") + std::string(name) + " " + std::to_string(size);
  }
  return "format: " + info.format + (sizes.empty() ? " (the layout it was saved at is not recorded)" : sizes) + "\n";
}

}  // namespace

Result<std::string> Inspect(const std::string& checkpoint, const InspectOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceCheckpoint> src, OpenCheckpoint(checkpoint, options));
  std::string notes;
  for (const std::string& note : OpenNotes(*src, options)) notes += "note: " + note + "\n";
  return "checkpoint: " + src->info().tag_dir + "\n" + FormatLine(src->info()) + src->info().summary + "\n" +
         src->Describe() + notes;
}

}  // namespace reshard
