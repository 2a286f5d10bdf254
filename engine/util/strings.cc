#include "util/strings.h"

#include <algorithm>
#include <cctype>
#include <charconv>

namespace reshard {

std::string Join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep) {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

bool ParseInt(const std::string& s, int64_t* out) {
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, *out);
  return !s.empty() && ec == std::errc() && ptr == end;
}

size_t EditDistance(const std::string& a, const std::string& b) {
  // One row of the dynamic-programming table at a time.
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

const std::string* ClosestName(const std::string& word, const std::vector<std::string>& allowed) {
  // Case and the '-' / '_' spelling aside (`HF`, `num-attention-heads`, `torch-dist`).
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return c == '-' ? '_' : std::tolower(c); });
    return s;
  };
  const std::string* best = nullptr;
  size_t best_distance = 3;  // more than two edits away is not a typo
  for (const std::string& a : allowed) {
    const size_t d = EditDistance(lower(word), lower(a));
    if (d < best_distance) best = &a, best_distance = d;
  }
  return best;
}

std::string Hint(const std::string& word, const std::vector<std::string>& allowed) {
  if (const std::string* best = ClosestName(word, allowed)) return "did you mean '" + *best + "'?";
  return "expected one of: " + Join(allowed, ", ");
}

bool StartsWith(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string Count(int64_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

}  // namespace reshard
