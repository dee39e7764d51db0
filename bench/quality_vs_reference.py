"""How far a served fast path's next-token distributions are from the float32 reference, and llama.cpp's.

    python bench/quality_vs_reference.py [--model PATH] [--backend torch] [--dtype DTYPE] [--window 512]
                                         [--rows-per-step N] [--max-tokens N] [--text FILE]
                                         [--llama-server URL] [--top-n 64] [--json FILE]

A fixed text (bench/texts/quality.txt: prose, a dialogue, a list, Python, shell, JSON, numbers) is
tokenized with the model's tokenizer and cut into windows of --window tokens, each read from its own
start: full context within a window, none across. The next-token distribution at every position of
every window comes from
  reference   candelabra's `cpu` backend: numpy in float32 on the weights dequantized, equal to
              transformers
  tested      --backend (default torch) in --dtype (default: the backend's first, as `candelabra serve`
              picks), its weights kept as serve keeps them (quantized where the backend keeps them)
  llama.cpp   with --llama-server URL: a running llama-server on the same GGUF (a slot's context longer
              than --window: `-np 1 -c 4096` for 512), asked for each position
              in turn (/completion, the window's token ids up to it as the prompt, n_predict 1, n_probs
              --top-n); its prompt cache holds the earlier tokens, so each answer is one decode step
The reference computes a window in one prefill step, the logits of every position at once. The tested
path does too unless --rows-per-step N cuts the window into steps of N rows, each reading the earlier
positions from the KV cache: at 1 every position is a decode step of one request, which is what a
served answer runs (and what llama.cpp's numbers measure), through the kernels chosen for that band.

Columns: positions scored; the mean and 99th percentile of KL(reference || tested) in nats, from
log-softmax in float64; top-1 agreement, the share of positions where both put the same token first.
llama-server gives only the top --top-n probabilities of a position, so llama.cpp's KL is over those
tokens plus one bucket for the rest of the mass on each side ("top N + rest"), a lower bound of the
full KL. With --llama-server the tested backend gets a second row computed the same way from its own
top --top-n, to compare like with like.

On 2 cores a window of 512 tokens takes each candelabra path tens of seconds, and llama-server a few
minutes (one request per position); --max-tokens 512 scores one window.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import httpx
import numpy as np

from candelabra.backends.torch.cpu.features import cpu_flags
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.llm import choose_backend, open_model
from candelabra.core.loading.model import load_model
from candelabra.core.text_table import format_table
from candelabra.core.worker.model_runner import ModelRunner

DEFAULT_TEXT = Path(__file__).parent / "texts" / "quality.txt"
BLOCK_SIZE = 16
HEADERS = ("path", "KL over", "positions", "mean KL (nats)", "p99 KL (nats)", "top-1 agreement")
# llama.cpp's float32 probabilities of a peaked row can sum past 1, leaving its "rest" bucket at 0
# while the reference's is not; the bucket is read as at least this much.
REST_FLOOR = 1e-12
LLAMA_TIMEOUT_SECONDS = 120.0


# The measures, on float64 log-probabilities [positions, vocabulary].

def cut_windows(token_ids: Sequence[int], window: int) -> list[np.ndarray]:
    """Consecutive windows of `window` tokens; the last is shorter where the text runs out."""
    if window < 1:
        raise ValueError(f"a window holds at least 1 token, not {window}")
    ids = np.asarray(token_ids, dtype=np.int64)
    return [ids[start:start + window] for start in range(0, len(ids), window)]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's log-probabilities, in float64."""
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_divergence(reference: np.ndarray, tested: np.ndarray) -> np.ndarray:
    """KL(reference || tested) of each row, in nats, from log-probabilities over the whole vocabulary."""
    return np.sum(np.exp(reference) * (reference - tested), axis=-1)


