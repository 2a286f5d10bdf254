#include "pickle/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "pickle/text_codecs.h"

namespace reshard {

// ---- Tensor -----------------------------------------------------------------

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

// PyTorch's definition: dims of size 1 may have any stride, and an empty
// tensor is contiguous.
bool Tensor::IsContiguous() const {
  if (sizes.size() != strides.size()) return false;
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] == 1) continue;
    if (strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

std::vector<int64_t> Tensor::ContiguousStrides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(sizes[i], 1);  // as PyTorch: a zero dim does not zero the strides
  }
  return strides;
}

// ---- Typed access -------------------------------------------------------------

namespace {

bool IsClass(const Value& v, const char* module, const char* name) {
  return v.is(Value::Kind::kObject) && v.as_object().cls.Is(module, name);
}

}  // namespace

bool IsOrderedDict(const Value& v) { return IsClass(v, "collections", "OrderedDict"); }

const Items* DictItems(const Value& v) {
  if (v.is(Value::Kind::kDict)) return &v.as_dict().items;
  if (!v.is(Value::Kind::kObject)) return nullptr;
  const Object& o = v.as_object();
  // Plain objects (argparse.Namespace, dataclasses) keep their fields in the
  // BUILD state; dict subclasses (OrderedDict) in their SETITEMS. A state
  // dict's OrderedDict has a BUILD state too (its `_metadata` attribute),
  // which is not its items.
  if (IsOrderedDict(v)) return &o.dict_items;
  if (o.state && o.state->is(Value::Kind::kDict)) return &o.state->as_dict().items;
  if (!o.dict_items.empty()) return &o.dict_items;
  return nullptr;
}

Items* MutableDictItems(Value& v) { return const_cast<Items*>(DictItems(v)); }

const Value* Find(const Value& v, const std::string& key) {
  const Items* items = DictItems(v);
  if (items == nullptr) return nullptr;
  for (const auto& [k, item] : *items) {
    if (k.is(Value::Kind::kString) && k.as_string() == key) return &item;
  }
  return nullptr;
}

Value* FindMutable(Value& v, const std::string& key) { return const_cast<Value*>(Find(v, key)); }

void Set(Value& v, const std::string& key, Value item) {
  if (Value* existing = FindMutable(v, key)) {
    *existing = std::move(item);
  } else if (Items* items = MutableDictItems(v)) {
    items->emplace_back(Value::String(key), std::move(item));
  }
}

Object::Object(const Object& other)
    : cls(other.cls),
      construct(other.construct),
      args(other.args),
      state(other.state ? std::make_shared<Value>(*other.state) : nullptr),
      dict_items(other.dict_items),
      list_items(other.list_items) {}

Object& Object::operator=(const Object& other) {
  if (this != &other) *this = Object(other);
  return *this;
}

Value WithOwnStorage(const Value& v) {
  if (!v.is(Value::Kind::kTensor)) return v;
  const Tensor& t = v.as_tensor();
  const ByteView& bytes = t.storage->bytes;
  const int64_t element = ElementSize(t.storage->dtype);
  Value copy = MakeTensorOver(t.storage->dtype, t.sizes,
                              ByteView{bytes.owner, bytes.data + t.storage_offset * element,
                                       static_cast<size_t>(t.numel() * element), bytes.mapped},
                              t.storage->location);
  copy.as_tensor().requires_grad = t.requires_grad;
  return copy;
}

Value MakeOwnedTensor(DType dtype, const std::vector<int64_t>& shape,
                      std::shared_ptr<std::vector<uint8_t>> bytes, const std::string& location) {
  const uint8_t* data = bytes->data();
  const size_t size = bytes->size();
  return MakeTensorOver(dtype, shape, ByteView{std::move(bytes), data, size}, location);
}

namespace {

Value ContiguousTensor(std::shared_ptr<Storage> storage, const std::vector<int64_t>& shape) {
  Tensor t;
  t.storage = std::move(storage);
  t.sizes = shape;
  t.strides = Tensor::ContiguousStrides(shape);
  return Value::MakeTensor(std::move(t));
}

}  // namespace

Value MakeTensorOver(DType dtype, const std::vector<int64_t>& shape, ByteView bytes,
                     const std::string& location) {
  auto storage = std::make_shared<Storage>();
  storage->dtype = dtype;
  storage->numel = static_cast<int64_t>(bytes.size) / ElementSize(dtype);
  storage->location = location;
  storage->bytes = std::move(bytes);
  return ContiguousTensor(std::move(storage), shape);
}

