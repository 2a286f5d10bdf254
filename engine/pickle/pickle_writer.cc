#include "pickle/pickle_writer.h"

#include <cstring>
#include <map>

#include "pickle/opcodes.h"
#include "pickle/text_codecs.h"

namespace reshard {
namespace {

// Protocol 2 names Python 3 modules by their Python 2 names, as Python's
// pickler does (fix_imports); Python 3 maps them back when loading.
std::string Py2Module(const std::string& module) {
  if (module == "builtins") return "__builtin__";
  if (module == "copyreg") return "copy_reg";
  return module;
}

class Writer {
 public:
  explicit Writer(const StorageSink& sink) : sink_(sink) {}

  Result<std::string> Run(const Value& root) {
    Op(op::kProto);
    out_ += '\x02';
    RESHARD_RETURN_IF_ERROR(Write(root));
    Op(op::kStop);
    return std::move(out_);
  }

 private:
  Status Write(const Value& v) {
    switch (v.kind()) {
      case Value::Kind::kNone: Op(op::kNone); return Status::Ok();
      case Value::Kind::kBool: Op(v.as_bool() ? op::kNewTrue : op::kNewFalse); return Status::Ok();
      case Value::Kind::kInt: Int(v.as_int()); return Status::Ok();
      case Value::Kind::kBigInt: Long(v.as_bigint().le_bytes); return Status::Ok();
      case Value::Kind::kFloat: Float(v.as_float()); return Status::Ok();
      case Value::Kind::kString: return Unicode(v.as_string());
      case Value::Kind::kBytes: return Bytes(v.as_bytes().data);
      case Value::Kind::kList: return List(v.as_list().items);
      case Value::Kind::kTuple: return Tuple(v.as_tuple().items);
      case Value::Kind::kDict: return Dict(v.as_dict().items);
      case Value::Kind::kSet: return SetLike("set", v.as_set().items);
      case Value::Kind::kFrozenSet: return SetLike("frozenset", v.as_frozenset().items);
      case Value::Kind::kTensor: return TensorOp(v.as_tensor());
      case Value::Kind::kObject: return ObjectOp(v.as_object());
      case Value::Kind::kGlobal: return GlobalOp(v.as_global());
    }
    return Status::Internal("pickle writer: unknown value kind");
  }

  void Op(uint8_t opcode) { out_ += static_cast<char>(opcode); }

  void LittleEndian(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_ += static_cast<char>(v >> (8 * i));
  }

  void Int(int64_t i) {
    if (i >= 0 && i < 0x100) {
      Op(op::kBinInt1);
      LittleEndian(static_cast<uint64_t>(i), 1);
    } else if (i >= 0 && i < 0x10000) {
      Op(op::kBinInt2);
      LittleEndian(static_cast<uint64_t>(i), 2);
    } else if (i >= INT32_MIN && i <= INT32_MAX) {
      Op(op::kBinInt);
      LittleEndian(static_cast<uint64_t>(i), 4);
    } else {
      // The shortest two's complement form, as Python writes it: drop top
      // bytes that only repeat the sign of the byte below.
      std::string le;
      for (int b = 0; b < 8; ++b) le += static_cast<char>(static_cast<uint64_t>(i) >> (8 * b));
      while (le.size() > 1) {
        const uint8_t top = static_cast<uint8_t>(le.back());
        const bool below_negative = static_cast<uint8_t>(le[le.size() - 2]) & 0x80;
        if (top != (below_negative ? 0xff : 0x00)) break;
        le.pop_back();
      }
      Long(le);
    }
  }

  void Long(const std::string& le) {
    if (le.size() < 0x100) {
      Op(op::kLong1);
      LittleEndian(le.size(), 1);
    } else {
      Op(op::kLong4);
      LittleEndian(le.size(), 4);
    }
    out_ += le;
  }

  void Float(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    Op(op::kBinFloat);
    for (int i = 7; i >= 0; --i) out_ += static_cast<char>(bits >> (8 * i));  // big-endian
  }

  Status Unicode(const std::string& s) {
    if (s.size() > UINT32_MAX)
      return Status::InvalidInput("pickle writer: string longer than 4 GiB");
    Op(op::kBinUnicode);
    LittleEndian(s.size(), 4);
    out_ += s;
    return Status::Ok();
  }

  // Protocol 2 has no bytes opcode that Python 3 loads as bytes; Python
  // itself writes _codecs.encode(<latin-1 str>, 'latin1').
  Status Bytes(const std::string& b) {
    RESHARD_RETURN_IF_ERROR(GlobalOp({"_codecs", "encode"}));
    RESHARD_RETURN_IF_ERROR(Unicode(Latin1ToUtf8(b)));
    RESHARD_RETURN_IF_ERROR(Unicode("latin1"));
    Op(op::kTuple2);
    Op(op::kReduce);
    return Status::Ok();
  }

