// PickleWriter: serialises a Value tree as a protocol-2 pickle that
// torch.load reads, in the shape torch.save gives it.
//
// Tensors become persistent ids ('storage', torch.<Type>Storage, key,
// location, numel) followed by torch._utils._rebuild_tensor_v2; Objects are
// emitted exactly as they were read (class, construction opcode, arguments,
// state, items). Storages are numbered in order of first appearance; the
// caller receives each one through `StorageSink` to write its bytes.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

// Receives every distinct storage once, with the key the pickle refers to it by.
using StorageSink = std::function<Status(const std::string& key, const Storage& storage)>;

// Refuses a tree holding a class the reader took only on trust
// (Global::trusted_only: one --allow-class let it read, an inert record):
// torch.load of the output would make its call, and reshard passes on no
// call it does not know to be data. The error names the class and where it
// lies in the tree ("args.gizmo").
Status CheckWritable(const Value& root);

// Serialises `root` (CheckWritable first). Storages shared between tensors
// are emitted once.
Result<std::string> WritePickle(const Value& root, const StorageSink& sink);

}  // namespace reshard
