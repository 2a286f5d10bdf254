#include "formats/deepspeed/known_classes.h"

namespace reshard {

const std::set<std::string>& DeepSpeedKnownClasses() {
  static const std::set<std::string> known = {
      // DeepSpeed: optimizer fragments, ZeRO stage, fp16 loss scalers, and the
      // universal checkpoint's sub-parameter shapes.
      "deepspeed.utils.tensor_fragment.fragment_address",
      "deepspeed.runtime.zero.config.ZeroStageEnum",
      "deepspeed.runtime.fp16.loss_scaler.LossScaler",
      "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
      "deepspeed.checkpoint.universal_checkpoint.SubparamShape",
      // Megatron enums in `args`: BigScience's megatron.enums and
      // Microsoft's megatron.model.enums.
      "megatron.enums.PositionEmbeddingType",
      "megatron.enums.AttnMaskType",
      "megatron.enums.LayerType",
      "megatron.enums.AttnType",
      "megatron.model.enums.PositionEmbeddingType",
      "megatron.model.enums.AttnMaskType",
      "megatron.model.enums.LayerType",
      "megatron.model.enums.AttnType",
  };
  return known;
}

}  // namespace reshard
