// The pickle opcodes, listed once for the reader and the writer: a named
// constant for each (`op::kMark`, ...) and its name for messages
// (OpcodeName). Names and bytes are those of Python's pickle.py, protocols
// 0-5; reshard reads most of them and writes a protocol 2 subset.
#pragma once

#include <cstdint>

namespace reshard {

// X(constant, byte, name) for every opcode.
#define RESHARD_PICKLE_OPCODES(X)               \
  /* Stream structure */                        \
  X(kProto, 0x80, "PROTO")                      \
  X(kFrame, 0x95, "FRAME")                      \
  X(kStop, '.', "STOP")                         \
  X(kMark, '(', "MARK")                         \
  X(kPop, '0', "POP")                           \
  X(kPopMark, '1', "POP_MARK")                  \
  X(kDup, '2', "DUP")                           \
  /* Scalars */                                 \
  X(kNone, 'N', "NONE")                         \
  X(kNewTrue, 0x88, "NEWTRUE")                  \
  X(kNewFalse, 0x89, "NEWFALSE")                \
  X(kInt, 'I', "INT")                           \
  X(kBinInt, 'J', "BININT")                     \
  X(kBinInt1, 'K', "BININT1")                   \
  X(kBinInt2, 'M', "BININT2")                   \
  X(kLong, 'L', "LONG")                         \
  X(kLong1, 0x8a, "LONG1")                      \
  X(kLong4, 0x8b, "LONG4")                      \
  X(kFloat, 'F', "FLOAT")                       \
  X(kBinFloat, 'G', "BINFLOAT")                 \
  /* Strings and bytes */                       \
  X(kString, 'S', "STRING")                     \
  X(kBinString, 'T', "BINSTRING")               \
  X(kShortBinString, 'U', "SHORT_BINSTRING")    \
  X(kUnicode, 'V', "UNICODE")                   \
  X(kBinUnicode, 'X', "BINUNICODE")             \
  X(kShortBinUnicode, 0x8c, "SHORT_BINUNICODE") \
  X(kBinUnicode8, 0x8d, "BINUNICODE8")          \
  X(kBinBytes, 'B', "BINBYTES")                 \
  X(kShortBinBytes, 'C', "SHORT_BINBYTES")      \
  X(kBinBytes8, 0x8e, "BINBYTES8")              \
  X(kByteArray8, 0x96, "BYTEARRAY8")            \
  /* Containers */                              \
  X(kEmptyList, ']', "EMPTY_LIST")              \
  X(kList, 'l', "LIST")                         \
  X(kAppend, 'a', "APPEND")                     \
  X(kAppends, 'e', "APPENDS")                   \
  X(kEmptyTuple, ')', "EMPTY_TUPLE")            \
  X(kTuple, 't', "TUPLE")                       \
  X(kTuple1, 0x85, "TUPLE1")                    \
  X(kTuple2, 0x86, "TUPLE2")                    \
  X(kTuple3, 0x87, "TUPLE3")                    \
  X(kEmptyDict, '}', "EMPTY_DICT")              \
  X(kDict, 'd', "DICT")                         \
  X(kSetItem, 's', "SETITEM")                   \
  X(kSetItems, 'u', "SETITEMS")                 \
  X(kEmptySet, 0x8f, "EMPTY_SET")               \
  X(kAddItems, 0x90, "ADDITEMS")                \
  X(kFrozenSet, 0x91, "FROZENSET")              \
  /* Classes and objects */                     \
  X(kGlobal, 'c', "GLOBAL")                     \
  X(kStackGlobal, 0x93, "STACK_GLOBAL")         \
  X(kReduce, 'R', "REDUCE")                     \
  X(kNewObj, 0x81, "NEWOBJ")                    \
  X(kNewObjEx, 0x92, "NEWOBJ_EX")               \
  X(kBuild, 'b', "BUILD")                       \
  X(kInst, 'i', "INST")                         \
  X(kObj, 'o', "OBJ")                           \
  X(kExt1, 0x82, "EXT1")                        \
  X(kExt2, 0x83, "EXT2")                        \
  X(kExt4, 0x84, "EXT4")                        \
  /* The memo */                                \
  X(kPut, 'p', "PUT")                           \
  X(kBinPut, 'q', "BINPUT")                     \
  X(kLongBinPut, 'r', "LONG_BINPUT")            \
  X(kMemoize, 0x94, "MEMOIZE")                  \
  X(kGet, 'g', "GET")                           \
  X(kBinGet, 'h', "BINGET")                     \
  X(kLongBinGet, 'j', "LONG_BINGET")            \
  /* Objects outside the stream */              \
  X(kPersId, 'P', "PERSID")                     \
  X(kBinPersId, 'Q', "BINPERSID")               \
  X(kNextBuffer, 0x97, "NEXT_BUFFER")           \
  X(kReadOnlyBuffer, 0x98, "READONLY_BUFFER")

namespace op {
#define RESHARD_PICKLE_OPCODE_CONSTANT(constant, byte, name) constexpr uint8_t constant = byte;
RESHARD_PICKLE_OPCODES(RESHARD_PICKLE_OPCODE_CONSTANT)
#undef RESHARD_PICKLE_OPCODE_CONSTANT
}  // namespace op

// "MARK", "BINPUT", ...; "unknown" for a byte that is not an opcode. As a
// switch, the list cannot give one byte two names: that fails to compile.
constexpr const char* OpcodeName(uint8_t opcode) {
  switch (opcode) {
#define RESHARD_PICKLE_OPCODE_CASE(constant, byte, name) \
  case op::constant: return name;
    RESHARD_PICKLE_OPCODES(RESHARD_PICKLE_OPCODE_CASE)
#undef RESHARD_PICKLE_OPCODE_CASE
    default: return "unknown";
  }
}

#undef RESHARD_PICKLE_OPCODES

}  // namespace reshard
