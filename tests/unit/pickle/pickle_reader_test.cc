#include "pickle/pickle_reader.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "formats/deepspeed/files/known_classes.h"
#include "pickle_test_support.h"

namespace reshard {
namespace {

using namespace std::string_literals;
using testing_pickle::ParseFixture;
using testing_pickle::ParseString;
using testing_pickle::SameValue;

const Value& At(const Value& v, const std::string& key) {
  const Value* found = Find(v, key);
  EXPECT_NE(found, nullptr) << "missing key " << key << " in " << v.DebugString();
  static const Value kNone;
  return found ? *found : kNone;
}

std::vector<int64_t> Ints(const Value& v) {
  std::vector<int64_t> out;
  EXPECT_TRUE(ReadIntSequence(v, &out)) << v.DebugString();
  return out;
}

// ---- torch.save output ------------------------------------------------------------

TEST(PickleReaderTest, StateDictFromTorchSave) {
  Result<Value> root = ParseFixture(testing_pickle::kStateDictPkl);
  ASSERT_TRUE(root.ok()) << root.status().message();
  ASSERT_TRUE(IsOrderedDict(*root));
  const Items* items = DictItems(*root);
  ASSERT_NE(items, nullptr);
  std::vector<std::string> keys;
  for (const auto& [k, v] : *items) keys.push_back(k.as_string());
  EXPECT_EQ(keys, (std::vector<std::string>{"a.weight", "b.bias", "a.row1", "a.t", "p"}));

  const Tensor& w = At(*root, "a.weight").as_tensor();
  EXPECT_EQ(w.storage->dtype, DType::kBFloat16);
  EXPECT_EQ(w.storage->numel, 6);
  EXPECT_EQ(w.storage->record_key, "0");
  EXPECT_EQ(w.storage->location, "cpu");
  EXPECT_FALSE(w.storage->bytes.data);  // no resolver: nothing bound
  EXPECT_EQ(w.storage_offset, 0);
  EXPECT_EQ(w.sizes, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w.strides, (std::vector<int64_t>{3, 1}));
  EXPECT_FALSE(w.requires_grad);
  EXPECT_TRUE(w.IsContiguous());
  ASSERT_EQ(w.extra_args.size(), 1u);  // the backward hooks
  EXPECT_TRUE(IsOrderedDict(w.extra_args[0]));
  EXPECT_TRUE(DictItems(w.extra_args[0])->empty());
  EXPECT_EQ(At(*root, "a.weight").DebugString(), "tensor(bfloat16, [2, 3])");

  const Tensor& b = At(*root, "b.bias").as_tensor();
  EXPECT_EQ(b.storage->dtype, DType::kFloat32);
  EXPECT_EQ(b.storage->record_key, "1");

  const Tensor& row = At(*root, "a.row1").as_tensor();
  EXPECT_EQ(row.storage, w.storage);  // a view keeps sharing the storage
  EXPECT_EQ(row.storage_offset, 3);
  EXPECT_EQ(row.sizes, (std::vector<int64_t>{3}));

  const Tensor& t = At(*root, "a.t").as_tensor();
  EXPECT_EQ(t.storage, w.storage);
  EXPECT_EQ(t.strides, (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(t.IsContiguous());

  const Value& p = At(*root, "p");
  ASSERT_TRUE(p.is(Value::Kind::kObject));
  EXPECT_TRUE(p.as_object().cls.Is("torch._utils", "_rebuild_parameter"));
  ASSERT_EQ(p.as_object().args.size(), 3u);
  EXPECT_EQ(p.as_object().args[0].as_tensor().storage->record_key, "2");
  EXPECT_TRUE(p.as_object().args[1].as_bool());  // requires_grad of the parameter
}

TEST(PickleReaderTest, ResolverIsCalledOncePerStorage) {
  std::map<std::string, int> calls;
  std::vector<std::shared_ptr<Storage>> made;
  StorageResolver resolver = [&](const std::string& key, DType dtype, int64_t numel,
                                 const std::string& location) -> Result<std::shared_ptr<Storage>> {
    ++calls[key];
    auto s = std::make_shared<Storage>();
    s->dtype = dtype;
    s->numel = numel;
    s->location = location;
    s->record_key = "resolved/" + key;
    made.push_back(s);
    return s;
  };
  Result<Value> root = ParseFixture(testing_pickle::kStateDictPkl, {}, resolver);
  ASSERT_TRUE(root.ok()) << root.status().message();
  EXPECT_EQ(calls, (std::map<std::string, int>{{"0", 1}, {"1", 1}, {"2", 1}}));
  ASSERT_EQ(made.size(), 3u);
  EXPECT_EQ(At(*root, "a.weight").as_tensor().storage, made[0]);
  EXPECT_EQ(At(*root, "a.t").as_tensor().storage, made[0]);
  EXPECT_EQ(made[0]->dtype, DType::kBFloat16);
  EXPECT_EQ(made[1]->numel, 3);
  EXPECT_EQ(made[2]->dtype, DType::kFloat32);
}

TEST(PickleReaderTest, ResolverErrorStopsParsing) {
  StorageResolver resolver = [](const std::string& key, DType, int64_t,
                                const std::string&) -> Result<std::shared_ptr<Storage>> {
    return Status::IoError("cannot read data/" + key);
  };
  Result<Value> root = ParseFixture(testing_pickle::kStateDictPkl, {}, resolver);
  ASSERT_FALSE(root.ok());
  EXPECT_EQ(root.status().code(), Status::Code::kIoError);
  EXPECT_EQ(root.status().message(), "cannot read data/0");
}

TEST(PickleReaderTest, NamespaceArgsWithNestedValues) {
  Result<Value> root = ParseFixture(testing_pickle::kMpRankPkl);
  ASSERT_TRUE(root.ok()) << root.status().message();
  const Value& args = At(*root, "args");
  ASSERT_TRUE(args.is(Value::Kind::kObject));
  EXPECT_TRUE(args.as_object().cls.Is("argparse", "Namespace"));
  EXPECT_EQ(args.as_object().construct, Object::Construct::kNewObj);

  int64_t n = 0;
  EXPECT_TRUE(ReadInt(At(args, "num_layers"), &n));
  EXPECT_EQ(n, 2);
  EXPECT_TRUE(At(args, "params_dtype").as_global().Is("torch", "bfloat16"));
  EXPECT_DOUBLE_EQ(At(args, "lr").as_float(), 1e-4);
  EXPECT_EQ(At(args, "name").as_string(), "h\u00e9llo w\u00f6rld \u2713 \U0001F600");
  EXPECT_EQ(At(args, "tags").DebugString(), "['a', 'b']");
  EXPECT_EQ(At(args, "nested").DebugString(), "{'k': (1, 2.5, None, True, False)}");

  // Enum members: getattr(EnumClass, 'member') since Python 3.11.
  const Value& pe = At(args, "position_embedding_type");
  EXPECT_EQ(pe.DebugString(), "builtins.getattr(megatron.enums.PositionEmbeddingType, 'rotary')");

  const Value& big = At(args, "big");
  ASSERT_TRUE(big.is(Value::Kind::kBigInt));
  EXPECT_EQ(big.DebugString(), "1208925819614629174706176");                // 2**80
  EXPECT_EQ(At(args, "neg_big").DebugString(), "-1180591620717411303424");  // -2**70
  std::vector<int64_t> i64;
  ASSERT_TRUE(ReadIntSequence(At(args, "i64"), &i64));
  EXPECT_EQ(i64, (std::vector<int64_t>{INT64_MAX, INT64_MIN, 1LL << 31, -(1LL << 31) - 1, 65536,
                                       256, 255, -1, 0}));

  EXPECT_EQ(At(args, "blob").as_bytes().data, "\x00\x01\xfe\xff"s);
  EXPECT_EQ(At(args, "empty_blob").as_bytes().data, "");
  const Value& seen = At(args, "seen");
  ASSERT_TRUE(seen.is(Value::Kind::kSet));
  EXPECT_EQ(seen.DebugString(), "{1, 3}");
  EXPECT_EQ(At(args, "frozen").DebugString(), "frozenset({'x'})");
  EXPECT_EQ(At(*root, "sparse_tensor_module_names").DebugString(), "set()");
}

TEST(PickleReaderTest, MemoReferencesSeeCompleteContainers) {
  Result<Value> root = ParseFixture(testing_pickle::kMpRankPkl);
  ASSERT_TRUE(root.ok()) << root.status().message();
  // `shapes_again` is a BINGET of the OrderedDict stored (BINPUT) before its
  // SETITEMS ran; it must hold the items all the same.
  const Value& shapes = At(*root, "param_shapes").as_list().items.at(0);
  const Value& again = At(*root, "shapes_again");
  for (const Value* v : {&shapes, &again}) {
    ASSERT_TRUE(IsOrderedDict(*v));
    ASSERT_EQ(DictItems(*v)->size(), 2u);
    EXPECT_EQ(Ints(At(*v, "w")), (std::vector<int64_t>{4, 8}));
    EXPECT_EQ(Ints(At(*v, "b")), (std::vector<int64_t>{4}));
  }
  EXPECT_TRUE(SameValue(shapes, again));
  EXPECT_EQ(At(*root, "shared_a").DebugString(), "[1, 2, 3]");
  EXPECT_EQ(At(*root, "shared_b").DebugString(), "[1, 2, 3]");

  // Value semantics: the two copies are independent.
  Value copy = *root;
  FindMutable(copy, "shared_a")->as_list().items.clear();
  EXPECT_EQ(At(copy, "shared_b").DebugString(), "[1, 2, 3]");
}

TEST(PickleReaderTest, DeepSpeedObjects) {
  Result<Value> root = ParseFixture(testing_pickle::kMpRankPkl);
  ASSERT_TRUE(root.ok()) << root.status().message();
  EXPECT_EQ(At(*root, "zero_stage").DebugString(),
            "builtins.getattr(deepspeed.runtime.zero.config.ZeroStageEnum, 'optimizer_states')");

  const Value& mappings = At(*root, "param_slice_mappings").as_list().items.at(0);
  ASSERT_TRUE(IsOrderedDict(mappings));
  const Value& w = At(mappings, "w");
  ASSERT_TRUE(w.is(Value::Kind::kObject));
  EXPECT_TRUE(w.as_object().cls.Is("deepspeed.utils.tensor_fragment", "fragment_address"));
  EXPECT_EQ(w.as_object().construct, Object::Construct::kNewObj);
  EXPECT_EQ(At(w, "numel").as_int(), 32);
  EXPECT_EQ(At(w, "start").as_int(), 0);
  EXPECT_EQ(At(mappings, "b").DebugString(),
            "deepspeed.utils.tensor_fragment.fragment_address(numel=4, start=32)");
}

TEST(PickleReaderTest, RngStates) {
  Result<Value> root = ParseFixture(testing_pickle::kMpRankPkl);
  ASSERT_TRUE(root.ok()) << root.status().message();
  const Tensor& rng = At(At(*root, "rng_tracker_states"), "model-parallel-rng").as_tensor();
  EXPECT_EQ(rng.storage->dtype, DType::kUInt8);
  EXPECT_EQ(rng.sizes, (std::vector<int64_t>{3}));

  // numpy's _reconstruct(ndarray, (0,), b'b') then BUILD (version, shape, dtype, fortran, data).
  const Value& np_state = At(*root, "np_rng_state");
  ASSERT_EQ(np_state.as_tuple().items.size(), 5u);
  const Object& array = np_state.as_tuple().items[1].as_object();
  EXPECT_TRUE(array.cls.Is("numpy.core.multiarray", "_reconstruct"));
  EXPECT_EQ(array.args.at(2).as_bytes().data, "b");
  const std::vector<Value>& state = array.state->as_tuple().items;
  ASSERT_EQ(state.size(), 5u);
  EXPECT_EQ(state[2].DebugString(),
            "numpy.dtype('u4', False, True, state=(3, '<', None, None, None, -1, -1, 0))");
  EXPECT_EQ(state[4].as_bytes().data, std::string("\0\0\0\0\1\0\0\0\2\0\0\0\3\0\0\0", 16));
}

// ---- The allow-list -------------------------------------------------------------------

TEST(PickleReaderTest, UnknownGlobalIsRefused) {
  Result<Value> root = ParseFixture(testing_pickle::kUnknownClassPkl);
  ASSERT_FALSE(root.ok());
  EXPECT_EQ(root.status().code(), Status::Code::kUnsupported);
  EXPECT_EQ(root.status().message(),
            "pickle refers to class 'mymod.Thing', which reshard does not know; reshard never runs "
            "code from checkpoints. Pass --allow-class mymod.Thing to read it");
}

TEST(PickleReaderTest, AllowedGlobalIsCarriedAsObject) {
  PickleReadOptions named;
  named.allowed_globals = {"mymod.Thing"};
  const KnownClasses format_classes = {{"mymod.Thing", {KnownClass::Kind::kRecord, {}}}};
  PickleReadOptions known;
  known.known_classes = &format_classes;
  for (const PickleReadOptions& options : {named, known}) {
    Result<Value> root = ParseFixture(testing_pickle::kUnknownClassPkl, options);
    ASSERT_TRUE(root.ok()) << root.status().message();
    const Value& thing = At(*root, "x");
    EXPECT_TRUE(thing.as_object().cls.Is("mymod", "Thing"));
    EXPECT_EQ(At(thing, "a").as_int(), 1);
    EXPECT_EQ(root->DebugString(), "{'x': mymod.Thing(a=1)}");
  }
}

TEST(PickleReaderTest, KnownGlobals) {
  for (const char* name : {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                           "torch.BFloat16Storage", "torch.ComplexDoubleStorage", "torch.bfloat16",
                           "torch.float", "argparse.Namespace", "numpy.dtype"}) {
    EXPECT_TRUE(IsKnownGlobal(name)) << name;
  }
  // DeepSpeed's and Megatron's classes come from the format, not the reader.
  for (const char* name : {"deepspeed.runtime.zero.config.ZeroStageEnum",
                           "deepspeed.checkpoint.universal_checkpoint.SubparamShape",
                           "megatron.model.enums.AttnMaskType"}) {
    EXPECT_EQ(DeepSpeedKnownClasses().count(name), 1u) << name;
    EXPECT_FALSE(IsKnownGlobal(name)) << name;
  }
  for (const char* name : {"os.system", "builtins.eval", "builtins.exec", "subprocess.Popen",
                           "torch.load", "mymod.Thing", "collections.OrderedDictX"}) {
    EXPECT_FALSE(IsKnownGlobal(name)) << name;
    EXPECT_EQ(DeepSpeedKnownClasses().count(name), 0u) << name;
  }
}

// ---- Protocols and opcodes ----------------------------------------------------------------

TEST(PickleReaderTest, AllProtocolsGiveTheSameTree) {
  Result<Value> p0 = ParseFixture(testing_pickle::kPlainProto0);
  ASSERT_TRUE(p0.ok()) << p0.status().message();
  EXPECT_EQ(
      p0->DebugString(1000),
      "{'i': [0, 1, -1, 255, 256, 65535, 65536, -2147483648, 2147483648, 9223372036854775807, "
      "-9223372036854775808, 18446744073709551616, -1267650600228229401496703205376], "
      "'f': [1.5, -0.0, inf], 's': 'h\u00e9llo\\n\\\\ \u20ac\U0001F600', 'b': b'\\x00\\xff', "
      "'t': (), 't1': (1,), 't4': (1, 2, 3, 4), 'set': {3}, 'fs': frozenset({4}), "
      "'od': collections.OrderedDict({'a': 1}), 'n': None, 'T': True, 'F': False}");
  EXPECT_TRUE(At(*p0, "T").is(Value::Kind::kBool));
  const std::vector<std::pair<const char*, Result<Value>>> others = {
      {"protocol 2", ParseFixture(testing_pickle::kPlainProto2)},
      {"protocol 4", ParseFixture(testing_pickle::kPlainProto4)},
      {"protocol 5", ParseFixture(testing_pickle::kPlainProto5)},
  };
  for (const auto& [name, other] : others) {
    ASSERT_TRUE(other.ok()) << name << ": " << other.status().message();
    EXPECT_TRUE(SameValue(*p0, *other)) << name;
  }
}

TEST(PickleReaderTest, Python2Strings) {
  // STRING with escapes, BINSTRING, SHORT_BINSTRING in a tuple.
  Result<Value> v = ParseString("(S'a\\'b\\n\\x41\\101'\nT\x03\x00\x00\x00xyzU\x02hit."s);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(v->DebugString(), "('a\\'b\\nAA', 'xyz', 'hi')");
  // A backslash before NUL stays; \0 is octal.
  EXPECT_EQ(ParseString("S'\\\0\\0'\n."s)->as_string(), std::string("\\\0\0", 3));
  EXPECT_EQ(ParseString("S'unterminated\n."s).status().code(), Status::Code::kInvalidInput);
}

TEST(PickleReaderTest, BytesOpcodes) {
  Result<Value> v = ParseString(
      "\x80\x05(B\x02\x00\x00\x00"
      "abC\x01"
      "c\x8e\x01\x00\x00\x00\x00\x00\x00\x00"
      "d"
      "\x96\x01\x00\x00\x00\x00\x00\x00\x00"
      "e\x8d\x02\x00\x00\x00\x00\x00\x00\x00"
      "\xc3\xa9t."s);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(v->DebugString(), "(b'ab', b'c', b'd', b'e', '\u00e9')");
}

TEST(PickleReaderTest, IntegerOpcodes) {
  // LONG4 of 9 bytes that still fits int64 (sign extension), LONG1 of zero
  // length, text LONG with its L suffix, LONG4 of a real big int.
  Result<Value> v = ParseString(
      "(\x8b\x09\x00\x00\x00\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x8a\x00L-12L\n"
      "\x8b\x09\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01t."s);
  ASSERT_TRUE(v.ok()) << v.status().message();
  const std::vector<Value>& items = v->as_tuple().items;
  EXPECT_EQ(items[0].as_int(), -2);
  EXPECT_EQ(items[1].as_int(), 0);
  EXPECT_EQ(items[2].as_int(), -12);
  ASSERT_TRUE(items[3].is(Value::Kind::kBigInt));
  EXPECT_EQ(items[3].DebugString(), "18446744073709551616");
}

TEST(PickleReaderTest, StackOpcodes) {
  // POP drops 1; POP_MARK drops the marked 2 and 3; DUP repeats 'x'
  // (text PUT/GET keep it); NEWOBJ_EX with no keyword arguments.
  Result<Value> v = ParseString(
      "(K\x01"
      "0(K\x02K\x03"
      "1X\x01\x00\x00\x00xp7\n2g7\n"
      "\x8c\x08"
      "argparse\x8c\x09Namespace\x93)}\x92t."s);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(v->DebugString(), "('x', 'x', 'x', argparse.Namespace())");
  EXPECT_EQ(v->as_tuple().items[3].as_object().construct, Object::Construct::kNewObj);
}

TEST(PickleReaderTest, SetOpcodes) {
  Result<Value> v = ParseString("\x80\x04\x8f(K\x01K\x02\x90(K\x03\x91\x86."s);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(v->DebugString(), "({1, 2}, frozenset({3}))");
}

// ---- Malformed input ------------------------------------------------------------------------

void ExpectInvalid(const std::string& bytes, const std::string& fragment,
                   PickleReadOptions options = {}) {
  Result<Value> v = ParseString(bytes, options);
  ASSERT_FALSE(v.ok()) << "accepted " << v->DebugString();
  EXPECT_EQ(v.status().code(), Status::Code::kInvalidInput) << v.status().message();
  EXPECT_NE(v.status().message().find(fragment), std::string::npos) << v.status().message();
}

TEST(PickleReaderTest, MalformedInputGivesClearErrors) {
  ExpectInvalid("", "ends at byte 0 before the STOP");
  ExpectInvalid("\x80\x02N"s, "ends at byte 3 before the STOP");
  ExpectInvalid("\x80\x02\xff."s, "at byte 2 (opcode unknown, 0xff): unknown opcode");
  ExpectInvalid("\x80\x02t."s, "at byte 2 (opcode TUPLE, 0x74): no MARK");
  ExpectInvalid("\x80\x02(\x86."s, "opcode TUPLE2, 0x86): stack underflow");
  ExpectInvalid("\x80\x02."s, "opcode STOP, 0x2e): stack underflow");
  ExpectInvalid("\x80\x02h\x05."s, "opcode BINGET, 0x68): memo entry 5 was never stored");
  ExpectInvalid(
      "\x80\x02X\xff\x00\x00\x00"
      "ab."s,
      "opcode BINUNICODE, 0x58): needs 255 more bytes");
  ExpectInvalid("\x80\x09N."s, "unsupported protocol 9");
  ExpectInvalid("\x80\x02]NNs."s,
                "opcode SETITEM, 0x73): setting items on something that is not a dict");
  ExpectInvalid("\x80\x02}Na."s, "appending to something that is not a list");
  ExpectInvalid("\x80\x02}(Nu."s, "odd number of items");
  ExpectInvalid("\x80\x02NNR."s, "REDUCE applies something that is not a class");
  ExpectInvalid("\x80\x02I12x\n."s, "bad integer '12x'");
  ExpectInvalid(
      "\x80\x02"
      "Fnope\n."s,
      "bad float 'nope'");
  ExpectInvalid(
      "\x80\x02"
      "ccollections\nOrderedDict"s,
      "not terminated by a newline");
  ExpectInvalid("\x80\x02Nr\xff\xff\xff\x7f."s, "memo index 2147483647 is beyond any valid stream");
  // Longer than Python accepts (decimal conversion is quadratic); the message quotes only a part.
  ExpectInvalid("I" + std::string(5000, '9') + "\n.",
                "bad integer '" + std::string(40, '9') + "...'");
}

TEST(PickleReaderTest, TruncatedPicklesAreInvalid) {
  const std::string full(reinterpret_cast<const char*>(testing_pickle::kMpRankPkl),
                         sizeof(testing_pickle::kMpRankPkl));
  for (size_t n = 0; n < full.size(); ++n) {
    Result<Value> v = ParseString(full.substr(0, n));
    ASSERT_FALSE(v.ok()) << "prefix of " << n << " bytes accepted";
    ASSERT_EQ(v.status().code(), Status::Code::kInvalidInput) << n << ": " << v.status().message();
  }
}

// Corrupt bytes must give an error or some tree, never a crash or a hang.
TEST(PickleReaderTest, CorruptedPicklesNeverCrash) {
  std::mt19937 rng(42);
  for (const std::string& full :
       {std::string(reinterpret_cast<const char*>(testing_pickle::kStateDictPkl),
                    sizeof(testing_pickle::kStateDictPkl)),
        std::string(reinterpret_cast<const char*>(testing_pickle::kPlainProto0),
                    sizeof(testing_pickle::kPlainProto0))}) {
    for (size_t i = 0; i < full.size(); ++i) {
      for (int trial = 0; trial < 4; ++trial) {
        std::string bad = full;
        bad[i] = static_cast<char>(rng());
        Result<Value> v = ParseString(bad);
        if (!v.ok()) {
          EXPECT_NE(v.status().code(), Status::Code::kInternal) << v.status().message();
        }
      }
    }
  }
  for (int trial = 0; trial < 3000; ++trial) {
    std::string garbage(1 + rng() % 48, '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    Result<Value> v = ParseString(garbage);
    if (!v.ok()) {
      EXPECT_NE(v.status().code(), Status::Code::kInternal) << v.status().message();
    }
  }
}

TEST(PickleReaderTest, NestingDeeperThanTheLimitIsRefused) {
  std::string deep = std::string(50, ']') + std::string(49, 'a') + ".";
  PickleReadOptions shallow;
  shallow.max_depth = 10;
  ExpectInvalid(deep, "nests deeper than 10 levels", shallow);
  EXPECT_TRUE(ParseString(deep).ok());  // well within the default

  const std::string very_deep = std::string(200000, ']') + std::string(199999, 'a') + ".";
  ExpectInvalid(very_deep, "nests deeper than 1000 levels");
}

TEST(PickleReaderTest, SelfReferenceIsUnsupported) {
  Result<Value> v = ParseString(
      "\x80\x02]q\x00h\x00"
      "a."s);  // l = []; l.append(l)
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), Status::Code::kUnsupported);
}

TEST(PickleReaderTest, ExponentialMemoExpansionIsRefused) {
  // Each DUP + TUPLE2 doubles the tree: 2^64 leaves from 131 bytes.
  std::string bomb = "\x80\x02N"s;
  for (int i = 0; i < 64; ++i) bomb += "2\x86"s;
  ExpectInvalid(bomb + ".", "too many values");
}

TEST(PickleReaderTest, TensorMustStayInsideItsStorage) {
  // _rebuild_tensor_v2(('storage', torch.FloatStorage, '0', 'cpu', 4), offset, (3,), (1,), False)
  auto tensor = [](const std::string& offset) {
    return "\x80\x02"
           "ctorch._utils\n_rebuild_tensor_v2\n("
           "(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x00"
           "0"
           "X\x03\x00\x00\x00"
           "cpuK\x04tQ"s +
           offset + "K\x03\x85K\x01\x85\x89tR."s;
  };
  Result<Value> ok = ParseString(tensor("K\x01"s));
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->as_tensor().storage_offset, 1);
  EXPECT_TRUE(ok->as_tensor().extra_args.empty());
  ExpectInvalid(tensor("K\x02"s), "tensor reaches element 4 of a storage of 4 elements");
}

TEST(PickleReaderTest, NonStoragePersistentIdsAreUnsupported) {
  for (const std::string& bytes : {"\x80\x02X\x01\x00\x00\x00xQ."s, "Pxyz\n."s}) {
    Result<Value> v = ParseString(bytes);
    ASSERT_FALSE(v.ok());
    EXPECT_EQ(v.status().code(), Status::Code::kUnsupported) << v.status().message();
  }
}

// ---- Calls that could run code when torch.load replays them ------------------------

// Protocol 0 pieces: GLOBAL, a str, a tensor of 4 floats with its arguments.
std::string G(const std::string& module, const std::string& name) {
  return "c" + module + "\n" + name + "\n";
}
std::string Str(const std::string& s) { return "V" + s + "\n"; }
const std::string kRebuild = G("torch._utils", "_rebuild_tensor_v2");
const std::string kNoHooks = G("collections", "OrderedDict") + ")R";
std::string TensorArgs(const std::string& hooks) {
  return "((" + Str("storage") + G("torch", "FloatStorage") + Str("0") + Str("cpu") +
         "I4\ntQI0\n(I4\nt(I1\ntI00\n" + hooks + "t";
}
const std::string kZeroStage = G("deepspeed.runtime.zero.config", "ZeroStageEnum");

void ExpectRefused(const std::string& bytes, const std::string& fragment,
                   PickleReadOptions options = testing_pickle::DeepSpeedReadOptions()) {
  Result<Value> v = ParseString(bytes, options);
  ASSERT_FALSE(v.ok()) << "accepted " << v->DebugString();
  EXPECT_EQ(v.status().code(), Status::Code::kUnsupported) << v.status().message();
  EXPECT_NE(v.status().message().find(fragment), std::string::npos) << v.status().message();
  EXPECT_NE(v.status().message().find("reshard never executes pickled code"), std::string::npos)
      << v.status().message();
}

TEST(PickleReaderCallShapeTest, GetAttrReachingAFunctionsGlobalsIsRefused) {
  // The first step of getattr(_rebuild_tensor_v2, '__globals__')['__builtins__']['eval'].
  for (const char* module : {"builtins", "__builtin__"}) {
    ExpectRefused(G(module, "getattr") + "(" + kRebuild + Str("__globals__") + "tR.",
                  "pickle calls builtins.getattr(torch._utils._rebuild_tensor_v2, '__globals__'), "
                  "which reshard accepts only as getattr(EnumClass, 'member')");
  }
  ExpectRefused(G("builtins", "getattr") + "(" + G("argparse", "Namespace") + Str("x") + "tR.",
                "calls builtins.getattr(argparse.Namespace, 'x')");
  ExpectRefused(G("builtins", "getattr") + "(" + kZeroStage + Str("__class__") + "tR.",
                "calls builtins.getattr(deepspeed.runtime.zero.config.ZeroStageEnum, '__class__')");
}

TEST(PickleReaderCallShapeTest, RebuildFromTypeOnlyWrapsTheTensorRebuild) {
  const std::string from_type = G("torch._tensor", "_rebuild_from_type_v2");
  // _rebuild_from_type_v2(f, torch.Tensor, args, None) calls f(*args).
  ExpectRefused(from_type + "(" + G("builtins", "getattr") + G("torch", "Tensor") + "(" +
                    kZeroStage + Str("weights") + "tNtR.",
                "calls torch._tensor._rebuild_from_type_v2(builtins.getattr, torch.Tensor, (...), "
                "None), which reshard accepts only as _rebuild_from_type_v2(torch._utils."
                "_rebuild_tensor_v2, torch.Tensor, args, None)");
  ExpectRefused(from_type + "(" + kRebuild + G("torch.nn.parameter", "Parameter") +
                    TensorArgs(kNoHooks) + "NtR.",
                "calls torch._tensor._rebuild_from_type_v2(");
  // Around the tensor rebuild it is the tensor; attributes cannot be carried.
  Result<Value> v = ParseString(from_type + "(" + kRebuild + G("torch", "Tensor") +
                                TensorArgs(kNoHooks) + "NtR.");
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(v->DebugString(), "tensor(float32, [4])");
  Result<Value> attributed = ParseString(from_type + "(" + kRebuild + G("torch", "Tensor") +
                                         TensorArgs(kNoHooks) + "}" + Str("a") + "I1\nstR.");
  ASSERT_FALSE(attributed.ok());
  EXPECT_EQ(attributed.status().message(),
            "pickle rebuilds a tensor with Python attributes {...} "
            "(torch._tensor._rebuild_from_type_v2), which reshard does not carry; save the "
            "tensor without them");
  // Attributes the caller knows to be bookkeeping (FSDP's _has_been_cloned) are dropped; no others.
  PickleReadOptions dropping = testing_pickle::DeepSpeedReadOptions();
  dropping.dropped_tensor_attributes = {"a"};
  Result<Value> dropped = ParseString(from_type + "(" + kRebuild + G("torch", "Tensor") + TensorArgs(kNoHooks) +
                                      "}" + Str("a") + "I1\nstR.", dropping);
  ASSERT_TRUE(dropped.ok()) << dropped.status().message();
  EXPECT_EQ(dropped->DebugString(), "tensor(float32, [4])");
  dropping.dropped_tensor_attributes = {"b"};
  EXPECT_FALSE(ParseString(from_type + "(" + kRebuild + G("torch", "Tensor") + TensorArgs(kNoHooks) + "}" +
                           Str("a") + "I1\nstR.", dropping)
                   .ok());
}

// torch.save's pickle of a DTensor of `global` elements whose local tensor is
// TensorArgs' 4 floats, placed by `placement` (a pickled placement) over a
// device mesh of `ranks`.
std::string DTensorPickle(int64_t global, const std::string& placement, int ranks) {
  const std::string spec_module = "torch.distributed.tensor._dtensor_spec";
  const std::string dtensor = G("torch.distributed.tensor", "DTensor");
  const std::string size = "(I" + std::to_string(global) + "\nt";
  const std::string wrapper = "(" + dtensor + G("torch", "float32") + size + "(I1\ntI0\n" +
                              G("torch.serialization", "_get_layout") + "(" + Str("torch.strided") + "tR" +
                              G("torch", "device") + "(" + Str("cpu") + "tRI00\nt";
  const std::string n = std::to_string(ranks);
  const std::string mesh = G("torch.distributed.device_mesh", "DeviceMesh") + ")\x81(" + Str("mesh") + kRebuild +
                           "((" + Str("storage") + G("torch", "IntStorage") + Str("1") + Str("cpu") + "I" + n +
                           "\ntQI0\n(I" + n + "\nt(I1\ntI00\n" + kNoHooks + "tRdb";
  const std::string meta = G(spec_module, "TensorMeta") + "(" + G("torch", "Size") + "(" + size + "tR(I1\nt" +
                           G("torch", "float32") + "t\x81";
  const std::string spec = G(spec_module, "DTensorSpec") + ")\x81(" + Str("mesh") + mesh + Str("placements") + "(" +
                           placement + "t" + Str("tensor_meta") + meta + "db";
  const std::string state =
      "(N(" + Str("_local_tensor") + kRebuild + TensorArgs(kNoHooks) + "R" + Str("_spec") + spec + "dt";
  return G("torch._tensor", "_rebuild_from_type_v2") + "(" + G("torch._utils", "_rebuild_wrapper_subclass") +
         dtensor + wrapper + state + "tR.";
}

TEST(PickleReaderCallShapeTest, DTensorIsItsLocalTensorWhereThatIsTheWhole) {
  const std::string placements = "torch.distributed.tensor.placement_types";
  const std::string shard = G(placements, "Shard") + ")\x81(" + Str("dim") + "I0\ndb";
  const std::string replicate = G(placements, "Replicate") + ")\x81";
  // Sharded over one rank, or replicated: the local tensor is the whole.
  for (const std::string& placement : {shard, replicate}) {
    Result<Value> v = ParseString(DTensorPickle(4, placement, 1));
    ASSERT_TRUE(v.ok()) << v.status().message();
    EXPECT_EQ(v->DebugString(), "tensor(float32, [4])");
  }
  // One rank's shard of 8: the other's is in no file.
  Result<Value> shard_of_two = ParseString(DTensorPickle(8, shard, 2));
  ASSERT_FALSE(shard_of_two.ok());
  EXPECT_EQ(shard_of_two.status().message(),
            "pickle holds a DTensor of size [8] placed (Shard(dim=0)) over a device mesh of 2 ranks, and of it only "
            "one rank's local tensor [4], the other ranks' parts being in no file; save the whole tensors "
            "(get_state_dict with full_state_dict=True, or DTensor.full_tensor()) or a sharded checkpoint");
  // A Partial's local tensor is an addend of the whole, not its values.
  Result<Value> partial =
      ParseString(DTensorPickle(4, G(placements, "Partial") + ")\x81(" + Str("reduce_op") + Str("sum") + "db", 2));
  ASSERT_FALSE(partial.ok());
  EXPECT_NE(partial.status().message().find("placed (torch.distributed.tensor.placement_types.Partial(...)) over a "
                                            "device mesh of 2 ranks, and of it one rank's addend, not its values"),
            std::string::npos)
      << partial.status().message();
  // The wrapper rebuild of another class is refused as any other call.
  std::string other = DTensorPickle(4, shard, 1);
  const std::string dtensor = G("torch.distributed.tensor", "DTensor");
  other.replace(other.find(dtensor), dtensor.size(), G("torch", "Tensor"));
  ExpectRefused(other, "which reshard accepts only as _rebuild_from_type_v2(");
}

TEST(PickleReaderCallShapeTest, EnumMembers) {
  Result<Value> member = ParseString(G("builtins", "getattr") + "(" + kZeroStage + Str("weights") + "tR.");
  ASSERT_TRUE(member.ok()) << member.status().message();
  Result<Value> by_value = ParseString(kZeroStage + "(I1\ntR.");  // Python < 3.11
  ASSERT_TRUE(by_value.ok()) << by_value.status().message();
  EXPECT_EQ(by_value->DebugString(), "deepspeed.runtime.zero.config.ZeroStageEnum(1)");
  ExpectRefused(kZeroStage + "(" + kRebuild + "tR.",
                "calls deepspeed.runtime.zero.config.ZeroStageEnum(torch._utils._rebuild_tensor_v2)");

  // A member the format does not list: refused, unless the user allows it.
  const std::string newer = G("builtins", "getattr") + "(" + kZeroStage + Str("offload") + "tR.";
  ExpectRefused(newer,
                "pickle reads 'offload' of the enum deepspeed.runtime.zero.config.ZeroStageEnum, "
                "which is not one of the members reshard knows (disabled, gradients, max_stage, "
                "optimizer_states, weights); reshard never executes pickled code and refuses calls "
                "that could run code when the file is loaded. Pass --allow-class "
                "deepspeed.runtime.zero.config.ZeroStageEnum.offload to read it");
  PickleReadOptions allowed = testing_pickle::DeepSpeedReadOptions();
  allowed.allowed_globals = {"deepspeed.runtime.zero.config.ZeroStageEnum.offload"};
  EXPECT_TRUE(ParseString(newer, allowed).ok());

  // Of a class the user allows, any public name.
  PickleReadOptions user;
  user.allowed_globals = {"mymod.Color"};
  EXPECT_TRUE(ParseString(G("builtins", "getattr") + "(" + G("mymod", "Color") + Str("red") + "tR.", user).ok());
  ExpectRefused(G("builtins", "getattr") + "(" + G("mymod", "Color") + Str("_red") + "tR.",
                "calls builtins.getattr(mymod.Color, '_red')", user);
}

TEST(PickleReaderCallShapeTest, StateAndItemsOnlyWhereTheClassTakesThem) {
  const std::string member = G("builtins", "getattr") + "(" + kZeroStage + Str("weights") + "tR";
  ExpectRefused(member + "}" + Str("value") + "I1\nsb.",
                "sets the state of builtins.getattr(...) to {...}, which builtins.getattr does not take");
  const std::string fragment = G("deepspeed.utils.tensor_fragment", "fragment_address") + ")\x81";
  EXPECT_TRUE(ParseString(fragment + "}" + Str("numel") + "I1\nsb.").ok());
  ExpectRefused(fragment + Str("k") + "I1\ns.",
                "sets items on deepspeed.utils.tensor_fragment.fragment_address(...), which "
                "deepspeed.utils.tensor_fragment.fragment_address does not take");
  ExpectRefused(fragment + "(I1\nI2\ntb.", "sets the state of");
  ExpectRefused(fragment + "}" + Str("__class__") + "I1\nsb.", "sets the state of");
  ExpectRefused(fragment + "Na.", "appends items to");
  // A format's class called another way: the user may vouch for it.
  ExpectRefused(G("deepspeed.utils.tensor_fragment", "fragment_address") + "(I1\nI2\ntR.",
                "Pass --allow-class deepspeed.utils.tensor_fragment.fragment_address to read it");
  // Generic classes have no such way out.
  Result<Value> od = ParseString(G("collections", "OrderedDict") + "(I1\ntR.");
  ASSERT_FALSE(od.ok());
  EXPECT_EQ(od.status().message().find("--allow-class"), std::string::npos) << od.status().message();
  ExpectRefused(G("collections", "OrderedDict") + ")\x81.", "builds collections.OrderedDict() with NEWOBJ");
  ExpectRefused(G("torch", "float32") + ")R.", "calls torch.float32(), which reshard accepts only as a name");
  ExpectRefused(G("_codecs", "encode") + "(" + Str("x") + Str("rot13") + "tR.", "calls _codecs.encode('x', 'rot13')");
}

TEST(PickleReaderCallShapeTest, BackwardHooksStayEmpty) {
  ExpectRefused(kRebuild + TensorArgs(G("collections", "OrderedDict") + ")R" + Str("h") +
                                      G("builtins", "getattr") + "s") + "R.",
                "calls torch._utils._rebuild_tensor_v2(a storage, 0, (...), (...), False, "
                "collections.OrderedDict(...)), which reshard accepts only around a torch storage, "
                "with no backward hooks");
  // Filled through the memo after the tensor took it.
  ExpectRefused("(" + kRebuild + TensorArgs(kNoHooks + "p0\n") + "Rg0\n" + Str("h") +
                    G("builtins", "getattr") + "st.",
                "sets items on collections.OrderedDict(...)");
  // torch >= 2 adds a dict of flags; nothing follows it.
  EXPECT_TRUE(ParseString(kRebuild + TensorArgs(kNoHooks + "}") + "R.").ok());
  ExpectRefused(kRebuild + TensorArgs(kNoHooks + "}N") + "R.", "calls torch._utils._rebuild_tensor_v2(");
}

TEST(PickleReaderCallShapeTest, TensorCountsMustFitInt64) {
  auto tensor = [](const std::string& size, const std::string& stride) {
    return kRebuild + "((" + Str("storage") + G("torch", "FloatStorage") + Str("0") + Str("cpu") +
           "I4\ntQI0\n" + size + stride + "I00\ntR.";
  };
  ExpectInvalid(tensor("(I1099511627776\nI1099511627776\nt", "(I0\nI0\nt"), "tensor size overflows");
  ExpectInvalid(tensor("(I2305843009213693952\nt", "(I0\nt"), "overflows its byte count");
  ExpectInvalid(tensor("(I0\nI-1\nt", "(I1\nI1\nt"), "negative tensor size or stride");
  Result<Value> expanded = ParseString(tensor("(I3\nI4\nt", "(I0\nI1\nt"));
  ASSERT_TRUE(expanded.ok()) << expanded.status().message();
  EXPECT_EQ(expanded->as_tensor().numel(), 12);
}

}  // namespace
}  // namespace reshard