Value MakeProducedTensor(DType dtype, const std::vector<int64_t>& shape, ByteProducer produce) {
  auto storage = std::make_shared<Storage>();
  storage->dtype = dtype;
  storage->numel = 1;
  for (int64_t d : shape) storage->numel *= d;
  storage->produce = std::move(produce);
  return ContiguousTensor(std::move(storage), shape);
}

Value MakeOrderedDict(Items items) {
  Object o;
  o.cls = {"collections", "OrderedDict"};
  o.dict_items = std::move(items);
  return Value::MakeObject(std::move(o));
}

Value MakeNamespace(Items fields) {
  Object o;
  o.cls = {"argparse", "Namespace"};
  o.construct = Object::Construct::kNewObj;
  o.state = std::make_shared<Value>(Value::MakeDict(std::move(fields)));
  return Value::MakeObject(std::move(o));
}

Value MakeTorchSize(const std::vector<int64_t>& dims) {
  std::vector<Value> ints;
  ints.reserve(dims.size());
  for (int64_t d : dims) ints.push_back(Value::Int(d));
  Object o;
  o.cls = {"torch", "Size"};
  o.args.push_back(Value::MakeTuple(std::move(ints)));
  return Value::MakeObject(std::move(o));
}

bool ReadIntSequence(const Value& v, std::vector<int64_t>* out) {
  if (IsClass(v, "torch", "Size")) {
    const std::vector<Value>& args = v.as_object().args;
    return args.size() == 1 && ReadIntSequence(args[0], out);
  }
  const std::vector<Value>* items = nullptr;
  if (v.is(Value::Kind::kTuple)) items = &v.as_tuple().items;
  if (v.is(Value::Kind::kList)) items = &v.as_list().items;
  if (items == nullptr) return false;
  std::vector<int64_t> dims;
  dims.reserve(items->size());
  for (const Value& item : *items) {
    if (!item.is(Value::Kind::kInt)) return false;
    dims.push_back(item.as_int());
  }
  *out = std::move(dims);
  return true;
}

bool ReadInt(const Value& v, int64_t* out) {
  if (v.is(Value::Kind::kInt)) {
    *out = v.as_int();
    return true;
  }
  if (v.is(Value::Kind::kBool)) {
    *out = v.as_bool() ? 1 : 0;
    return true;
  }
  return false;
}

// ---- DebugString --------------------------------------------------------------

namespace {

// Decimal rendering of a little-endian two's complement integer. Conversion
// is quadratic, so huge ones are only sized.
std::string BigIntToDecimal(const std::string& le) {
  if (le.size() > 1024) return "<int of " + std::to_string(le.size()) + " bytes>";
  return TwosComplementToDecimal(le);
}

// Python's repr: the shortest digits that read back exactly, positional
// notation for 1e-4 <= |d| < 1e16 and scientific notation outside it.
std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[40];
  const auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  const std::string sci(buf, res.ptr);  // "-1.2345e-05"
  const size_t e = sci.find('e');
  const int exp = std::atoi(sci.c_str() + e + 1);
  const bool negative = sci[0] == '-';
  std::string digits;
  for (size_t i = negative ? 1 : 0; i < e; ++i) {
    if (sci[i] != '.') digits.push_back(sci[i]);
  }
  std::string out = negative ? "-" : "";
  if (exp < -4 || exp >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    const std::string mag = std::to_string(std::abs(exp));
    out += std::string(exp < 0 ? "e-" : "e+") + (mag.size() < 2 ? "0" : "") + mag;
  } else if (exp < 0) {
    out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  } else {
    const size_t int_digits = static_cast<size_t>(exp) + 1;
    if (digits.size() < int_digits) digits.append(int_digits - digits.size(), '0');
    const std::string frac = digits.substr(int_digits);
    out += digits.substr(0, int_digits) + "." + (frac.empty() ? "0" : frac);
  }
  return out;
}