  Status Each(const std::vector<Value>& items) {
    for (const Value& item : items) RESHARD_RETURN_IF_ERROR(Write(item));
    return Status::Ok();
  }

  Status Tuple(const std::vector<Value>& items) {
    if (items.empty()) {
      Op(op::kEmptyTuple);
      return Status::Ok();
    }
    static constexpr uint8_t kSmallTuple[] = {op::kTuple1, op::kTuple2, op::kTuple3};
    if (items.size() > 3) Op(op::kMark);
    RESHARD_RETURN_IF_ERROR(Each(items));
    Op(items.size() > 3 ? op::kTuple : kSmallTuple[items.size() - 1]);
    return Status::Ok();
  }

  // MARK items APPENDS onto the list or object on top of the stack.
  Status Appends(const std::vector<Value>& items) {
    if (items.empty()) return Status::Ok();
    Op(op::kMark);
    RESHARD_RETURN_IF_ERROR(Each(items));
    Op(op::kAppends);
    return Status::Ok();
  }

  // MARK key value ... SETITEMS onto the dict or object on top of the stack.
  Status SetItems(const Items& items) {
    if (items.empty()) return Status::Ok();
    Op(op::kMark);
    for (const auto& [key, value] : items) {
      RESHARD_RETURN_IF_ERROR(Write(key));
      RESHARD_RETURN_IF_ERROR(Write(value));
    }
    Op(op::kSetItems);
    return Status::Ok();
  }

  Status List(const std::vector<Value>& items) {
    Op(op::kEmptyList);
    return Appends(items);
  }

  Status Dict(const Items& items) {
    Op(op::kEmptyDict);
    return SetItems(items);
  }

  // set(list) / frozenset(list): protocol 2 has no set opcodes.
  Status SetLike(const char* name, const std::vector<Value>& items) {
    RESHARD_RETURN_IF_ERROR(GlobalOp({"builtins", name}));
    RESHARD_RETURN_IF_ERROR(List(items));
    Op(op::kTuple1);
    Op(op::kReduce);
    return Status::Ok();
  }

  Status GlobalOp(const Global& g) {
    const std::string module = Py2Module(g.module);
    if (module.find('\n') != std::string::npos || g.name.find('\n') != std::string::npos) {
      return Status::InvalidInput("pickle writer: class name '" + g.Qualified() +
                                  "' contains a newline");
    }
    Op(op::kGlobal);
    out_ += module + "\n" + g.name + "\n";
    return Status::Ok();
  }

  // In the order Python's pickler uses: construct, APPENDS, SETITEMS, BUILD.
  Status ObjectOp(const Object& o) {
    RESHARD_RETURN_IF_ERROR(GlobalOp(o.cls));
    RESHARD_RETURN_IF_ERROR(Tuple(o.args));
    Op(o.construct == Object::Construct::kNewObj ? op::kNewObj : op::kReduce);
    RESHARD_RETURN_IF_ERROR(Appends(o.list_items));
    RESHARD_RETURN_IF_ERROR(SetItems(o.dict_items));
    if (o.state) {
      RESHARD_RETURN_IF_ERROR(Write(*o.state));
      Op(op::kBuild);
    }
    return Status::Ok();
  }

  Status Ints(const std::vector<int64_t>& ints) {
    std::vector<Value> items;
    items.reserve(ints.size());
    for (int64_t i : ints) items.push_back(Value::Int(i));
    return Tuple(items);
  }

  // _rebuild_tensor_v2(persistent storage, offset, size, stride, requires_grad, *extra_args).
  Status TensorOp(const Tensor& t) {
    if (!t.storage) return Status::InvalidInput("pickle writer: tensor has no storage");
    std::string key;
    RESHARD_RETURN_IF_ERROR(StorageKey(*t.storage, &key));
    RESHARD_RETURN_IF_ERROR(GlobalOp({"torch._utils", "_rebuild_tensor_v2"}));
    Op(op::kMark);
    RESHARD_RETURN_IF_ERROR(PersistentId(*t.storage, key));
    Int(t.storage_offset);
    RESHARD_RETURN_IF_ERROR(Ints(t.sizes));
    RESHARD_RETURN_IF_ERROR(Ints(t.strides));
    Op(t.requires_grad ? op::kNewTrue : op::kNewFalse);
    if (t.extra_args.empty()) {
      RESHARD_RETURN_IF_ERROR(ObjectOp(MakeOrderedDict({}).as_object()));  // no backward hooks
    } else {
      RESHARD_RETURN_IF_ERROR(Each(t.extra_args));
    }
    Op(op::kTuple);
    Op(op::kReduce);
    return Status::Ok();
  }

