"""The hooks a candelabra plugin can implement.

A plugin is a module named by an entry point in the group `candelabra`:

    [project.entry-points.candelabra]
    mybackend = "my_package.candelabra_plugin"

and decorates the hooks it implements with `candelabra.plugins.hookimpl`. Each hook receives a
`register` callable and calls it once per thing it provides.
"""

from __future__ import annotations

import pluggy

PROJECT = "candelabra"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_backends(register):
    """Call `register(backend_class)` for each `candelabra.core.contract.backend.Backend` subclass."""


@hookspec
def register_model_architectures(register):
    """Call `register(name, model_class)` for each architecture, `name` as in a checkpoint's
    `architectures` list (e.g. "LlamaForCausalLM"). `model_class` is a
    `candelabra.core.models.base.DecoderModel` subclass: the loader reads the checkpoint as its class
    attributes say, then builds it as `model_class(config, backend, weights, communicator)`."""


@hookspec
def register_quantization_formats(register):
    """Call `register(name, quantization_format)` for each weight format (e.g. "q4_k")."""
