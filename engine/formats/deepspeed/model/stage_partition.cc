#include "formats/deepspeed/model/stage_partition.h"

#include <re2/re2.h>

#include <algorithm>
#include <limits>

namespace reshard {

std::vector<int> PartitionUniform(int num_items, int num_parts) {
  std::vector<int> parts(num_parts + 1, 0);
  if (num_items <= num_parts) {
    for (int p = 0; p <= num_parts; ++p) parts[p] = std::min(p, num_items);
    return parts;
  }
  const int chunk = num_items / num_parts;
  const int residual = num_items - chunk * num_parts;
  // The first `residual` stages get one extra item.
  for (int p = 1; p <= num_parts; ++p) parts[p] = parts[p - 1] + chunk + (p <= residual ? 1 : 0);
  return parts;
}

std::vector<int> PartitionBalanced(const std::vector<int64_t>& weights, int num_parts) {
  const int n = static_cast<int>(weights.size());
  const int m = num_parts;
  if (n <= m) return PartitionUniform(n, m);

  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(weights[i]);
  auto cell = [m](int i, int j) { return static_cast<size_t>(i) * (m + 1) + j; };
  std::vector<double> best_max((n + 1) * (m + 1), inf), best_min((n + 1) * (m + 1), inf),
      best_cost((n + 1) * (m + 1), inf);
  std::vector<int> cut((n + 1) * (m + 1), 0);
  best_max[cell(0, 0)] = 0;
  best_cost[cell(0, 0)] = 0;
  // best_*[i][j]: the first i items in j runs; ties go to the latest cut,
  // exactly as DeepSpeed's `>=` comparison does, so stage bounds agree.
  for (int i = 1; i <= n; ++i) {
    for (int j = 1; j <= std::min(i, m); ++j) {
      for (int k = 0; k < i; ++k) {
        const double run = prefix[i] - prefix[k];
        const double hi = std::max(best_max[cell(k, j - 1)], run);
        const double lo = std::min(best_min[cell(k, j - 1)], run);
        const double cost = hi - lo;
        if (best_cost[cell(i, j)] >= cost) {
          best_cost[cell(i, j)] = cost;
          best_max[cell(i, j)] = hi;
          best_min[cell(i, j)] = lo;
          cut[cell(i, j)] = k;
        }
      }
    }
  }
  std::vector<int> parts{n};
  for (int j = m; j >= 1; --j) parts.push_back(cut[cell(parts.back(), j)]);
  std::reverse(parts.begin(), parts.end());
  return parts;
}

Result<std::vector<int>> PartitionStages(const std::string& method,
                                         const std::vector<SpecWeight>& specs, int num_stages) {
  if (num_stages < 1) return Status::InvalidInput("pipeline size must be at least 1");
  const int n = static_cast<int>(specs.size());
  if (method == "uniform") return PartitionUniform(n, num_stages);
  std::vector<int64_t> weights(n, 0);
  if (method == "parameters") {
    for (int i = 0; i < n; ++i) weights[i] = specs[i].num_params;
  } else if (method.rfind("type:", 0) == 0) {
    RE2::Options opts;
    opts.set_case_sensitive(false);
    opts.set_log_errors(false);
    RE2 re(method.substr(5), opts);
    if (!re.ok()) {
      return Status::InvalidInput("bad pipeline partition method '" + method + "': " + re.error());
    }
    for (int i = 0; i < n; ++i) weights[i] = RE2::PartialMatch(specs[i].class_name, re) ? 1 : 0;
  } else {
    return Status::Unsupported("pipeline partition method '" + method +
                               "' is not supported; use uniform, parameters or type:<regex>");
  }
  return PartitionBalanced(weights, num_stages);
}

}  // namespace reshard
