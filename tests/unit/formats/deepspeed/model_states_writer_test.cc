// The mp_rank dict of a fresh run made for a model another format read: the
// fields in Megatron-DeepSpeed's order, the model's own values in their place.
#include "formats/deepspeed/pipeline/model_states_writer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace reshard {
namespace {

std::vector<std::string> Keys(const Value& dict) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : *DictItems(dict)) keys.push_back(k.as_string());
  return keys;
}

TEST(FreshRunModelStatesTest, TakesTheRunsValuesInPlaceAndItsOtherKeysAfter) {
  Value run = Value::MakeDict({{Value::String("args"), MakeNamespace({{Value::String("num_layers"), Value::Int(6)}})},
                               {Value::String("iteration"), Value::Int(0)},
                               {Value::String("universal_checkpoint_info"), Value::MakeDict()}});
  const Value states = FreshRunModelStates(run);
  const std::vector<std::string> expected = {
      "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
      "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
      "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "args",
      "checkpoint_version", "iteration", "tokens", "universal_checkpoint_info"};
  EXPECT_EQ(Keys(states), expected);
  EXPECT_EQ(Find(*Find(states, "args"), "num_layers")->as_int(), 6);
  EXPECT_TRUE(Find(states, "optimizer")->is_none());
  EXPECT_EQ(Find(states, "global_steps")->as_int(), 0);
}

}  // namespace
}  // namespace reshard
