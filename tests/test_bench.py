"""`candelabra bench`: its statistics, prompts and arrivals, and a run against a live server."""

import argparse
import json
import math
import re
import socket

import numpy as np
import pytest

from candelabra.core.clients import bench
from candelabra.core.clients.bench import RequestResult
from support import run_candelabra


def bench_args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("size", [1, 2, 3, 10, 101, 1000])
def test_percentiles_and_mean_match_numpy(size):
    rng = np.random.default_rng(size)
    values = list(rng.lognormal(size=size))
    for q in [0, 1, 25, 50, 90, 99, 100, *rng.uniform(0, 100, 5)]:
        assert bench.percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    stats = bench.distribution(values)
    assert stats["mean"] == pytest.approx(np.mean(values), rel=1e-12)
    assert stats["median"] == pytest.approx(np.median(values), rel=1e-12)
    assert (stats["p90"], stats["p99"]) == pytest.approx(tuple(np.percentile(values, [90, 99])), rel=1e-12)


def test_no_values_have_no_statistics():
    assert bench.distribution([]) == {"mean": None, "median": None, "p90": None, "p99": None}
    with pytest.raises(ValueError):
        bench.percentile([], 50)


def random_results(rng, count):
    results = []
    for _ in range(count):
        tokens = int(rng.integers(1, 20))
        gaps = list(rng.uniform(0.001, 0.05, size=max(tokens - 1, 0)))
        ttft = float(rng.uniform(0.01, 0.5))
        results.append(RequestResult(ok=True, ttft=ttft, latency=ttft + sum(gaps), chunk_gaps=gaps,
                                     prompt_tokens=int(rng.integers(1, 100)), completion_tokens=tokens))
    return results


def test_summary_aggregates_successful_requests_and_groups_errors():
    rng = np.random.default_rng(0)
    done = random_results(rng, 50)
    refused = [RequestResult(error="HTTP 503: busy") for _ in range(7)] + [RequestResult(error="HTTP 400: too long")]
    summary = bench.summarize(done + refused, duration=4.0)

    assert (summary["successful_requests"], summary["failed_requests"]) == (50, 8)
    assert summary["errors"] == [{"message": "HTTP 503: busy", "count": 7},
                                 {"message": "HTTP 400: too long", "count": 1}]
    prompt, completion = sum(r.prompt_tokens for r in done), sum(r.completion_tokens for r in done)
    assert (summary["total_prompt_tokens"], summary["total_completion_tokens"]) == (prompt, completion)
    assert summary["request_throughput"] == pytest.approx(50 / 4)
    assert summary["output_token_throughput"] == pytest.approx(completion / 4)
    assert summary["total_token_throughput"] == pytest.approx((prompt + completion) / 4)

    def expected(values):
        values = 1000 * np.array(values)
        return pytest.approx([values.mean(), np.median(values), *np.percentile(values, [90, 99])], rel=1e-9)

    def measured(key):
        return [summary[key][s] for s in ("mean", "median", "p90", "p99")]

    assert measured("ttft_ms") == expected([r.ttft for r in done])
    assert measured("e2e_latency_ms") == expected([r.latency for r in done])
    assert measured("itl_ms") == expected([gap for r in done for gap in r.chunk_gaps])
    # TPOT spreads the time after the first token over the tokens after it, whatever the chunking.
    assert measured("tpot_ms") == expected([(r.latency - r.ttft) / (r.completion_tokens - 1)
                                            for r in done if r.completion_tokens > 1])


def test_tpot_counts_tokens_not_chunks():
    # Three chunks carrying nine tokens: TPOT uses the token count, ITL the raw chunk gaps.
    result = RequestResult(ok=True, ttft=0.2, latency=1.0, chunk_gaps=[0.3, 0.5], completion_tokens=9)
    assert result.tpot == pytest.approx(0.1)
    assert RequestResult(ok=True, ttft=0.2, latency=0.2, completion_tokens=1).tpot is None
    assert RequestResult(error="refused").tpot is None


