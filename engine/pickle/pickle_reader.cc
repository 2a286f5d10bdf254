#include "pickle/pickle_reader.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "pickle/opcodes.h"
#include "pickle/text_codecs.h"

namespace reshard {

// ---- The allow-list and the calls it allows ---------------------------------------

namespace {

// How a pickle may use a global: the one shape of call torch.save and
// Python's pickler make of it (see the header for why no other is accepted).
enum class Use {
  kName,           // only named, never called: dtypes, storage types, torch.Tensor
  kOrderedDict,    // OrderedDict(); then SETITEMS, and BUILD of its attributes
  kRecord,         // NEWOBJ of no arguments, then BUILD of its attributes
  kSet,            // set() or set(list); frozenset likewise
  kBytes,          // bytes(): b'' in protocol 2
  kEncode,         // _codecs.encode(str, 'latin1'): bytes in protocol 2
  kByteArray,      // bytearray(bytes), or bytearray(str, 'latin-1') in protocol 2
  kSlice,          // slice(start, stop, step) of ints and Nones
  kComplex,        // complex(real, imag)
  kGetAttr,        // getattr(EnumClass, 'member'): an enum member since Python 3.11
  kRebuildTensor,  // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])
  kTypedTensor,    // _rebuild_from_type_v2(_rebuild_tensor_v2, torch.Tensor, args, None)
  kParameter,      // _rebuild_parameter(tensor, requires_grad, hooks)
  kSize,           // torch.Size(ints)
  kTensorMeta,     // TensorMeta(torch.Size, stride, dtype) by NEWOBJ: a DTensor's global shape
  kDevice,         // torch.device(type[, index])
  kNumpyArray,     // _reconstruct(numpy.ndarray, shape, bytes); then BUILD of a state tuple
  kNumpyDType,     // numpy.dtype(str, bool, bool); then BUILD of a state tuple
  kNumpyScalar,    // scalar(numpy.dtype, bytes)
  kEnum,           // a format's enum (KnownClass::Kind::kEnum)
  kTupleRecord,    // NEWOBJ of no arguments, then BUILD of a tuple (KnownClass::Kind::kTupleRecord)
  kValue,          // Class(constants) (KnownClass::Kind::kValue)
  kInert,          // a global on no list, read as an inert record (inert_packages)
  kUser,           // allowed by the user: any call, on the user's word
};

// The accepted call of each use, for messages.
const char* Shape(Use use) {
  switch (use) {
    case Use::kName: return "as a name, never called";
    case Use::kOrderedDict: return "as OrderedDict()";
    case Use::kRecord: return "as Class.__new__(Class) (NEWOBJ of no arguments), then BUILD";
    case Use::kSet: return "as set() or set(list)";
    case Use::kBytes: return "as bytes()";
    case Use::kEncode: return "as _codecs.encode(str, 'latin1')";
    case Use::kByteArray: return "as bytearray(bytes)";
    case Use::kSlice: return "as slice() of ints and Nones";
    case Use::kComplex: return "as complex(real, imag)";
    case Use::kGetAttr: return "as getattr(EnumClass, 'member') for an enum class it knows";
    case Use::kRebuildTensor: return "around a torch storage, with no backward hooks";
    case Use::kTypedTensor:
      return "as _rebuild_from_type_v2(torch._utils._rebuild_tensor_v2, torch.Tensor, args, None), or of a DTensor "
             "as torch.save writes it";
    case Use::kParameter: return "as _rebuild_parameter(tensor, bool, OrderedDict())";
    case Use::kSize: return "as torch.Size(ints)";
    case Use::kTensorMeta: return "as TensorMeta.__new__(TensorMeta, torch.Size, stride, dtype)";
    case Use::kDevice: return "as torch.device(str[, int])";
    case Use::kNumpyArray: return "as _reconstruct(numpy.ndarray, shape, bytes)";
    case Use::kNumpyDType: return "as numpy.dtype(str, bool, bool)";
    case Use::kNumpyScalar: return "as scalar(numpy.dtype, bytes)";
    case Use::kEnum: return "as EnumClass(value) or getattr(EnumClass, 'member')";
    case Use::kTupleRecord: return "as Class.__new__(Class) (NEWOBJ of no arguments), then BUILD of a tuple";
    case Use::kValue: return "as Class(constants)";
    case Use::kInert:
    case Use::kUser: return "in any call";
  }
  return "";
}

// Globals any torch.save checkpoint may hold. A checkpoint format adds its
// own through PickleReadOptions::known_classes.
const std::map<std::string, Use>& GenericGlobals() {
  static const std::map<std::string, Use> known = [] {
    // clang-format off
    std::map<std::string, Use> m = {
        // Plain data.
        {"collections.OrderedDict", Use::kOrderedDict}, {"argparse.Namespace", Use::kRecord},
        {"builtins.set", Use::kSet}, {"builtins.frozenset", Use::kSet},
        {"builtins.slice", Use::kSlice}, {"builtins.complex", Use::kComplex},
        {"builtins.bytes", Use::kBytes}, {"builtins.bytearray", Use::kByteArray},
        {"_codecs.encode", Use::kEncode}, {"codecs.encode", Use::kEncode},
        {"builtins.getattr", Use::kGetAttr},
        // Tensors and their metadata.
        {"torch._utils._rebuild_tensor_v2", Use::kRebuildTensor},
        {"torch._tensor._rebuild_from_type_v2", Use::kTypedTensor},
        {"torch._utils._rebuild_parameter", Use::kParameter},
        {"torch.nn.parameter.Parameter", Use::kName}, {"torch.Tensor", Use::kName},
        {"torch.Size", Use::kSize}, {"torch.device", Use::kDevice},
        {"torch.serialization._get_layout", Use::kValue},
        // A DTensor (torch.distributed.tensor), read as its local tensor where that is the whole.
        {"torch._utils._rebuild_wrapper_subclass", Use::kName}, {"torch.distributed.tensor.DTensor", Use::kName},
        {"torch.distributed.tensor._dtensor_spec.DTensorSpec", Use::kRecord},
        {"torch.distributed.tensor._dtensor_spec.TensorMeta", Use::kTensorMeta},
        {"torch.distributed.device_mesh.DeviceMesh", Use::kRecord},
        {"torch.distributed.tensor.placement_types.Shard", Use::kRecord},
        {"torch.distributed.tensor.placement_types.Replicate", Use::kRecord},
        {"torch.distributed.tensor.placement_types.Partial", Use::kRecord},
        // dtype aliases; the canonical names (torch.float32, ...) are added below.
        {"torch.float", Use::kName}, {"torch.half", Use::kName}, {"torch.long", Use::kName},
        {"torch.int", Use::kName}, {"torch.double", Use::kName},
        // NumPy arrays and scalars (the NumPy RNG state); numpy._core is NumPy >= 2.
        {"numpy.core.multiarray._reconstruct", Use::kNumpyArray},
        {"numpy._core.multiarray._reconstruct", Use::kNumpyArray},
        {"numpy.core.multiarray.scalar", Use::kNumpyScalar},
        {"numpy._core.multiarray.scalar", Use::kNumpyScalar},
        {"numpy.ndarray", Use::kName}, {"numpy.dtype", Use::kNumpyDType},
    };
    // clang-format on
    for (int d = 0; d <= static_cast<int>(DType::kComplex128); ++d) {  // the last DType
      m.emplace(std::string("torch.") + StorageClassName(static_cast<DType>(d)), Use::kName);
      m.emplace(std::string("torch.") + DTypeName(static_cast<DType>(d)), Use::kName);
    }
    return m;
  }();
  return known;
}

}  // namespace

bool IsKnownGlobal(const std::string& qualified) { return GenericGlobals().count(qualified) > 0; }

namespace {

// The use of `qualified`, or null when it is on no list. Generic globals keep
// their shapes whatever the user allows: they are what calls compose from.
std::optional<Use> UseOf(const std::string& qualified, const PickleReadOptions& options) {
  if (auto it = GenericGlobals().find(qualified); it != GenericGlobals().end()) return it->second;
  if (options.allowed_globals.count(qualified) > 0) return Use::kUser;
  if (options.known_classes != nullptr) {
    auto it = options.known_classes->find(qualified);
    if (it != options.known_classes->end()) {
      switch (it->second.kind) {
        case KnownClass::Kind::kEnum: return Use::kEnum;
        case KnownClass::Kind::kRecord: return Use::kRecord;
        case KnownClass::Kind::kTupleRecord: return Use::kTupleRecord;
        case KnownClass::Kind::kValue: return Use::kValue;
      }
    }
  }
  if (options.inert_packages.count(qualified.substr(0, qualified.find('.')))) return Use::kInert;
  return std::nullopt;
}

// A name a class's public attribute may have: no dunder, nothing private.
bool IsPublicName(const std::string& name) {
  if (name.empty() || !std::isalpha(static_cast<unsigned char>(name[0]))) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

}  // namespace

// ---- Parsing --------------------------------------------------------------------

namespace {

// Python 2 module names that protocol 0-2 pickles use; Python maps them back
// when loading (its fix_imports), and so do we.
std::string Py3Module(const std::string& module) {
  if (module == "__builtin__") return "builtins";
  if (module == "copy_reg") return "copyreg";
  return module;
}

// The int that little-endian two's complement bytes (LONG1, LONG4) encode:
// kInt when it fits int64, else kBigInt keeping the bytes.
Value IntFromLE(const std::string& le) {
  if (le.empty()) return Value::Int(0);
  const bool negative = static_cast<uint8_t>(le.back()) & 0x80;
  const uint8_t ext = negative ? 0xff : 0x00;
  // Non-minimal encodings may carry extra sign bytes; the value fits int64
  // when everything above the low 8 bytes is sign extension of byte 7.
  bool fits = true;
  for (size_t i = 8; i < le.size(); ++i) fits = fits && static_cast<uint8_t>(le[i]) == ext;
  if (le.size() > 8 && fits) fits = (static_cast<uint8_t>(le[7]) & 0x80) == (ext & 0x80);
  if (!fits) return Value::MakeBigInt(le);
  uint64_t bits = negative ? ~uint64_t{0} : 0;
  for (size_t i = 0; i < std::min<size_t>(le.size(), 8); ++i) {
    bits &= ~(uint64_t{0xff} << (8 * i));
    bits |= uint64_t{static_cast<uint8_t>(le[i])} << (8 * i);
  }
  return Value::Int(static_cast<int64_t>(bits));
}

// What may be applied to an object after the call that made it (Node::then).
enum Then : uint8_t {
  kThenSetItems = 1,     // SETITEM(S)
  kThenAppends = 2,      // APPEND(S)
  kThenAttributes = 4,   // BUILD of a dict of attribute names
  kThenStateTuple = 8,   // BUILD of a tuple (NumPy's __setstate__)
  kThenAnyState = 16,    // BUILD of anything
};

// While parsing, every object lives in one Node that the stack, the memo and
// the containers holding it all point to, so SETITEMS, APPENDS and BUILD on an
// object also reach the copies the memo hands out. Values are materialised
// from the nodes once the stream is complete.
struct Node {
  enum class Kind { kLeaf, kStorage, kList, kTuple, kDict, kSet, kFrozenSet, kObject, kTensor };
  Kind kind = Kind::kLeaf;
  // kLeaf: the value. kObject: an Object with class and construction only.
  // kTensor: the tensor without its extra arguments.
  Value leaf;
  std::shared_ptr<Storage> storage;  // kStorage
  std::vector<Node*> items;          // elements; kObject: arguments; kTensor: extra arguments
  std::vector<Node*> appends;        // kObject: APPEND(S)
  std::vector<std::pair<Node*, Node*>> pairs;  // kDict: items; kObject: SETITEM(S)
  Node* state = nullptr;                       // kObject: BUILD
  uint8_t then = 0;                            // kObject: Then bits its call's shape allows
  bool visiting = false;                       // being materialised (finds cycles)
};

// Owns the nodes of one parse. A checkpoint pickle makes millions of them and
// frees none before the end, so they are allocated in blocks.
class NodeArena {
 public:
  Node* New(Node::Kind kind) {
    if (used_ == kBlock) {
      blocks_.push_back(std::make_unique<Node[]>(kBlock));
      used_ = 0;
    }
    Node* n = &blocks_.back()[used_++];
    n->kind = kind;
    return n;
  }

