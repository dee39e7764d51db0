"""The one error after which an engine cannot go on."""


class EngineFailure(RuntimeError):
    """The engine cannot take another step (a tensor-parallel rank is gone, so the ranks are out of
    step): every request in flight fails with it, and the engine stops."""
