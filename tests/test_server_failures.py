"""A failure inside the engine fails the requests in flight with an OpenAI error, and the server
goes on serving (the app in-process, its engine made to fail one step)."""

import json

import pytest
from fastapi.testclient import TestClient

from candelabra.core.engine.async_engine import AsyncEngine
from candelabra.core.server.app import build_app
from candelabra.core.server.metrics import ServerMetrics
from candelabra.core.server.serving import ServedModel
from live_server import write_chat_checkpoint

BODY = {"prompt": "w10 w11 w12", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app_and_runner(tmp_path_factory, tiny_llm):
    llm = tiny_llm(folder=write_chat_checkpoint(tmp_path_factory.mktemp("failing")))
    engine = AsyncEngine(llm.engine)
    served = ServedModel("tiny", engine, ServerMetrics(engine, "tiny"))
    yield build_app(served), llm.engine.runner
    engine.shutdown()


def fail_next_step(runner, monkeypatch):
    real = runner.execute

    def execute_once_failing(*args, **kwargs):
        monkeypatch.setattr(runner, "execute", real)
        raise RuntimeError("the device was lost")

    monkeypatch.setattr(runner, "execute", execute_once_failing)


def test_a_failed_step_is_a_500_and_the_next_request_is_served(app_and_runner, monkeypatch):
    app, runner = app_and_runner
    with TestClient(app) as client:
        fail_next_step(runner, monkeypatch)
        failed = client.post("/v1/completions", json=BODY)
        assert failed.status_code == 500
        assert "the device was lost" in failed.json()["error"]["message"]
        assert client.get("/health").status_code == 200
        served = client.post("/v1/completions", json=BODY)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 6


def test_a_failed_step_mid_stream_sends_an_error_event_then_done(app_and_runner, monkeypatch):
    app, runner = app_and_runner
    with TestClient(app) as client:
        fail_next_step(runner, monkeypatch)
        with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "the device was lost" in error["message"] and error["type"] == "internal_error"
        after = client.post("/v1/completions", json=BODY)
        assert after.status_code == 200