 private:
  static constexpr size_t kBlock = 1024;
  std::vector<std::unique_ptr<Node[]>> blocks_;
  size_t used_ = kBlock;
};

bool IsLeaf(const Node* n, Value::Kind kind) {
  return n->kind == Node::Kind::kLeaf && n->leaf.is(kind);
}

bool LeafString(const Node* n, std::string* out) {
  if (!IsLeaf(n, Value::Kind::kString)) return false;
  *out = n->leaf.as_string();
  return true;
}

bool LeafInt(const Node* n, int64_t* out) {
  if (!IsLeaf(n, Value::Kind::kInt)) return false;
  *out = n->leaf.as_int();
  return true;
}

// A tuple, list or torch.Size of ints.
bool NodeInts(const Node* n, std::vector<int64_t>* out) {
  if (n->kind == Node::Kind::kObject && n->leaf.as_object().cls.Is("torch", "Size")) {
    if (n->items.size() != 1) return false;
    n = n->items[0];
  }
  if (n->kind != Node::Kind::kTuple && n->kind != Node::Kind::kList) return false;
  out->clear();
  for (const Node* item : n->items) {
    int64_t v;
    if (!LeafInt(item, &v)) return false;
    out->push_back(v);
  }
  return true;
}

bool IsGlobalLeaf(const Node* n, const char* module, const char* name) {
  return IsLeaf(n, Value::Kind::kGlobal) && n->leaf.as_global().Is(module, name);
}

bool IsObjectOf(const Node* n, const char* module, const char* name) {
  return n->kind == Node::Kind::kObject && n->leaf.as_object().cls.Is(module, name);
}

// A constant: a leaf that is not a global.
bool IsConstant(const Node* n) {
  return n->kind == Node::Kind::kLeaf && !n->leaf.is(Value::Kind::kGlobal);
}

bool IsIntOrNone(const Node* n) {
  return IsLeaf(n, Value::Kind::kInt) || IsLeaf(n, Value::Kind::kNone);
}

bool IsNumber(const Node* n) {
  return IsLeaf(n, Value::Kind::kInt) || IsLeaf(n, Value::Kind::kFloat);
}

bool IsFlag(const Node* n) {
  return IsLeaf(n, Value::Kind::kBool) || IsLeaf(n, Value::Kind::kInt);
}

bool IsInts(const Node* n) {
  std::vector<int64_t> ints;
  return (n->kind == Node::Kind::kTuple || n->kind == Node::Kind::kList) && NodeInts(n, &ints);
}

bool IsLatin1Name(const Node* n) {
  std::string encoding;
  return LeafString(n, &encoding) && (encoding == "latin1" || encoding == "latin-1");
}

// The bytes _codecs.encode(text, 'latin1') gives; false for any other call.
bool EncodedBytes(const std::vector<Node*>& args, std::string* bytes) {
  std::string text;
  return args.size() == 2 && LeafString(args[0], &text) && IsLatin1Name(args[1]) &&
         Utf8ToLatin1(text, bytes);
}

// OrderedDict() with nothing in it: the backward hooks torch.save writes.
bool IsEmptyOrderedDict(const Node* n) {
  return IsObjectOf(n, "collections", "OrderedDict") && n->items.empty() && n->pairs.empty() &&
         n->appends.empty() && n->state == nullptr;
}

// A dict of constants by string keys, or None: _rebuild_tensor_v2's metadata.
bool IsConstantDictOrNone(const Node* n) {
  if (IsLeaf(n, Value::Kind::kNone)) return true;
  if (n->kind != Node::Kind::kDict) return false;
  return std::all_of(n->pairs.begin(), n->pairs.end(), [](const auto& kv) {
    return IsLeaf(kv.first, Value::Kind::kString) && IsConstant(kv.second);
  });
}

// BUILD state that only sets attributes: string keys, none of them dunder.
bool IsAttributeDict(const Node* n) {
  if (n->kind != Node::Kind::kDict) return false;
  return std::all_of(n->pairs.begin(), n->pairs.end(), [](const auto& kv) {
    std::string key;
    return LeafString(kv.first, &key) && key.rfind("__", 0) != 0;
  });
}

bool StateFits(const Node* target, const Node* state) {
  if (target->then & kThenAnyState) return true;
  if (target->then & kThenStateTuple) return state->kind == Node::Kind::kTuple;
  return (target->then & kThenAttributes) && IsAttributeDict(state);
}

uint8_t ThenOf(Use use) {
  switch (use) {
    case Use::kOrderedDict: return kThenSetItems | kThenAttributes;
    case Use::kRecord: return kThenAttributes;
    case Use::kNumpyArray:
    case Use::kNumpyDType:
    case Use::kTupleRecord: return kThenStateTuple;
    case Use::kInert:
    case Use::kUser: return kThenSetItems | kThenAppends | kThenAnyState;
    default: return 0;
  }
}

// A short rendering of a node for messages (nodes are not Values yet).
std::string Describe(const Node* n) {
  switch (n->kind) {
    case Node::Kind::kLeaf: return n->leaf.DebugString(60);
    case Node::Kind::kObject: return n->leaf.as_object().cls.Qualified() + "(...)";
    case Node::Kind::kTensor: return "a tensor";
    case Node::Kind::kStorage: return "a storage";
    case Node::Kind::kList: return n->items.empty() ? "[]" : "[...]";
    case Node::Kind::kTuple: return n->items.empty() ? "()" : "(...)";
    case Node::Kind::kDict: return n->pairs.empty() ? "{}" : "{...}";
    case Node::Kind::kSet:
    case Node::Kind::kFrozenSet: return "a set";
  }
  return "";
}

std::string DescribeCall(const Global& g, const std::vector<Node*>& args) {
  std::string out = g.Qualified() + "(";
  for (size_t i = 0; i < args.size(); ++i) out += (i > 0 ? ", " : "") + Describe(args[i]);
  return out + ")";
}

// Values a stream may expand to per input byte (plus a fixed allowance):
// memo references make copies, and nested references could otherwise
// expand a few hundred bytes into billions of values.
constexpr size_t kMaxValuesPerByte = 16;
constexpr size_t kValueAllowance = size_t{1} << 20;

class Parser {
 public:
  Parser(const PickleReadOptions& options, const StorageResolver& resolver, const uint8_t* data,
         size_t size)
      : options_(options),
        resolver_(resolver),
        data_(data),
        size_(size),
        value_budget_(size * kMaxValuesPerByte + kValueAllowance) {}

