#include "pickle/text_codecs.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace reshard {
namespace {

using namespace std::string_literals;

const std::string kRefused = "<refused>";

// "80 ff": bytes in hex, to compare integers readably.
std::string Hex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) {
    char buf[4];
    std::snprintf(buf, sizeof(buf), "%02x", c);
    out += (out.empty() ? "" : " ") + std::string(buf);
  }
  return out;
}

// The codecs' results, or kRefused when they return false.
std::string Decimal(const std::string& text) {
  std::string le;
  return DecimalToTwosComplement(text, &le) ? Hex(le) : kRefused;
}

std::string RawUnicode(const std::string& in) {
  std::string out;
  return DecodeRawUnicodeEscape(in, &out) ? out : kRefused;
}

std::string Quoted(const std::string& in) {
  std::string out;
  return DecodeQuotedString(in, &out) ? out : kRefused;
}

std::string Latin1(const std::string& utf8) {
  std::string out;
  return Utf8ToLatin1(utf8, &out) ? out : kRefused;
}

// ---- Decimal integers ---------------------------------------------------------------------

TEST(PickleTextCodecs, DecimalToTwosComplement) {
  EXPECT_EQ(Decimal("7"), "07");
  EXPECT_EQ(Decimal("+7"), "07");
  EXPECT_EQ(Decimal("127"), "7f");
  EXPECT_EQ(Decimal("128"), "80 00");  // a byte more for the sign bit
  EXPECT_EQ(Decimal("255"), "ff 00");
  EXPECT_EQ(Decimal("256"), "00 01");
  EXPECT_EQ(Decimal("-1"), "ff");
  EXPECT_EQ(Decimal("-127"), "81");
  EXPECT_EQ(Decimal("-129"), "7f ff");
  EXPECT_EQ(Decimal("-256"), "00 ff");
  EXPECT_EQ(Decimal("9223372036854775807"), "ff ff ff ff ff ff ff 7f");
  EXPECT_EQ(Decimal("1208925819614629174706176"), "00 00 00 00 00 00 00 00 00 00 01");  // 2**80
  EXPECT_EQ(Decimal("-1180591620717411303424"), "00 00 00 00 00 00 00 00 c0");          // -2**70
}

TEST(PickleTextCodecs, DecimalZeroAndLeadingZeros) {
  EXPECT_EQ(Decimal("0"), "");
  EXPECT_EQ(Decimal("-0"), "");
  EXPECT_EQ(Decimal("+000"), "");
  EXPECT_EQ(Decimal("007"), "07");
  EXPECT_EQ(Decimal("-0001"), "ff");
}

// The magnitude gets its sign byte before negation, so a negative power of
// two keeps one byte more than it needs; readers take both forms.
TEST(PickleTextCodecs, DecimalNegativePowersOfTwoKeepASignByte) {
  EXPECT_EQ(Decimal("-128"), "80 ff");
  EXPECT_EQ(Decimal("-32768"), "00 80 ff");
  EXPECT_EQ(Decimal("-9223372036854775808"), "00 00 00 00 00 00 00 80 ff");
}

TEST(PickleTextCodecs, DecimalRefusesWhatIsNotAnInteger) {
  for (const char* text :
       {"", "-", "+", "--1", "+-1", "1a", " 1", "1 ", "1_000", "1.0", "0x10", "1L", "\xd9\xa1"}) {
    EXPECT_EQ(Decimal(text), kRefused) << "'" << text << "'";
  }
}

// Python's limit: at most 4300 digits, leading zeros included, sign not.
TEST(PickleTextCodecs, DecimalOfHugeIntegers) {
  const std::string nines(4300, '9');  // 10**4300 - 1
  std::string le;
  ASSERT_TRUE(DecimalToTwosComplement(nines, &le));
  ASSERT_EQ(le.size(), 1786u);
  EXPECT_EQ(Hex(le.substr(0, 4)), "ff ff ff ff");
  EXPECT_EQ(Hex(le.substr(le.size() - 4)), "7c bd 92 13");
  EXPECT_EQ(TwosComplementToDecimal(le), nines);

  ASSERT_TRUE(DecimalToTwosComplement("-" + nines, &le));
  ASSERT_EQ(le.size(), 1786u);
  EXPECT_EQ(Hex(le.substr(0, 4)), "01 00 00 00");
  EXPECT_EQ(Hex(le.substr(le.size() - 2)), "6d ec");
  EXPECT_EQ(TwosComplementToDecimal(le), "-" + nines);

  EXPECT_EQ(Decimal(std::string(4301, '9')), kRefused);
  EXPECT_EQ(Decimal("+0" + nines), kRefused);
  EXPECT_EQ(Decimal(std::string(4300, '0')), "");
}

