// Finding the prefixes of a DCP recipe save from its keys' structure: torch's
// recipe, the tutorial's AppState, a model at the top level, a model saved
// alone, the refusal of two candidate pairs and of an option the folder does
// not fit.
#include "formats/dcp_recipe/dcp_recipe_import.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

// A folder holding tensors `tensors` and objects `objects` (only their keys matter).
DcpTensors Keys(const std::vector<std::string>& tensors, const std::vector<std::string>& objects) {
  DcpTensors dcp;
  dcp.folder = "ckpt";
  for (const std::string& key : tensors) dcp.tensors[key] = ImportedTensor{Value::None(), std::nullopt};
  dcp.objects = objects;
  return dcp;
}

// A model with two parameters under `model` and its AdamW state under `optim`.
DcpTensors Recipe(const std::string& model, const std::string& optim) {
  std::vector<std::string> tensors;
  for (const std::string fqn : {"model.embed_tokens.weight", "lm_head.weight"}) {
    tensors.push_back(model + fqn);
    for (const std::string state : {"exp_avg", "exp_avg_sq", "step"}) tensors.push_back(optim + "state." + fqn + "." + state);
  }
  return Keys(tensors, {optim + "param_groups.0.lr", optim + "param_groups.0.params"});
}

RecipePrefixes Found(const DcpTensors& dcp, const std::string& option = "") {
  Result<std::optional<RecipePrefixes>> found = FindRecipePrefixes(dcp, option, "");
  EXPECT_TRUE(found.ok()) << found.status().message();
  if (!found.ok() || !found->has_value()) return {"<none>", "<none>"};
  return **found;
}

TEST(FindRecipePrefixesTest, FindsTorchsRecipeTheTutorialsAndATopLevelModel) {
  EXPECT_EQ(Found(Recipe("model.", "optim.")).model, "model.");
  EXPECT_EQ(Found(Recipe("model.", "optim.")).optim, "optim.");
  EXPECT_EQ(Found(Recipe("app.model.", "app.optim.")).model, "app.model.");
  EXPECT_EQ(Found(Recipe("app.model.", "app.optim.")).optim, "app.optim.");
  EXPECT_EQ(Found(Recipe("", "optimizer.")).model, "");
}

TEST(FindRecipePrefixesTest, AFolderWithoutOptimizerStateIsNotTheRecipe) {
  Result<std::optional<RecipePrefixes>> found = FindRecipePrefixes(Keys({"model.w", "fc.bias"}, {"step"}), "", "");
  ASSERT_TRUE(found.ok());
  EXPECT_FALSE(found->has_value());
}

TEST(FindRecipePrefixesTest, FindsAModelSavedAloneUnderOnePrefixOnlyWhereAFamilyNamesItsKeys) {
  const RecipePrefixes alone = Found(Keys({"model.model.embed_tokens.weight", "model.lm_head.weight"}, {}));
  EXPECT_EQ(alone.model, "model.");
  EXPECT_EQ(alone.optim, "");
  for (const DcpTensors& dcp : {Keys({"model.model.embed_tokens.weight", "ema.lm_head.weight"}, {}),
                                Keys({"model.w", "model.b"}, {})}) {
    Result<std::optional<RecipePrefixes>> found = FindRecipePrefixes(dcp, "", "");
    ASSERT_TRUE(found.ok());
    EXPECT_FALSE(found->has_value());
  }
}

TEST(FindRecipePrefixesTest, TwoModelPrefixesAreRefusedUntilTheOptionNamesOne) {
  DcpTensors dcp = Recipe("model.", "optim.");
  dcp.tensors["ema.model.embed_tokens.weight"] = ImportedTensor{Value::None(), std::nullopt};
  dcp.tensors["ema.lm_head.weight"] = ImportedTensor{Value::None(), std::nullopt};
  Result<std::optional<RecipePrefixes>> found = FindRecipePrefixes(dcp, "", "");
  ASSERT_FALSE(found.ok());
  EXPECT_NE(found.status().message().find("(ema,optim; model,optim)"), std::string::npos) << found.status().message();
  EXPECT_NE(found.status().message().find("--state-dict-prefixes MODEL,OPTIM"), std::string::npos);
  EXPECT_EQ(Found(dcp, "ema,optim").model, "ema.");
}

TEST(FindRecipePrefixesTest, AnOptionTheFolderDoesNotFitIsRefused) {
  const DcpTensors dcp = Recipe("model.", "optim.");
  EXPECT_FALSE(FindRecipePrefixes(dcp, "model", "").ok());               // no OPTIM
  EXPECT_FALSE(FindRecipePrefixes(dcp, "model,optimizer", "").ok());     // no state there
  EXPECT_FALSE(FindRecipePrefixes(dcp, "weights,optim", "").ok());       // the parameters are not there
}

}  // namespace
}  // namespace reshard
