"""What structured output costs: output tokens per second with and without a constraint, on one
backend, measured in the same run.

    python bench/structured_output.py [--backend torch] [--model PATH] [--concurrency 1 16]
                                      [--output-tokens 64]

Every request is the same chat prompt, greedy, exactly --output-tokens tokens (the constraints
are chosen never to complete sooner): no constraint; a regex that allows most of the vocabulary
(`[a-z ,.]+`: the mask is large to fill); a JSON schema of a long array of strings (the mask
follows JSON's structure). The ratio is each row's throughput over the unconstrained one's at
the same concurrency.
"""

from __future__ import annotations

import argparse
import time

from candelabra.core.llm import LLM
from candelabra.core.requests.sampling_params import SamplingParams, StructuredOutput
from candelabra.core.text_table import format_table

CONSTRAINTS = {
    "none": None,
    "regex [a-z ,.]+": StructuredOutput(regex=r"[a-z ,.]+"),
    "json schema": StructuredOutput(json_schema={
        "type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}}},
        "required": ["words"]}),
}
ASK = [{"role": "user", "content": "List as many English words as you can, as JSON."}]


def throughput(llm: LLM, prompt: list[int], concurrency: int, output_tokens: int, spec) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True,
                            structured_output=spec)
    for i in range(concurrency):
        engine.add_request(f"bench-{id(spec)}-{concurrency}-{i}", prompt, params)
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.delta_token_ids) for r in engine.step() for o in r.outputs)
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(args.model, backend=args.backend)
    prompt = llm.engine.tokenizer.chat_token_ids(ASK)
    llm.engine.grammars.warm_up()
    throughput(llm, prompt, 1, 4, None)  # warm-up
    rows = []
    for concurrency in args.concurrency:
        base = None
        for name, spec in CONSTRAINTS.items():
            rate = throughput(llm, prompt, concurrency, args.output_tokens, spec)
            base = base or rate
            rows.append([concurrency, name, f"{rate:.1f}", f"{rate / base:.2f}"])
    print(f"backend {args.backend}, {args.output_tokens} output tokens a request, greedy")
    print(format_table(["concurrency", "constraint", "output tok/s", "vs none"], rows))


if __name__ == "__main__":
    main()
