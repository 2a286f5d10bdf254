// The tensors of an HF export: each canonical tensor renamed, divided and
// reordered as the rule set's hf.tensors section declares (rules/rule_set.h,
// HfTensorMap), made a range at a time from the source.
//
// Dividing and reordering are gathers of dim-0 rows, which stream: a range
// of the output is a few contiguous ranges of the source. A transpose needs
// every source row for each output row, so a matrix of more than 1 MiB is
// transposed once into a scratch file in the output's folder and read back
// from it; the plan reports the few MiB that takes so that --max-memory
// leaves room for it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "container/scratch_file.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/state_dict.h"
#include "rules/rule_set.h"

namespace re2 {
class RE2;
}

namespace reshard {

// A size written in an hf section (a `shape` dim, a `null_means`): N, a
// metadata path, or N*path; an error saying how to give a path not recorded.
Result<int64_t> HfSize(const std::string& size, const RuleInputs& inputs);

// A tensor name of an hf.tensors entry, whose placeholders are {block} and
// {expert} (a MoE layer's experts: one HF tensor per block and expert).
class HfNameTemplate {
 public:
  explicit HfNameTemplate(std::string name);
  ~HfNameTemplate();
  // Whether `name` is this template's for some block (and expert); *block
  // and *expert learn them ("" where the template has no such placeholder).
  bool Match(const std::string& name, std::string* block, std::string* expert = nullptr) const;
  // The name of block `block` (and expert `expert`).
  std::string With(const std::string& block, const std::string& expert = "") const;

 private:
  std::string name_;
  std::vector<bool> expert_group_;  // per capture group of the pattern: whether it is {expert}'s
  std::unique_ptr<re2::RE2> pattern_;
};

// `count` rows of the source from row `first`.
struct RowRun {
  int64_t first = 0;
  int64_t count = 0;
  bool operator==(const RowRun& o) const { return first == o.first && count == o.count; }
};

// The rows of part `part` (0 q, 1 k, 2 v) of a fused QKV laid out per KV
// group, [groups, heads/groups + 2, head_dim]: each group's query heads,
// then its key head, then its value head. With groups == heads it is
// multi-head attention's per-head [heads, 3, head_dim].
std::vector<RowRun> QkvRows(int64_t groups, int64_t heads, int64_t head_dim, int part);

// The rows of half `half` (0 or 1) of `rows` rows.
std::vector<RowRun> HalfRows(int64_t rows, int half);

// A q or k projection of `rows` rows in `heads` heads of hd rows each, whose
// rotary embedding turns interleaved pairs (torchtitan, Meta's Llama: rows
// 2i and 2i + 1 of a head) where HF's turns halves (rows i and hd/2 + i).
// `interleaved`: HF's rows in the interleaved order (writing torchtitan);
// else the interleaved rows in HF's order (reading it).
std::vector<RowRun> RotaryPairRows(int64_t rows, int64_t heads, bool interleaved);

// One HF tensor of an hf.tensors entry: its name, the rows of the canonical
// tensor it takes in order (empty: all of them) and how many rows that is.
struct HfPart {
  std::string name;
  std::vector<RowRun> runs;
  int64_t rows = 0;
};

// How `map` divides dim 0 of the canonical tensor `name` of `shape` (of
// block `block` and expert `expert`; "" outside them) among its HF tensors;
// `inputs` gives split_qkv's sizes. Refused when the rows do not divide as
// the entry says.
Result<std::vector<HfPart>> HfParts(const HfTensorMap& map, const std::string& name,
                                    const std::vector<int64_t>& shape, const RuleInputs& inputs,
                                    const std::string& block, const std::string& expert);

// Refuses the canonical tensor `name` of `shape` unless it has the shape
// `map` says the architecture needs (its `shape:`; any when it has none).
Status CheckHfShape(const HfExport& hf, const HfTensorMap& map, const std::string& name,
                    const std::vector<int64_t>& shape, const RuleInputs& inputs);

// The rows `runs` of `source` (rows of `row_bytes` bytes), one after the other.
ByteProducer GatherRows(ByteProducer source, int64_t row_bytes, std::vector<RowRun> runs);

// What a transpose holds of a matrix at once, about, for each step of its
// work: a bigger matrix goes through a scratch file in two passes (a strip
// of source rows a read, a band of the transpose's rows a reordering), so
// its memory stays a few pieces whatever the matrix size, and the file's
// bytes are the page cache's to keep or write out.
inline constexpr int64_t kTransposePieceBytes = int64_t{1} << 20;

// `out` = the [cols, rows] transpose of `in`, a row-major [rows, cols] matrix
// of `element`-byte elements.
void TransposeMatrix(const uint8_t* in, int64_t rows, int64_t cols, int element, uint8_t* out);

// The [cols, rows] transpose of `source`, a row-major [rows, cols] matrix,
// made at its first request (in memory, or in a file of `scratch` when the
// matrix is more than a piece and there is one) and dropped once all of its
// bytes have been produced. Requests may come from several threads at once.
ByteProducer Transposed(ByteProducer source, int64_t rows, int64_t cols, int element,
                        std::shared_ptr<const ScratchFolder> scratch,
                        int64_t piece_bytes = kTransposePieceBytes);

// The memory Transposed holds at once for such a matrix, with a scratch folder.
int64_t TransposeScratchBytes(int64_t rows, int64_t cols, int element,
                              int64_t piece_bytes = kTransposePieceBytes);

// The HF tensors made from `chosen` (the export's parameters under their
// canonical names, in order), as `hf` maps them; `inputs` gives split_qkv's
// sizes; transposes keep big matrices in files of `scratch`. Refused when a
// parameter has no mapping or a mapping finds no parameter. *scratch_bytes
// learns the most a transpose holds.
Result<std::vector<StateDictTensor>> MapHfTensors(const HfExport& hf, const std::vector<ChosenTensor>& chosen,
                                                  const RuleInputs& inputs,
                                                  const std::shared_ptr<const ScratchFolder>& scratch,
                                                  int64_t* scratch_bytes);

}  // namespace reshard
