// Reading and writing torch.save files (the PyTorch zip container).
//
// A torch.save file is a zip archive holding `<archive>/data.pkl` (the
// pickled object tree) and one record `<archive>/data/<key>` per tensor
// storage. ReadTorchFile parses the pickle with reshard's own reader (nothing
// is executed) and binds each storage to its bytes inside a memory map of the
// file, so tensors cost nothing until they are touched. WriteTorchFile writes
// a Value tree back in the layout torch.load expects.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "container/mapped_file.h"
#include "pickle/pickle_reader.h"
#include "pickle/value.h"
#include "reshard/status.h"
#include "util/crc32.h"

namespace reshard {

// Errors: InvalidInput for a file that is not a torch.save zip, whose
// records are compressed or disagree with the zip directory, or whose
// storages do not fill their records exactly; Unsupported for pickled
// classes and calls reshard refuses.
Result<Value> ReadTorchFile(const std::string& path, const PickleReadOptions& options = {});

// The torch.save archive filling `window` of `file` (a Distributed
// Checkpoint item inside its `.distcp` file), read as ReadTorchFile reads a
// whole file; its storages are bound inside `file`.
Result<Value> ReadTorchArchive(std::shared_ptr<const MappedFile> file, const FileWindow& window,
                               const PickleReadOptions& options = {});

struct TorchWriteOptions {
  // The buffer tensor data streams through (reused across files); null or
  // empty: one of 1 MiB for this file.
  std::vector<uint8_t>* buffer = nullptr;
  // Told the tensor bytes written after each buffer.
  std::function<void(int64_t)> written;
  // Set to the file's size and CRC-32 once it is complete (may be null).
  FileDigest* digest = nullptr;
};

// Writes `root` to `path` (replacing it). Every storage reachable from `root`
// must have its bytes bound or a producer.
Status WriteTorchFile(const std::string& path, const Value& root,
                      const TorchWriteOptions& options = {});

// The bytes of every storage reachable from `root` (each counted once).
Result<int64_t> TensorBytes(const Value& root);

}  // namespace reshard
