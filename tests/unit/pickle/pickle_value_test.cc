#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "pickle/value.h"
#include "test_util.h"

namespace reshard {
namespace {

Value Str(const char* s) { return Value::String(s); }

TEST(PickleValueTest, TensorGeometry) {
  Tensor t;
  t.sizes = {2, 3, 4};
  t.strides = Tensor::ContiguousStrides(t.sizes);
  EXPECT_EQ(t.strides, (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.IsContiguous());

  t.strides = {1, 2, 6};  // a permuted view
  EXPECT_FALSE(t.IsContiguous());

  Tensor ones;  // dims of size 1 may have any stride
  ones.sizes = {1, 5, 1};
  ones.strides = {99, 1, 7};
  EXPECT_TRUE(ones.IsContiguous());

  Tensor empty;
  empty.sizes = {2, 0, 3};
  empty.strides = Tensor::ContiguousStrides(empty.sizes);
  EXPECT_EQ(empty.strides, (std::vector<int64_t>{3, 3, 1}));  // as torch.empty(2, 0, 3).stride()
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_TRUE(empty.IsContiguous());

  Tensor scalar;
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_TRUE(scalar.IsContiguous());

  Tensor mismatched;
  mismatched.sizes = {2};
  EXPECT_FALSE(mismatched.IsContiguous());
}

TEST(PickleValueTest, DictItemsOfDictLikeValues) {
  Value dict = Value::MakeDict({{Str("a"), Value::Int(1)}});
  Value od = MakeOrderedDict({{Str("b"), Value::Int(2)}});
  Value ns = MakeNamespace({{Str("c"), Value::Int(3)}});
  ASSERT_NE(DictItems(dict), nullptr);
  EXPECT_EQ(DictItems(od)->at(0).first.as_string(), "b");
  EXPECT_EQ(DictItems(ns)->at(0).first.as_string(), "c");
  EXPECT_NE(DictItems(MakeOrderedDict({})), nullptr);  // empty, but dict-like
  EXPECT_EQ(DictItems(MakeTorchSize({1})), nullptr);
  EXPECT_EQ(DictItems(Value::Int(1)), nullptr);
  EXPECT_EQ(MutableDictItems(ns), DictItems(ns));
  EXPECT_TRUE(IsOrderedDict(od));
  EXPECT_FALSE(IsOrderedDict(dict));
}

TEST(PickleValueTest, StateDictItemsAreNotItsMetadataAttribute) {
  // module.state_dict() pickles its `_metadata` attribute as the OrderedDict's BUILD state.
  Value sd = MakeOrderedDict({{Str("w"), Value::Int(1)}});
  sd.as_object().state = std::make_shared<Value>(Value::MakeDict({{Str("_metadata"), Value::MakeDict()}}));
  ASSERT_NE(DictItems(sd), nullptr);
  ASSERT_EQ(DictItems(sd)->size(), 1u);
  EXPECT_EQ(DictItems(sd)->at(0).first.as_string(), "w");
  EXPECT_NE(Find(sd, "w"), nullptr);
  EXPECT_EQ(Find(sd, "_metadata"), nullptr);
}

TEST(PickleValueTest, FindAndSet) {
  Value ns = MakeNamespace({{Str("lr"), Value::Float(0.1)}, {Value::Int(7), Str("not a str key")}});
  EXPECT_EQ(Find(ns, "lr")->as_float(), 0.1);
  EXPECT_EQ(Find(ns, "7"), nullptr);
  EXPECT_EQ(Find(ns, "missing"), nullptr);
  EXPECT_EQ(Find(Value::MakeList({}), "lr"), nullptr);

  Set(ns, "lr", Value::Float(0.2));      // replaces in place
  Set(ns, "iteration", Value::Int(10));  // appends at the end
  *FindMutable(ns, "iteration") = Value::Int(11);
  EXPECT_EQ(ns.DebugString(), "argparse.Namespace(lr=0.2, 7='not a str key', iteration=11)");

  Value od = MakeOrderedDict({});
  Set(od, "w", MakeTorchSize({4, 8}));
  EXPECT_EQ(od.DebugString(), "collections.OrderedDict({'w': torch.Size((4, 8))})");
}

TEST(PickleValueTest, IntSequencesAndInts) {
  std::vector<int64_t> dims;
  EXPECT_TRUE(ReadIntSequence(MakeTorchSize({4, 8}), &dims));
  EXPECT_EQ(dims, (std::vector<int64_t>{4, 8}));
  EXPECT_TRUE(ReadIntSequence(Value::MakeList({Value::Int(-1)}), &dims));
  EXPECT_EQ(dims, (std::vector<int64_t>{-1}));
  EXPECT_TRUE(ReadIntSequence(Value::MakeTuple({}), &dims));
  EXPECT_TRUE(dims.empty());
  EXPECT_FALSE(ReadIntSequence(Value::MakeTuple({Value::Float(1.0)}), &dims));
  EXPECT_FALSE(ReadIntSequence(Value::Int(3), &dims));

  int64_t i = 0;
  EXPECT_TRUE(ReadInt(Value::Int(-5), &i));
  EXPECT_EQ(i, -5);
  EXPECT_TRUE(ReadInt(Value::Bool(true), &i));
  EXPECT_EQ(i, 1);
  EXPECT_FALSE(ReadInt(Value::Float(1.0), &i));
  EXPECT_FALSE(ReadInt(Value::MakeBigInt(std::string(9, '\x01')), &i));
}

TEST(PickleValueTest, DebugStringLooksLikePython) {
  EXPECT_EQ(Value().DebugString(), "None");
  EXPECT_EQ(Value::MakeTuple({Value::Bool(true)}).DebugString(), "(True,)");
  EXPECT_EQ(Value::MakeSet({}).DebugString(), "set()");
  EXPECT_EQ(Value::MakeFrozenSet({}).DebugString(), "frozenset()");
  EXPECT_EQ(Value::MakeFrozenSet({Value::Int(1)}).DebugString(), "frozenset({1})");
  EXPECT_EQ(Value::MakeBigInt(std::string("\0\0\0\0\0\0\0\0\xff", 9)).DebugString(),
            "-18446744073709551616");
  EXPECT_EQ(Value::MakeBigInt("").DebugString(), "0");
  EXPECT_EQ(Value::MakeBigInt(std::string(2000, '\x01')).DebugString(), "<int of 2000 bytes>");
  EXPECT_EQ(Str("it's\t\x01").DebugString(), "'it\\'s\\t\\x01'");
  EXPECT_EQ(Value::MakeBytes(std::string("a\0\xff", 3)).DebugString(), "b'a\\x00\\xff'");
  EXPECT_EQ(Value::MakeGlobal({"torch", "float16"}).DebugString(), "torch.float16");

  const std::vector<std::pair<double, std::string>> floats = {
      {1.0, "1.0"},
      {-0.0, "-0.0"},
      {0.1, "0.1"},
      {1e-4, "0.0001"},
      {1.5e-5, "1.5e-05"},
      {123.25, "123.25"},
      {1e15, "1000000000000000.0"},
      {1e16, "1e+16"},
      {1.2345e100, "1.2345e+100"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {std::nan(""), "nan"}};
  for (const auto& [d, repr] : floats) EXPECT_EQ(Value::Float(d).DebugString(), repr);

  Tensor t;
  t.storage = std::make_shared<Storage>();
  t.storage->dtype = DType::kBFloat16;
  t.sizes = {4, 16};
  EXPECT_EQ(Value::MakeTensor(t).DebugString(), "tensor(bfloat16, [4, 16])");

  Object o;
  o.cls = {"numpy.core.multiarray", "_reconstruct"};
  o.args = {Value::Int(0)};
  o.list_items = {Value::Int(1)};
  o.state = std::make_shared<Value>(Value::MakeTuple({}));
  EXPECT_EQ(Value::MakeObject(o).DebugString(),
            "numpy.core.multiarray._reconstruct(0, [1], state=())");
}

TEST(PickleValueTest, DebugStringIsTruncatedCheaply) {
  std::vector<Value> many(1000000, Value::Int(123456));
  const Value big = Value::MakeList(std::move(many));
  const auto start = std::chrono::steady_clock::now();
  const std::string s = big.DebugString(50);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.size(), 50u);
  EXPECT_EQ(s.substr(0, 17), "[123456, 123456, ");
  EXPECT_EQ(s.substr(47), "...");
  EXPECT_LT(elapsed, std::chrono::milliseconds(50));
  EXPECT_EQ(Value::Int(12345).DebugString(4), "1...");
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {

// Editing a copy's BUILD state (an argparse.Namespace, say) leaves the original alone.
TEST(PickleValueTest, ObjectCopiesAreDeep) {
  Object ns;
  ns.cls = Global{"argparse", "Namespace"};
  ns.construct = Object::Construct::kNewObj;
  ns.state = std::make_shared<Value>(Value::MakeDict({{Value::String("tp"), Value::Int(2)}}));
  const Value original = Value::MakeObject(ns);
  Value copy = original;
  Set(copy, "tp", Value::Int(4));
  int64_t tp = 0;
  ASSERT_TRUE(ReadInt(*Find(original, "tp"), &tp));
  EXPECT_EQ(tp, 2);
  ASSERT_TRUE(ReadInt(*Find(copy, "tp"), &tp));
  EXPECT_EQ(tp, 4);
}

}  // namespace
}  // namespace reshard
