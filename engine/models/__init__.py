from pdserve.engine.models.llama import LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}

__all__ = ["LlamaForCausalLM", "MODEL_CLASSES"]
