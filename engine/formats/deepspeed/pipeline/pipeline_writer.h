// The files of a DeepSpeedPlan as jobs for the executor.
//
// Each job is one target file: its pickled tree (the source file's as the
// template, so container types, key order and fields reshard does not know
// are kept) whose big tensors are produced from the memory-mapped source
// shards while the file is written, a buffer at a time. Nothing is read
// until a job runs.
#pragma once

#include <atomic>
#include <vector>

#include "exec/job.h"
#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "logical/logical_checkpoint.h"
#include "pickle/value.h"

namespace reshard {

// `src` and `opt` (null without optimizer state) must outlive the jobs; the
// source bytes they read are added to *read.
Result<std::vector<Job>> DeepSpeedJobs(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                                       const DeepSpeedPlan& plan, std::atomic<int64_t>* read);

}  // namespace reshard
