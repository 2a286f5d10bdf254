// Small string helpers shared across the engine: joining lists, parsing
// integers written as text, counts in words, and the "did you mean" suggestion that messages
// about a misspelt name end with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "reshard/names.h"

namespace reshard {

// "a, b, c" for Join({"a", "b", "c"}, ", "); "" for an empty list.
std::string Join(const std::vector<std::string>& items, const std::string& sep);

// {"a", "", "b"} for Split("a,,b", ','): every piece, empty ones too.
std::vector<std::string> Split(const std::string& s, char sep);

// True when all of `s` is a decimal integer that fits ("12", "-3"; not
// "", "+1", "1e3" or "12 "), stored in *out.
bool ParseInt(const std::string& s, int64_t* out);

// Whether `s` begins with `prefix`, or ends with `suffix`.
bool StartsWith(const std::string& s, const std::string& prefix);
bool EndsWith(const std::string& s, const std::string& suffix);

// "1 block", "3 blocks": a count and its noun, plural but for one.
std::string Count(int64_t n, const std::string& noun);

// The Levenshtein distance: insertions, deletions and substitutions needed
// to turn `a` into `b`.
size_t EditDistance(const std::string& a, const std::string& b);

// The end of a message about an unknown `word`: "did you mean 'x'?" for
// ClosestName (reshard/names.h: "torchdist" for "torch_dist", "HF" for "hf",
// "num-attention-heads" for "num_attention_heads"), else "expected one of:
// a, b, c".
std::string Hint(const std::string& word, const std::vector<std::string>& allowed);

}  // namespace reshard
