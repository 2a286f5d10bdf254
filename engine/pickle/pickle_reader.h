// PickleReader: parses a Python pickle stream into a Value tree without
// executing anything.
//
// Supported: protocols 0-5 opcodes that torch.save and DeepSpeed produce
// (protocol 2 in practice), persistent ids for tensor storages, memo
// references. Every global the stream names must be on an allow-list: the
// generic classes built in here (Python builtins, torch, NumPy), the classes
// of the checkpoint format being read, or classes the user allows. Any other
// global is refused; an allowed one the reader does not interpret is carried
// through as an opaque Object and never called.
//
//   PickleReader reader(options, resolver);
//   Result<Value> root = reader.Parse(bytes, size);
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>

#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

struct PickleReadOptions {
  // The classes ("module.name") of the checkpoint format being read, e.g.
  // &DeepSpeedKnownClasses(); not owned, must outlive the reader.
  const std::set<std::string>* known_classes = nullptr;
  // Classes the user allows (--allow-class). Both lists are accepted like the
  // built-in one; they differ only in who vouches for a class.
  std::set<std::string> allowed_globals;
  // Refuse streams nested deeper than this (protects the stack).
  int max_depth = 1000;
};

// Called for each distinct storage the stream references. It returns the
// Storage object (typically with `bytes` bound lazily by the container).
using StorageResolver = std::function<Result<std::shared_ptr<Storage>>(
    const std::string& key, DType dtype, int64_t numel, const std::string& location)>;

// True when `qualified` ("module.name") is on the reader's built-in list of
// generic classes (not a format's known_classes).
bool IsKnownGlobal(const std::string& qualified);

class PickleReader {
 public:
  // `resolver` may be empty: storages are then created without bytes.
  PickleReader(PickleReadOptions options, StorageResolver resolver);

  // Parses one pickle (up to its STOP opcode).
  Result<Value> Parse(const uint8_t* data, size_t size);

 private:
  PickleReadOptions options_;
  StorageResolver resolver_;
};

}  // namespace reshard