  // ('storage', torch.<X>Storage, key, location, numel), as torch.save writes it.
  Status PersistentId(const Storage& s, const std::string& key) {
    Op(op::kMark);
    RESHARD_RETURN_IF_ERROR(Unicode("storage"));
    RESHARD_RETURN_IF_ERROR(GlobalOp({"torch", StorageClassName(s.dtype)}));
    RESHARD_RETURN_IF_ERROR(Unicode(key));
    RESHARD_RETURN_IF_ERROR(Unicode(s.location));
    Int(s.numel);
    Op(op::kTuple);
    Op(op::kBinPersId);
    return Status::Ok();
  }

  // Numbers storages "0", "1", ... in order of first appearance and hands each
  // to the sink once.
  Status StorageKey(const Storage& s, std::string* key) {
    auto it = keys_.find(&s);
    if (it != keys_.end()) {
      *key = it->second;
      return Status::Ok();
    }
    *key = std::to_string(keys_.size());
    keys_.emplace(&s, *key);
    return sink_ ? sink_(*key, s) : Status::Ok();
  }

  const StorageSink& sink_;
  std::string out_;
  std::map<const Storage*, std::string> keys_;
};

// `where` and one step further into it, for messages: "args.gizmo", "[3]".
std::string Into(const std::string& where, const Value& key) {
  if (!key.is(Value::Kind::kString)) return where + "[" + key.DebugString(40) + "]";
  return where.empty() ? key.as_string() : where + "." + key.as_string();
}

// The first class taken on trust in `v` (at `where`): its refusal.
Status FirstTrustedOnly(const Value& v, const std::string& where);

Status EachWritable(const std::vector<Value>& items, const std::string& where) {
  for (size_t i = 0; i < items.size(); ++i) {
    RESHARD_RETURN_IF_ERROR(FirstTrustedOnly(items[i], where + "[" + std::to_string(i) + "]"));
  }
  return Status::Ok();
}

Status EachWritable(const Items& items, const std::string& where) {
  for (const auto& [key, value] : items) {
    RESHARD_RETURN_IF_ERROR(FirstTrustedOnly(key, where));
    RESHARD_RETURN_IF_ERROR(FirstTrustedOnly(value, Into(where, key)));
  }
  return Status::Ok();
}

Status Refuse(const Global& g, const std::string& where) {
  return Status::Unsupported((where.empty() ? std::string("the value") : where) + " is " + g.Qualified() +
                             ", which --allow-class let reshard read; reshard writes no call it does not know to "
                             "be data, as torch.load of the output would make it. Remove it from the checkpoint, "
                             "or export --to hf or consolidated, which keep no pickled metadata");
}

Status FirstTrustedOnly(const Value& v, const std::string& where) {
  switch (v.kind()) {
    case Value::Kind::kList: return EachWritable(v.as_list().items, where);
    case Value::Kind::kTuple: return EachWritable(v.as_tuple().items, where);
    case Value::Kind::kSet: return EachWritable(v.as_set().items, where);
    case Value::Kind::kFrozenSet: return EachWritable(v.as_frozenset().items, where);
    case Value::Kind::kDict: return EachWritable(v.as_dict().items, where);
    case Value::Kind::kGlobal: return v.as_global().trusted_only ? Refuse(v.as_global(), where) : Status::Ok();
    case Value::Kind::kTensor: return EachWritable(v.as_tensor().extra_args, where);
    case Value::Kind::kObject: {
      const Object& o = v.as_object();
      if (o.cls.trusted_only) return Refuse(o.cls, where);
      RESHARD_RETURN_IF_ERROR(EachWritable(o.args, where));
      RESHARD_RETURN_IF_ERROR(EachWritable(o.dict_items, where));
      RESHARD_RETURN_IF_ERROR(EachWritable(o.list_items, where));
      // A record's state dict names its attributes ("args.gizmo").
      return o.state ? FirstTrustedOnly(*o.state, where) : Status::Ok();
    }
    default: return Status::Ok();
  }
}

}  // namespace

Status CheckWritable(const Value& root) { return FirstTrustedOnly(root, ""); }

Result<std::string> WritePickle(const Value& root, const StorageSink& sink) {
  RESHARD_RETURN_IF_ERROR(CheckWritable(root));
  Writer writer(sink);
  return writer.Run(root);
}

}  // namespace reshard
