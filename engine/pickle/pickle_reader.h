// PickleReader: parses a Python pickle stream into a Value tree without
// executing anything.
//
// Supported: protocols 0-5 opcodes that torch.save and DeepSpeed produce
// (protocol 2 in practice), persistent ids for tensor storages, memo
// references. Every global the stream names must be on an allow-list: the
// generic classes built in here (Python builtins, torch, NumPy), the classes
// of the checkpoint format being read, or classes the user allows. Any other
// global is refused.
//
// reshard never makes a pickle's calls, but torch.load makes them when it
// loads a file reshard wrote, and allowed calls compose into code execution
// (getattr of a function's __globals__ reaches eval). So each allowed global
// is accepted only in the shape of call torch.save and Python's pickler make
// of it, with data for arguments, and BUILD, SETITEMS and APPENDS only on the
// objects whose class takes them. A call of another shape is refused; an
// accepted call the reader does not interpret is carried through as an
// opaque Object.
//
//   PickleReader reader(options, resolver);
//   Result<Value> root = reader.Parse(bytes, size);
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <map>
#include <set>
#include <string>

#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

// A class of a checkpoint format, and so the calls a pickle may make of it.
struct KnownClass {
  enum class Kind {
    // An enum: Class(value) with one constant (Python < 3.11), or
    // getattr(Class, 'member') naming one of `members` (Python >= 3.11).
    kEnum,
    // A plain class (a dataclass, an attribute bag): built by NEWOBJ of no
    // arguments, then BUILD with a dict of its attributes.
    kRecord,
    // A record whose class takes its state as a tuple: NEWOBJ of no
    // arguments, then BUILD with a tuple (DCP's TensorProperties).
    kTupleRecord,
    // A value named by constants: Class(c1, c2, ...) with plain constant
    // arguments (str, int, ...) and no state: a path (pathlib.PosixPath), a
    // lookup by name (torch.serialization._get_layout('torch.strided')).
    kValue,
  };
  Kind kind = Kind::kRecord;
  std::set<std::string> members;  // kEnum: the member names
};

// By "module.name".
using KnownClasses = std::map<std::string, KnownClass>;

struct PickleReadOptions {
  // The classes of the checkpoint format being read, e.g.
  // &DeepSpeedKnownClasses(); not owned, must outlive the reader.
  const KnownClasses* known_classes = nullptr;
  // Classes the user allows (--allow-class "module.name"): any call of them
  // is read as an opaque Object, on the user's word, its Global marked
  // trusted_only, which no writer writes (CheckWritable). They override a
  // format's class of the same name, never a generic one. "module.Enum.member"
  // allows getattr(module.Enum, 'member') for a member of a format's enum
  // that KnownClass::members does not list.
  std::set<std::string> allowed_globals;
  // Top-level packages ("megatron") whose globals on no list are read as
  // inert records (any call of them is carried through as an opaque Object)
  // instead of being refused. Only for callers that take plain data out of
  // the tree and never write it back: a Distributed Checkpoint's `.metadata`
  // holds other libraries' classes (Megatron's MCoreSavePlan) beside the
  // fields reshard reads. A global of any other package (os.system) is
  // refused as ever.
  std::set<std::string> inert_packages;
  // Python attributes of a tensor that are its writer's bookkeeping, not
  // data (FSDP1 marks each tensor of its full state dict
  // `_has_been_cloned`): a tensor with only these is read as the plain
  // tensor; any other attribute is refused.
  std::set<std::string> dropped_tensor_attributes;
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
