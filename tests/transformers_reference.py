"""Log-probabilities from transformers on torch CPU: the independent reference for candelabra's
scores of a tiny checkpoint's prompts."""

import numpy as np


def log_softmax_at_each_position(folder):
    """A function from a prompt (token ids) to transformers' float64 log-softmax of the logits at
    each of its positions, [len(prompt), vocab], for the tiny Qwen2 checkpoint in `folder`."""
    import torch
    from transformers import Qwen2ForCausalLM  # the tiny checkpoint's config names no model_type

    model = Qwen2ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()

    def log_softmax(prompt: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].double()
        return torch.log_softmax(logits, dim=-1).numpy()

    return log_softmax