void AppendEscaped(std::string* out, const std::string& s, bool is_bytes) {
  out->push_back('\'');
  for (unsigned char c : s) {
    switch (c) {
      case '\\': *out += "\\\\"; break;
      case '\'': *out += "\\'"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      default:
        // Strings are UTF-8 and shown as such; bytes outside ASCII are escaped.
        if (c < 0x20 || c == 0x7f || (is_bytes && c >= 0x80)) {
          char hex[5];
          std::snprintf(hex, sizeof(hex), "\\x%02x", c);
          *out += hex;
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('\'');
}

// Renders into `out` and stops descending once `limit` characters exist, so a
// huge tree costs no more than its first few hundred characters.
class Renderer {
 public:
  explicit Renderer(size_t limit) : limit_(limit) {}
  std::string Take() { return std::move(out_); }

  void Render(const Value& v) {
    if (out_.size() > limit_) return;
    switch (v.kind()) {
      case Value::Kind::kNone: out_ += "None"; break;
      case Value::Kind::kBool: out_ += v.as_bool() ? "True" : "False"; break;
      case Value::Kind::kInt: out_ += std::to_string(v.as_int()); break;
      case Value::Kind::kBigInt: out_ += BigIntToDecimal(v.as_bigint().le_bytes); break;
      case Value::Kind::kFloat: out_ += FloatRepr(v.as_float()); break;
      case Value::Kind::kString: AppendEscaped(&out_, v.as_string(), false); break;
      case Value::Kind::kBytes:
        out_ += "b";
        AppendEscaped(&out_, v.as_bytes().data, true);
        break;
      case Value::Kind::kList: Sequence("[", v.as_list().items, "]"); break;
      case Value::Kind::kTuple: Tuple(v.as_tuple().items); break;
      case Value::Kind::kDict: Dict(v.as_dict().items); break;
      case Value::Kind::kSet: SetLike("", v.as_set().items); break;
      case Value::Kind::kFrozenSet: SetLike("frozenset", v.as_frozenset().items); break;
      case Value::Kind::kTensor: RenderTensor(v.as_tensor()); break;
      case Value::Kind::kObject: RenderObject(v.as_object()); break;
      case Value::Kind::kGlobal: out_ += v.as_global().Qualified(); break;
    }
  }

 private:
  void Sequence(const char* open, const std::vector<Value>& items, const char* close) {
    out_ += open;
    for (size_t i = 0; i < items.size() && out_.size() <= limit_; ++i) {
      if (i > 0) out_ += ", ";
      Render(items[i]);
    }
    out_ += close;
  }

  void Tuple(const std::vector<Value>& items) {
    if (items.size() == 1) {
      out_ += "(";
      Render(items[0]);
      out_ += ",)";
    } else {
      Sequence("(", items, ")");
    }
  }

  void SetLike(const char* name, const std::vector<Value>& items) {
    if (items.empty()) {
      out_ += *name ? name : "set";
      out_ += "()";
      return;
    }
    out_ += name;
    if (*name) out_ += "(";
    Sequence("{", items, "}");
    if (*name) out_ += ")";
  }

  void Dict(const Items& items) {
    out_ += "{";
    for (size_t i = 0; i < items.size() && out_.size() <= limit_; ++i) {
      if (i > 0) out_ += ", ";
      Render(items[i].first);
      out_ += ": ";
      Render(items[i].second);
    }
    out_ += "}";
  }

  void RenderTensor(const Tensor& t) {
    out_ += "tensor(";
    out_ += t.storage ? DTypeName(t.storage->dtype) : "?";
    out_ += ", [";
    for (size_t i = 0; i < t.sizes.size(); ++i) {
      if (i > 0) out_ += ", ";
      out_ += std::to_string(t.sizes[i]);
    }
    out_ += "])";
  }

  // module.name(args..., {dict items}, [list items], field=value...) with the
  // BUILD state shown as keyword arguments when it is a str-keyed dict.
  void RenderObject(const Object& o) {
    out_ += o.cls.Qualified();
    out_ += "(";
    bool first = true;
    auto next = [&] {
      if (!first) out_ += ", ";
      first = false;
    };
    for (const Value& arg : o.args) {
      next();
      Render(arg);
    }
    if (!o.dict_items.empty()) {
      next();
      Dict(o.dict_items);
    }
    if (!o.list_items.empty()) {
      next();
      Sequence("[", o.list_items, "]");
    }
    if (o.state) RenderState(*o.state, next);
    out_ += ")";
  }

  template <typename Next>
  void RenderState(const Value& state, Next& next) {
    if (!state.is(Value::Kind::kDict)) {
      next();
      out_ += "state=";
      Render(state);
      return;
    }
    for (const auto& [key, item] : state.as_dict().items) {
      if (out_.size() > limit_) return;
      next();
      if (key.is(Value::Kind::kString)) {
        out_ += key.as_string();
      } else {
        Render(key);
      }
      out_ += "=";
      Render(item);
    }
  }

  size_t limit_;
  std::string out_;
};

}  // namespace

std::string Value::DebugString(size_t max_len) const {
  Renderer r(max_len);
  r.Render(*this);
  std::string s = r.Take();
  if (s.size() > max_len) {
    s.resize(max_len > 3 ? max_len - 3 : 0);
    s += "...";
  }
  return s;
}

}  // namespace reshard