TEST(PickleTextCodecs, TwosComplementToDecimal) {
  EXPECT_EQ(TwosComplementToDecimal(""), "0");
  EXPECT_EQ(TwosComplementToDecimal("\x00\x00"s), "0");
  EXPECT_EQ(TwosComplementToDecimal("\x7f"), "127");
  EXPECT_EQ(TwosComplementToDecimal("\x80\x00"s), "128");
  EXPECT_EQ(TwosComplementToDecimal("\x00\x01"s), "256");
  EXPECT_EQ(TwosComplementToDecimal("\x80"), "-128");
  EXPECT_EQ(TwosComplementToDecimal("\x80\xff"), "-128");  // a redundant sign byte
  EXPECT_EQ(TwosComplementToDecimal("\xff"), "-1");
  EXPECT_EQ(TwosComplementToDecimal("\xff\xff\xff"), "-1");
  EXPECT_EQ(TwosComplementToDecimal("\x00\x00\x00\x00\x00\x00\x00\x80"s), "-9223372036854775808");
  EXPECT_EQ(TwosComplementToDecimal(std::string(10, '\0') + "\x01"), "1208925819614629174706176");
  EXPECT_EQ(TwosComplementToDecimal(std::string(8, '\0') + "\xc0"), "-1180591620717411303424");
}

TEST(PickleTextCodecs, DecimalRoundTrips) {
  for (const char* text :
       {"0", "1", "-1", "127", "128", "-128", "-129", "65535", "-65536", "9223372036854775807",
        "-9223372036854775808", "18446744073709551616", "-340282366920938463463374607431768211456",
        "123456789012345678901234567890123456789"}) {
    std::string le;
    ASSERT_TRUE(DecimalToTwosComplement(text, &le)) << text;
    EXPECT_EQ(TwosComplementToDecimal(le), text);
  }
}

// ---- Protocol 0 UNICODE -------------------------------------------------------------------

TEST(PickleTextCodecs, RawUnicodeEscape) {
  EXPECT_EQ(RawUnicode(""), "");
  EXPECT_EQ(RawUnicode("plain text"), "plain text");
  EXPECT_EQ(RawUnicode("caf\xe9"), "caf\xc3\xa9");  // latin-1 bytes are code points
  EXPECT_EQ(RawUnicode("\x80\xff"), "\xc2\x80\xc3\xbf");
  EXPECT_EQ(RawUnicode("\\u00e9"), "\xc3\xa9");
  EXPECT_EQ(RawUnicode("\\u20AC"), "\xe2\x82\xac");
  EXPECT_EQ(RawUnicode("\\U0001F600"), "\xf0\x9f\x98\x80");
  EXPECT_EQ(RawUnicode("\\U0010ffff"), "\xf4\x8f\xbf\xbf");
  EXPECT_EQ(RawUnicode("\\u0000"), "\0"s);
  EXPECT_EQ(RawUnicode("a\\u000ab\\u005c"), "a\nb\\");  // Python escapes newline and backslash
}

TEST(PickleTextCodecs, RawUnicodeKeepsOtherBackslashes) {
  EXPECT_EQ(RawUnicode("\\"), "\\");
  EXPECT_EQ(RawUnicode("a\\"), "a\\");
  EXPECT_EQ(RawUnicode("a\\nb"), "a\\nb");
  EXPECT_EQ(RawUnicode("\\x41"), "\\x41");
}

TEST(PickleTextCodecs, RawUnicodeRefusesBadEscapes) {
  for (const char* in : {"\\u", "\\u12", "\\U0001F60", "x\\u00", "\\u12g4", "\\u-123", "\\u 123",
                         "\\U00110000", "\\Uffffffff"}) {
    EXPECT_EQ(RawUnicode(in), kRefused) << in;
  }
}

TEST(PickleTextCodecs, DecodersAppend) {
  std::string out = "kept:";
  ASSERT_TRUE(DecodeRawUnicodeEscape("\\u0041", &out));
  ASSERT_TRUE(DecodeQuotedString("'B'", &out));
  ASSERT_TRUE(Utf8ToLatin1("C", &out));
  EXPECT_EQ(out, "kept:ABC");
}

// ---- Protocol 0 STRING --------------------------------------------------------------------

