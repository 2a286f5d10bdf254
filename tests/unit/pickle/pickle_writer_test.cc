#include "pickle/pickle_writer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "pickle/pickle_reader.h"
#include "pickle_test_support.h"

namespace reshard {
namespace {

using namespace std::string_literals;
using testing_pickle::ParseFixture;
using testing_pickle::ParseString;
using testing_pickle::SameValue;

std::string Write(const Value& v, const StorageSink& sink = nullptr) {
  Result<std::string> out = WritePickle(v, sink);
  EXPECT_TRUE(out.ok()) << out.status().message();
  return out.ok() ? *out : std::string();
}

Value Reread(const Value& v) {
  Result<Value> back = ParseString(Write(v));
  EXPECT_TRUE(back.ok()) << back.status().message();
  return back.ok() ? *back : Value();
}

std::shared_ptr<Storage> MakeStorage(DType dtype, std::vector<uint8_t> bytes) {
  auto buffer = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  auto s = std::make_shared<Storage>();
  s->dtype = dtype;
  s->numel = static_cast<int64_t>(buffer->size()) / ElementSize(dtype);
  s->bytes = {buffer, buffer->data(), buffer->size()};
  return s;
}

Value MakeTensorValue(std::shared_ptr<Storage> s, int64_t offset, std::vector<int64_t> sizes) {
  Tensor t;
  t.storage = std::move(s);
  t.storage_offset = offset;
  t.strides = Tensor::ContiguousStrides(sizes);
  t.sizes = std::move(sizes);
  return Value::MakeTensor(std::move(t));
}

std::vector<uint8_t> Encode(DType dtype, const std::vector<double>& values) {
  std::vector<uint8_t> bytes(values.size() * ElementSize(dtype));
  for (size_t i = 0; i < values.size(); ++i)
    StoreFromDouble(dtype, values[i], &bytes[i * ElementSize(dtype)]);
  return bytes;
}

// ---- Encoding ---------------------------------------------------------------------------

TEST(PickleWriterTest, EmitsProtocolTwo) {
  EXPECT_EQ(Write(Value::None()), "\x80\x02N."s);
  EXPECT_EQ(Write(Value::Bool(true)), "\x80\x02\x88."s);
  EXPECT_EQ(Write(Value::MakeTuple({})), "\x80\x02)."s);
  EXPECT_EQ(Write(Value::Float(1.5)), "\x80\x02G\x3f\xf8\x00\x00\x00\x00\x00\x00."s);
  EXPECT_EQ(Write(Value::String("h\u00e9")), "\x80\x02X\x03\x00\x00\x00h\xc3\xa9."s);
  EXPECT_EQ(Write(Value::MakeList({Value::Int(1)})),
            "\x80\x02](K\x01"
            "e."s);
  EXPECT_EQ(Write(Value::MakeDict({{Value::String("k"), Value::None()}})),
            "\x80\x02}(X\x01\x00\x00\x00kNu."s);
  EXPECT_EQ(Write(Value::MakeGlobal({"torch", "bfloat16"})),
            "\x80\x02"
            "ctorch\nbfloat16\n."s);
}

TEST(PickleWriterTest, IntsUseTheShortestOpcode) {
  const std::vector<std::pair<int64_t, std::string>> cases = {
      {0, "K\x00"s},
      {255, "K\xff"s},
      {256, "M\x00\x01"s},
      {65535, "M\xff\xff"s},
      {65536, "J\x00\x00\x01\x00"s},
      {-1, "J\xff\xff\xff\xff"s},
      {INT32_MIN, "J\x00\x00\x00\x80"s},
      {INT32_MAX, "J\xff\xff\xff\x7f"s},
      {1LL << 31, "\x8a\x05\x00\x00\x00\x80\x00"s},  // needs a zero sign byte
      {-(1LL << 31) - 1, "\x8a\x05\xff\xff\xff\x7f\xff"s},
      {-(1LL << 40), "\x8a\x06\x00\x00\x00\x00\x00\xff"s},
      {INT64_MAX, "\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f"s},
      {INT64_MIN, "\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80"s},
  };
  for (const auto& [i, encoded] : cases) {
    EXPECT_EQ(Write(Value::Int(i)), "\x80\x02"s + encoded + ".") << i;
    EXPECT_EQ(Reread(Value::Int(i)).as_int(), i);
  }
}

TEST(PickleWriterTest, BigIntsBytesAndSetsAsPythonWritesThem) {
  const std::string two_to_64("\0\0\0\0\0\0\0\0\1", 9);
  EXPECT_EQ(Write(Value::MakeBigInt(two_to_64)), "\x80\x02\x8a\x09"s + two_to_64 + ".");
  const std::string huge(300, '\x11');
  EXPECT_EQ(Write(Value::MakeBigInt(huge)), "\x80\x02\x8b\x2c\x01\x00\x00"s + huge + ".");
  EXPECT_EQ(Write(Value::MakeBytes("\x00\xff"s)),
            "\x80\x02"
            "c_codecs\nencode\nX\x03\x00\x00\x00\x00\xc3\xbfX\x06\x00\x00\x00latin1\x86R."s);
  EXPECT_EQ(Write(Value::MakeSet({Value::Int(1)})),
            "\x80\x02"
            "c__builtin__\nset\n](K\x01"
            "e\x85R."s);
}

TEST(PickleWriterTest, ObjectsInPythonsOrder) {
  Object o;
  o.cls = {"argparse", "Namespace"};
  o.construct = Object::Construct::kNewObj;
  o.state = std::make_shared<Value>(Value::MakeDict({{Value::String("a"), Value::Int(1)}}));
  o.list_items = {Value::Int(2)};
  o.dict_items = {{Value::Int(3), Value::Int(4)}};
  EXPECT_EQ(Write(Value::MakeObject(o)),
            "\x80\x02"
            "cargparse\nNamespace\n)\x81(K\x02"
            "e(K\x03K\x04u}(X\x01\x00\x00\x00"
            "aK\x01ub."s);
}

// ---- Round trips ----------------------------------------------------------------------------

TEST(PickleWriterTest, RoundTripsTorchPickles) {
  const std::vector<std::pair<const char*, Result<Value>>> fixtures = {
      {"state dict", ParseFixture(testing_pickle::kStateDictPkl)},
      {"mp_rank", ParseFixture(testing_pickle::kMpRankPkl)},
      {"protocol 0", ParseFixture(testing_pickle::kPlainProto0)},
      {"protocol 5", ParseFixture(testing_pickle::kPlainProto5)},
  };
  for (const auto& [name, original] : fixtures) {
    ASSERT_TRUE(original.ok()) << name << ": " << original.status().message();
    const std::string written = Write(*original);
    Result<Value> back = ParseString(written);
    ASSERT_TRUE(back.ok()) << name << ": " << back.status().message();
    EXPECT_TRUE(SameValue(*original, *back)) << name;
    EXPECT_EQ(Write(*back), written) << name << ": writing is not stable";
  }
}

TEST(PickleWriterTest, RoundTripsEveryKind) {
  Object ns;
  ns.cls = {"argparse", "Namespace"};
  ns.construct = Object::Construct::kNewObj;
  ns.state = std::make_shared<Value>(Value::MakeDict({{Value::String("lr"), Value::Float(0.5)}}));
  auto storage = MakeStorage(DType::kInt64, std::vector<uint8_t>(48));
  storage->record_key =
      "0";  // the key the writer gives it, so that the reread storage compares equal
  Tensor t = MakeTensorValue(storage, 2, {2, 2}).as_tensor();
  t.requires_grad = true;
  t.extra_args = {MakeOrderedDict({}), Value::None()};
  const Value root = Value::MakeList({
      Value::None(),
      Value::Bool(false),
      Value::Int(-7),
      Value::MakeBigInt("\x01\x02\x03\x04\x05\x06\x07\x08\x89"s),
      Value::Float(-0.0),
      Value::Float(std::numeric_limits<double>::quiet_NaN()),
      Value::Float(-std::numeric_limits<double>::infinity()),
      Value::String(""),
      Value::String("\U0001F600"),
      Value::MakeBytes(""),
      Value::MakeBytes(std::string(256, '\x80')),
      Value::MakeTuple({Value::Int(1), Value::Int(2), Value::Int(3), Value::Int(4)}),
      Value::MakeSet({}),
      Value::MakeFrozenSet({Value::String("a"), Value::String("b")}),
      Value::MakeDict(
          {{Value::Int(1), Value::String("int key")}, {Value::MakeTuple({}), Value::None()}}),
      MakeOrderedDict({{Value::String("z"), Value::Int(1)}, {Value::String("a"), Value::Int(2)}}),
      MakeTorchSize({3, 0, 5}),
      Value::MakeObject(ns),
      Value::MakeGlobal({"builtins", "slice"}),
      Value::MakeTensor(t),
  });
  const Value back = Reread(root);
  EXPECT_TRUE(SameValue(root, back));
  EXPECT_TRUE(
      back.as_list().items[18].as_global().Is("builtins", "slice"));  // __builtin__ on the wire
}

TEST(PickleWriterTest, StoragesAreNumberedInOrderOfFirstUse) {
  auto a = MakeStorage(DType::kFloat32, std::vector<uint8_t>(16));
  auto b = MakeStorage(DType::kBFloat16, std::vector<uint8_t>(4));
  const Value root = MakeOrderedDict({
      {Value::String("x"), MakeTensorValue(a, 0, {4})},
      {Value::String("y"), MakeTensorValue(b, 0, {2})},
      {Value::String("z"), MakeTensorValue(a, 1, {3})},
  });
  std::vector<std::pair<std::string, const Storage*>> sunk;
  const std::string written = Write(root, [&](const std::string& key, const Storage& s) {
    sunk.emplace_back(key, &s);
    return Status::Ok();
  });
  EXPECT_EQ(sunk,
            (std::vector<std::pair<std::string, const Storage*>>{{"0", a.get()}, {"1", b.get()}}));

  Result<Value> back = ParseString(written);
  ASSERT_TRUE(back.ok()) << back.status().message();
  const Tensor& x = Find(*back, "x")->as_tensor();
  const Tensor& y = Find(*back, "y")->as_tensor();
  const Tensor& z = Find(*back, "z")->as_tensor();
  EXPECT_EQ(x.storage->record_key, "0");
  EXPECT_EQ(y.storage->record_key, "1");
  EXPECT_EQ(y.storage->dtype, DType::kBFloat16);
  EXPECT_EQ(z.storage, x.storage);
  EXPECT_EQ(z.storage_offset, 1);
  EXPECT_EQ(x.storage->numel, 4);
  ASSERT_EQ(x.extra_args.size(),
            1u);  // an empty OrderedDict of backward hooks, as torch.save writes
  EXPECT_TRUE(IsOrderedDict(x.extra_args[0]));
}

TEST(PickleWriterTest, ErrorsAreReported) {
  Result<std::string> sink_error =
      WritePickle(MakeTensorValue(MakeStorage(DType::kUInt8, {1}), 0, {1}),
                  [](const std::string&, const Storage&) { return Status::IoError("disk full"); });
  ASSERT_FALSE(sink_error.ok());
  EXPECT_EQ(sink_error.status().code(), Status::Code::kIoError);

  Result<std::string> no_storage = WritePickle(Value::MakeTensor(Tensor()), nullptr);
  ASSERT_FALSE(no_storage.ok());
  EXPECT_EQ(no_storage.status().code(), Status::Code::kInvalidInput);

  Result<std::string> bad_name = WritePickle(Value::MakeGlobal({"a\nb", "c"}), nullptr);
  EXPECT_EQ(bad_name.status().code(), Status::Code::kInvalidInput);
}

// ---- Python reads what we write
// ------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "reshard_pickle_XXXXXX";
    path_ = mkdtemp(tmpl.data()) ? tmpl : "";
  }
  ~TempDir() {
    if (!path_.empty()) std::system(("rm -rf '" + path_ + "'").c_str());
  }
  std::string File(const std::string& name, const std::string& contents) const {
    const std::string p = path_ + "/" + name;
    std::ofstream(p, std::ios::binary) << contents;
    return p;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Runs `script` with Debian's python3 and returns its standard output.
std::string RunPython(const TempDir& dir, const std::string& script, const std::string& args) {
  const std::string cmd =
      std::string(RESHARD_PYTHON) + " " + dir.File("check.py", script) + " " + args;
  std::FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return "cannot run " + cmd;
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
  pclose(pipe);
  return out;
}

// A plain-Python unpickler with stand-ins for torch, so no torch import is needed.
constexpr const char* kLoadWithStubs = R"py(
import argparse, collections, math, pickle, sys

class Size(tuple):
    pass

class Tensor:
    def __init__(self, *args):
        self.args = args

class Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        return ('pid',) + tuple(pid)

    def find_class(self, module, name):
        if (module, name) == ('torch._utils', '_rebuild_tensor_v2'):
            return Tensor
        if (module, name) == ('torch', 'Size'):
            return Size
        if module == 'torch':
            return 'torch.' + name
        return super().find_class(module, name)

def same(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, argparse.Namespace):
        return same(vars(a), vars(b))
    if isinstance(a, Tensor):
        return same(a.args, b.args)
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or a != a and b != b)
    return a == b

def T(key, storage_class, numel, offset, size, stride):
    pid = ('pid', 'storage', 'torch.' + storage_class, key, 'cpu', numel)
    return Tensor(pid, offset, size, stride, False, collections.OrderedDict())

expected = {
    'none': None, 'bools': [True, False],
    'ints': [0, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, 2**31, 2**63 - 1, -2**63],
    'big': 2**64, 'negbig': -2**64,
    'floats': [1.5, -0.0, math.inf],
    'str': 'h\u00e9llo \u2713 \U0001F600\n', 'bytes': b'\x00\x80\xff', 'empty_bytes': b'',
    'tuples': [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
    'set': {1, 2}, 'frozenset': frozenset({'a'}), 'dtype': 'torch.bfloat16',
    'od': collections.OrderedDict([('w', Size((4, 8)))]),
    'ns': argparse.Namespace(lr=0.5, layers=2),
    'tensor': T('0', 'FloatStorage', 6, 0, (2, 3), (3, 1)),
    'view': T('0', 'FloatStorage', 6, 3, (3,), (1,)),
}
with open(sys.argv[1], 'rb') as f:
    loaded = Unpickler(f).load()
print('OK' if same(loaded, expected) else repr(loaded))
)py";

Value Str(const char* s) { return Value::String(s); }

TEST(PickleWriterTest, PythonLoadsWhatWeWrite) {
  std::vector<Value> ints;
  for (int64_t i :
       {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536}, int64_t{-1},
        int64_t{INT32_MIN}, int64_t{INT32_MAX}, int64_t{1} << 31, INT64_MAX, INT64_MIN}) {
    ints.push_back(Value::Int(i));
  }
  std::vector<Value> tuples;
  for (int n = 0; n <= 4; ++n) {
    std::vector<Value> items;
    for (int i = 1; i <= n; ++i) items.push_back(Value::Int(i));
    tuples.push_back(Value::MakeTuple(items));
  }
  Object ns;
  ns.cls = {"argparse", "Namespace"};
  ns.construct = Object::Construct::kNewObj;
  ns.state = std::make_shared<Value>(
      Value::MakeDict({{Str("lr"), Value::Float(0.5)}, {Str("layers"), Value::Int(2)}}));
  auto storage = MakeStorage(DType::kFloat32, std::vector<uint8_t>(24));
  const Value root = Value::MakeDict({
      {Str("none"), Value::None()},
      {Str("bools"), Value::MakeList({Value::Bool(true), Value::Bool(false)})},
      {Str("ints"), Value::MakeList(ints)},
      {Str("big"), Value::MakeBigInt("\0\0\0\0\0\0\0\0\x01"s)},
      {Str("negbig"), Value::MakeBigInt("\0\0\0\0\0\0\0\0\xff"s)},
      {Str("floats"), Value::MakeList({Value::Float(1.5), Value::Float(-0.0),
                                       Value::Float(std::numeric_limits<double>::infinity())})},
      {Str("str"), Str("h\u00e9llo \u2713 \U0001F600\n")},
      {Str("bytes"), Value::MakeBytes("\x00\x80\xff"s)},
      {Str("empty_bytes"), Value::MakeBytes("")},
      {Str("tuples"), Value::MakeList(tuples)},
      {Str("set"), Value::MakeSet({Value::Int(1), Value::Int(2)})},
      {Str("frozenset"), Value::MakeFrozenSet({Str("a")})},
      {Str("dtype"), Value::MakeGlobal({"torch", "bfloat16"})},
      {Str("od"), MakeOrderedDict({{Str("w"), MakeTorchSize({4, 8})}})},
      {Str("ns"), Value::MakeObject(ns)},
      {Str("tensor"), MakeTensorValue(storage, 0, {2, 3})},
      {Str("view"), MakeTensorValue(storage, 3, {3})},
  });
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string pkl = dir.File("data.pkl", Write(root));
  EXPECT_EQ(RunPython(dir, kLoadWithStubs, pkl), "OK\n");
}

