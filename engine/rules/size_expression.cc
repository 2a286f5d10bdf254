#include "rules/size_expression.h"

#include <algorithm>
#include <cctype>

#include "util/strings.h"

namespace reshard {
namespace {

std::string Trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-'; }

Result<SizeTerm> ParseTerm(const std::string& raw, const std::string& text) {
  const std::string word = Trim(raw);
  SizeTerm term;
  if (ParseInt(word, &term.number)) {
    if (term.number < 1) return Status::InvalidInput("size '" + text + "': " + word + " must be positive");
    return term;
  }
  std::string name = word;
  if (!word.empty() && word.back() == ']') {
    const size_t open = word.rfind('[');
    if (open == std::string::npos || !ParseInt(word.substr(open + 1, word.size() - open - 2), &term.number) ||
        term.number < 0) {
      return Status::InvalidInput("size '" + text + "': '" + word + "' is not TENSOR[dim] with a dim from 0");
    }
    name = word.substr(0, open);
    term.kind = SizeTerm::Kind::kDim;
  } else {
    term.kind = SizeTerm::Kind::kName;
  }
  if (name.empty() || std::any_of(name.begin(), name.end(), [](char c) { return !IsNameChar(c); })) {
    return Status::InvalidInput("size '" + text + "': '" + word + "' is neither an integer, a name nor "
                                "TENSOR[dim]; join terms with * and /");
  }
  term.name = name;
  return term;
}

}  // namespace

Result<SizeExpression> ParseSizeExpression(const std::string& text) {
  SizeExpression e;
  e.text = text;
  bool divide = false;
  size_t begin = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i < text.size() && text[i] != '*' && text[i] != '/') continue;
    RESHARD_ASSIGN_OR_RETURN(SizeTerm term, ParseTerm(text.substr(begin, i - begin), text));
    term.divide = divide;
    e.terms.push_back(std::move(term));
    if (i < text.size()) divide = text[i] == '/';
    begin = i + 1;
  }
  return e;
}

Result<int64_t> EvaluateSize(const SizeExpression& e, const SizeLookup& lookup) {
  int64_t value = 1;
  for (const SizeTerm& term : e.terms) {
    std::optional<int64_t> v = term.number;
    if (term.kind != SizeTerm::Kind::kNumber) v = lookup(term.name, term.kind == SizeTerm::Kind::kDim ? term.number : -1);
    const std::string shown = term.kind == SizeTerm::Kind::kDim ? term.name + "[" + std::to_string(term.number) + "]"
                                                                : term.name;
    if (!v) return Status::InvalidInput("size '" + e.text + "': " + shown + " is not known");
    if (!term.divide) {
      value *= *v;
    } else if (*v == 0 || value % *v != 0) {
      return Status::InvalidInput("size '" + e.text + "': " + std::to_string(value) + " is not a multiple of " +
                                  shown + " = " + std::to_string(*v));
    } else {
      value /= *v;
    }
  }
  return value;
}

}  // namespace reshard
