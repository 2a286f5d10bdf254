// Value: what a checkpoint pickle holds, as plain data.
//
// reshard never executes a pickle. The reader turns the stream into a tree of
// Values: Python scalars and containers map to their own kinds, tensors to
// Tensor (a view of a Storage whose bytes live in the zip container), and every
// other object to Object — the class name plus the exact arguments and state
// the pickle gave it, so the writer can emit it again unchanged. Known classes
// (OrderedDict, torch.Size, argparse.Namespace, DeepSpeed's fragment_address,
// ...) are Objects too; helpers below give typed access to the ones reshard
// reads or edits.
//
// Values have value semantics (copying a tree copies it), except that
// Storages are shared: two tensors viewing one storage keep sharing it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "pickle/dtype.h"
#include "util/byte_producer.h"

namespace reshard {

class Value;

// A read-only run of bytes and the owner that keeps it alive (a memory-mapped
// file, a buffer). Empty when the storage has not been materialised.
struct ByteView {
  std::shared_ptr<const void> owner;
  const uint8_t* data = nullptr;
  size_t size = 0;
  // The bytes are a read-only file mapping: their pages may be dropped from
  // memory at any time and are read again from the file when touched.
  // `owner` is then the MappedFile (container/mapped_file.h).
  bool mapped = false;
};

// One PyTorch storage: `numel` elements of `dtype`.
struct Storage {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  std::string location = "cpu";  // as pickled: "cpu", "cuda:0", ...
  std::string record_key;         // key of `data/<key>` in the source archive; empty for new storages
  ByteView bytes;                 // numel * ElementSize(dtype) bytes once loaded
  // A storage written by reshard may instead be produced piecewise while it
  // is written (see ByteProducer); then `bytes` is empty.
  ByteProducer produce;
};

// A Python global reference: `module.name` (a class or function).
struct Global {
  std::string module;
  std::string name;
  // Read only on trust: the reader took it without knowing its call to be
  // data (a class the user allowed, an inert record). reshard reads such a
  // value and never writes one (CheckWritable, pickle_writer.h).
  bool trusted_only = false;
  std::string Qualified() const { return module + "." + name; }
  bool Is(const char* m, const char* n) const { return module == m && name == n; }
  bool operator==(const Global& o) const { return module == o.module && name == o.name; }
};

// torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, ...).
struct Tensor {
  std::shared_ptr<Storage> storage;
  int64_t storage_offset = 0;  // in elements
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  bool requires_grad = false;
  std::vector<Value> extra_args;  // backward hooks and anything after them, kept as read

  int64_t numel() const;
  bool IsContiguous() const;
  // Strides of a contiguous tensor of `sizes`.
  static std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& sizes);
};

// Any object the pickle builds by calling a class or function (REDUCE or NEWOBJ),
// optionally followed by BUILD (state), SETITEMS and APPENDS.
struct Object {
  enum class Construct { kReduce, kNewObj };
  Global cls;
  Construct construct = Construct::kReduce;
  std::vector<Value> args;                        // the argument tuple
  std::shared_ptr<Value> state;                   // BUILD argument; null when absent
  std::vector<std::pair<Value, Value>> dict_items;  // SETITEM(S) applied after construction
  std::vector<Value> list_items;                  // APPEND(S) applied after construction

  // Copies are deep, like every Value: a copy's state can be edited alone.
  Object() = default;
  Object(const Object& other);
  Object& operator=(const Object& other);
  Object(Object&&) = default;
  Object& operator=(Object&&) = default;
};

using Items = std::vector<std::pair<Value, Value>>;

// A T on the heap that copies like a value. Value boxes its large kinds
// (tensors, objects, globals: 64-160 bytes) so that it is 40 bytes, not
// 168: a checkpoint's trees are mostly strings, numbers and containers, and
// every dict entry is two Values.
template <typename T>
class Boxed {
 public:
  Boxed(T v) : p_(std::make_unique<T>(std::move(v))) {}  // NOLINT: implicit, as T itself
  Boxed(const Boxed& o) : p_(o.p_ ? std::make_unique<T>(*o.p_) : nullptr) {}
  Boxed& operator=(const Boxed& o) {
    p_ = o.p_ ? std::make_unique<T>(*o.p_) : nullptr;
    return *this;
  }
  Boxed(Boxed&&) noexcept = default;
  Boxed& operator=(Boxed&&) noexcept = default;

  T& get() { return *p_; }
  const T& get() const { return *p_; }

 private:
  std::unique_ptr<T> p_;
};

class Value {
 public:
  enum class Kind {
    kNone, kBool, kInt, kBigInt, kFloat, kString, kBytes,
    kList, kTuple, kDict, kSet, kFrozenSet,
    kTensor, kObject, kGlobal,
  };
  struct BigInt { std::string le_bytes; };  // two's complement, little-endian (pickle LONG1/LONG4)
  struct Bytes { std::string data; };
  struct List { std::vector<Value> items; };
  struct Tuple { std::vector<Value> items; };
  struct Set { std::vector<Value> items; };
  struct FrozenSet { std::vector<Value> items; };
  struct Dict { Items items; };  // insertion order kept

