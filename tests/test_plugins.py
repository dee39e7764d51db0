"""Plugin discovery through entry points: broken plugins, conflicts, and every registration hook."""

import json

import pytest

from candelabra.core.cli import main
from candelabra.plugins import RegistryError, backend_class, discover
from support import make_distribution

GOOD_BACKEND = """
    from candelabra.backends.cpu import CpuBackend
    from candelabra.plugins import hookimpl

    class {cls}(CpuBackend):
        name = "{name}"

    @hookimpl
    def register_backends(register):
        register({cls})
"""


@pytest.mark.parametrize("name", ["cpu", "metal"])
def test_in_tree_backends_register_through_their_entry_points(name):
    registration = discover().backends.lookup(name)
    assert registration.source.plugin == name
    assert registration.source.distribution.startswith("candelabra ")


def test_plugin_that_fails_to_import_is_listed_broken_and_others_load(tmp_path, monkeypatch):
    make_distribution(tmp_path, "exploding", {"exploding_plugin": "raise RuntimeError('no driver found')"},
                      {"exploding": "exploding_plugin"})
    make_distribution(tmp_path / "b", "fine", {"fine_plugin": GOOD_BACKEND.format(cls="Fine", name="fine")},
                      {"fine": "fine_plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))

    plugins = discover()

    assert [(b.source.plugin, b.source.distribution, b.stage) for b in plugins.broken] == [
        ("exploding", "exploding 1.0", "import")]
    assert "RuntimeError: no driver found" in plugins.broken[0].error
    assert {"cpu", "fine"} <= set(plugins.backends.names())


def test_plugin_raising_inside_its_hook_is_broken_without_partial_registrations(tmp_path, monkeypatch):
    source = """
        from candelabra.backends.cpu import CpuBackend
        from candelabra.plugins import hookimpl

        class Half(CpuBackend):
            name = "half"

        @hookimpl
        def register_backends(register):
            register(Half)
            raise ValueError("second backend misconfigured")
    """
    make_distribution(tmp_path, "halfway", {"halfway_plugin": source}, {"halfway": "halfway_plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))

    plugins = discover()

    assert [(b.source.plugin, b.stage) for b in plugins.broken] == [("halfway", "register_backends")]
    assert "half" not in plugins.backends


def test_registering_something_that_is_not_a_backend_is_reported(tmp_path, monkeypatch):
    source = """
        from candelabra.plugins import hookimpl

        @hookimpl
        def register_backends(register):
            register(object)
    """
    make_distribution(tmp_path, "confused", {"confused_plugin": source}, {"confused": "confused_plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))

    (broken,) = discover().broken
    assert "not a Backend subclass" in broken.error


def test_two_plugins_claiming_one_backend_name_is_a_clear_error(tmp_path, monkeypatch, capsys):
    for dist in ("vendor_a", "vendor_b"):
        make_distribution(tmp_path / dist, dist, {f"{dist}_plugin": GOOD_BACKEND.format(cls="Npu", name="npu")},
                          {dist: f"{dist}_plugin"})
        monkeypatch.syspath_prepend(str(tmp_path / dist))

    plugins = discover()
    with pytest.raises(RegistryError, match=r"'npu' is claimed by vendor_a 1.0 .* and vendor_b 1.0"):
        plugins.backends.get("npu")
    assert plugins.backends.get("cpu").name == "cpu"  # other names are unaffected

    assert main(["backends"]) == 1
    assert "backend name 'npu' is claimed by vendor_a 1.0 and vendor_b 1.0" in capsys.readouterr().err


def test_model_architecture_and_quantization_format_hooks(tmp_path, monkeypatch):
    source = """
        from candelabra.plugins import hookimpl

        class TinyModel:
            pass

        @hookimpl
        def register_model_architectures(register):
            register("TinyForCausalLM", TinyModel)

        @hookimpl
        def register_quantization_formats(register):
            register("q3_tiny", {"block": 32})
    """
    make_distribution(tmp_path, "extras", {"extras_plugin": source}, {"extras": "extras_plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))

    plugins = discover()

    assert plugins.model_architectures.get("TinyForCausalLM").__name__ == "TinyModel"
    assert plugins.quantization_formats.lookup("q3_tiny").source.distribution == "extras 1.0"
    with pytest.raises(RegistryError, match="no model architecture named 'Missing'"):
        plugins.model_architectures.get("Missing")


def test_unknown_backend_name_lists_the_installed_ones():
    installed = r"\(installed: cpu, cuda, gcu, metal, torch\)"
    with pytest.raises(RegistryError, match=r"no backend named 'tpu' is installed " + installed):
        backend_class("tpu")


def test_backend_by_import_path():
    assert backend_class("candelabra.backends.cpu:CpuBackend").name == "cpu"
    with pytest.raises(RegistryError, match="cannot load backend"):
        backend_class("candelabra.backends.cpu:Nothing")
    with pytest.raises(RegistryError, match="not a Backend subclass"):
        backend_class("candelabra.core.contract.ops:Ops")


def test_backends_command_lists_cpu_as_available(capsys):
    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["backend", "distribution", "available", "priority", "auto", "device", "/", "why",
                                "not"]
    cpu = next(line for line in lines if line.startswith("cpu "))
    assert "candelabra 0.1.0" in cpu and " yes " in cpu and " 10 " in cpu


def test_backends_command_shows_unavailable_backends_with_their_reason(tmp_path, monkeypatch, capsys):
    source = """
        from candelabra.core.contract.backend import Backend, Probe
        from candelabra.plugins import hookimpl

        class Ghost(Backend):
            name = "ghost"

            @classmethod
            def probe(cls):
                return Probe(False, "ghostlib is not installed")

        @hookimpl
        def register_backends(register):
            register(Ghost)
    """
    make_distribution(tmp_path, "ghost", {"ghost_plugin": source}, {"ghost": "ghost_plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))

    assert main(["backends", "--json"]) == 0
    listed = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    assert listed["ghost"] == {"name": "ghost", "distribution": "ghost 1.0", "available": False, "priority": 0,
                               "detail": "ghostlib is not installed"}
    assert listed["cpu"]["available"] is True
