#include "container/json_reader.h"

#include <cerrno>
#include <cstdlib>
#include <set>

namespace reshard {
namespace {

constexpr int kMaxDepth = 64;

class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& what) : text_(text), what_(what) {}

  Result<Value> Document() {
    RESHARD_ASSIGN_OR_RETURN(Value v, Parse(0));
    SkipSpace();
    if (at_ != text_.size()) return Error("text after the end of the document");
    return v;
  }

 private:
  Status Error(const std::string& problem) const {
    return Status::InvalidInput(what_ + " is not valid JSON: " + problem + " at byte " + std::to_string(at_));
  }

  void SkipSpace() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\t' || text_[at_] == '\n' ||
                                  text_[at_] == '\r')) {
      ++at_;
    }
  }

  bool Consume(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }

  Result<Value> Parse(int depth) {
    if (depth > kMaxDepth) return Error("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    SkipSpace();
    if (at_ == text_.size()) return Error("unexpected end");
    const char c = text_[at_];
    if (c == '{') return Object(depth);
    if (c == '[') return Array(depth);
    if (c == '"') {
      RESHARD_ASSIGN_OR_RETURN(std::string s, String());
      return Value::String(std::move(s));
    }
    if (Consume("true")) return Value::Bool(true);
    if (Consume("false")) return Value::Bool(false);
    if (Consume("null")) return Value::None();
    if (c == '-' || (c >= '0' && c <= '9')) return Number();
    return Error(std::string("unexpected '") + c + "'");
  }

  Result<Value> Object(int depth) {
    ++at_;  // {
    Items items;
    std::set<std::string> keys;
    SkipSpace();
    if (Consume("}")) return Value::MakeDict(std::move(items));
    while (true) {
      SkipSpace();
      if (at_ == text_.size() || text_[at_] != '"') return Error("expected a string key");
      RESHARD_ASSIGN_OR_RETURN(std::string key, String());
      if (!keys.insert(key).second) return Error("key \"" + key + "\" given twice");
      SkipSpace();
      if (!Consume(":")) return Error("expected ':'");
      RESHARD_ASSIGN_OR_RETURN(Value v, Parse(depth + 1));
      items.emplace_back(Value::String(std::move(key)), std::move(v));
      SkipSpace();
      if (Consume("}")) return Value::MakeDict(std::move(items));
      if (!Consume(",")) return Error("expected ',' or '}'");
    }
  }

  Result<Value> Array(int depth) {
    ++at_;  // [
    std::vector<Value> list;
    SkipSpace();
    if (Consume("]")) return Value::MakeList(std::move(list));
    while (true) {
      RESHARD_ASSIGN_OR_RETURN(Value v, Parse(depth + 1));
      list.push_back(std::move(v));
      SkipSpace();
      if (Consume("]")) return Value::MakeList(std::move(list));
      if (!Consume(",")) return Error("expected ',' or ']'");
    }
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      *out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      *out += static_cast<char>(0xC0 | (cp >> 6));
      *out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      *out += static_cast<char>(0xE0 | (cp >> 12));
      *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      *out += static_cast<char>(0xF0 | (cp >> 18));
      *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  Result<uint32_t> Hex4() {
    if (text_.size() - at_ < 4) return Error("a \\u escape needs 4 hex digits");
    uint32_t cp = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = text_[at_++];
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                  : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) return Error("a \\u escape needs 4 hex digits");
      cp = cp * 16 + static_cast<uint32_t>(d);
    }
    return cp;
  }

  Result<std::string> String() {
    ++at_;  // "
    std::string out;
    while (at_ < text_.size()) {
      const char c = text_[at_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) return Error("a control character inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ == text_.size()) break;
      const char e = text_[at_++];
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          RESHARD_ASSIGN_OR_RETURN(uint32_t cp, Hex4());
          if (cp >= 0xD800 && cp < 0xDC00 && Consume("\\u")) {  // a surrogate pair
            RESHARD_ASSIGN_OR_RETURN(uint32_t low, Hex4());
            if (low < 0xDC00 || low >= 0xE000) return Error("a broken surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          AppendUtf8(cp, &out);
          break;
        }
        default: return Error(std::string("the escape \\") + e);
      }
    }
    return Error("a string without its closing quote");
  }

  Result<Value> Number() {
    const size_t start = at_;
    auto digits = [&] {
      const size_t from = at_;
      while (at_ < text_.size() && text_[at_] >= '0' && text_[at_] <= '9') ++at_;
      return at_ > from;
    };
    Consume("-");
    if (!Consume("0") && !digits()) return Error("a number without digits");
    bool integer = true;
    if (Consume(".")) {
      integer = false;
      if (!digits()) return Error("a number with no digits after '.'");
    }
    if (at_ < text_.size() && (text_[at_] == 'e' || text_[at_] == 'E')) {
      integer = false;
      ++at_;
      if (!Consume("+")) Consume("-");
      if (!digits()) return Error("a number with no exponent digits");
    }
    const std::string number(text_.substr(start, at_ - start));
    errno = 0;
    if (integer) {
      const long long n = std::strtoll(number.c_str(), nullptr, 10);
      if (errno == 0) return Value::Int(n);
      errno = 0;  // beyond 64 bits: kept as a float
    }
    const double d = std::strtod(number.c_str(), nullptr);
    if (errno == ERANGE && (d > 1 || d < -1)) return Error("the number " + number + " is out of range");
    return Value::Float(d);
  }

  std::string_view text_;
  const std::string& what_;
  size_t at_ = 0;
};

}  // namespace

Result<Value> ParseJson(std::string_view text, const std::string& what) {
  return JsonParser(text, what).Document();
}

}  // namespace reshard
