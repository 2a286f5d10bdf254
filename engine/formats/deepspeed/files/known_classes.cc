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

namespace {

// An instance of a plain class as protocol 2 pickles it: NEWOBJ, then BUILD with its __dict__.
Value Record(const std::string& module, const std::string& name, Items fields) {
  Object o;
  o.cls = Global{module, name};
  o.construct = Object::Construct::kNewObj;
  o.state = std::make_shared<Value>(Value::MakeDict(std::move(fields)));
  return Value::MakeObject(std::move(o));
}

}  // namespace

Value FragmentAddress(int64_t numel, int64_t start) {
  return Record("deepspeed.utils.tensor_fragment", "fragment_address",
                {{Value::String("numel"), Value::Int(numel)}, {Value::String("start"), Value::Int(start)}});
}

Value ZeroStage(int stage) {
  Object o;  // an enum member: the class called with its value
  o.cls = Global{"deepspeed.runtime.zero.config", "ZeroStageEnum"};
  o.args = {Value::Int(stage)};
  return Value::MakeObject(std::move(o));
}

Value StaticLossScaler(double scale) {
  return Record("deepspeed.runtime.fp16.loss_scaler", "LossScaler",
                {{Value::String("cur_scale"), Value::Float(scale)}, {Value::String("dynamic"), Value::Bool(false)}});
}

}  // namespace reshard
