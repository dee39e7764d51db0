"""The accelerator template: the gcu backend on its CPU stand-in, vendor kernel overrides and their
fall-backs, and probe reasons."""

from __future__ import annotations

import json
import logging
import sys
import types

import numpy as np
import pytest
import torch

from candelabra.backends.gcu import GcuBackend
from candelabra.backends.torch.accelerator import (
    STAND_IN_VARIABLE,
    AcceleratorBackend,
    KernelLookupError,
    VendorKernel,
    resolve,
)
from support import run_candelabra


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv(STAND_IN_VARIABLE, "gcu")


def test_without_torch_gcu_the_probe_says_so_and_how_to_stand_in(monkeypatch):
    monkeypatch.delenv(STAND_IN_VARIABLE, raising=False)
    probe = GcuBackend.probe()
    assert not probe.available
    assert probe.reason.startswith("torch_gcu is not installed")
    assert f"{STAND_IN_VARIABLE}=gcu" in probe.reason
    assert GcuBackend.dtypes == ("bfloat16", "float16", "float32")


def fake_extension(monkeypatch, name: str, devices: int) -> None:
    """A module `name` registering device type "fakedev" with `devices` devices."""
    extension = types.ModuleType(name)
    extension.fakedev = types.SimpleNamespace(device_count=lambda: devices)
    monkeypatch.setitem(sys.modules, name, extension)


class FakeDevice(AcceleratorBackend):
    name = "fakedev"
    device_type = "fakedev"
    extension = "fake_torch_extension"
    visible_devices_variable = "FAKEDEV_VISIBLE_DEVICES"


def test_with_the_extension_but_no_device_the_probe_names_the_variable_it_read(monkeypatch):
    monkeypatch.delenv(STAND_IN_VARIABLE, raising=False)
    fake_extension(monkeypatch, "fake_torch_extension", devices=0)
    monkeypatch.setenv("FAKEDEV_VISIBLE_DEVICES", "")
    assert FakeDevice.probe().reason == "no FAKEDEV device visible (FAKEDEV_VISIBLE_DEVICES='')"
    monkeypatch.delenv("FAKEDEV_VISIBLE_DEVICES")
    assert FakeDevice.probe().reason == "no FAKEDEV device visible (FAKEDEV_VISIBLE_DEVICES is not set)"
    fake_extension(monkeypatch, "fake_torch_extension", devices=2)
    probe = FakeDevice.probe()
    assert probe.available and probe.priority == 100 and FakeDevice.device_count() == 2


def test_an_extension_that_fails_to_import_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.delenv(STAND_IN_VARIABLE, raising=False)
    (tmp_path / "broken_torch_extension.py").write_text("raise RuntimeError('driver 5.1 needed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    class Broken(FakeDevice):
        extension = "broken_torch_extension"

    assert Broken.probe().reason == "broken_torch_extension failed to import: RuntimeError: driver 5.1 needed"


def test_the_stand_in_is_torch_on_the_cpu_presented_as_the_device(stand_in):
    probe = GcuBackend.probe()
    assert probe.available and probe.priority == 1 and "stand-in for gcu" in probe.detail
    backend = GcuBackend()
    assert backend.torch_device.type == "cpu" and backend.name == "gcu" and backend.fallback_reasons == {}
    assert backend.distributed_backend == "eccl"
    assert {"bfloat16", "float16"} <= set(GcuBackend.kv_cache_dtypes("bfloat16"))


def test_overrides_run_decline_and_say_so(stand_in):
    backend = GcuBackend()
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((5, 16))).to(torch.bfloat16)
    weight = torch.from_numpy(rng.standard_normal(16)).to(torch.bfloat16)
    base = type(backend.ops)(backend.torch_device)
    assert backend.kernel_record() == {}

    assert torch.equal(backend.ops.silu_and_mul(x), base.silu_and_mul(x))
    normed = backend.ops.rms_norm(x, weight, 1e-6)
    assert torch.allclose(normed.float(), base.rms_norm(x, weight, 1e-6).float(), atol=0.02)
    assert backend.kernel_record() == {"silu_and_mul": "override", "rms_norm": "override"}
    assert backend.kernel_record() == {}, "a record is read once"

    backend.ops.rms_norm(x, weight, 1e-6, weight_offset=1.0)  # Gemma's 1 + w: the kernel declines
    backend.ops.rms_norm(x, weight, 1e-6)
    assert backend.kernel_record() == {"rms_norm": "override, fell back"}

    residual = x.flip(0)
    kept_x, kept_residual = x.clone(), residual.clone()
    got, summed = backend.ops.add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_sum = base.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_sum) and torch.allclose(got.float(), expected.float(), atol=0.02)
    assert torch.equal(x, kept_x) and torch.equal(residual, kept_residual), "the op changes neither input"