// torch.load of a checkpoint zip around our pickle (the zip is made by
// Python's zipfile here; the real container is another component's job).
constexpr const char* kTorchLoad = R"py(
import io, os, sys, zipfile
import torch
pkl, storages = sys.argv[1], sys.argv[2]
buf = io.BytesIO()
with zipfile.ZipFile(buf, 'w', zipfile.ZIP_STORED) as z:
    z.write(pkl, 'archive/data.pkl')
    for key in sorted(os.listdir(storages)):
        z.write(os.path.join(storages, key), 'archive/data/' + key)
    z.writestr('archive/version', '3\n')
buf.seek(0)
sd = torch.load(buf)
w, v, b = sd['w'], sd['v'], sd['b']
print(type(sd).__name__, list(sd), w.dtype, w.tolist(), v.tolist(), b.dtype, b.tolist(),
      v.storage().data_ptr() == w.storage().data_ptr(), b.requires_grad)
)py";

TEST(PickleWriterTest, TorchLoadsWhatWeWrite) {
  auto w = MakeStorage(DType::kBFloat16, Encode(DType::kBFloat16, {0, 1, 2, 3, 4, 5}));
  auto b = MakeStorage(DType::kFloat32, Encode(DType::kFloat32, {1.5, -2, 3}));
  Tensor bias = MakeTensorValue(b, 0, {3}).as_tensor();
  bias.requires_grad = true;
  const Value root = MakeOrderedDict({
      {Str("w"), MakeTensorValue(w, 0, {2, 3})},
      {Str("v"), MakeTensorValue(w, 3, {3})},
      {Str("b"), Value::MakeTensor(bias)},
  });
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string storages = dir.path() + "/storages";
  ASSERT_EQ(mkdir(storages.c_str(), 0700), 0);
  const std::string pkl =
      dir.File("data.pkl", Write(root, [&](const std::string& key, const Storage& s) {
                 dir.File("storages/" + key,
                          std::string(reinterpret_cast<const char*>(s.bytes.data), s.bytes.size));
                 return Status::Ok();
               }));
  EXPECT_EQ(RunPython(dir, kTorchLoad, pkl + " " + storages),
            "OrderedDict ['w', 'v', 'b'] torch.bfloat16 [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] "
            "[3.0, 4.0, 5.0] torch.float32 [1.5, -2.0, 3.0] True True\n");
}