  Result<Value> Run();

 private:
  // ---- Errors and input
  Status Fail(const std::string& what) const;
  Status Take(size_t n, const uint8_t** out);
  Status ReadUInt(size_t n, uint64_t* out);
  Status ReadLine(std::string* out);
  Status ReadIndexLine(uint64_t* out);

  // ---- Stack and memo
  Node* New(Node::Kind kind);
  Node* NewLeaf(Value v);
  void Push(Node* n) { stack_.push_back(n); }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  Status Pop(Node** out);
  Status Top(Node** out);
  Status PopMark(std::vector<Node*>* items);
  Status Put(uint64_t index);
  Status Get(uint64_t index);

  // ---- Opcodes
  Status Step(bool* stop);
  Status Proto();
  Status Frame();
  Status PopOp();
  Status Dup();
  Status IntLine();
  Status LongLine();
  Status PushDecimal(const std::string& line);
  Status LongN(size_t len_size);
  Status FloatLine();
  Status BinFloat();
  Status QuotedString();
  Status UnicodeLine();
  Status Counted(size_t len_size, Value::Kind kind);
  Status Collect(Node::Kind kind);
  Status TupleN(size_t n);
  Status Append();
  Status Appends();
  Status AppendTo(Node* target, const std::vector<Node*>& items);
  Status SetItem();
  Status SetItems();
  Status SetPairs(Node* target, const std::vector<Node*>& flat);
  Status AddItems();
  Status GlobalLines();
  Status StackGlobal();
  Status PushGlobal(std::string module, std::string name);
  Status Reduce();
  Status NewObj(bool with_kwargs);
  Status Build();
  Status PersId();
  Status BinPersId();

  // ---- Torch and Python semantics
  Status Call(const Global& g, Object::Construct how, const std::vector<Node*>& args, Node** out);
  bool ArgsFit(Use use, const std::vector<Node*>& args) const;
  Status GetAttr(const Global& g, const std::vector<Node*>& args, Node** out);
  bool IsEnumMember(const Global& cls, const std::string& member) const;
  Status TypedTensor(const Global& g, const std::vector<Node*>& args, Node** out);
  Status DTensor(const Global& g, const std::vector<Node*>& args, Node** out);
  Status RebuildTensor(const std::vector<Node*>& args, Node** out);
  Status Refuse(const std::string& what, const std::string& allow = "") const;
  Status RefuseCall(Use use, const Global& g, const std::vector<Node*>& args,
                    Object::Construct how) const;
  std::string FormatClass(const Global& g) const;
  Status CheckTensorBounds(const Tensor& t);
  Status ResolveStorage(const Node* pid, Node** out);
  Status LookupStorage(const std::string& key, DType dtype, int64_t numel,
                       const std::string& location, std::shared_ptr<Storage>* out);
  Node* NewObject(const Global& g, Object::Construct construct, const std::vector<Node*>& args);

  // ---- Materialisation
  Status Materialise(Node* n, int depth, Value* out);
  Status MaterialiseAll(const std::vector<Node*>& nodes, int depth, std::vector<Value>* out);
  Status MaterialisePairs(const std::vector<std::pair<Node*, Node*>>& pairs, int depth, Items* out);
  Status MaterialiseObject(Node* n, int depth, Value* out);

  const PickleReadOptions& options_;
  const StorageResolver& resolver_;
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  uint8_t op_ = 0;
  size_t value_budget_;

  NodeArena nodes_;
  std::vector<Node*> stack_;
  std::vector<size_t> marks_;  // stack sizes at each MARK
  // The memo, indexed directly: a pickler numbers entries 0, 1, ... as it
  // writes them, so no valid index reaches the stream's size.
  std::vector<Node*> memo_;
  size_t memo_count_ = 0;  // entries set: the index MEMOIZE uses

