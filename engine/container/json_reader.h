// Reading JSON (safetensors headers, config.json, weight index files) as
// Values: objects become dicts with their keys in file order, arrays lists,
// integers that fit 64 bits ints, other numbers floats, and true, false,
// null and strings (with \u escapes decoded to UTF-8) themselves.
//
// Strict JSON only, nested at most 64 deep, and no key twice in one object:
// the files come from users and the Hub, and a reader that guessed at a
// malformed one could read another tensor than the writer meant.
#pragma once

#include <string>
#include <string_view>

#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

// `what` names the text in errors ("hf-model/config.json").
Result<Value> ParseJson(std::string_view text, const std::string& what);

}  // namespace reshard