TEST(PickleTextCodecs, QuotedString) {
  EXPECT_EQ(Quoted("''"), "");
  EXPECT_EQ(Quoted("\"\""), "");
  EXPECT_EQ(Quoted("'abc'"), "abc");
  EXPECT_EQ(Quoted("\"it's\""), "it's");
  EXPECT_EQ(Quoted("'say \"hi\"'"), "say \"hi\"");
  EXPECT_EQ(Quoted("'caf\xe9'"), "caf\xe9");  // bytes, not text: no UTF-8
}

TEST(PickleTextCodecs, QuotedStringEscapes) {
  EXPECT_EQ(Quoted("'a\\nb\\tc'"), "a\nb\tc");
  EXPECT_EQ(Quoted("'\\a\\b\\f\\r\\v'"), "\a\b\f\r\v");
  EXPECT_EQ(Quoted("'\\\\'"), "\\");
  EXPECT_EQ(Quoted("'\\''"), "'");
  EXPECT_EQ(Quoted("'\\\"'"), "\"");
  EXPECT_EQ(Quoted("'\\x41\\xFF'"), "A\xff");
  EXPECT_EQ(Quoted("'\\0'"), "\0"s);
  EXPECT_EQ(Quoted("'\\08'"), (std::string{'\0', '8'}));
  EXPECT_EQ(Quoted("'\\101'"), "A");
  EXPECT_EQ(Quoted("'\\1012'"), "A2");  // at most three octal digits
  EXPECT_EQ(Quoted("'\\777'"), "\xff");
  EXPECT_EQ(Quoted("'a\\\nb'"), "ab");  // line continuation
}

TEST(PickleTextCodecs, QuotedStringKeepsEscapesItCannotDecode) {
  EXPECT_EQ(Quoted("'\\q'"), "\\q");
  EXPECT_EQ(Quoted("'\\u0041'"), "\\u0041");  // no \u in a Python 2 str
  EXPECT_EQ(Quoted("'\\x4'"), "\\x4");
  EXPECT_EQ(Quoted("'\\xg0'"), "\\xg0");
  EXPECT_EQ(Quoted("'ab\\'"), "ab\\");
}

TEST(PickleTextCodecs, QuotedStringRefusesMissingQuotes) {
  for (const char* in : {"", "'", "\"", "abc", "'abc", "abc'", "'abc\"", "\"abc'"}) {
    EXPECT_EQ(Quoted(in), kRefused) << in;
  }
}

// ---- Latin-1 ------------------------------------------------------------------------------

TEST(PickleTextCodecs, Utf8ToLatin1) {
  EXPECT_EQ(Latin1(""), "");
  EXPECT_EQ(Latin1("abc"), "abc");
  EXPECT_EQ(Latin1("\0\x7f"s), "\0\x7f"s);
  EXPECT_EQ(Latin1("\xc2\x80\xc3\xbf"), "\x80\xff");
  EXPECT_EQ(Latin1("caf\xc3\xa9"), "caf\xe9");
}

TEST(PickleTextCodecs, Utf8ToLatin1RefusesOtherText) {
  for (const char* in : {"\xc4\x80",          // U+0100
                         "\xe2\x82\xac",      // U+20AC
                         "\xf0\x9f\x98\x80",  // U+1F600
                         "\xc3", "ab\xc3",    // cut short
                         "\xc3\x41",          // no continuation byte
                         "\x80", "\xbf",      // a lone continuation byte
                         "\xc1\x81"}) {       // overlong 'A'
    EXPECT_EQ(Latin1(in), kRefused) << Hex(in);
  }
}

TEST(PickleTextCodecs, Latin1ToUtf8) {
  EXPECT_EQ(Latin1ToUtf8(""), "");
  EXPECT_EQ(Latin1ToUtf8("abc"), "abc");
  EXPECT_EQ(Latin1ToUtf8("\0\x7f\x80\xff"s), "\0\x7f\xc2\x80\xc3\xbf"s);

  std::string every_byte;
  for (int b = 0; b < 256; ++b) every_byte.push_back(static_cast<char>(b));
  const std::string utf8 = Latin1ToUtf8(every_byte);
  EXPECT_EQ(utf8.size(), 128u + 2 * 128u);
  EXPECT_EQ(Latin1(utf8), every_byte);
}

// Without escapes, protocol 0 UNICODE is latin-1 too.
TEST(PickleTextCodecs, RawUnicodeWithoutEscapesIsLatin1) {
  std::string text;
  for (int b = 0; b < 256; ++b) {
    if (b != '\\') text.push_back(static_cast<char>(b));
  }
  EXPECT_EQ(RawUnicode(text), Latin1ToUtf8(text));
}

}  // namespace
}  // namespace reshard