  std::map<std::string, std::shared_ptr<Storage>> storages_;  // by record key
};

// ---- Errors and input

// A line argument quoted in an error message, cut to a readable length.
std::string Excerpt(const std::string& line) {
  return "'" + (line.size() > 40 ? line.substr(0, 40) + "..." : line) + "'";
}

Status Parser::Fail(const std::string& what) const {
  char op[8];
  std::snprintf(op, sizeof(op), "0x%02x", op_);
  return Status::InvalidInput("malformed pickle at byte " + std::to_string(op_pos_) + " (opcode " +
                              OpcodeName(op_) + ", " + op + "): " + what);
}

Status Parser::Take(size_t n, const uint8_t** out) {
  if (n > size_ - pos_) {
    return Fail("needs " + std::to_string(n) + " more bytes but the input ends after " +
                std::to_string(size_ - pos_));
  }
  *out = data_ + pos_;
  pos_ += n;
  return Status::Ok();
}

Status Parser::ReadUInt(size_t n, uint64_t* out) {
  const uint8_t* p;
  RESHARD_RETURN_IF_ERROR(Take(n, &p));
  uint64_t v = 0;
  for (size_t i = n; i-- > 0;) v = (v << 8) | p[i];
  *out = v;
  return Status::Ok();
}

Status Parser::ReadLine(std::string* out) {
  const void* nl = std::memchr(data_ + pos_, '\n', size_ - pos_);
  if (nl == nullptr) return Fail("line argument is not terminated by a newline");
  const size_t len = static_cast<const uint8_t*>(nl) - (data_ + pos_);
  out->assign(reinterpret_cast<const char*>(data_ + pos_), len);
  pos_ += len + 1;
  return Status::Ok();
}

Status Parser::ReadIndexLine(uint64_t* out) {
  std::string line;
  RESHARD_RETURN_IF_ERROR(ReadLine(&line));
  const char* end = line.data() + line.size();
  auto res = std::from_chars(line.data(), end, *out);
  if (line.empty() || res.ec != std::errc() || res.ptr != end)
    return Fail("bad memo index " + Excerpt(line));
  return Status::Ok();
}

// ---- Stack and memo

Node* Parser::New(Node::Kind kind) { return nodes_.New(kind); }

Node* Parser::NewLeaf(Value v) {
  Node* n = New(Node::Kind::kLeaf);
  n->leaf = std::move(v);
  return n;
}

Status Parser::Pop(Node** out) {
  if (stack_.size() <= Floor()) return Fail("stack underflow");
  *out = stack_.back();
  stack_.pop_back();
  return Status::Ok();
}

Status Parser::Top(Node** out) {
  if (stack_.size() <= Floor()) return Fail("stack underflow");
  *out = stack_.back();
  return Status::Ok();
}

Status Parser::PopMark(std::vector<Node*>* items) {
  if (marks_.empty()) return Fail("no MARK to pop to");
  const size_t mark = marks_.back();
  marks_.pop_back();
  items->assign(stack_.begin() + static_cast<ptrdiff_t>(mark), stack_.end());
  stack_.resize(mark);
  return Status::Ok();
}

Status Parser::Put(uint64_t index) {
  Node* top;
  RESHARD_RETURN_IF_ERROR(Top(&top));
  if (index >= size_)
    return Fail("memo index " + std::to_string(index) + " is beyond any valid stream");
  if (index >= memo_.size()) memo_.resize(std::max<size_t>(index + 1, 2 * memo_.size()));
  if (memo_[index] == nullptr) ++memo_count_;
  memo_[index] = top;
  return Status::Ok();
}

Status Parser::Get(uint64_t index) {
  if (index >= memo_.size() || memo_[index] == nullptr) {
    return Fail("memo entry " + std::to_string(index) + " was never stored");
  }
  Push(memo_[index]);
  return Status::Ok();
}

// ---- Opcodes

Status Parser::Step(bool* stop) {
  uint64_t u;
  switch (op_) {
    case op::kProto: return Proto();
    case op::kFrame: return Frame();
    case op::kStop: *stop = true; return Status::Ok();
    case op::kMark: marks_.push_back(stack_.size()); return Status::Ok();
    case op::kPop: return PopOp();
    case op::kPopMark: {
      std::vector<Node*> discard;
      return PopMark(&discard);
    }
    case op::kDup: return Dup();
    case op::kNone: Push(NewLeaf(Value::None())); return Status::Ok();
    case op::kNewTrue: Push(NewLeaf(Value::Bool(true))); return Status::Ok();
    case op::kNewFalse: Push(NewLeaf(Value::Bool(false))); return Status::Ok();
    case op::kInt: return IntLine();
    case op::kBinInt:
      RESHARD_RETURN_IF_ERROR(ReadUInt(4, &u));
      Push(NewLeaf(Value::Int(static_cast<int32_t>(static_cast<uint32_t>(u)))));
      return Status::Ok();
    case op::kBinInt1:
    case op::kBinInt2:
      RESHARD_RETURN_IF_ERROR(ReadUInt(op_ == op::kBinInt1 ? 1 : 2, &u));
      Push(NewLeaf(Value::Int(static_cast<int64_t>(u))));
      return Status::Ok();
    case op::kLong: return LongLine();
    case op::kLong1: return LongN(1);
    case op::kLong4: return LongN(4);
    case op::kFloat: return FloatLine();
    case op::kBinFloat: return BinFloat();
    case op::kString: return QuotedString();
    case op::kUnicode: return UnicodeLine();
    // Python 2 str (BINSTRING) loads as str, as torch.load's encoding='utf-8' does.
    case op::kBinString: return Counted(4, Value::Kind::kString);
    case op::kShortBinString: return Counted(1, Value::Kind::kString);
    case op::kBinUnicode: return Counted(4, Value::Kind::kString);
    case op::kShortBinUnicode: return Counted(1, Value::Kind::kString);
    case op::kBinUnicode8: return Counted(8, Value::Kind::kString);
    case op::kBinBytes: return Counted(4, Value::Kind::kBytes);
    case op::kShortBinBytes: return Counted(1, Value::Kind::kBytes);
    case op::kBinBytes8: return Counted(8, Value::Kind::kBytes);
    // A bytearray: its bytes are what matter.
    case op::kByteArray8: return Counted(8, Value::Kind::kBytes);
    case op::kEmptyList: Push(New(Node::Kind::kList)); return Status::Ok();
    case op::kList: return Collect(Node::Kind::kList);
    case op::kAppend: return Append();
    case op::kAppends: return Appends();
    case op::kEmptyTuple: Push(New(Node::Kind::kTuple)); return Status::Ok();
    case op::kTuple: return Collect(Node::Kind::kTuple);
    case op::kTuple1: return TupleN(1);
    case op::kTuple2: return TupleN(2);
    case op::kTuple3: return TupleN(3);
    case op::kEmptyDict: Push(New(Node::Kind::kDict)); return Status::Ok();
    case op::kDict: return Collect(Node::Kind::kDict);
    case op::kSetItem: return SetItem();
    case op::kSetItems: return SetItems();
    case op::kEmptySet: Push(New(Node::Kind::kSet)); return Status::Ok();
    case op::kAddItems: return AddItems();
    case op::kFrozenSet: return Collect(Node::Kind::kFrozenSet);
    case op::kGlobal: return GlobalLines();
    case op::kStackGlobal: return StackGlobal();
    case op::kReduce: return Reduce();
    case op::kNewObj: return NewObj(false);
    case op::kNewObjEx: return NewObj(true);
    case op::kBuild: return Build();
    case op::kPut: RESHARD_RETURN_IF_ERROR(ReadIndexLine(&u)); return Put(u);
    case op::kBinPut: RESHARD_RETURN_IF_ERROR(ReadUInt(1, &u)); return Put(u);
    case op::kLongBinPut: RESHARD_RETURN_IF_ERROR(ReadUInt(4, &u)); return Put(u);
    case op::kMemoize: return Put(memo_count_);
    case op::kGet: RESHARD_RETURN_IF_ERROR(ReadIndexLine(&u)); return Get(u);
    case op::kBinGet: RESHARD_RETURN_IF_ERROR(ReadUInt(1, &u)); return Get(u);
    case op::kLongBinGet: RESHARD_RETURN_IF_ERROR(ReadUInt(4, &u)); return Get(u);
    case op::kPersId: return PersId();
    case op::kBinPersId: return BinPersId();
    case op::kInst:
    case op::kObj:
    case op::kExt1:
    case op::kExt2:
    case op::kExt4:
    case op::kNextBuffer:
    case op::kReadOnlyBuffer:
      return Status::Unsupported(std::string("pickle opcode ") + OpcodeName(op_) + " at byte " +
                                 std::to_string(op_pos_) + " is not supported by reshard");
    default: return Fail("unknown opcode");
  }
}

Status Parser::Proto() {
  uint64_t proto;
  RESHARD_RETURN_IF_ERROR(ReadUInt(1, &proto));
  if (proto > 5) return Fail("unsupported protocol " + std::to_string(proto));
  return Status::Ok();
}

// Frames only group opcodes for buffered reading; their contents follow inline.
Status Parser::Frame() {
  uint64_t len;
  RESHARD_RETURN_IF_ERROR(ReadUInt(8, &len));
  if (len > size_ - pos_)
    return Fail("frame of " + std::to_string(len) + " bytes overruns the input");
  return Status::Ok();
}

// As Python: POP discards the top item, or the MARK above it.
Status Parser::PopOp() {
  if (stack_.size() > Floor()) {
    stack_.pop_back();
    return Status::Ok();
  }
  std::vector<Node*> discard;
  return PopMark(&discard);
}

Status Parser::Dup() {
  Node* top;
  RESHARD_RETURN_IF_ERROR(Top(&top));
  Push(top);
  return Status::Ok();
}

Status Parser::IntLine() {
  std::string line;
  RESHARD_RETURN_IF_ERROR(ReadLine(&line));
  if (line == "00" || line == "01") {  // protocol 0 booleans
    Push(NewLeaf(Value::Bool(line == "01")));
    return Status::Ok();
  }
  return PushDecimal(line);
}

Status Parser::LongLine() {
  std::string line;
  RESHARD_RETURN_IF_ERROR(ReadLine(&line));
  if (!line.empty() && line.back() == 'L') line.pop_back();
  return PushDecimal(line);
}

Status Parser::PushDecimal(const std::string& line) {
  std::string le;
  if (!DecimalToTwosComplement(line, &le)) return Fail("bad integer " + Excerpt(line));
  Push(NewLeaf(IntFromLE(le)));
  return Status::Ok();
}

Status Parser::LongN(size_t len_size) {
  uint64_t n;
  RESHARD_RETURN_IF_ERROR(ReadUInt(len_size, &n));
  if (len_size == 4 && n > INT32_MAX) return Fail("negative byte count");
  const uint8_t* p;
  RESHARD_RETURN_IF_ERROR(Take(n, &p));
  Push(NewLeaf(IntFromLE(std::string(reinterpret_cast<const char*>(p), n))));
  return Status::Ok();
}

Status Parser::FloatLine() {
  std::string line;
  RESHARD_RETURN_IF_ERROR(ReadLine(&line));
  const char* begin = line.data() + (!line.empty() && line[0] == '+' ? 1 : 0);
  const char* end = line.data() + line.size();
  double d;
  auto res = std::from_chars(begin, end, d);
  if (begin == end || res.ec != std::errc() || res.ptr != end)
    return Fail("bad float " + Excerpt(line));
  Push(NewLeaf(Value::Float(d)));
  return Status::Ok();
}

Status Parser::BinFloat() {
  const uint8_t* p;
  RESHARD_RETURN_IF_ERROR(Take(8, &p));
  uint64_t bits = 0;
  for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];  // big-endian
  double d;
  std::memcpy(&d, &bits, 8);
  Push(NewLeaf(Value::Float(d)));
  return Status::Ok();
}

Status Parser::QuotedString() {
  std::string line, s;
  RESHARD_RETURN_IF_ERROR(ReadLine(&line));
  if (!DecodeQuotedString(line, &s)) return Fail("bad string literal");
  Push(NewLeaf(Value::String(std::move(s))));
  return Status::Ok();
}

Status Parser::UnicodeLine() {
  std::string line, s;
  RESHARD_RETURN_IF_ERROR(ReadLine(&line));
  if (!DecodeRawUnicodeEscape(line, &s)) return Fail("bad \\u escape");
  Push(NewLeaf(Value::String(std::move(s))));
  return Status::Ok();
}

Status Parser::Counted(size_t len_size, Value::Kind kind) {
  uint64_t n;
  RESHARD_RETURN_IF_ERROR(ReadUInt(len_size, &n));
  const uint8_t* p;
  RESHARD_RETURN_IF_ERROR(Take(n, &p));
  std::string s(reinterpret_cast<const char*>(p), n);
  Push(NewLeaf(kind == Value::Kind::kBytes ? Value::MakeBytes(std::move(s))
                                           : Value::String(std::move(s))));
  return Status::Ok();
}

// LIST, TUPLE, DICT, FROZENSET: a container of the items since the last MARK.
Status Parser::Collect(Node::Kind kind) {
  std::vector<Node*> items;
  RESHARD_RETURN_IF_ERROR(PopMark(&items));
  Node* n = New(kind);
  if (kind == Node::Kind::kDict) {
    RESHARD_RETURN_IF_ERROR(SetPairs(n, items));
  } else {
    n->items = std::move(items);
  }
  Push(n);
  return Status::Ok();
}

Status Parser::TupleN(size_t count) {
  if (stack_.size() < Floor() + count) return Fail("stack underflow");
  Node* n = New(Node::Kind::kTuple);
  n->items.assign(stack_.end() - static_cast<ptrdiff_t>(count), stack_.end());
  stack_.resize(stack_.size() - count);
  Push(n);
  return Status::Ok();
}

Status Parser::Append() {
  Node* item;
  Node* target;
  RESHARD_RETURN_IF_ERROR(Pop(&item));
  RESHARD_RETURN_IF_ERROR(Top(&target));
  return AppendTo(target, {item});
}

Status Parser::Appends() {
  std::vector<Node*> items;
  Node* target;
  RESHARD_RETURN_IF_ERROR(PopMark(&items));
  RESHARD_RETURN_IF_ERROR(Top(&target));
  return AppendTo(target, items);
}

Status Parser::AppendTo(Node* target, const std::vector<Node*>& items) {
  std::vector<Node*>* dest = target->kind == Node::Kind::kList     ? &target->items
                             : target->kind == Node::Kind::kObject ? &target->appends
                                                                   : nullptr;
  if (dest == nullptr) return Fail("appending to something that is not a list or an object");
  if (target->kind == Node::Kind::kObject && !(target->then & kThenAppends)) {
    const Global& cls = target->leaf.as_object().cls;
    return Refuse("appends items to " + Describe(target) + ", which " + cls.Qualified() +
                      " does not take",
                  FormatClass(cls));
  }
  dest->insert(dest->end(), items.begin(), items.end());
  return Status::Ok();
}

Status Parser::SetItem() {
  Node* key;
  Node* value;
  Node* target;
  RESHARD_RETURN_IF_ERROR(Pop(&value));
  RESHARD_RETURN_IF_ERROR(Pop(&key));
  RESHARD_RETURN_IF_ERROR(Top(&target));
  return SetPairs(target, {key, value});
}

Status Parser::SetItems() {
  std::vector<Node*> flat;
  Node* target;
  RESHARD_RETURN_IF_ERROR(PopMark(&flat));
  RESHARD_RETURN_IF_ERROR(Top(&target));
  return SetPairs(target, flat);
}

Status Parser::SetPairs(Node* target, const std::vector<Node*>& flat) {
  if (target->kind != Node::Kind::kDict && target->kind != Node::Kind::kObject) {
    return Fail("setting items on something that is not a dict or an object");
  }
  if (flat.size() % 2 != 0) return Fail("odd number of items for key/value pairs");
  if (target->kind == Node::Kind::kObject && !(target->then & kThenSetItems)) {
    const Global& cls = target->leaf.as_object().cls;
    return Refuse("sets items on " + Describe(target) + ", which " + cls.Qualified() +
                      " does not take",
                  FormatClass(cls));
  }
  for (size_t i = 0; i < flat.size(); i += 2) target->pairs.emplace_back(flat[i], flat[i + 1]);
  return Status::Ok();
}

Status Parser::AddItems() {
  std::vector<Node*> items;
  Node* target;
  RESHARD_RETURN_IF_ERROR(PopMark(&items));
  RESHARD_RETURN_IF_ERROR(Top(&target));
  if (target->kind != Node::Kind::kSet) return Fail("adding items to something that is not a set");
  target->items.insert(target->items.end(), items.begin(), items.end());
  return Status::Ok();
}

Status Parser::GlobalLines() {
  std::string module, name;
  RESHARD_RETURN_IF_ERROR(ReadLine(&module));
  RESHARD_RETURN_IF_ERROR(ReadLine(&name));
  return PushGlobal(std::move(module), std::move(name));
}

Status Parser::StackGlobal() {
  Node* name;
  Node* module;
  RESHARD_RETURN_IF_ERROR(Pop(&name));
  RESHARD_RETURN_IF_ERROR(Pop(&module));
  std::string m, n;
  if (!LeafString(module, &m) || !LeafString(name, &n))
    return Fail("module and name must be strings");
  return PushGlobal(std::move(m), std::move(n));
}

Status Parser::PushGlobal(std::string module, std::string name) {
  Global g{Py3Module(module), std::move(name)};
  const std::string q = g.Qualified();
  const std::optional<Use> use = UseOf(q, options_);
  if (!use) {
    return Status::Unsupported("pickle refers to class '" + q +
                               "', which reshard does not know; reshard never runs code from "
                               "checkpoints. Pass --allow-class " +
                               q + " to read it");
  }
  g.trusted_only = *use == Use::kUser || *use == Use::kInert;
  Push(NewLeaf(Value::MakeGlobal(std::move(g))));
  return Status::Ok();
}

Status Parser::Reduce() {
  Node* args;
  Node* callable;
  RESHARD_RETURN_IF_ERROR(Pop(&args));
  RESHARD_RETURN_IF_ERROR(Pop(&callable));
  if (!IsLeaf(callable, Value::Kind::kGlobal))
    return Fail("REDUCE applies something that is not a class or function");
  if (args->kind != Node::Kind::kTuple) return Fail("REDUCE arguments are not a tuple");
  Node* result = nullptr;
  RESHARD_RETURN_IF_ERROR(
      Call(callable->leaf.as_global(), Object::Construct::kReduce, args->items, &result));
  Push(result);
  return Status::Ok();
}

// NEWOBJ: cls.__new__(cls, *args); NEWOBJ_EX adds keyword arguments, which
// Object cannot carry, so only an empty set of them is accepted.
Status Parser::NewObj(bool with_kwargs) {
  Node* kwargs = nullptr;
  Node* args;
  Node* cls;
  if (with_kwargs) RESHARD_RETURN_IF_ERROR(Pop(&kwargs));
  RESHARD_RETURN_IF_ERROR(Pop(&args));
  RESHARD_RETURN_IF_ERROR(Pop(&cls));
  if (!IsLeaf(cls, Value::Kind::kGlobal)) return Fail("NEWOBJ of something that is not a class");
  if (args->kind != Node::Kind::kTuple) return Fail("NEWOBJ arguments are not a tuple");
  if (kwargs != nullptr && (kwargs->kind != Node::Kind::kDict || !kwargs->pairs.empty())) {
    return Status::Unsupported("pickle constructs '" + cls->leaf.as_global().Qualified() +
                               "' with keyword arguments, which reshard does not support");
  }
  Node* result = nullptr;
  RESHARD_RETURN_IF_ERROR(
      Call(cls->leaf.as_global(), Object::Construct::kNewObj, args->items, &result));
  Push(result);
  return Status::Ok();
}

Status Parser::Build() {
  Node* state;
  Node* target;
  RESHARD_RETURN_IF_ERROR(Pop(&state));
  RESHARD_RETURN_IF_ERROR(Top(&target));
  if (target->kind != Node::Kind::kObject) return Fail("BUILD on something that is not an object");
  const Global& cls = target->leaf.as_object().cls;
  if (target->state != nullptr) {
    return Status::Unsupported("pickle sets the state of '" + cls.Qualified() +
                               "' twice, which reshard does not support");
  }
  if (!StateFits(target, state)) {
    return Refuse("sets the state of " + Describe(target) + " to " + Describe(state) + ", which " +
                      cls.Qualified() + " does not take",
                  FormatClass(cls));
  }
  target->state = state;
  return Status::Ok();
}

Status Parser::PersId() {
  std::string line;
  RESHARD_RETURN_IF_ERROR(ReadLine(&line));
  Node* storage = nullptr;
  RESHARD_RETURN_IF_ERROR(ResolveStorage(NewLeaf(Value::String(std::move(line))), &storage));
  Push(storage);
  return Status::Ok();
}

Status Parser::BinPersId() {
  Node* pid;
  Node* storage = nullptr;
  RESHARD_RETURN_IF_ERROR(Pop(&pid));
  RESHARD_RETURN_IF_ERROR(ResolveStorage(pid, &storage));
  Push(storage);
  return Status::Ok();
}

// ---- Torch and Python semantics

Node* Parser::NewObject(const Global& g, Object::Construct construct,
                        const std::vector<Node*>& args) {
  Object o;
  o.cls = g;
  o.construct = construct;
  Node* n = New(Node::Kind::kObject);
  n->leaf = Value::MakeObject(std::move(o));
  n->items = args;
  return n;
}

// The call `g(*args)` (NEWOBJ: `g.__new__(g, *args)`) as torch.load would
// make it, if it has the shape of g's use: its result as plain data where
// that is what it gives (tensors, bytes, sets), else as an Object.
Status Parser::Call(const Global& g, Object::Construct how, const std::vector<Node*>& args,
                    Node** out) {
  const Use use = *UseOf(g.Qualified(), options_);  // PushGlobal accepted g
  const bool newobj = how == Object::Construct::kNewObj;
  const bool any_call = use == Use::kUser || use == Use::kInert;
  if (!any_call && newobj != (use == Use::kRecord || use == Use::kTupleRecord || use == Use::kTensorMeta)) {
    return RefuseCall(use, g, args, how);
  }
  switch (use) {
    case Use::kRebuildTensor: return RebuildTensor(args, out);
    case Use::kTypedTensor: return TypedTensor(g, args, out);
    case Use::kGetAttr: return GetAttr(g, args, out);
    default: break;
  }
  if (!ArgsFit(use, args)) return RefuseCall(use, g, args, how);
  std::string bytes;
  if (use == Use::kEncode && EncodedBytes(args, &bytes)) {
    *out = NewLeaf(Value::MakeBytes(std::move(bytes)));
  } else if (use == Use::kBytes) {
    *out = NewLeaf(Value::MakeBytes(""));
  } else if (use == Use::kSet) {
    *out = New(g.name == "set" ? Node::Kind::kSet : Node::Kind::kFrozenSet);
    if (!args.empty()) (*out)->items = args[0]->items;
  } else {
    *out = NewObject(g, how, args);
    (*out)->then = ThenOf(use);
  }
  return Status::Ok();
}

// Whether `a` are the arguments torch.save or Python's pickler pass to a
// global of `use` (the uses Call does not hand on).
bool Parser::ArgsFit(Use use, const std::vector<Node*>& a) const {
  switch (use) {
    case Use::kOrderedDict:
    case Use::kRecord:
    case Use::kTupleRecord:
    case Use::kBytes: return a.empty();
    case Use::kSet:
      return a.empty() || (a.size() == 1 && (a[0]->kind == Node::Kind::kList ||
                                             a[0]->kind == Node::Kind::kTuple));
    case Use::kEncode: {
      std::string bytes;
      return EncodedBytes(a, &bytes);
    }
    case Use::kByteArray:
      return (a.size() == 1 && IsLeaf(a[0], Value::Kind::kBytes)) ||
             (a.size() == 2 && IsLeaf(a[0], Value::Kind::kString) && IsLatin1Name(a[1]));
    case Use::kSlice:
      return !a.empty() && a.size() <= 3 && std::all_of(a.begin(), a.end(), IsIntOrNone);
    case Use::kComplex:
      return !a.empty() && a.size() <= 2 && std::all_of(a.begin(), a.end(), IsNumber);
    case Use::kSize: return a.size() == 1 && IsInts(a[0]);
    case Use::kTensorMeta: {
      std::vector<int64_t> ints;
      return a.size() == 3 && NodeInts(a[0], &ints) && IsInts(a[1]) && IsLeaf(a[2], Value::Kind::kGlobal);
    }
    case Use::kDevice:
      return (a.size() == 1 || a.size() == 2) && IsLeaf(a[0], Value::Kind::kString) &&
             (a.size() == 1 || IsLeaf(a[1], Value::Kind::kInt));
    case Use::kParameter:
      return a.size() == 3 && a[0]->kind == Node::Kind::kTensor &&
             IsLeaf(a[1], Value::Kind::kBool) && IsEmptyOrderedDict(a[2]);
    case Use::kNumpyArray:
      return a.size() == 3 && IsGlobalLeaf(a[0], "numpy", "ndarray") && IsInts(a[1]) &&
             IsLeaf(a[2], Value::Kind::kBytes);
    case Use::kNumpyDType:
      return a.size() == 3 && IsLeaf(a[0], Value::Kind::kString) && IsFlag(a[1]) && IsFlag(a[2]);
    case Use::kNumpyScalar:
      return a.size() == 2 && IsObjectOf(a[0], "numpy", "dtype") && IsLeaf(a[1], Value::Kind::kBytes);
    case Use::kEnum: return a.size() == 1 && IsConstant(a[0]);
    case Use::kValue: return std::all_of(a.begin(), a.end(), IsConstant);
    case Use::kInert:
    case Use::kUser: return true;
    default: return false;  // kName: never called
  }
}

// getattr(EnumClass, 'member'): how Python >= 3.11 pickles an enum member.
// Anything else getattr reaches (a function's __globals__, a bound method)
// is how pickles get at eval, so only members of enums are accepted.
Status Parser::GetAttr(const Global& g, const std::vector<Node*>& args, Node** out) {
  std::string member;
  std::optional<Use> of;
  if (args.size() == 2 && IsLeaf(args[0], Value::Kind::kGlobal) && LeafString(args[1], &member)) {
    of = UseOf(args[0]->leaf.as_global().Qualified(), options_);
  }
  if (!of || (*of != Use::kEnum && *of != Use::kUser && *of != Use::kInert) ||
      !IsPublicName(member)) {
    return RefuseCall(Use::kGetAttr, g, args, Object::Construct::kReduce);
  }
  const Global& cls = args[0]->leaf.as_global();
  if (*of == Use::kEnum && !IsEnumMember(cls, member)) {
    std::string members;
    for (const std::string& m : options_.known_classes->at(cls.Qualified()).members) {
      members += (members.empty() ? "" : ", ") + m;
    }
    return Refuse("reads '" + member + "' of the enum " + cls.Qualified() +
                      ", which is not one of the members reshard knows (" + members + ")",
                  cls.Qualified() + "." + member);
  }
  *out = NewObject(g, Object::Construct::kReduce, args);
  return Status::Ok();
}

bool Parser::IsEnumMember(const Global& cls, const std::string& member) const {
  const std::string q = cls.Qualified();
  return options_.known_classes->at(q).members.count(member) > 0 ||
         options_.allowed_globals.count(q + "." + member) > 0;
}

// _rebuild_from_type_v2(func, new_type, args, state) calls func(*args), so
// func must be the tensor rebuild. torch.save writes it for a tensor with
// Python attributes, which reshard cannot carry; without them, or with only
// those the caller knows to be bookkeeping (dropped_tensor_attributes), it
// is the plain tensor.
Status Parser::TypedTensor(const Global& g, const std::vector<Node*>& args, Node** out) {
  if (args.size() == 4 && IsGlobalLeaf(args[0], "torch._utils", "_rebuild_wrapper_subclass")) {
    return DTensor(g, args, out);
  }
  if (args.size() != 4 || !IsGlobalLeaf(args[0], "torch._utils", "_rebuild_tensor_v2") ||
      !IsGlobalLeaf(args[1], "torch", "Tensor") || args[2]->kind != Node::Kind::kTuple) {
    return RefuseCall(Use::kTypedTensor, g, args, Object::Construct::kReduce);
  }
  const auto dropped = [this](const std::pair<Node*, Node*>& attribute) {
    std::string name;
    return LeafString(attribute.first, &name) && options_.dropped_tensor_attributes.count(name) > 0;
  };
  if (!IsLeaf(args[3], Value::Kind::kNone) &&
      !(args[3]->kind == Node::Kind::kDict && std::all_of(args[3]->pairs.begin(), args[3]->pairs.end(), dropped))) {
    return Status::Unsupported("pickle rebuilds a tensor with Python attributes " +
                               Describe(args[3]) +
                               " (torch._tensor._rebuild_from_type_v2), which reshard does not "
                               "carry; save the tensor without them");
  }
  return RebuildTensor(args[2]->items, out);
}

// The item under string `key` of dict node `dict`; null when it has none.
const Node* Item(const Node* dict, const std::string& key) {
  if (dict == nullptr || dict->kind != Node::Kind::kDict) return nullptr;
  for (const auto& [k, v] : dict->pairs) {
    std::string name;
    if (LeafString(k, &name) && name == key) return v;
  }
  return nullptr;
}

std::string Dims(const std::vector<int64_t>& sizes) {
  std::string out;
  for (int64_t s : sizes) out += (out.empty() ? "" : ", ") + std::to_string(s);
  return "[" + out + "]";
}

constexpr char kPlacements[] = "torch.distributed.tensor.placement_types";

// Placement `p` as torch prints it ("Shard(dim=0)", "Replicate()"); false for
// any other (a Partial's local tensor is an addend of the whole, not its values).
bool PlacementText(const Node* p, std::string* text) {
  const Node* dim = Item(p->state, "dim");
  if (IsObjectOf(p, kPlacements, "Shard") && dim != nullptr && IsLeaf(dim, Value::Kind::kInt)) {
    *text = "Shard(dim=" + std::to_string(dim->leaf.as_int()) + ")";
    return true;
  }
  *text = IsObjectOf(p, kPlacements, "Replicate") ? "Replicate()" : Describe(p);
  return IsObjectOf(p, kPlacements, "Replicate");
}

// The ranks of a DTensor spec's device mesh, as words; "its device mesh" where
// the spec does not record them.
std::string MeshRanks(const Node* spec) {
  const Node* mesh = Item(spec->state, "mesh");
  const Node* ranks = mesh != nullptr && mesh->kind == Node::Kind::kObject ? Item(mesh->state, "mesh") : nullptr;
  if (ranks == nullptr || ranks->kind != Node::Kind::kTensor) return "its device mesh";
  int64_t count = 1;
  for (int64_t s : ranks->leaf.as_tensor().sizes) count *= s;
  return "a device mesh of " + std::to_string(count) + " ranks";
}

// torch.save writes a DTensor as _rebuild_from_type_v2(_rebuild_wrapper_subclass,
// DTensor, (DTensor, dtype, size, stride, offset, layout, device, requires_grad),
// (None, {'_local_tensor': t, '_spec': DTensorSpec})): the saving rank's local
// tensor and where it lies in the whole. Where the local tensor is the whole
// (replicated, or sharded with every row on this rank) it is read as that
// tensor; else the other ranks' parts are in no file of the save.
Status Parser::DTensor(const Global& g, const std::vector<Node*>& args, Node** out) {
  const Node* wrapper = args[2];
  const Node* state = args[3];
  std::vector<int64_t> global;
  const bool fits = IsGlobalLeaf(args[1], "torch.distributed.tensor", "DTensor") &&
                    wrapper->kind == Node::Kind::kTuple && wrapper->items.size() == 8 &&
                    IsGlobalLeaf(wrapper->items[0], "torch.distributed.tensor", "DTensor") &&
                    IsLeaf(wrapper->items[1], Value::Kind::kGlobal) && NodeInts(wrapper->items[2], &global) &&
                    state->kind == Node::Kind::kTuple && state->items.size() == 2 &&
                    IsLeaf(state->items[0], Value::Kind::kNone) && state->items[1]->kind == Node::Kind::kDict &&
                    state->items[1]->pairs.size() == 2;
  Node* local = fits ? const_cast<Node*>(Item(state->items[1], "_local_tensor")) : nullptr;
  const Node* spec = fits ? Item(state->items[1], "_spec") : nullptr;
  if (local == nullptr || local->kind != Node::Kind::kTensor || spec == nullptr ||
      !IsObjectOf(spec, "torch.distributed.tensor._dtensor_spec", "DTensorSpec")) {
    return RefuseCall(Use::kTypedTensor, g, args, Object::Construct::kReduce);
  }
  const Node* placements = Item(spec->state, "placements");
  if (placements == nullptr || placements->kind != Node::Kind::kTuple) return Fail("DTensor spec without placements");
  std::string where;
  bool values = true;  // every placement leaves the local tensor holding values of the whole
  for (const Node* p : placements->items) {
    std::string text;
    values = PlacementText(p, &text) && values;
    where += (where.empty() ? "" : ", ") + text;
  }
  const Tensor& t = local->leaf.as_tensor();
  const std::string held = "pickle holds a DTensor of size " + Dims(global) + " placed (" + where + ") over " +
                           MeshRanks(spec) + ", and of it ";
  const char* fix = "; save the whole tensors (get_state_dict with full_state_dict=True, or DTensor.full_tensor()) "
                    "or a sharded checkpoint";
  if (!values) return Status::Unsupported(held + "one rank's addend, not its values" + fix);
  if (t.sizes != global) {
    return Status::Unsupported(held + "only one rank's local tensor " + Dims(t.sizes) + ", the other ranks' parts "
                               "being in no file" + fix);
  }
  if (wrapper->items[1]->leaf.as_global().name != DTypeName(t.storage->dtype)) {
    return Fail("DTensor of " + wrapper->items[1]->leaf.as_global().Qualified() + " around a tensor of " +
                DTypeName(t.storage->dtype));
  }
  *out = local;
  return Status::Ok();
}

// The class a format knows under `g` (so that --allow-class can stand in for
// a shape of call the format does not expect); empty for generic globals.
std::string Parser::FormatClass(const Global& g) const {
  const std::optional<Use> use = UseOf(g.Qualified(), options_);
  return use == Use::kEnum || use == Use::kTupleRecord || use == Use::kValue ||
                 (use == Use::kRecord && !IsKnownGlobal(g.Qualified()))
             ? g.Qualified()
             : "";
}

Status Parser::Refuse(const std::string& what, const std::string& allow) const {
  std::string message = "pickle " + what +
                        "; reshard never executes pickled code and refuses calls that could run "
                        "code when the file is loaded";
  if (!allow.empty()) message += ". Pass --allow-class " + allow + " to read it";
  return Status::Unsupported(message);
}

Status Parser::RefuseCall(Use use, const Global& g, const std::vector<Node*>& args,
                          Object::Construct how) const {
  const bool newobj = how == Object::Construct::kNewObj;
  return Refuse(std::string(newobj ? "builds " : "calls ") + DescribeCall(g, args) +
                    (newobj ? " with NEWOBJ" : "") + ", which reshard accepts only " + Shape(use),
                FormatClass(g));
}

// torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, ...).
Status Parser::RebuildTensor(const std::vector<Node*>& args, Node** out) {
  if (args.size() < 5) return Fail("_rebuild_tensor_v2 needs at least 5 arguments");
  if (args[0]->kind != Node::Kind::kStorage)
    return Fail("_rebuild_tensor_v2 of something that is not a storage");
  Tensor t;
  t.storage = args[0]->storage;
  if (!LeafInt(args[1], &t.storage_offset)) return Fail("tensor storage offset is not an int");
  if (!NodeInts(args[2], &t.sizes)) return Fail("tensor size is not a tuple of ints");
  if (!NodeInts(args[3], &t.strides)) return Fail("tensor stride is not a tuple of ints");
  if (!IsLeaf(args[4], Value::Kind::kBool)) return Fail("tensor requires_grad is not a bool");
  t.requires_grad = args[4]->leaf.as_bool();
  // torch.save never pickles backward hooks (it writes an empty OrderedDict,
  // sealed here so that no later SETITEMS fills it) and torch >= 2 adds a
  // dict of flags; anything more is not a tensor torch.save wrote.
  const bool extra_fit = args.size() <= 7 && (args.size() < 6 || IsEmptyOrderedDict(args[5])) &&
                         (args.size() < 7 || IsConstantDictOrNone(args[6]));
  if (!extra_fit) {
    return RefuseCall(Use::kRebuildTensor, {"torch._utils", "_rebuild_tensor_v2"}, args,
                      Object::Construct::kReduce);
  }
  if (args.size() >= 6) args[5]->then = 0;
  RESHARD_RETURN_IF_ERROR(CheckTensorBounds(t));
  *out = New(Node::Kind::kTensor);
  (*out)->leaf = Value::MakeTensor(std::move(t));
  (*out)->items.assign(args.begin() + 5, args.end());
  return Status::Ok();
}

// Later stages index storages with these numbers and multiply them, so a
// tensor must stay inside its storage, and its element and byte counts must
// fit int64: with zero strides a tensor has more elements than its storage.
Status Parser::CheckTensorBounds(const Tensor& t) {
  if (t.sizes.size() != t.strides.size()) return Fail("tensor size and stride differ in length");
  if (t.storage_offset < 0) return Fail("negative tensor storage offset");
  int64_t numel = 1;
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    if (t.sizes[i] < 0 || t.strides[i] < 0) return Fail("negative tensor size or stride");
    if (__builtin_mul_overflow(numel, t.sizes[i], &numel)) return Fail("tensor size overflows");
  }
  int64_t bytes;
  if (__builtin_mul_overflow(numel, ElementSize(t.storage->dtype), &bytes)) {
    return Fail("tensor of " + std::to_string(numel) + " elements overflows its byte count");
  }
  if (numel == 0) return Status::Ok();
  int64_t last = t.storage_offset;  // element offset of the last element
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    int64_t span;
    if (__builtin_mul_overflow(t.sizes[i] - 1, t.strides[i], &span) ||
        __builtin_add_overflow(last, span, &last)) {
      return Fail("tensor extent overflows");
    }
  }
  if (last >= t.storage->numel) {
    return Fail("tensor reaches element " + std::to_string(last) + " of a storage of " +
                std::to_string(t.storage->numel) + " elements");
  }
  return Status::Ok();
}

