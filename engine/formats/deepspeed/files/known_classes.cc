#include "formats/deepspeed/files/known_classes.h"

namespace reshard {

const KnownClasses& DeepSpeedKnownClasses() {
  using Kind = KnownClass::Kind;
  // Enum members are the union over the DeepSpeed versions and Megatron
  // forks reshard reads; a fork's new member is allowed by --allow-class
  // module.Enum.member.
  static const KnownClasses known = {
      // DeepSpeed: optimizer fragments, ZeRO stage, fp16 loss scalers, and the
      // universal checkpoint's sub-parameter shapes.
      {"deepspeed.utils.tensor_fragment.fragment_address", {Kind::kRecord, {}}},
      {"deepspeed.runtime.zero.config.ZeroStageEnum",
       {Kind::kEnum, {"disabled", "optimizer_states", "gradients", "weights", "max_stage"}}},
      {"deepspeed.runtime.fp16.loss_scaler.LossScaler", {Kind::kRecord, {}}},
      {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", {Kind::kRecord, {}}},
      {"deepspeed.checkpoint.universal_checkpoint.SubparamShape", {Kind::kRecord, {}}},
      // Megatron enums in `args`: BigScience's megatron.enums and
      // Microsoft's megatron.model.enums.
      {"megatron.enums.PositionEmbeddingType", {Kind::kEnum, {"rotary", "absolute", "alibi"}}},
      {"megatron.enums.AttnMaskType", {Kind::kEnum, {"padding", "causal", "prefix", "custom"}}},
      {"megatron.enums.LayerType", {Kind::kEnum, {"encoder", "decoder"}}},
      {"megatron.enums.AttnType", {Kind::kEnum, {"self_attn", "cross_attn"}}},
      {"megatron.model.enums.PositionEmbeddingType",
       {Kind::kEnum, {"rotary", "absolute", "alibi", "learned_absolute", "rope"}}},
      {"megatron.model.enums.AttnMaskType", {Kind::kEnum, {"padding", "causal", "prefix", "custom"}}},
      {"megatron.model.enums.LayerType",
       {Kind::kEnum,
        {"encoder", "decoder", "retro_encoder", "retro_decoder", "retro_decoder_with_retriever"}}},
      {"megatron.model.enums.AttnType", {Kind::kEnum, {"self_attn", "cross_attn"}}},
  };
  return known;
}

}  // namespace reshard
