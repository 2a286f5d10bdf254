// Reading and writing torch.save files (the PyTorch zip container).
//
// A torch.save file is a zip archive holding `<archive>/data.pkl` (the
// pickled object tree) and one record `<archive>/data/<key>` per tensor
// storage. ReadTorchFile parses the pickle with reshard's own reader (nothing
// is executed) and binds each storage to its bytes inside a memory map of the
// file, so tensors cost nothing until they are touched. WriteTorchFile writes
// a Value tree back in the layout torch.load expects.
#pragma once

#include <string>

#include "pickle/pickle_reader.h"
#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

// Errors: InvalidInput for a file that is not a torch.save zip or whose
// storages are truncated, Unsupported for pickled classes reshard refuses.
Result<Value> ReadTorchFile(const std::string& path, const PickleReadOptions& options = {});

// Writes `root` to `path` (replacing it). Every storage reachable from `root`
// must have its bytes bound.
Status WriteTorchFile(const std::string& path, const Value& root);

}  // namespace reshard