// torch.save's persistent ids: ('storage', torch.<X>Storage, key, location, numel).
Status Parser::ResolveStorage(const Node* pid, Node** out) {
  std::string tag, key, location;
  int64_t numel = 0;
  const std::vector<Node*>& f = pid->items;
  const bool is_storage = pid->kind == Node::Kind::kTuple && f.size() == 5 &&
                          LeafString(f[0], &tag) && tag == "storage";
  if (!is_storage) {
    return Status::Unsupported("pickle at byte " + std::to_string(op_pos_) +
                               " refers to an external object that is not a torch storage");
  }
  if (!IsLeaf(f[1], Value::Kind::kGlobal) || !LeafString(f[2], &key) ||
      !LeafString(f[3], &location) || !LeafInt(f[4], &numel) || numel < 0) {
    return Fail("storage reference is not (type, key, location, numel)");
  }
  const Global& type = f[1]->leaf.as_global();
  std::optional<DType> dtype;
  if (type.module == "torch") dtype = DTypeFromStorageClass(type.name);
  if (!dtype)
    return Status::Unsupported("tensor storage type '" + type.Qualified() + "' is not supported");
  *out = New(Node::Kind::kStorage);
  return LookupStorage(key, *dtype, numel, location, &(*out)->storage);
}

Status Parser::LookupStorage(const std::string& key, DType dtype, int64_t numel,
                             const std::string& location, std::shared_ptr<Storage>* out) {
  auto it = storages_.find(key);
  if (it != storages_.end()) {
    if (it->second->dtype != dtype)
      return Fail("storage '" + key + "' is referenced with two dtypes");
    *out = it->second;
    return Status::Ok();
  }
  std::shared_ptr<Storage> storage;
  if (resolver_) {
    Result<std::shared_ptr<Storage>> resolved = resolver_(key, dtype, numel, location);
    if (!resolved.ok()) return resolved.status();
    storage = std::move(resolved.value());
    if (!storage) return Status::Internal("storage resolver returned nothing for '" + key + "'");
  } else {
    storage = std::make_shared<Storage>();
    storage->dtype = dtype;
    storage->numel = numel;
    storage->location = location;
    storage->record_key = key;
  }
  storages_[key] = storage;
  *out = std::move(storage);
  return Status::Ok();
}

