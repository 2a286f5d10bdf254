#include "pickle/text_codecs.h"

#include <cstdint>
#include <vector>

namespace reshard {
namespace {

// Python's own limit on converting decimal text to int; conversion takes
// quadratic time, so longer text is refused.
constexpr size_t kMaxDecimalDigits = 4300;

// Two's complement negation of little-endian bytes: invert and add one.
void Negate(std::vector<uint8_t>* le) {
  unsigned carry = 1;
  for (uint8_t& b : *le) {
    const unsigned sum = static_cast<uint8_t>(~b) + carry;
    b = static_cast<uint8_t>(sum);
    carry = sum >> 8;
  }
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

bool ParseHex(const std::string& s, size_t pos, size_t n, uint32_t* out) {
  if (pos + n > s.size()) return false;
  uint32_t v = 0;
  for (size_t i = pos; i < pos + n; ++i) {
    const char c = s[i];
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
    if (digit < 0) return false;
    v = v * 16 + static_cast<uint32_t>(digit);
  }
  *out = v;
  return true;
}

// The character a one-letter escape (\n, \', ...) stands for; 0 for others.
char SimpleEscape(char c) {
  switch (c) {
    case '\\':
    case '\'':
    case '"': return c;
    case 'a': return '\a';
    case 'b': return '\b';
    case 'f': return '\f';
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    case 'v': return '\v';
    default: return 0;
  }
}

}  // namespace

bool DecimalToTwosComplement(const std::string& text, std::string* out) {
  size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) i = 1;
  if (i == text.size() || text.size() - i > kMaxDecimalDigits) return false;
  std::vector<uint8_t> mag;  // little-endian magnitude
  for (; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return false;
    unsigned carry = static_cast<unsigned>(text[i] - '0');
    for (uint8_t& b : mag) {
      const unsigned cur = b * 10u + carry;
      b = static_cast<uint8_t>(cur);
      carry = cur >> 8;
    }
    if (carry) mag.push_back(static_cast<uint8_t>(carry));
  }
  if (!mag.empty() && (mag.back() & 0x80)) mag.push_back(0);  // room for the sign bit
  if (negative) Negate(&mag);
  out->assign(mag.begin(), mag.end());
  return true;
}

std::string TwosComplementToDecimal(const std::string& le) {
  std::vector<uint8_t> mag(le.begin(), le.end());  // little-endian magnitude
  const bool negative = !mag.empty() && (mag.back() & 0x80);
  if (negative) Negate(&mag);
  std::string digits;
  while (true) {
    unsigned rem = 0;
    bool nonzero = false;
    for (size_t i = mag.size(); i-- > 0;) {  // divide by 10, most significant byte first
      const unsigned cur = (rem << 8) | mag[i];
      mag[i] = static_cast<uint8_t>(cur / 10);
      rem = cur % 10;
      nonzero = nonzero || mag[i] != 0;
    }
    digits.push_back(static_cast<char>('0' + rem));
    if (!nonzero) break;
  }
  if (negative) digits.push_back('-');
  return std::string(digits.rbegin(), digits.rend());
}

bool DecodeRawUnicodeEscape(const std::string& in, std::string* out) {
  for (size_t i = 0; i < in.size(); ++i) {
    const bool escape =
        in[i] == '\\' && i + 1 < in.size() && (in[i + 1] == 'u' || in[i + 1] == 'U');
    if (!escape) {
      AppendUtf8(static_cast<uint8_t>(in[i]), out);
      continue;
    }
    const size_t n = in[i + 1] == 'u' ? 4 : 8;
    uint32_t cp;
    if (!ParseHex(in, i + 2, n, &cp) || cp > 0x10ffff) return false;
    AppendUtf8(cp, out);
    i += 1 + n;
  }
  return true;
}

bool DecodeQuotedString(const std::string& in, std::string* out) {
  if (in.size() < 2 || (in[0] != '\'' && in[0] != '"') || in.back() != in[0]) return false;
  const std::string body = in.substr(1, in.size() - 2);
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out->push_back(body[i]);
      continue;
    }
    const char c = body[++i];
    uint32_t code;
    if (SimpleEscape(c) != 0) {
      out->push_back(SimpleEscape(c));
    } else if (c == 'x' && ParseHex(body, i + 1, 2, &code)) {
      out->push_back(static_cast<char>(code));
      i += 2;
    } else if (c >= '0' && c <= '7') {  // up to three octal digits
      code = 0;
      size_t end = i;
      for (; end < i + 3 && end < body.size() && body[end] >= '0' && body[end] <= '7'; ++end) {
        code = code * 8 + static_cast<uint32_t>(body[end] - '0');
      }
      out->push_back(static_cast<char>(code));
      i = end - 1;
    } else if (c != '\n') {  // backslash-newline is a line continuation
      out->push_back('\\');
      out->push_back(c);
    }
  }
  return true;
}

bool Utf8ToLatin1(const std::string& in, std::string* out) {
  for (size_t i = 0; i < in.size(); ++i) {
    const uint8_t c = static_cast<uint8_t>(in[i]);
    if (c < 0x80) {
      out->push_back(static_cast<char>(c));
      continue;
    }
    if ((c & 0xe0) != 0xc0 || i + 1 == in.size()) return false;
    const uint8_t c2 = static_cast<uint8_t>(in[++i]);
    const uint32_t cp = ((c & 0x1fu) << 6) | (c2 & 0x3fu);
    if ((c2 & 0xc0) != 0x80 || cp < 0x80 || cp > 0xff) return false;
    out->push_back(static_cast<char>(cp));
  }
  return true;
}

std::string Latin1ToUtf8(const std::string& bytes) {
  std::string s;
  s.reserve(bytes.size());
  for (unsigned char c : bytes) AppendUtf8(c, &s);
  return s;
}

}  // namespace reshard