// ---- What is never written ------------------------------------------------------------

// A class --allow-class let the reader take (any call of it) is read, and
// refused by the writer wherever it lies, naming it and its place: torch.load
// of the output would make the call (os.system here).
TEST(PickleWriterTest, AClassReadOnTrustIsNeverWritten) {
  // {'args': Namespace(gadget=posix.system('touch pwned'))}, protocol 0.
  const std::string pickle = "(dVargs\ncargparse\nNamespace\n)\x81(dVgadget\ncposix\nsystem\n(Vtouch pwned\ntRsbs.";
  PickleReadOptions options;
  options.allowed_globals = {"posix.system"};
  Result<Value> read = ParseString(pickle, options);
  ASSERT_TRUE(read.ok()) << read.status().message();
  const std::string refusal = "args.gadget is posix.system, which --allow-class let reshard read; reshard writes no "
                              "call it does not know to be data, as torch.load of the output would make it. Remove "
                              "it from the checkpoint, or export --to hf or consolidated, which keep no pickled metadata";
  EXPECT_EQ(CheckWritable(*read).message(), refusal);
  Result<std::string> written = WritePickle(*read, nullptr);
  ASSERT_FALSE(written.ok());
  EXPECT_EQ(written.status().message(), refusal);
  // Inside a list, as a bare global, and as a getattr of an allowed enum.
  for (const char* inner : {"(lp0\ncposix\nsystem\na.", "cposix\nsystem\n.",
                            "c__builtin__\ngetattr\n(cposix\nsystem\nVmember\ntR."}) {
    Result<Value> v = ParseString(inner, options);
    ASSERT_TRUE(v.ok()) << inner << ": " << v.status().message();
    EXPECT_FALSE(CheckWritable(*v).ok()) << inner;
  }
  // The same data with a class the reader knows to be data is written.
  const std::string known = "(dVargs\ncargparse\nNamespace\n)\x81(dVlr\nF0.5\nsbs.";
  Result<Value> plain = ParseString(known, options);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_TRUE(CheckWritable(*plain).ok());
  EXPECT_TRUE(WritePickle(*plain, nullptr).ok());
}

}  // namespace
}  // namespace reshard
