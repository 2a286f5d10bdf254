// reshard::Inspect: a readable description of a checkpoint.
#include "formats/format.h"
#include "reshard/reshard.h"

namespace reshard {

Result<std::string> Inspect(const std::string& checkpoint, const InspectOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceCheckpoint> src, OpenCheckpoint(checkpoint, options));
  std::string notes;
  for (const std::string& note : src->info().notes) notes += "note: " + note + "\n";
  return "checkpoint: " + src->info().tag_dir + "\n" + src->info().summary + "\n" + src->Describe() + notes;
}

}  // namespace reshard