def test_a_missing_automatic_kernel_falls_back_with_the_reason_logged(stand_in, caplog):
    class Missing(GcuBackend):
        overrides = {"gelu": VendorKernel("candelabra_no_such_vendor.kernels:gelu"),
                     "softmax": VendorKernel("torch.ops.candelabra_no_such_namespace:softmax")}

    with caplog.at_level(logging.INFO, logger="candelabra"):
        backend = Missing()
    assert set(backend.fallback_reasons) == {"gelu", "softmax"}
    assert "candelabra_no_such_vendor" in backend.fallback_reasons["gelu"]
    assert "no 'softmax'" in backend.fallback_reasons["softmax"]
    assert "gcu: gelu falls back to torch" in caplog.text
    backend.ops.gelu(torch.ones(2, 4))
    assert backend.kernel_record() == {"gelu": "fell back"}


def test_a_missing_explicit_kernel_is_an_error(stand_in):
    class Required(GcuBackend):
        overrides = {"gelu": VendorKernel("candelabra_no_such_vendor.kernels:gelu", required=True)}

    with pytest.raises(KernelLookupError, match="the gelu kernel candelabra_no_such_vendor.kernels:gelu was asked "
                                                "for explicitly and cannot be used"):
        Required()


def test_an_override_for_something_that_is_not_an_op_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match="overrides names fused_everything, which are not ops"):
        type("Typo", (GcuBackend,), {"overrides": {"fused_everything": VendorKernel("x:y")}})


def test_targets_resolve_modules_attributes_and_torch_op_namespaces():
    assert resolve("numpy.linalg:norm") is np.linalg.norm
    assert resolve("torch.ops.aten:add") is torch.ops.aten.add
    assert resolve("os:path.join") is __import__("os").path.join
    for target, said in (("numpy", "is not 'module:attribute'"), ("numpy:pi", "is a float, not a callable"),
                         ("numpy:no_such_function", "numpy has no 'no_such_function'"),
                         ("candelabra_no_such_vendor:f", "No module named 'candelabra_no_such_vendor'")):
        with pytest.raises(LookupError, match=said):
            resolve(target)


def test_conformance_on_the_stand_in_reports_which_kernel_ran(tmp_path):
    report = tmp_path / "gcu.json"
    result = run_candelabra("conformance", "--backend", "gcu", "--level", "ops", "--op", "rms_norm", "--op",
                            "silu_and_mul", "--op", "gelu", "--json", str(report), env_extra={STAND_IN_VARIABLE: "gcu"})
    assert result.returncode == 0, result.stdout + result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("op "))
    assert header.split()[-1] == "kernel"
    rows = {tuple(line.split()[:2]): line for line in result.stdout.splitlines() if line.split()[:1] in
            (["rms_norm"], ["silu_and_mul"], ["gelu"])}
    assert rows[("silu_and_mul", "float32")].endswith("override")
    assert "override 3, fell back 3" in rows[("rms_norm", "float32")]
    assert rows[("gelu", "float32")].split()[-1] != "override"
    document = json.loads(report.read_text())
    kernels = {case["op"]: case["kernel"] for case in document["cases"] if case["dtype"] == "float32"}
    assert kernels["silu_and_mul"] == "override" and kernels["gelu"] is None
    assert document["summary"]["rms_norm"]["kernels"] == {"override": 9, "fell back": 9}


def test_every_conformance_level_is_green_on_the_stand_in(tmp_path):
    report = tmp_path / "gcu.json"
    # The stand-in computes the quantized weights and KV caches with the torch backend's code, whose own
    # tests run those cases (int4 and int8 cases, GPTQ/AWQ and in-situ quantized models); CI's time.
    result = run_candelabra("conformance", "--backend", "gcu", "--json", str(report), "--", "-k",
                            "not int4 and not int8 and not gptq and not awq and not isq",
                            env_extra={STAND_IN_VARIABLE: "gcu"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads(report.read_text())
    assert document["cases"] and all(case["status"] == "passed" for case in document["cases"])
    assert document["models"] and all(model["status"] == "passed" for model in document["models"])
    assert document["engine"] and all(case["status"] == "passed" for case in document["engine"])
    overridden = {op for op, counts in document["summary"].items() if counts["kernels"].get("override")}
    assert overridden == {"silu_and_mul", "rms_norm", "add_rms_norm"}
