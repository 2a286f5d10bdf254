// The optimizers Megatron-Core builds for a model with experts, and the
// param groups a save must hold for each.
//
// Megatron-Core builds the experts an optimizer of their own once their
// gradients are reduced over the expert-data-parallel group rather than the
// data-parallel one: at expert-parallel size N > 1 (the expert TP being the
// dense TP, as reshard writes it) its ChainedOptimizer holds two, the dense
// parameters' then the experts', whose groups say is_expert_parallel; at
// N = 1 the experts are dense parameters and one optimizer holds them all.
// Its load refuses a saved state of another number of optimizers, and pairs
// each group an optimizer builds with a saved one by identifier
// (is_expert_parallel and wd_mult among its fields), so a save written for
// EP N carries, per optimizer, the groups of the weight-decay multipliers
// its parameters have.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "formats/format.h"

namespace reshard {

// The param groups of each optimizer Megatron-Core builds at expert-parallel
// size `ep` (one at EP 1; dense then experts above), from `megatron_groups`
// (MegatronParamGroups' list: one group per weight-decay multiplier, none
// expert-parallel), `source` (which parameter is in which group) and the
// canonical names of the `experts`' parameters.
std::vector<Value> ParamGroupsPerOptimizer(const Value& megatron_groups, const OptimizerParamGroups& source,
                                           const std::set<std::string>& experts, int ep);

// ParamGroupsPerOptimizer's inverse: the groups of a ChainedOptimizer's
// optimizers (`groups`, dense then experts', without `params`) as one
// optimizer's, none expert-parallel; an expert group that is a dense one
// but for is_expert_parallel is that group. Unsupported where an expert
// group differs from the dense group of its wd_mult in more.
Result<std::vector<Value>> ParamGroupsAsOneOptimizer(const std::vector<Value>& groups);

}  // namespace reshard
