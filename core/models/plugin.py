"""Registers the in-tree architectures through the `candelabra` entry-point group, like any plugin."""

from candelabra.plugins import hookimpl


@hookimpl
def register_model_architectures(register):
    from candelabra.core.models.deepseek import DeepseekV2, DeepseekV3
    from candelabra.core.models.gemma import Gemma, Gemma2, Gemma3
    from candelabra.core.models.glm4 import Glm4
    from candelabra.core.models.llama import Llama
    from candelabra.core.models.mixtral import Mixtral
    from candelabra.core.models.phi import Phi2, Phi3
    from candelabra.core.models.qwen import Qwen2, Qwen3, Qwen3Moe
    from candelabra.core.models.stablelm import StableLm

    for name, model in {
        "LlamaForCausalLM": Llama,
        "MistralForCausalLM": Llama,
        "Qwen2ForCausalLM": Qwen2,
        "Qwen3ForCausalLM": Qwen3,
        "Qwen3MoeForCausalLM": Qwen3Moe,
        "MixtralForCausalLM": Mixtral,
        "GemmaForCausalLM": Gemma,
        "Gemma2ForCausalLM": Gemma2,
        "Gemma3ForCausalLM": Gemma3,
        "Phi3ForCausalLM": Phi3,
        "PhiForCausalLM": Phi2,
        "StableLmForCausalLM": StableLm,
        "Glm4ForCausalLM": Glm4,
        "DeepseekV2ForCausalLM": DeepseekV2,
        "DeepseekV3ForCausalLM": DeepseekV3,
    }.items():
        register(name, model)
