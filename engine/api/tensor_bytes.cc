#include "api/tensor_bytes.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "container/mapped_file.h"
#include "container/record_crc.h"

namespace reshard {
namespace {

int64_t NumelOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A private, writable mapping of `span`: pages are read from the file when
// touched and copied only when written, never back to the file.
Result<std::shared_ptr<void>> MapPrivately(const FileSpan& span, uint8_t** data) {
  static const int64_t page = ::sysconf(_SC_PAGESIZE);
  const int64_t start = span.offset / page * page;
  const size_t length = static_cast<size_t>(span.offset - start + span.length);
  void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE, span.fd, start);
  if (base == MAP_FAILED) return Status::IoError(std::string("cannot map a tensor's bytes: ") + std::strerror(errno));
  *data = static_cast<uint8_t*>(base) + (span.offset - start);
  return std::shared_ptr<void>(base, [length](void* p) { ::munmap(p, length); });
}

Result<TensorBytes> Produced(TensorBytes t, const ByteProducer& produce) {
  const InPlaceBytes* in_place = produce.in_place();
  if (in_place != nullptr && in_place->span.length == t.size && t.size > 0) {
    RESHARD_RETURN_IF_ERROR(in_place->check());
    RESHARD_ASSIGN_OR_RETURN(t.owner, MapPrivately(in_place->span, &t.data));
    t.mapped = true;
  } else {
    auto buffer = std::shared_ptr<uint8_t>(new uint8_t[static_cast<size_t>(std::max<int64_t>(t.size, 1))],
                                           std::default_delete<uint8_t[]>());
    t.data = buffer.get();
    t.owner = buffer;
    if (t.size > 0) RESHARD_RETURN_IF_ERROR(produce(0, t.size, t.data));
  }
  RESHARD_RETURN_IF_ERROR(CheckReadRecords());
  return t;
}

// The elements of a contiguous tensor of a tree, from its storage.
ByteProducer TensorProducer(const Tensor& t, int64_t bytes) {
  const Storage& storage = *t.storage;
  if (storage.produce) return BytesFrom(storage.produce, t.storage_offset * ElementSize(storage.dtype));
  const ByteView view = storage.bytes;
  const uint8_t* from = view.data + t.storage_offset * ElementSize(storage.dtype);
  return [view, from, bytes](int64_t offset, int64_t length, uint8_t* dst) {
    if (from + offset + length > view.data + view.size) return Status::Internal("a tensor reads past its storage");
    TouchedPages pages;
    CopyFromView(view, from + offset, static_cast<size_t>(length), dst, &pages);
    return Status::Ok();
  };
}

Result<TreeValue> TensorValue(const Tensor& t) {
  if (!t.IsContiguous()) {
    return Status::Unsupported("a tensor of the tree is a strided view of its storage, which reshard does not "
                               "read into a tensor of its own");
  }
  const DType dtype = t.storage->dtype;
  TreeValue out;
  out.kind = TreeValue::Kind::kTensor;
  RESHARD_ASSIGN_OR_RETURN(out.tensor, MakeTensorBytes(dtype, t.sizes, TensorProducer(t, NumelOf(t.sizes) *
                                                                                            ElementSize(dtype))));
  return out;
}

Result<TreeValue> Sequence(TreeValue::Kind kind, const std::vector<Value>& items) {
  TreeValue out;
  out.kind = kind;
  for (const Value& item : items) {
    RESHARD_ASSIGN_OR_RETURN(TreeValue v, MakeTreeValue(item));
    out.items.push_back(std::move(v));
  }
  return out;
}

Result<TreeValue> Mapping(const Items& items) {
  TreeValue out;
  out.kind = TreeValue::Kind::kDict;
  for (const auto& [key, value] : items) {
    RESHARD_ASSIGN_OR_RETURN(TreeValue k, MakeTreeValue(key));
    RESHARD_ASSIGN_OR_RETURN(TreeValue v, MakeTreeValue(value));
    out.entries.emplace_back(std::move(k), std::move(v));
  }
  return out;
}

Result<TreeValue> ObjectValue(const Value& v) {
  const Object& o = v.as_object();
  std::vector<int64_t> dims;
  if (o.cls.Is("torch", "Size") && ReadIntSequence(v, &dims)) {
    TreeValue out;
    out.kind = TreeValue::Kind::kTuple;
    for (int64_t d : dims) {
      TreeValue dim;
      dim.kind = TreeValue::Kind::kInt;
      dim.integer = d;
      out.items.push_back(std::move(dim));
    }
    return out;
  }
  if (IsOrderedDict(v)) return Mapping(*DictItems(v));
  RESHARD_ASSIGN_OR_RETURN(TreeValue out, Sequence(TreeValue::Kind::kObject, o.args));
  out.text = o.cls.Qualified();
  Items state = o.dict_items;
  if (o.state != nullptr) {
    const Items* fields = DictItems(*o.state);
    if (fields != nullptr) state.insert(state.end(), fields->begin(), fields->end());
    else state.emplace_back(Value::String("__state__"), *o.state);
  }
  RESHARD_ASSIGN_OR_RETURN(TreeValue entries, Mapping(state));
  out.entries = std::move(entries.entries);
  for (const Value& item : o.list_items) {
    RESHARD_ASSIGN_OR_RETURN(TreeValue element, MakeTreeValue(item));
    out.items.push_back(std::move(element));
  }
  return out;
}

Result<int64_t> SmallInt(const Value::BigInt& big) {
  const std::string& le = big.le_bytes;
  if (le.size() > 8) return Status::Unsupported("an integer of the tree does not fit in 64 bits");
  uint64_t bits = 0;
  for (size_t i = 0; i < le.size(); ++i) bits |= static_cast<uint64_t>(static_cast<uint8_t>(le[i])) << (8 * i);
  if (!le.empty() && le.size() < 8 && (static_cast<uint8_t>(le.back()) & 0x80)) bits |= ~uint64_t{0} << (8 * le.size());
  return static_cast<int64_t>(bits);
}

}  // namespace