def test_report_shows_every_measure_and_the_errors():
    summary = bench.summarize(random_results(np.random.default_rng(1), 3) + [RequestResult(error="boom")], 2.0)
    report = bench.format_report(summary)
    for label in ("successful requests", "failed requests", "wall time (s)", "request throughput (req/s)",
                  "output throughput (tok/s)", "total throughput (tok/s)", "TTFT", "TPOT", "ITL", "E2E"):
        assert label in report
    assert "error (1 requests): boom" in report
    nothing = bench.format_report(bench.summarize([RequestResult(error="down")], 0.5))
    ttft_row = next(line for line in nothing.splitlines() if line.startswith("TTFT"))
    assert ttft_row.split() == ["TTFT", "-", "-", "-", "-"]


@pytest.mark.parametrize("words", [1, 8, 64, 500])
def test_prompts_have_the_asked_number_of_common_words(words):
    prompts = bench.make_prompts(10, words, seed=3)
    assert len(prompts) == 10 and len(set(prompts)) == 10
    for prompt in prompts:
        assert len(prompt.split()) == words and set(prompt.split()) <= set(bench.COMMON_WORDS)
    assert bench.make_prompts(10, words, seed=3) == prompts
    assert bench.make_prompts(10, words, seed=4) != prompts


def test_arrivals_are_a_seeded_poisson_process():
    assert bench.arrival_times(5, math.inf, seed=0) == [0.0] * 5
    times = bench.arrival_times(20000, 50.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: standard deviation equals the mean
    assert bench.arrival_times(100, 50.0, seed=1) == times[:100]
    assert bench.arrival_times(100, 50.0, seed=2) != times[:100]


def test_request_bodies_ask_for_exactly_the_output_length():
    completion = bench.request_body("completions", "m", "the sea", 16)
    assert completion["prompt"] == "the sea" and "messages" not in completion
    chat = bench.request_body("chat", "m", "the sea", 16)
    assert chat["messages"] == [{"role": "user", "content": "the sea"}] and "prompt" not in chat
    for body in (completion, chat):
        assert body["max_tokens"] == 16 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"


def test_flags_and_their_defaults():
    args = bench_args()
    assert (args.endpoint, args.num_prompts, args.concurrency, args.request_rate) == ("completions", 32, 16, math.inf)
    assert (args.input_len, args.output_len, args.warmup, args.json) == (64, 64, 1, None)
    assert args.url == "http://127.0.0.1:2000" and args.progress is True
    assert bench_args("--no-progress").progress is False
    assert bench_args("--request-rate", "2.5", "--endpoint", "chat").request_rate == 2.5
    for bad in (["--concurrency", "0"], ["--request-rate", "-1"], ["--warmup", "-1"], ["--endpoint", "x"]):
        with pytest.raises(SystemExit):
            bench_args(*bad)



NO_SERVER_HINT = "is a server running there? start one with `candelabra serve`, or pass --url"


def unused_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def table_value(report, label):
    return next(line[len(label):].strip() for line in report.splitlines() if line.startswith(label))


def finished_bar(err, total):
    """Whether stderr holds tqdm's bar of the measured requests, complete at `total` of `total`."""
    return re.search(rf"benchmarking: 100%\|.*\| {total}/{total} \[", err) is not None


def test_bench_measures_every_request_on_a_live_server(live_server, tmp_path, capsys):
    results = tmp_path / "bench.json"
    code = bench.run(bench_args("--url", live_server.url, "--num-prompts", "8", "--concurrency", "4",
                                "--input-len", "8", "--output-len", "8", "--json", str(results)))
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert (table_value(out, "successful requests"), table_value(out, "failed requests")) == ("8", "0")
    assert table_value(out, "completion tokens") == "64"
    assert all(float(cell) > 0 for cell in table_value(out, "TTFT").split())

    report = json.loads(results.read_text())
    summary = report["summary"]
    assert (summary["successful_requests"], summary["failed_requests"], summary["errors"]) == (8, 0, [])
    assert (summary["total_prompt_tokens"], summary["total_completion_tokens"]) == (64, 64)
    assert report["config"]["model"] == live_server.model and report["config"]["request_rate"] is None
    assert len(report["requests"]) == 8
    for request in report["requests"]:
        assert request["ok"] and (request["prompt_tokens"], request["completion_tokens"]) == (8, 8)
        assert 0 < request["ttft"] < request["latency"] <= summary["duration_s"]
        assert len(request["chunk_gaps"]) <= 7
        assert request["tpot"] == pytest.approx((request["latency"] - request["ttft"]) / 7)
    assert summary["output_token_throughput"] == pytest.approx(64 / summary["duration_s"])


def test_progress_goes_to_stderr_and_stdout_holds_only_the_report(live_server, tmp_path, capsys):
    results = tmp_path / "bench.json"
    args = ("--url", live_server.url, "--num-prompts", "5", "--input-len", "4", "--output-len", "4", "--warmup", "2",
            "--json", str(results))
    assert bench.run(bench_args(*args)) == 0
    out, err = capsys.readouterr()
    assert out == bench.format_report(json.loads(results.read_text())["summary"]) + "\n"
    assert "Warming up with 2 request(s)." in err.splitlines() and finished_bar(err, 5)
    assert "failed=" not in err

    assert bench.run(bench_args(*args, "--no-progress")) == 0
    out, err = capsys.readouterr()
    assert out == bench.format_report(json.loads(results.read_text())["summary"]) + "\n"
    assert err.startswith("Benchmarking ") and err.splitlines()[1:] == ["Warming up with 2 request(s)."]


def test_bench_paces_requests_on_the_chat_endpoint(live_server, tmp_path, capsys):
    results = tmp_path / "bench.json"
    code = bench.run(bench_args("--url", live_server.url + "/v1/", "--endpoint", "chat", "--num-prompts", "6",
                                "--request-rate", "20", "--input-len", "4", "--output-len", "5", "--warmup", "0",
                                "--seed", "3", "--json", str(results)))
    out, err = capsys.readouterr()
    assert code == 0, out + err
    summary = json.loads(results.read_text())["summary"]
    assert (summary["successful_requests"], summary["total_completion_tokens"]) == (6, 30)
    assert finished_bar(err, 6) and "Warming up" not in err
    last_arrival = bench.arrival_times(6, 20, seed=3)[-1]
    assert last_arrival > 0.1 and summary["duration_s"] >= last_arrival


def test_bench_reports_requests_the_server_refuses(live_server, tmp_path, capsys):
    results = tmp_path / "bench.json"
    args = ("--url", live_server.url, "--model", "no-such-model", "--num-prompts", "3", "--input-len", "4",
            "--output-len", "4")
    assert bench.run(bench_args(*args, "--warmup", "0", "--json", str(results))) == 1
    out, err = capsys.readouterr()
    assert finished_bar(err, 3) and "failed=3" in err  # failed requests are finished too
    summary = json.loads(results.read_text())["summary"]
    assert (summary["successful_requests"], summary["failed_requests"]) == (0, 3)
    [error] = summary["errors"]
    assert error["count"] == 3 and "answered HTTP 400" in error["message"] and "no-such-model" in error["message"]
    assert f"error (3 requests): {error['message']}" in out

    assert bench.run(bench_args(*args)) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].startswith("error: the warmup request failed: ")


