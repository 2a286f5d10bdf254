// The tensors of an HF export: each canonical tensor renamed, divided and
// reordered as the rule set's hf.tensors section declares (rules/rule_set.h,
// HfTensorMap), made a range at a time from the source.
//
// Dividing and reordering are gathers of dim-0 rows, which stream: a range
// of the output is a few contiguous ranges of the source. A transpose does
// not (every output row needs every source row), so a transposed tensor is
// read whole into memory once while its file is written; the plan reports
// the largest such tensor so that --max-memory leaves room for it.
#pragma once

#include <cstdint>
#include <vector>

#include "formats/state_dict.h"
#include "rules/rule_set.h"

namespace reshard {

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

// The rows `runs` of `source` (rows of `row_bytes` bytes), one after the other.
ByteProducer GatherRows(ByteProducer source, int64_t row_bytes, std::vector<RowRun> runs);

// The [cols, rows] transpose of `source`, a row-major [rows, cols] matrix of
// `element`-byte elements. The source is read whole at the first request and
// freed once every byte has been produced; requests may come from several
// threads at once, each byte once.
ByteProducer Transposed(ByteProducer source, int64_t rows, int64_t cols, int element);

// The HF tensors made from `chosen` (the export's parameters under their
// canonical names, in order), as `hf` maps them; `inputs` gives split_qkv's
// sizes. Refused when a parameter has no mapping or a mapping finds no
// parameter. *scratch_bytes learns the largest tensor built whole.
Result<std::vector<StateDictTensor>> MapHfTensors(const HfExport& hf, const std::vector<ChosenTensor>& chosen,
                                                  const RuleInputs& inputs, int64_t* scratch_bytes);

}  // namespace reshard
