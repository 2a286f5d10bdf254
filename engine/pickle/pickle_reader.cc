#include "pickle/pickle_reader.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include "pickle/opcodes.h"
#include "pickle/text_codecs.h"

namespace reshard {

// ---- The allow-list -------------------------------------------------------------

namespace {

// Classes any torch.save checkpoint may hold. A checkpoint format adds its
// own through PickleReadOptions::known_classes.
const std::set<std::string>& KnownGlobals() {
  static const std::set<std::string> known = [] {
    // clang-format off
    std::set<std::string> s = {
        // Plain data. Protocol 2 pickles bytes as _codecs.encode(str, 'latin1'),
        // b'' as builtins.bytes() and bytearray as builtins.bytearray(bytes).
        "collections.OrderedDict", "builtins.set", "builtins.frozenset", "builtins.slice",
        "builtins.complex", "builtins.bytes", "builtins.bytearray", "_codecs.encode",
        "codecs.encode", "argparse.Namespace",
        // Python >= 3.11 pickles an enum member as getattr(EnumClass, 'name').
        // Safe to accept: its first argument is itself a checked global, and
        // a getattr result cannot be called, as REDUCE only applies globals.
        "builtins.getattr",
        // Tensors and their metadata.
        "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
        "torch._tensor._rebuild_from_type_v2", "torch.nn.parameter.Parameter", "torch.Tensor",
        "torch.Size", "torch.device",
        // dtype aliases; the canonical names (torch.float32, ...) are added below.
        "torch.float", "torch.half", "torch.long", "torch.int", "torch.double",
        // NumPy arrays and scalars (the NumPy RNG state); numpy._core is NumPy >= 2.
        "numpy.core.multiarray._reconstruct", "numpy.core.multiarray.scalar", "numpy.ndarray",
        "numpy.dtype", "numpy._core.multiarray._reconstruct", "numpy._core.multiarray.scalar",
    };
    // clang-format on
    for (int d = 0; d <= static_cast<int>(DType::kComplex128); ++d) {  // the last DType
      s.insert(std::string("torch.") + StorageClassName(static_cast<DType>(d)));
      s.insert(std::string("torch.") + DTypeName(static_cast<DType>(d)));
    }
    return s;
  }();
  return known;
}

}  // namespace

bool IsKnownGlobal(const std::string& qualified) { return KnownGlobals().count(qualified) > 0; }

namespace {

// The built-in list, the format's and the user's are accepted alike.
bool IsAccepted(const std::string& qualified, const PickleReadOptions& options) {
  return IsKnownGlobal(qualified) ||
         (options.known_classes != nullptr && options.known_classes->count(qualified) > 0) ||
         options.allowed_globals.count(qualified) > 0;
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
  Status Call(const Global& g, const std::vector<Node*>& args, Node** out);
  Status RebuildTensor(const std::vector<Node*>& args, Node** out);
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
  if (!IsAccepted(q, options_)) {
    return Status::Unsupported("pickle refers to class '" + q +
                               "', which reshard does not know; reshard never runs code from "
                               "checkpoints. Pass --allow-class " +
                               q + " to carry it through unchanged");
  }
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
  RESHARD_RETURN_IF_ERROR(Call(callable->leaf.as_global(), args->items, &result));
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
  Push(NewObject(cls->leaf.as_global(), Object::Construct::kNewObj, args->items));
  return Status::Ok();
}

Status Parser::Build() {
  Node* state;
  Node* target;
  RESHARD_RETURN_IF_ERROR(Pop(&state));
  RESHARD_RETURN_IF_ERROR(Top(&target));
  if (target->kind != Node::Kind::kObject) return Fail("BUILD on something that is not an object");
  if (target->state != nullptr) {
    return Status::Unsupported("pickle sets the state of '" +
                               target->leaf.as_object().cls.Qualified() +
                               "' twice, which reshard does not support");
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

// The result of calling `g(*args)`, for the calls whose result is plain data
// (tensors, bytes, sets); every other call stays an Object.
Status Parser::Call(const Global& g, const std::vector<Node*>& args, Node** out) {
  if (g.Is("torch._utils", "_rebuild_tensor_v2")) return RebuildTensor(args, out);
  std::string text, encoding, bytes;
  const bool latin1 = (g.Is("_codecs", "encode") || g.Is("codecs", "encode")) && args.size() == 2 &&
                      LeafString(args[0], &text) && LeafString(args[1], &encoding) &&
                      (encoding == "latin1" || encoding == "latin-1") && Utf8ToLatin1(text, &bytes);
  if (latin1) {
    *out = NewLeaf(Value::MakeBytes(std::move(bytes)));
  } else if (g.Is("builtins", "bytes") && args.empty()) {
    *out = NewLeaf(Value::MakeBytes(""));
  } else if ((g.Is("builtins", "set") || g.Is("builtins", "frozenset")) &&
             (args.empty() || (args.size() == 1 && (args[0]->kind == Node::Kind::kList ||
                                                    args[0]->kind == Node::Kind::kTuple)))) {
    *out = New(g.name == "set" ? Node::Kind::kSet : Node::Kind::kFrozenSet);
    if (!args.empty()) (*out)->items = args[0]->items;
  } else {
    *out = NewObject(g, Object::Construct::kReduce, args);
  }
  return Status::Ok();
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
  RESHARD_RETURN_IF_ERROR(CheckTensorBounds(t));
  *out = New(Node::Kind::kTensor);
  (*out)->leaf = Value::MakeTensor(std::move(t));
  (*out)->items.assign(args.begin() + 5, args.end());
  return Status::Ok();
}

// Later stages index storages with these numbers, so a tensor must stay
// inside its storage.
Status Parser::CheckTensorBounds(const Tensor& t) {
  if (t.sizes.size() != t.strides.size()) return Fail("tensor size and stride differ in length");
  if (t.storage_offset < 0) return Fail("negative tensor storage offset");
  int64_t last = t.storage_offset;  // element offset of the last element
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    if (t.sizes[i] < 0 || t.strides[i] < 0) return Fail("negative tensor size or stride");
    if (t.sizes[i] == 0) return Status::Ok();  // no elements
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
