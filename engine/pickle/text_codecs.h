// The text encodings a pickle carries values in, as pure functions on bytes:
// protocol 0's decimal integers, quoted string literals (STRING) and
// raw-unicode-escape lines (UNICODE), and the latin-1 str that protocol 2
// pickles bytes as (_codecs.encode(str, 'latin1')). Integers are little-endian
// two's complement bytes, as LONG1 / LONG4 and Value::BigInt hold them; text
// Python holds as str is UTF-8.
//
// The string decoders append to `*out`. A decoder that returns false (for
// input it cannot decode) may have written part of `*out`.
#pragma once

#include <string>

namespace reshard {

// An optionally signed decimal integer ("-12", "+7", "007") as two's
// complement bytes: the fewest that hold its magnitude and sign bit, then
// negated, so a negative power of two may keep a redundant sign byte ("-128":
// 80 ff); zero is no bytes. False for text with anything but digits after the
// sign, or more than 4300 digits (Python's limit: conversion is quadratic).
bool DecimalToTwosComplement(const std::string& text, std::string* out);

// The decimal text of two's complement bytes (any length; none is "0").
// Quadratic in the length.
std::string TwosComplementToDecimal(const std::string& le);

// Protocol 0 UNICODE: latin-1 text with \uXXXX and \UXXXXXXXX escapes, to
// UTF-8. Other backslashes are plain characters. False for an escape that is
// cut short, not hex, or beyond U+10FFFF.
bool DecodeRawUnicodeEscape(const std::string& in, std::string* out);

// Protocol 0 STRING: a Python 2 string literal in single or double quotes
// with backslash escapes (\n, \x41, \101, ...). An escape it does not know,
// a \x without two hex digits and a final lone backslash stay as written.
// False when the quotes are missing or do not match.
bool DecodeQuotedString(const std::string& in, std::string* out);

// The bytes a latin-1 str stands for: UTF-8 of code points up to U+00FF, one
// byte each. False for any other code point or malformed UTF-8.
bool Utf8ToLatin1(const std::string& in, std::string* out);

// The inverse: bytes as the UTF-8 of the latin-1 str that holds them.
std::string Latin1ToUtf8(const std::string& bytes);

}  // namespace reshard