  Value() = default;  // None
  static Value None() { return Value(); }
  static Value Bool(bool b) { return Value(b); }
  static Value Int(int64_t i) { return Value(i); }
  static Value Float(double d) { return Value(d); }
  static Value String(std::string s) { return Value(std::move(s)); }
  static Value MakeBytes(std::string s) { return Value(Bytes{std::move(s)}); }
  static Value MakeBigInt(std::string le) { return Value(BigInt{std::move(le)}); }
  static Value MakeList(std::vector<Value> v) { return Value(List{std::move(v)}); }
  static Value MakeTuple(std::vector<Value> v) { return Value(Tuple{std::move(v)}); }
  static Value MakeSet(std::vector<Value> v) { return Value(Set{std::move(v)}); }
  static Value MakeFrozenSet(std::vector<Value> v) { return Value(FrozenSet{std::move(v)}); }
  static Value MakeDict(Items items = {}) { return Value(Dict{std::move(items)}); }
  static Value MakeTensor(Tensor t) { return Value(std::move(t)); }
  static Value MakeObject(Object o) { return Value(std::move(o)); }
  static Value MakeGlobal(Global g) { return Value(std::move(g)); }

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  bool is_none() const { return kind() == Kind::kNone; }
  bool is(Kind k) const { return kind() == k; }

  // Accessors. REQUIRES: the matching kind.
  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_float() const { return std::get<double>(v_); }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const BigInt& as_bigint() const { return std::get<BigInt>(v_); }
  const Bytes& as_bytes() const { return std::get<Bytes>(v_); }
  const List& as_list() const { return std::get<List>(v_); }
  List& as_list() { return std::get<List>(v_); }
  const Tuple& as_tuple() const { return std::get<Tuple>(v_); }
  Tuple& as_tuple() { return std::get<Tuple>(v_); }
  const Set& as_set() const { return std::get<Set>(v_); }
  const FrozenSet& as_frozenset() const { return std::get<FrozenSet>(v_); }
  const Dict& as_dict() const { return std::get<Dict>(v_); }
  Dict& as_dict() { return std::get<Dict>(v_); }
  const Tensor& as_tensor() const { return std::get<Boxed<Tensor>>(v_).get(); }
  Tensor& as_tensor() { return std::get<Boxed<Tensor>>(v_).get(); }
  const Object& as_object() const { return std::get<Boxed<Object>>(v_).get(); }
  Object& as_object() { return std::get<Boxed<Object>>(v_).get(); }
  const Global& as_global() const { return std::get<Boxed<Global>>(v_).get(); }

  // A Python-like one-line rendering for messages and `inspect`
  // (tensors as `tensor(bfloat16, [4, 16])`, objects as `module.name(...)`).
  std::string DebugString(size_t max_len = 200) const;

 private:
  explicit Value(bool b) : v_(b) {}
  explicit Value(int64_t i) : v_(i) {}
  explicit Value(double d) : v_(d) {}
  explicit Value(std::string s) : v_(std::move(s)) {}
  explicit Value(BigInt b) : v_(std::move(b)) {}
  explicit Value(Bytes b) : v_(std::move(b)) {}
  explicit Value(List l) : v_(std::move(l)) {}
  explicit Value(Tuple t) : v_(std::move(t)) {}
  explicit Value(Dict d) : v_(std::move(d)) {}
  explicit Value(Set s) : v_(std::move(s)) {}
  explicit Value(FrozenSet s) : v_(std::move(s)) {}
  explicit Value(Tensor t) : v_(Boxed<Tensor>(std::move(t))) {}
  explicit Value(Object o) : v_(Boxed<Object>(std::move(o))) {}
  explicit Value(Global g) : v_(Boxed<Global>(std::move(g))) {}

  // Order matches Kind.
  std::variant<std::monostate, bool, int64_t, BigInt, double, std::string, Bytes,
               List, Tuple, Dict, Set, FrozenSet, Boxed<Tensor>, Boxed<Object>, Boxed<Global>>
      v_;
};

// ---- Typed access to the objects checkpoints are made of --------------------

// The string-keyed entries of a dict-like value: a plain dict, a
// collections.OrderedDict, or an object's BUILD state dict (argparse.Namespace,
// dataclasses). Null when `v` is none of these.
const Items* DictItems(const Value& v);
Items* MutableDictItems(Value& v);

// Looks up `key` among DictItems(v). Null when absent or `v` is not dict-like.
const Value* Find(const Value& v, const std::string& key);
Value* FindMutable(Value& v, const std::string& key);

// Replaces the value under `key` or appends it at the end. REQUIRES: dict-like.
void Set(Value& v, const std::string& key, Value item);

// collections.OrderedDict with `items`, pickled the way torch.save does.
Value MakeOrderedDict(Items items);
bool IsOrderedDict(const Value& v);

// argparse.Namespace(**fields), pickled as Python pickles it (NEWOBJ with no
// arguments, then BUILD with the fields): what Megatron saves as `args`.
Value MakeNamespace(Items fields);

// A contiguous tensor of `shape` over a new storage holding `bytes`
// (numel * ElementSize(dtype) of them), which may view part of a larger buffer.
Value MakeTensorOver(DType dtype, const std::vector<int64_t>& shape, ByteView bytes,
                     const std::string& location = "cpu");

// `v` when it is not a tensor; else the same contiguous tensor over a storage
// of its own holding just its elements: a view into a larger buffer is then
// written compact, and no tensor shares a storage another may update in place.
Value WithOwnStorage(const Value& v);

// A contiguous tensor of `shape` whose bytes `produce` makes while it is written.
Value MakeProducedTensor(DType dtype, const std::vector<int64_t>& shape, ByteProducer produce);

// The same over a buffer the storage owns.
Value MakeOwnedTensor(DType dtype, const std::vector<int64_t>& shape,
                      std::shared_ptr<std::vector<uint8_t>> bytes, const std::string& location = "cpu");

// torch.Size(dims).
Value MakeTorchSize(const std::vector<int64_t>& dims);
// The dims of a torch.Size, tuple or list of ints; false when `v` is none of these.
bool ReadIntSequence(const Value& v, std::vector<int64_t>* out);

// An int (kInt) or a bool; false otherwise.
bool ReadInt(const Value& v, int64_t* out);

}  // namespace reshard