Result<TensorBytes> MakeTensorBytes(DType dtype, const std::vector<int64_t>& shape, const ByteProducer& produce) {
  TensorBytes t;
  t.dtype = DTypeName(dtype);
  t.shape = shape;
  t.size = NumelOf(shape) * ElementSize(dtype);
  return Produced(std::move(t), produce);
}

Result<TreeValue> MakeTreeValue(const Value& v) {
  using K = Value::Kind;
  using T = TreeValue::Kind;
  TreeValue out;
  switch (v.kind()) {
    case K::kNone: return out;
    case K::kBool: out.kind = T::kBool; out.boolean = v.as_bool(); return out;
    case K::kInt: out.kind = T::kInt; out.integer = v.as_int(); return out;
    case K::kBigInt: {
      out.kind = T::kInt;
      RESHARD_ASSIGN_OR_RETURN(out.integer, SmallInt(v.as_bigint()));
      return out;
    }
    case K::kFloat: out.kind = T::kFloat; out.number = v.as_float(); return out;
    case K::kString: out.kind = T::kString; out.text = v.as_string(); return out;
    case K::kBytes: out.kind = T::kBytes; out.text = v.as_bytes().data; return out;
    case K::kList: return Sequence(T::kList, v.as_list().items);
    case K::kTuple: return Sequence(T::kTuple, v.as_tuple().items);
    case K::kSet: return Sequence(T::kList, v.as_set().items);
    case K::kFrozenSet: return Sequence(T::kList, v.as_frozenset().items);
    case K::kDict: return Mapping(v.as_dict().items);
    case K::kTensor: return TensorValue(v.as_tensor());
    case K::kObject: return ObjectValue(v);
    case K::kGlobal: out.kind = T::kGlobal; out.text = v.as_global().Qualified(); return out;
  }
  return Status::Internal("a value of an unknown kind");
}

}  // namespace reshard
