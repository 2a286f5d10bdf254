// Reading safetensors files: an 8-byte little-endian header length, a JSON
// header naming each tensor's dtype, shape and byte range, then the bytes.
// Each tensor is bound to its bytes inside a memory map of the file, so it
// costs nothing until it is touched. Nothing in the file is executed: the
// format holds no code.
//
// The header is checked whole before any tensor is returned: known dtypes,
// shapes whose bytes are the range's length, ranges inside the file that do
// not overlap. Any problem is one error naming the file and the tensor.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "container/mapped_file.h"
#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

struct SafetensorsFile {
  // Name and tensor, in the order of their bytes in the file.
  std::vector<std::pair<std::string, Value>> tensors;
  Value metadata = Value::MakeDict();  // "__metadata__": string -> string
};

Result<SafetensorsFile> ReadSafetensors(const std::string& path);

// The safetensors file filling `window` of `file`, its offsets relative to
// the window's start; its tensors are bound inside `file`.
Result<SafetensorsFile> ReadSafetensors(std::shared_ptr<const MappedFile> file, const FileWindow& window);

}  // namespace reshard
