// A size written as a product and quotient of terms, for what a checkpoint
// records only through its tensors' shapes (torchtitan keeps no model
// config): `tok_embeddings.weight[1]` (dim 1 of that tensor),
// `num_attention_heads * layers.0.attention.wk.weight[0] / layers.0.attention.wq.weight[0]`.
// A term is an integer, NAME[dim] (a dim of a tensor) or NAME (a value
// known by name: another config field, `blocks`). Evaluated left to right;
// a quotient must be exact.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "reshard/status.h"

namespace reshard {

struct SizeTerm {
  enum class Kind { kNumber, kDim, kName };
  Kind kind = Kind::kNumber;
  int64_t number = 0;  // kNumber; the dim for kDim
  std::string name;    // kDim: the tensor; kName: the value
  bool divide = false;  // divides the product so far (else multiplies)
};

struct SizeExpression {
  std::vector<SizeTerm> terms;
  std::string text;
};

// Parses `text`; an error saying what is wrong with it.
Result<SizeExpression> ParseSizeExpression(const std::string& text);

// What a name stands for: a tensor's dim (dim >= 0) or a named value (dim
// -1); nullopt when unknown.
using SizeLookup = std::function<std::optional<int64_t>(const std::string& name, int64_t dim)>;

// The value of `e`; an error naming the unknown term, or the quotient that
// is not whole.
Result<int64_t> EvaluateSize(const SizeExpression& e, const SizeLookup& lookup);

}  // namespace reshard
