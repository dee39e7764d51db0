"""`SamplingParams` where README's offline example imports it from; it lives in core/requests."""

from candelabra.core.requests.sampling_params import SamplingParams, StructuredOutput

__all__ = ["SamplingParams", "StructuredOutput"]