def top_n(logprobs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The `n` most likely tokens of each row, most likely first, and their log-probabilities."""
    ids = np.argpartition(-logprobs, n - 1, axis=-1)[:, :n]
    values = np.take_along_axis(logprobs, ids, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, axis=-1), np.take_along_axis(values, order, axis=-1)


def lumped_kl(reference: np.ndarray, tested_ids: np.ndarray, tested_logprobs: np.ndarray) -> np.ndarray:
    """KL(reference || tested) of each row over the tested side's top tokens `tested_ids` [rows, n], with
    log-probabilities `tested_logprobs`, plus one bucket holding every other token on each side."""
    reference_top = np.exp(np.take_along_axis(reference, tested_ids, axis=-1))
    tested_top = np.exp(np.asarray(tested_logprobs, dtype=np.float64))
    p = np.concatenate([reference_top, _rest(reference_top, 0.0)], axis=-1)
    q = np.concatenate([tested_top, _rest(tested_top, REST_FLOOR)], axis=-1)
    terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - np.log(q)), 0.0)
    return terms.sum(axis=-1)


def _rest(top_probabilities: np.ndarray, floor: float) -> np.ndarray:
    return np.maximum(1.0 - top_probabilities.sum(axis=-1, keepdims=True), floor)


def top1_agreement(reference: np.ndarray, tested_first: np.ndarray) -> np.ndarray:
    """Whether each row's most likely reference token is the tested side's first token."""
    return np.argmax(reference, axis=-1) == np.asarray(tested_first)


@dataclass
class PathScores:
    """One tested path's KL and top-1 agreement at every position scored, window by window."""

    label: str
    kl_over: str  # "full vocabulary", or "top N + rest"
    kl: list[np.ndarray] = field(default_factory=list)
    agreement: list[np.ndarray] = field(default_factory=list)

    def add_window(self, kl: np.ndarray, agreement: np.ndarray) -> None:
        self.kl.append(kl)
        self.agreement.append(agreement)

    def summary(self) -> dict:
        kl, agreement = np.concatenate(self.kl), np.concatenate(self.agreement)
        return {"path": self.label, "kl_over": self.kl_over, "positions": int(kl.size),
                "mean_kl": float(kl.mean()), "p99_kl": float(np.percentile(kl, 99)),
                "top1_agreement": float(agreement.mean()),
                "windows": [{"positions": int(k.size), "mean_kl": float(k.mean()), "top1_agreement": float(a.mean())}
                            for k, a in zip(self.kl, self.agreement)]}


def table_row(summary: dict) -> list[str]:
    return [summary["path"], summary["kl_over"], str(summary["positions"]), f"{summary['mean_kl']:.3g}",
            f"{summary['p99_kl']:.3g}", f"{100 * summary['top1_agreement']:.2f}%"]


# Where the distributions come from.

class CandelabraScorer:
    """A model on one backend, giving the log-probabilities of every position of a window in one step."""

    def __init__(self, checkpoint, backend_name: str, dtype: str | None, window: int,
                 rows_per_step: int | None = None) -> None:
        self.backend = choose_backend(backend_name)()
        self.model = load_model(checkpoint, self.backend, dtype)
        self.runner = ModelRunner(self.model, num_blocks=-(-window // BLOCK_SIZE), block_size=BLOCK_SIZE)
        self.rows_per_step = rows_per_step or window

    @property
    def label(self) -> str:
        return f"candelabra {self.backend.name} {self.model.dtype}"

    def logprobs(self, window_ids: np.ndarray) -> np.ndarray:
        """Every position's log-probabilities, in steps of `rows_per_step` positions over one sequence."""
        blocks = list(range(-(-len(window_ids) // BLOCK_SIZE)))
        steps = []
        for start in range(0, len(window_ids), self.rows_per_step):
            rows = window_ids[start:start + self.rows_per_step]
            end = start + len(rows)
            step = StepMetadata.build([len(rows)], [end], [blocks[:-(-end // BLOCK_SIZE)]], BLOCK_SIZE,
                                      logits_rows=np.arange(len(rows)))
            steps.append(log_softmax(self.backend.to_host(self.runner.logits(rows, step))))
        return np.concatenate(steps)


class LlamaServerScorer:
    """A running llama-server, asked for the top `n` tokens after every prefix of a window."""

    def __init__(self, url: str, n: int) -> None:
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=LLAMA_TIMEOUT_SECONDS)
        self.n = n

    def describe(self) -> dict:
        props = self.client.get("/props").json()
        return {"url": str(self.client.base_url), "model_path": props.get("model_path"),
                "build_info": props.get("build_info")}

    def top_logprobs(self, window_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The top tokens [positions, n] and their log-probabilities, one request per position."""
        answers = [self._next_token_top(window_ids[:end]) for end in range(1, len(window_ids) + 1)]
        return (np.array([[entry["id"] for entry in top] for top in answers], dtype=np.int64),
                np.array([[entry["logprob"] for entry in top] for top in answers], dtype=np.float64))

    def _next_token_top(self, prompt: np.ndarray) -> list[dict]:
        body = {"prompt": prompt.tolist(), "n_predict": 1, "n_probs": self.n, "temperature": 0.0,
                "cache_prompt": True, "post_sampling_probs": False}
        response = self.client.post("/completion", json=body)
        if response.status_code == 400:
            raise RuntimeError(f"llama-server refused a prompt of {len(prompt)} tokens: {response.text[:300]} "
                               "(start it with one slot whose context holds a window: -np 1 -c 4096)")
        response.raise_for_status()
        top = response.json()["completion_probabilities"][0]["top_logprobs"]
        if len(top) < self.n:
            raise RuntimeError(f"llama-server gave {len(top)} probabilities, not the {self.n} asked for")
        return top[:self.n]


# The run.

def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", metavar="PATH",
                        help="a .gguf file or a checkpoint folder (default: the default model)")
    parser.add_argument("--backend", default="torch", help="the tested backend (default: %(default)s)")
    parser.add_argument("--dtype", help="the tested backend's compute dtype (default: its first, as serve picks)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text to score (default: %(default)s)")
    parser.add_argument("--window", type=int, default=512, help="tokens per window (default: %(default)s)")
    parser.add_argument("--rows-per-step", type=int, metavar="N",
                        help="run the tested path N positions per step (1: as serve decodes; default: the window)")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="score only the text's first N tokens")
    parser.add_argument("--llama-server", metavar="URL", help="a running llama-server on the same model to score too")
    parser.add_argument("--top-n", type=int, default=64,
                        help="probabilities asked of llama-server per position (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write every number as JSON")
    args = parser.parse_args()
    for option in ("window", "rows_per_step", "max_tokens", "top_n"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    return args


def cpu_name() -> str:
    """lscpu's model name, else /proc/cpuinfo's, else what Python knows."""
    try:
        listing = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        listing = ""
    for line in listing.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            return value.strip()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return platform.processor() or platform.machine()
    names = [line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    return names[0] if names else platform.machine()


def torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def machine_description(model_path: Path) -> dict:
    return {"cpu": cpu_name(), "amx": "amx_tile" in cpu_flags(), "torch": torch_version(), "model": str(model_path)}


def main() -> None:
    args = parse_arguments()
    llama = LlamaServerScorer(args.llama_server, args.top_n) if args.llama_server else None
    with open_model(args.model) as checkpoint:
        started = time.perf_counter()
        reference = CandelabraScorer(checkpoint, "cpu", "float32", args.window)
        tested = CandelabraScorer(checkpoint, args.backend, args.dtype, args.window, args.rows_per_step)
        checkpoint.release_pages()
        tokenizer = _tokenizer(checkpoint, reference.model)
        token_ids = tokenizer.encode(args.text.read_text(encoding="utf-8"))[:args.max_tokens]
        windows = cut_windows(token_ids, args.window)
        print(f"loaded in {time.perf_counter() - started:.0f} s; {len(token_ids)} tokens of {args.text.name} "
              f"in {len(windows)} windows of up to {args.window}", flush=True)
        scores = _score(windows, reference, tested, llama, args.top_n)

    machine = machine_description(checkpoint.path)
    summaries = [path.summary() for path in scores]
    print(f"CPU {machine['cpu']}, AMX {'yes' if machine['amx'] else 'no'}; torch {machine['torch']}; "
          f"model {machine['model']}")
    steps = f"{args.rows_per_step} positions per step" if args.rows_per_step else "one step per window"
    print(f"reference: candelabra cpu float32; {len(token_ids)} tokens, windows of {args.window}; "
          f"tested path in {steps}")
    print(format_table(HEADERS, [table_row(summary) for summary in summaries]))
    if llama is not None:
        print(f"top {args.top_n} + rest: KL over llama-server's top {args.top_n} tokens (the tested path's own, for "
              "candelabra) and one bucket for the rest of the mass on each side, a lower bound of the full KL")
    if args.json:
        record = {"machine": machine, "text": str(args.text), "tokens": len(token_ids), "window": args.window,
                  "rows_per_step": args.rows_per_step or args.window,
                  "reference": reference.label, "llama_server": llama.describe() if llama else None,
                  "paths": summaries}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _tokenizer(checkpoint, model):
    from candelabra.core.engine.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(checkpoint, model.config.eos_token_ids)


def _score(windows: list[np.ndarray], reference: CandelabraScorer, tested: CandelabraScorer,
           llama: LlamaServerScorer | None, n: int) -> list[PathScores]:
    """Every path's scores, window by window: only one window's distributions are held at a time."""
    full = PathScores(tested.label, "full vocabulary")
    tested_top = PathScores(tested.label, f"top {n} + rest")
    llama_top = PathScores("llama.cpp", f"top {n} + rest")
    for number, window_ids in enumerate(windows, 1):
        started = time.perf_counter()
        expected, observed = reference.logprobs(window_ids), tested.logprobs(window_ids)
        full.add_window(kl_divergence(expected, observed), top1_agreement(expected, observed.argmax(axis=-1)))
        if llama is not None:
            ids, logprobs = top_n(observed, n)
            tested_top.add_window(lumped_kl(expected, ids, logprobs), top1_agreement(expected, ids[:, 0]))
            ids, logprobs = llama.top_logprobs(window_ids)
            llama_top.add_window(lumped_kl(expected, ids, logprobs), top1_agreement(expected, ids[:, 0]))
        print(f"window {number}/{len(windows)}: {len(window_ids)} positions in {time.perf_counter() - started:.0f} s",
              flush=True)
    return [full, tested_top, llama_top] if llama is not None else [full]


if __name__ == "__main__":
    main()
