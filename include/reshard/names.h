// reshard::ClosestName: how reshard's "did you mean" messages find the name
// a misspelt one stands for, for front ends that name their own options.
#pragma once

#include <string>
#include <vector>

namespace reshard {

// The one of `allowed` that `word` is a typo of (case and '-' for '_' aside,
// at most two edits away); null when none is.
const std::string* ClosestName(const std::string& word, const std::vector<std::string>& allowed);

}  // namespace reshard
