// Building target tensor bytes from source shards, by element range.
//
// A TensorPlan says which slices of which source shards fill a
// target tensor. Materialising any range of the target's elements needs only
// the matching source elements, so a writer can produce a tensor of any size
// a buffer at a time, and an optimizer partition can take just the part of a
// parameter that falls inside it.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "container/mapped_file.h"
#include "logical/source_shard.h"
#include "plan/tensor_plan.h"
#include "util/byte_producer.h"

namespace reshard {

// What a tensor plan reads: the shard table of one tensor (a weight, or an
// optimizer state located in its partitions).
struct SourceTensor {
  DType dtype = DType::kFloat32;
  std::vector<SourceShard> shards;  // BoxCopy::src_shard indexes this

  static SourceTensor Of(const LogicalTensor& t);
};

// Writes elements [begin, end) of the target tensor `plan` describes (in
// row-major order, src.dtype) to `dst`. Returns the source bytes read.
// Mapped source pages read are noted in `pages`, and the bytes copied as they
// lie in a source file in `spans`.
int64_t MaterializeRange(const SourceTensor& src, const TensorPlan& plan, int64_t begin,
                         int64_t end, uint8_t* dst, TouchedPages* pages, const SpanSink& spans = {});

// The target tensor's bytes, produced a range at a time (ranges of whole
// elements); adds the source bytes read to *read, which must outlive it.
ByteProducer RangeProducer(SourceTensor source, TensorPlan plan, std::atomic<int64_t>* read);

// The element range [*begin, *end) of the byte range [offset, offset + length)
// of `element_size`-byte elements; an error for a range of partial elements.
Status ElementRange(int64_t offset, int64_t length, int element_size, int64_t* begin, int64_t* end);

}  // namespace reshard