def test_bench_without_a_server_fails_in_one_line(tmp_path, capsys):
    url = unused_url()
    assert bench.run(bench_args("--url", url)) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"error: cannot connect to {url}: ")
    assert err.endswith(f" ({NO_SERVER_HINT})\n")

    results = tmp_path / "bench.json"
    assert bench.run(bench_args("--url", url, "--model", "m", "--warmup", "0", "--num-prompts", "3",
                                "--json", str(results))) == 1
    summary = json.loads(results.read_text())["summary"]
    assert (summary["successful_requests"], summary["failed_requests"]) == (0, 3)
    assert summary["errors"][0]["count"] == 3 and summary["errors"][0]["message"].startswith("cannot connect to ")


def test_the_bench_command_runs_as_a_user_would(live_server, tmp_path):
    results = tmp_path / "bench.json"
    done = run_candelabra("bench", "--url", live_server.url, "--num-prompts", "4", "--input-len", "4",
                          "--output-len", "4", "--endpoint", "chat", "--json", str(results))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == bench.format_report(json.loads(results.read_text())["summary"]) + "\n"
    assert table_value(done.stdout, "successful requests") == "4"
    assert table_value(done.stdout, "completion tokens") == "16"
    assert f"Benchmarking {live_server.model} at {live_server.url}/v1/chat/completions" in done.stderr
    assert "Warming up with 1 request(s)." in done.stderr.splitlines() and finished_bar(done.stderr, 4)


def test_the_bench_command_without_a_server_says_to_start_one():
    url = unused_url()
    done = run_candelabra("bench", "--url", url)
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: cannot connect to {url}: ") and "Connection refused" in line
    assert line.endswith(f" ({NO_SERVER_HINT})")
