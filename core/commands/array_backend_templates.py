"""The files `candelabra new-backend NAME --array-library numpy` writes, as `string.Template` texts keyed
by their path in the package folder: a backend for a device whose runtime hands out arrays of its own,
written on numpy, the host standing in for the device. The placeholders: $name (the backend),
$distribution, $package, $class_name, $ops_class_name, $array_library and $candelabra_requirement.

Python files import the package's own modules relatively, and never numpy next to candelabra (what the
package takes from candelabra comes in through its contract.py), so that their imports sort the same
under any isort settings that know one of the two as first-party.
"""

from candelabra.core.commands.backend_package_templates import PLUGIN

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$distribution"
version = "0.1.0"
description = "The $name backend for candelabra: a device whose runtime hands out arrays of its own"
readme = "README.md"
requires-python = ">=3.10"
dependencies = [
    "$candelabra_requirement",
    # The array library the backend is written on, the host standing in for the device; add your
    # runtime's Python package here.
    "numpy>=1.26",
    # The host's free memory, while the host is the device (free_memory in backend.py).
    "psutil>=5.9",
]

# How candelabra finds the backend: `candelabra backends` lists it once the package is installed.
[project.entry-points.candelabra]
$name = "$package.plugin"

[tool.setuptools]
packages = ["$package"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

README = """\
# $distribution

The `$name` backend for candelabra, for a device whose runtime hands out arrays of its own (not a
PyTorch device). It implements candelabra's whole backend contract on $array_library arrays, with
the host standing in for the device: every op runs candelabra's numpy reference, so the package
passes conformance and serves before a line of your runtime is in it. You then replace the
device's methods with your runtime's calls, a step at a time, checking each step.

## What "array library" means here

The array library is the library whose arrays are the backend's tensors. candelabra hands the
backend host numpy arrays through `to_device` (weights through `upload_weight`, which calls it)
and takes host numpy arrays back through `to_host` (and `fetch`, once per step). Everything in
between (weights, activations, the KV cache, the sampled tokens until they are fetched) stays in
the library's arrays, which only the backend and its ops look inside, except for the few array
methods the model graph uses directly: `x.shape`, `x.reshape(...)`, indexing with ints and slices,
and `x + y`, `x * y` with a tensor of the same shape and dtype or a Python float. Your runtime's
arrays need those; conformance's `array_subset` case checks them.

As written the array library is numpy, so the device's arrays are numpy arrays on the host.

## Install and check

In the environment that has candelabra:

    pip install -e .
    candelabra backends                                 # lists $name
    candelabra conformance --backend $name --level ops --level engine
    pytest                                              # the ops level, as a test

(`candelabra conformance --backend $name` also runs the models level, which compares with
transformers on torch: `pip install 'candelabra[dev]'` for it.)

## Bringing up your device, in order

In `$package/backend.py` the methods the device must do are grouped under comments marked
`DEVICE`, numbered as the steps below. In `$package/ops.py` each op runs the numpy reference on
host copies of its arguments (`on_host`) until you replace its body with your kernel's call.
Work down the list: after each step its check passes, and `pytest` still does.

1. **Memory** (`backend.py`): `to_device`, `to_host`, `dtype_of`, `zeros`, `synchronize` and
   `free_memory`, with your runtime's upload, download, allocation, wait and memory query. Every
   op reaches the reference through `to_host` and comes back through `to_device`, so any op's
   cases check them; `array_subset` checks the array methods above.

       candelabra conformance --backend $name --level ops --op array_subset --op silu_and_mul

   Then the whole ops level: every op now runs on your arrays, through the host.

2. **The KV cache** (`backend.py`): `allocate_kv_cache`, `copy_blocks`, `allocate_swap_space`,
   `swap_out` and `swap_in`.

       candelabra conformance --backend $name --level ops --op allocate_kv_cache --op copy_blocks --op swap

3. **The ops that carry the KV cache** (`ops.py`): `write_kv`, `rotary_and_write_kv`,
   `paged_attention` and `rotary_and_paged_attention` (the two in turn: delete it to run yours), and
   `prepare_step` in `backend.py`, which makes the step's metadata into what your attention kernel
   reads. On the host these copy a layer's whole cache both ways at every call, which is why they
   come first, and why the KV cache takes 2% of free memory until then (`kv_cache_fraction`; or
   serve with `--kvcache-mem-gpu 64`).

       candelabra conformance --backend $name --level ops --op write_kv --op rotary_and_write_kv \\
           --op paged_attention --op rotary_and_paged_attention

4. **The ops that read whole weights** (`ops.py`): `linear`, `gated_linear` (a gated MLP's
   activation and down projection: delete it to run your activation, then your `linear`),
   `rms_norm_linear` (a pre-norm and the projection reading it: delete it to run your norm, then your
   `linear`), `rms_norm_gated_mlp` (a pre-norm and the gated MLP after it: delete it to run your
   `rms_norm_linear`, then your `gated_linear`) and `embedding`; override `upload_weight` in
   `backend.py` if your kernels want weights in a layout of their own.

       candelabra conformance --backend $name --level ops --op linear --op gated_linear \\
           --op rms_norm_linear --op rms_norm_gated_mlp --op embedding

5. **The rest, one at a time** (`ops.py`): `rms_norm`, `add_rms_norm`, `layer_norm`, `rotary`,
   `silu_and_mul`, `gelu_and_mul`, `gelu`, `softcap`, `softmax`, `gather_rows`, `sample`,
   `token_logprobs`, for mixture-of-experts models `route_experts` and `moe_experts`, and for
   DeepSeek's latent attention `per_head_linear` and `paged_latent_attention`, each checked with
   `--op NAME`. Once none calls `on_host`, delete it.

6. **Finding the device** (`backend.py`): `probe` imports your runtime and says why the backend
   cannot run when the runtime or a device is missing (priority 100 for an accelerator),
   `device_count` says how many devices it sees, and `dtypes` what they compute in.

       candelabra backends

The conformance table's `kernel` column says `fell back` for an op whose cases ran the numpy
reference on the host, and is empty for an op your device ran; once no op falls back, the column
goes. A passing row that says `fell back` tests candelabra's reference, not your device.

## Serve

    candelabra serve --backend $name --weight-path /path/to/checkpoint

## Later

- **Several devices for one model** (tensor parallelism): `communicator` on your collective
  library.
- **A lazy runtime**: `evaluate` computes what a step built; **graph capture**: `step_executor`.
- **Quantized weights**: `quantized_formats`, and `upload_weight` keeping the blocks.

`docs/backend-contract.md` in candelabra's repository says what each call must do, and
`docs/writing-a-backend.md` how the two scaffolds differ.
"""

INIT = '''\
"""The $name backend for candelabra: a device whose runtime hands out arrays of its own, on $array_library.

backend.py   the backend: memory, the KV cache and the step's metadata on the device's arrays
ops.py       the ops, each running the numpy reference on the host until it has a device kernel
contract.py  what the package takes from candelabra
plugin.py    registers the backend with candelabra (the `candelabra` entry point in pyproject.toml)
"""
'''

CONTRACT = '''\
"""What this package takes from candelabra, in one place: the backend contract it implements, and
the numpy reference (candelabra's cpu backend) whose ops run on the host until the device runs them."""

from candelabra.backends.cpu.ops import NumpyOps
from candelabra.core.contract import FLOAT_DTYPES, Backend, KVCache, Ops, Probe
from candelabra.core.contract.attention_layout import GatheredStep, gather_groups

__all__ = ["FLOAT_DTYPES", "Backend", "GatheredStep", "KVCache", "NumpyOps", "Ops", "Probe", "gather_groups"]
'''

BACKEND = '''\
"""The $name backend: candelabra's backend contract on a device whose runtime hands out arrays of its
own, written on $array_library.

The array library is the library whose arrays are the backend's tensors. The contract meets it at two
doors: host numpy arrays come in through `to_device` (weights through `upload_weight`, which calls it)
and go back out through `to_host` (and `fetch`, which calls it). Everything in between (weights,
activations, the KV cache, the sampled tokens until they are fetched) is the library's arrays, which
only this backend and its ops look inside, but for the few array methods the model graph uses directly
(shape, reshape, basic indexing, + and *: candelabra.core.contract.ops says which).

As written the array library is numpy and the host is the device, so the package passes conformance
before a line of your runtime is in it. The methods under comments marked DEVICE are the device's:
replace their numpy calls with your runtime's, in the order README.md gives, checking each step with
`candelabra conformance --backend $name --level ops --op ...`.
"""

from __future__ import annotations

import numpy as np
import psutil

from .contract import Backend, GatheredStep, KVCache, Probe, gather_groups
from .ops import $ops_class_name


class $class_name(Backend):
    name = "$name"
    # DEVICE, step 6: what the device computes in, the default first. The numpy reference that the
    # ops run on the host computes in float32 and hands back results in these.
    dtypes = ("float32",)

    def __init__(self, device=None):
        super().__init__(device)  # checks device.index against device_count()
        self.ops = $ops_class_name(self)

    # DEVICE, step 1: memory. Replace these first; every op reaches the host through them.

    def to_device(self, array, dtype=None):
        """A device array holding the host numpy array `array`: floats in `dtype` (float32 when None),
        integers keeping an integer type."""
        array = np.asarray(array)
        if array.dtype.kind == "f":
            return np.array(array, dtype=self.check_dtype(dtype or "float32"))
        if array.dtype.kind in "iub":
            return np.array(array)
        raise TypeError(f"cannot move an array of dtype {array.dtype} to the $name device")

    def to_host(self, tensor):
        """A host numpy copy of the device array `tensor`; bfloat16 comes back as float32."""
        return np.array(tensor)

    def dtype_of(self, tensor):
        """The device array's dtype by candelabra's name: float32, float16, bfloat16, int32 or int64."""
        return str(tensor.dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=self.check_dtype(dtype))

    def synchronize(self):
        """Waits until the work handed to the device so far has finished; numpy finishes each call
        before it returns."""

    def free_memory(self):
        """Bytes the device could still allocate, which sizes the KV cache when --kvcache-mem-gpu is
        not given; the host's are its RAM."""
        return int(psutil.virtual_memory().available)

    def kv_cache_fraction(self):
        """The share of free_memory() the KV cache takes when no size is given: small while write_kv
        and paged_attention run on the host, copying a layer's whole cache at every call (step 3);
        a device with memory of its own then gives it 0.5 or more."""
        return 0.02

    # DEVICE, step 2: the KV cache.

    def allocate_kv_cache(self, spec):
        """One KVCache per layer in `spec.dtype`: key `spec.block_shape`, value `spec.value_block_shape`."""
        return [KVCache(self.zeros(spec.block_shape, spec.dtype), self.zeros(spec.value_block_shape, spec.dtype))
                for _ in range(spec.num_layers)]

    def copy_blocks(self, caches, mapping):
        """Copies whole blocks within every layer's cache: `mapping` [N, 2] holds (source, destination)."""
        sources, destinations = _columns(mapping)
        for cache in caches:
            for part in cache:
                part[destinations] = part[sources]
        return caches

    def allocate_swap_space(self, spec):
        """Host memory for `spec.num_blocks` blocks of every layer, which swap_out fills and swap_in
        reads; float32 holds any compute dtype exactly."""
        return [KVCache(np.zeros(spec.block_shape, np.float32), np.zeros(spec.value_block_shape, np.float32))
                for _ in range(spec.num_layers)]

    def swap_out(self, caches, swap, mapping):
        """Copies device blocks to host blocks: `mapping` [N, 2] holds (device, host) pairs."""
        device_blocks, host_blocks = _columns(mapping)
        for cache, host in zip(caches, swap):
            for part, host_part in zip(cache, host):
                host_part[host_blocks] = self.to_host(part[device_blocks])
        return swap

    def swap_in(self, caches, swap, mapping):
        """Copies host blocks to device blocks: `mapping` [N, 2] holds (host, device) pairs."""
        host_blocks, device_blocks = _columns(mapping)
        for cache, host in zip(caches, swap):
            for part, host_part in zip(cache, host):
                part[device_blocks] = self.to_device(host_part[host_blocks], self.dtype_of(part))
        return caches

    # DEVICE, step 3: what the ops read of a step.

    def prepare_step(self, meta):
        """The step's metadata as the ops read it, built once per step: every array of `meta` on the
        device (the model hands rope_positions, slot_mapping and logits_rows to ops), and `gathered`,
        the host layout the numpy reference's paged_attention reads. Once paged_attention runs on
        the device, put what your kernel reads here in place of `gathered`."""
        prepared = super().prepare_step(meta)
        prepared.gathered = GatheredStep(meta, gather_groups(meta))
        return prepared

    # DEVICE, step 6: finding the device.

    @classmethod
    def probe(cls):
        """Whether the backend can run here, never raising: import your runtime here, and answer
        Probe(False, reason) when it or a device is missing, with priority 100 for an accelerator.
        The host is always here; priority 1 keeps `--backend auto` from picking it."""
        return Probe(True, detail=f"the host, numpy {np.__version__} standing in for the $name device", priority=1)

    @classmethod
    def device_count(cls):
        """How many devices the runtime sees, numbered from 0 (`--device-ids` picks one)."""
        return 1

    # For conformance: which ops still run on the host.

    def kernel_record(self):
        """The ops that ran the numpy reference on the host since the last call, each as "fell back"
        (conformance's `kernel` column); then forgets them."""
        ran, self.ops.ran_on_host = self.ops.ran_on_host, set()
        return dict.fromkeys(sorted(ran), "fell back")


def _columns(mapping):
    """The two columns of a block mapping [N, 2], as int64 index arrays."""
    mapping = np.asarray(mapping, dtype=np.int64).reshape(-1, 2)
    return mapping[:, 0], mapping[:, 1]
'''

OPS = '''\
"""The $name backend's ops. Until you give an op a device kernel it runs candelabra's numpy reference
(the cpu backend's ops) on the host: `on_host` copies the device arrays among its arguments to the
host with the backend's `to_host`, runs the reference op in float32, and brings what it returns back
with `to_device`. Every op therefore works on your runtime's arrays as soon as to_device and to_host
do, however slowly; replace an op's body with your kernel's call and it runs on the device.

The ops are in the order README.md replaces them: those that carry the KV cache, which on the host
copy a layer's whole cache both ways at every call; those that read whole weights; then the rest.
What each computes is in the docstrings of candelabra.core.contract.ops.Ops;
`candelabra conformance --backend $name --level ops --op NAME` checks one.
"""

from __future__ import annotations

from .contract import FLOAT_DTYPES, KVCache, NumpyOps, Ops


class $ops_class_name(Ops):
    backend_name = "$name"

    def __init__(self, backend):
        self.backend = backend
        self.reference = NumpyOps()
        self.ran_on_host: set[str] = set()  # since the backend's last kernel_record()

    # Step 3: the ops that carry the KV cache. The model calls rotary_and_paged_attention rather
    # than its parts apart: a kernel may fuse them, or delete it to run Ops' default, which calls
    # rotary_and_write_kv (itself rotary, then write_kv), then paged_attention.

    def write_kv(self, cache, key, value, slot_mapping):
        return self.on_host("write_kv", cache, key, value, slot_mapping)

    def rotary_and_write_kv(self, q, k, v, positions, cos_sin, cache, slot_mapping, style="neox"):
        return self.on_host("rotary_and_write_kv", q, k, v, positions, cos_sin, cache, slot_mapping, style)

    def paged_attention(self, q, cache, step, scale, sliding_window=None, logit_softcap=None):
        return self.on_host("paged_attention", q, cache, step.gathered, scale, sliding_window, logit_softcap)

    def rotary_and_paged_attention(self, q, k, v, positions, cos_sin, cache, slot_mapping, step, scale,
                                   sliding_window=None, logit_softcap=None, style="neox"):
        return self.on_host("rotary_and_paged_attention", q, k, v, positions, cos_sin, cache, slot_mapping,
                            step.gathered, scale, sliding_window, logit_softcap, style)

    # Step 4: the ops that read whole weights.

    def linear(self, x, weight, bias=None):
        return self.on_host("linear", x, weight, bias)

    def gated_linear(self, x, weight, bias=None, activation="silu"):
        return self.on_host("gated_linear", x, weight, bias, activation)

    def rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, weight_offset=0.0):
        return self.on_host("rms_norm_linear", x, residual, norm_weight, eps, weight, bias, weight_offset)

    def rms_norm_gated_mlp(self, x, residual, norm_weight, eps, gate_up, down, gate_up_bias=None, down_bias=None,
                           weight_offset=0.0, activation="silu"):
        return self.on_host("rms_norm_gated_mlp", x, residual, norm_weight, eps, gate_up, down, gate_up_bias,
                            down_bias, weight_offset, activation)

    def embedding(self, ids, table, scale=None):
        return self.on_host("embedding", ids, table, scale)

    # Step 5: the rest.

    def rms_norm(self, x, weight, eps, weight_offset=0.0):
        return self.on_host("rms_norm", x, weight, eps, weight_offset)

    def add_rms_norm(self, x, residual, weight, eps, weight_offset=0.0):
        return self.on_host("add_rms_norm", x, residual, weight, eps, weight_offset)

    def layer_norm(self, x, weight, bias, eps):
        return self.on_host("layer_norm", x, weight, bias, eps)

    def rotary(self, q, k, positions, cos_sin, style="neox"):
        return self.on_host("rotary", q, k, positions, cos_sin, style)

    def silu_and_mul(self, x):
        return self.on_host("silu_and_mul", x)

    def gelu_and_mul(self, x, approximate="none"):
        return self.on_host("gelu_and_mul", x, approximate)

    def gelu(self, x, approximate="none"):
        return self.on_host("gelu", x, approximate)

    def softcap(self, x, cap):
        return self.on_host("softcap", x, cap)

    def softmax(self, x):
        return self.on_host("softmax", x)

    def gather_rows(self, x, rows):
        return self.on_host("gather_rows", x, rows)

    def sample(self, logits, params):
        # params: Backend.prepare_sampling's, every array of the batch's SamplingMetadata on the
        # device; params.host is the SamplingMetadata itself, which the reference reads.
        return self.on_host("sample", logits, params.host, result_dtype="float32")

    def token_logprobs(self, logits, token_ids, num_top):
        return self.on_host("token_logprobs", logits, token_ids, num_top, result_dtype="float32")

    def route_experts(self, router_logits, top_k, scoring="softmax", renormalize=True, scale=1.0, num_groups=1,
                      top_groups=1, group_scoring="max", correction_bias=None):
        return self.on_host("route_experts", router_logits, top_k, scoring, renormalize, scale, num_groups,
                            top_groups, group_scoring, correction_bias, result_dtype="float32")

    def moe_experts(self, x, weights, expert_ids, gate_up, down, first_expert=0):
        return self.on_host("moe_experts", x, weights, expert_ids, gate_up, down, first_expert)

    def per_head_linear(self, x, weight):
        return self.on_host("per_head_linear", x, weight)

    def paged_latent_attention(self, q_latent, q_rope, cache, step, scale):
        return self.on_host("paged_latent_attention", q_latent, q_rope, cache, step.gathered, scale)

    # The way to the reference on the host: delete it once no op calls it.

    def on_host(self, op, *args, result_dtype=None):
        """The reference's `op` run on host float32 copies of the device arrays among `args` (KV caches
        included), its result brought back to the device: a KV cache in the dtype of the cache among
        `args`, other float arrays in `result_dtype`, by default the dtype of the first float array
        among `args`, and integer arrays as they are."""
        self.ran_on_host.add(op)
        float_dtypes = [dtype for dtype in map(self.backend.dtype_of, _arrays(args)) if dtype in FLOAT_DTYPES]
        caches = [arg for arg in args if isinstance(arg, KVCache)]
        cache_dtype = self.backend.dtype_of(caches[0].key) if caches else None
        result = getattr(self.reference, op)(*map(self._to_host, args))
        return self._to_device(result, result_dtype or float_dtypes[0], cache_dtype)

    def _to_host(self, value):
        if isinstance(value, KVCache):
            return KVCache(*map(self._to_host, value))
        if not hasattr(value, "shape"):  # a number, a string, None, or host metadata
            return value
        array = self.backend.to_host(value)
        return array.astype("float32", copy=False) if array.dtype.kind == "f" else array

    def _to_device(self, value, dtype, cache_dtype):
        if isinstance(value, KVCache):
            return KVCache(*(self.backend.to_device(part, cache_dtype) for part in value))
        if isinstance(value, tuple):  # (q, k), (normed, summed), (q, cache), SampleResult, TokenLogprobs
            parts = [self._to_device(part, dtype, cache_dtype) for part in value]
            return type(value)(*parts) if hasattr(value, "_fields") else tuple(parts)
        return self.backend.to_device(value, dtype)


def _arrays(args):
    """The device arrays among `args`, a KV cache's key and value among them."""
    for arg in args:
        if isinstance(arg, KVCache):
            yield from arg
        elif hasattr(arg, "shape"):
            yield arg
'''

TEST_CONFORMANCE = '''\
"""candelabra's conformance suite, ops level: every op of the contract passes on the backend as it stands."""

import json
import subprocess
import sys

from $package.backend import $class_name


def test_every_op_passes_the_ops_level_and_none_is_left_unsupported(tmp_path):
    report = tmp_path / "conformance.json"
    command = [sys.executable, "-m", "candelabra.core.cli", "conformance", "--backend", $class_name.name,
               "--level", "ops", "--json", str(report)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-10000:] + run.stderr[-10000:]
    # Quantized weights are for later: their cases count as not supported until quantized_formats says more.
    unsupported = [case["case"] for case in json.loads(report.read_text())["cases"]
                   if case["status"] == "not supported" and not case["weight_format"]]
    assert not unsupported, f"cases the backend does not run: {unsupported}"
'''

FILES = {
    "pyproject.toml": PYPROJECT,
    "README.md": README,
    "$package/__init__.py": INIT,
    "$package/plugin.py": PLUGIN,
    "$package/contract.py": CONTRACT,
    "$package/backend.py": BACKEND,
    "$package/ops.py": OPS,
    "tests/test_conformance.py": TEST_CONFORMANCE,
}
