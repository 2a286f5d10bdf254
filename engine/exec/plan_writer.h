// The writer: any OutputPlan as the executor's jobs, whatever format planned
// it. A job writes one file (a torch.save tree, a text, a copy) or a byte
// range of one (a big safetensors file, a run of a `.distcp` file's items,
// shared among workers), reports the
// digest of what it wrote for the manifest, and streams the file's tensors
// from their producers through the worker's buffer.
#pragma once

#include <vector>

#include "exec/job.h"
#include "plan/output_plan.h"

namespace reshard {

// The jobs writing `plan`'s files into the job context's folder (their
// parent folders made), in the plan's order.
std::vector<Job> PlanJobs(const OutputPlan& plan);

}  // namespace reshard