// ---- Materialisation

Status Parser::Materialise(Node* n, int depth, Value* out) {
  if (depth > options_.max_depth) {
    return Status::InvalidInput("pickle nests deeper than " + std::to_string(options_.max_depth) +
                                " levels");
  }
  if (value_budget_ == 0) {
    return Status::InvalidInput(
        "pickle expands to too many values through repeated memo references");
  }
  --value_budget_;
  if (n->visiting) return Status::Unsupported("pickle holds an object that contains itself");
  n->visiting = true;
  Status st;
  switch (n->kind) {
    case Node::Kind::kLeaf: *out = n->leaf; break;
    case Node::Kind::kStorage:
      st = Status::Unsupported("pickle holds a torch storage outside a tensor");
      break;
    case Node::Kind::kList:
    case Node::Kind::kTuple:
    case Node::Kind::kSet:
    case Node::Kind::kFrozenSet: {
      std::vector<Value> items;
      st = MaterialiseAll(n->items, depth + 1, &items);
      *out = n->kind == Node::Kind::kList    ? Value::MakeList(std::move(items))
             : n->kind == Node::Kind::kTuple ? Value::MakeTuple(std::move(items))
             : n->kind == Node::Kind::kSet   ? Value::MakeSet(std::move(items))
                                             : Value::MakeFrozenSet(std::move(items));
      break;
    }
    case Node::Kind::kDict: {
      Items items;
      st = MaterialisePairs(n->pairs, depth + 1, &items);
      *out = Value::MakeDict(std::move(items));
      break;
    }
    case Node::Kind::kTensor:
      *out = n->leaf;
      st = MaterialiseAll(n->items, depth + 1, &out->as_tensor().extra_args);
      break;
    case Node::Kind::kObject: st = MaterialiseObject(n, depth, out); break;
  }
  n->visiting = false;
  return st;
}

