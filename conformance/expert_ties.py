"""The prompt positions where a mixture-of-experts reference chooses its experts within a dtype's
rounding of a tie. A correct backend computing in that dtype may choose others there, and that
position's logits then move far from the reference's: the models level leaves such positions out
of its logits NMSE, and greedy decoding that parts from transformers' at one parts on a tie.

A position counts as tied when nudging some router's input, each element by its own random
fraction of `NUDGE_UNITS` units in the dtype's last place, changes that router's set of experts in
one of `NUDGES` draws. It asks transformers' own routers, so it holds for every routing rule they
have (softmax top-k, DeepSeek's groups and correction bias) without restating any."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8,
                 # a quantized KV cache's rows: int8 keeps an element to half a code of its row's largest
                 # magnitude over 127, about 2^-8 of it; fp8 (e4m3) to its 3 mantissa bits
                 "int8": 2.0**-8, "fp8": 2.0**-4}


def coarsest(*roundings: str | None) -> str:
    """Of the dtypes and KV cache dtypes named (None for none), the one that rounds the most."""
    return max((r for r in roundings if r is not None), key=UNIT_ROUNDOFF.__getitem__)

# On the tiny MoE cases in bfloat16 (8 cases x 12 seeds) and float16 (8 x 8) every position whose
# logits moved by more than the dense limit was found at 4 units; 1 and 2 units missed one of them.
# At 4 units 0 to 4 of a 21-token prompt's positions counted as tied.
NUDGE_UNITS = 4
NUDGES = 16


def routers(model) -> list:
    """transformers' router modules in `model`: each maps hidden states to (router logits, expert
    weights, expert ids)."""
    return [module for module in model.modules() if type(module).__name__.lower().endswith("router")]


def positions_near_expert_ties(model, forward: Callable[[], np.ndarray], positions: int, dtype: str,
                               seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Run `forward` (one sequence of `positions` tokens through `model`) and return its result with
    a boolean per position: True where some router's choice is within `dtype`'s rounding of a tie."""
    import torch

    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no router module (a class named *Router) to ask about ties")
    tied = np.zeros(positions, dtype=bool)
    generator = torch.Generator().manual_seed(seed)
    reach = NUDGE_UNITS * UNIT_ROUNDOFF[dtype]

    def look_for_ties(router, inputs, output) -> None:
        hidden = inputs[0].reshape(-1, inputs[0].shape[-1])
        if len(hidden) != positions:
            raise ValueError(f"a router saw {len(hidden)} tokens, not the sequence's {positions}")
        chosen = output[2].sort(dim=-1).values
        with torch.no_grad():
            for _ in range(NUDGES):
                nudge = (torch.rand(hidden.shape, generator=generator, dtype=hidden.dtype) * 2 - 1) * reach
                other = router.forward(hidden * (1 + nudge))[2].sort(dim=-1).values
                tied[(other != chosen).any(dim=-1).numpy()] = True

    handles = [router.register_forward_hook(look_for_ties) for router in found]
    try:
        result = forward()
    finally:
        for handle in handles:
            handle.remove()
    return result, tied


class CheckpointExpertTies:
    """Whether the newest position of a token sequence routes within `dtype`'s rounding of an expert
    tie, asked of transformers' model of the checkpoint in `folder` (its weights rounded to `weights_dtype`,
    computing in float32). The model loads on the first question, while the folder must still exist;
    without torch there is no model to ask, and the answer is None."""

    def __init__(self, folder, weights_dtype: str, dtype: str) -> None:
        self.folder, self.weights_dtype, self.dtype = folder, weights_dtype, dtype
        self._model = None

    def newest_at_tie(self, tokens: list[int]) -> bool | None:
        try:
            import torch
        except ImportError:
            return None
        model = self._model or self._load()
        ids = torch.tensor([tokens], dtype=torch.long)
        with torch.no_grad():
            _, tied = positions_near_expert_ties(model, lambda: model(ids), len(tokens), self.dtype)
        return bool(tied[-1])

    def _load(self):
        import json
        import warnings

        import torch
        import transformers

        from candelabra.conformance.compare import round_to

        config = json.loads((self.folder / "config.json").read_text())
        model_class = getattr(transformers, config["architectures"][0])
        transformers.logging.set_verbosity_error()
        bar = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # a conformance report has no room for one
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = model_class.from_pretrained(self.folder, config=model_class.config_class(**config),
                                                    torch_dtype=torch.float32, attn_implementation="eager")
        finally:
            if bar:
                transformers.utils.logging.enable_progress_bar()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.from_numpy(round_to(parameter.numpy(), self.weights_dtype)))
        self._model = model.eval()
        return self._model
