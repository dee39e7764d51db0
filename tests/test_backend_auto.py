"""`--backend auto`: every installed backend ranked by the priority its probe gives, plugins included."""

import json
import logging

import pytest

from candelabra.core.cli import main
from candelabra.core.contract.backend import Probe
from candelabra.core.llm import choose_backend
from candelabra.plugins import Candidate, auto_choice, discover, ranked_backends
from support import make_distribution

PRIORITY_BACKEND = """
    from candelabra.backends.cpu import CpuBackend
    from candelabra.core.contract.backend import Probe
    from candelabra.plugins import hookimpl

    class {cls}(CpuBackend):
        name = "{name}"

        @classmethod
        def probe(cls):
            return Probe({available}, reason="{reason}", detail="{name} device", priority={priority})

    @hookimpl
    def register_backends(register):
        register({cls})
"""


def install(tmp_path, monkeypatch, name: str, priority: int, available: bool = True, reason: str = "",
            source: str | None = None) -> None:
    source = source or PRIORITY_BACKEND.format(cls=name.capitalize(), name=name, priority=priority,
                                               available=available, reason=reason)
    make_distribution(tmp_path / name, name, {f"{name}_plugin": source}, {name: f"{name}_plugin"})
    monkeypatch.syspath_prepend(str(tmp_path / name))


def auto_log(caplog) -> tuple[type, str]:
    with caplog.at_level(logging.INFO, logger="candelabra"):
        chosen = choose_backend("auto")
    return chosen, " ".join(r.getMessage() for r in caplog.records)


def test_a_plugin_of_higher_priority_is_chosen_and_an_unavailable_one_is_passed_over_with_its_reason(
        tmp_path, monkeypatch, caplog):
    install(tmp_path, monkeypatch, "fastnpu", priority=100)
    install(tmp_path, monkeypatch, "ghostnpu", priority=1000, available=False, reason="no ghost device found")

    chosen, message = auto_log(caplog)

    assert chosen.name == "fastnpu"
    assert "backend auto: chose fastnpu, priority 100, the highest available, on fastnpu device" in message
    assert "ghostnpu: not available, no ghost device found" in message
    assert "cpu: priority 10, on cpu (" in message


def test_equal_priorities_go_to_the_name_that_sorts_first(tmp_path, monkeypatch, caplog):
    install(tmp_path, monkeypatch, "zetanpu", priority=70)
    install(tmp_path, monkeypatch, "alphanpu", priority=70)

    chosen, message = auto_log(caplog)

    assert chosen.name == "alphanpu"
    assert "zetanpu: priority 70" in message
    assert [c.name for c in ranked_backends()][:3] == ["alphanpu", "zetanpu", "torch"]


def test_a_probe_that_raises_only_rules_itself_out(tmp_path, monkeypatch):
    source = """
        from candelabra.backends.cpu import CpuBackend
        from candelabra.plugins import hookimpl

        class Flaky(CpuBackend):
            name = "flaky"

            @classmethod
            def probe(cls):
                raise OSError("driver handshake failed")

        @hookimpl
        def register_backends(register):
            register(Flaky)
    """
    install(tmp_path, monkeypatch, "flaky", 0, source=source)

    flaky = next(c for c in ranked_backends() if c.name == "flaky")

    assert not flaky.probe.available
    assert flaky.probe.reason == "its probe raised OSError: driver handshake failed"
    assert choose_backend("auto").name == "torch"


def test_a_name_two_plugins_claim_is_never_chosen(tmp_path, monkeypatch):
    for vendor in ("vendor_a", "vendor_b"):
        source = PRIORITY_BACKEND.format(cls="Npu", name="npu", priority=500, available=True, reason="")
        make_distribution(tmp_path / vendor, vendor, {f"{vendor}_plugin": source}, {vendor: f"{vendor}_plugin"})
        monkeypatch.syspath_prepend(str(tmp_path / vendor))

    npu = next(c for c in ranked_backends() if c.name == "npu")

    assert npu.backend is None and npu.distribution == "vendor_a 1.0 and vendor_b 1.0"
    assert "is claimed by vendor_a 1.0" in npu.probe.reason
    assert choose_backend("auto").name == "torch"


def test_with_nothing_available_auto_says_why_for_each():
    with pytest.raises(RuntimeError, match="no backend is available: none is installed"):
        auto_choice(ranked_backends(discover(group="candelabra-test-no-such-group")))
    ghost = Candidate("ghost", "ghost 1.0", None, Probe(False, "ghostlib is not installed"))
    with pytest.raises(RuntimeError, match="no backend is available: ghost: ghostlib is not installed"):
        auto_choice([ghost])


def test_backends_command_shows_priorities_and_marks_what_auto_picks(tmp_path, monkeypatch, capsys):
    install(tmp_path, monkeypatch, "fastnpu", priority=100)
    install(tmp_path, monkeypatch, "ghostnpu", priority=1000, available=False, reason="no ghost device found")

    assert main(["backends", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["auto"] == "fastnpu"
    priorities = {b["name"]: (b["available"], b["priority"]) for b in listing["backends"]}
    assert priorities["fastnpu"] == (True, 100) and priorities["cpu"] == (True, 10)
    assert priorities["ghostnpu"] == (False, 1000)

    assert main(["backends"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    # distributions are two words: "fastnpu 1.0"
    assert rows["fastnpu"][3:6] == ["yes", "100", "picks"]
    assert rows["cpu"][3:5] == ["yes", "10"] and "picks" not in rows["cpu"]
    assert rows["ghostnpu"][3:5] == ["no", "-"]


def test_a_probe_says_what_it_runs_on_as_detail_and_still_takes_the_first_contracts_device_keyword():
    from candelabra.core.contract.backend import Probe

    assert Probe(True, detail="npu 0 (64 GiB)").detail == "npu 0 (64 GiB)"
    assert Probe(True, device="npu 0 (64 GiB)") == Probe(True, detail="npu 0 (64 GiB)")
    with pytest.raises(TypeError, match="not both"):
        Probe(True, detail="a", device="b")


def test_backend_auto_says_which_and_why(caplog):
    import logging

    from candelabra.core.llm import choose_backend

    with caplog.at_level(logging.INFO, logger="candelabra"):
        chosen = choose_backend("auto")
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"backend auto: chose {chosen.name}, priority {chosen.probe().priority}, the highest available" in message
    assert "chose gcu" not in message  # no GCU here, and its CPU stand-in only when asked for
    if chosen.name == "torch":  # the fast CPU path, over the numpy reference
        assert "passed over: cpu: priority 10, on cpu (" in message
    if chosen.name == "cpu":  # MLX's CPU build here: passed over for its lower priority, saying why it is lower
        assert "passed over: metal: priority 5, on cpu (MLX" in message and "slower than the numpy backend" in message