Status Parser::MaterialiseAll(const std::vector<Node*>& nodes, int depth, std::vector<Value>* out) {
  out->resize(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    RESHARD_RETURN_IF_ERROR(Materialise(nodes[i], depth, &(*out)[i]));
  }
  return Status::Ok();
}

Status Parser::MaterialisePairs(const std::vector<std::pair<Node*, Node*>>& pairs, int depth,
                                Items* out) {
  out->resize(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    RESHARD_RETURN_IF_ERROR(Materialise(pairs[i].first, depth, &(*out)[i].first));
    RESHARD_RETURN_IF_ERROR(Materialise(pairs[i].second, depth, &(*out)[i].second));
  }
  return Status::Ok();
}

Status Parser::MaterialiseObject(Node* n, int depth, Value* out) {
  *out = n->leaf;
  Object& o = out->as_object();
  RESHARD_RETURN_IF_ERROR(MaterialiseAll(n->items, depth + 1, &o.args));
  RESHARD_RETURN_IF_ERROR(MaterialiseAll(n->appends, depth + 1, &o.list_items));
  RESHARD_RETURN_IF_ERROR(MaterialisePairs(n->pairs, depth + 1, &o.dict_items));
  if (n->state != nullptr) {
    o.state = std::make_shared<Value>();
    RESHARD_RETURN_IF_ERROR(Materialise(n->state, depth + 1, o.state.get()));
  }
  return Status::Ok();
}

Result<Value> Parser::Run() {
  bool stop = false;
  while (!stop) {
    if (pos_ >= size_) {
      return Status::InvalidInput("malformed pickle: input ends at byte " + std::to_string(size_) +
                                  " before the STOP opcode");
    }
    op_pos_ = pos_;
    op_ = data_[pos_++];
    RESHARD_RETURN_IF_ERROR(Step(&stop));
  }
  Node* root;
  RESHARD_RETURN_IF_ERROR(Pop(&root));
  Value v;
  RESHARD_RETURN_IF_ERROR(Materialise(root, 0, &v));
  return v;
}

}  // namespace

PickleReader::PickleReader(PickleReadOptions options, StorageResolver resolver)
    : options_(std::move(options)), resolver_(std::move(resolver)) {}

Result<Value> PickleReader::Parse(const uint8_t* data, size_t size) {
  if (data == nullptr && size > 0) return Status::InvalidInput("pickle: no data");
  Parser parser(options_, resolver_, data, size);
  return parser.Run();
}

}  // namespace reshard
