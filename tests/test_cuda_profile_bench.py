"""bench/cuda_profile.py's accounting of a step's kernels: how much of the step each kernel adds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "cuda_profile.py"


def load_script():
    spec = importlib.util.spec_from_file_location("cuda_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_kernel_adds_what_it_ran_past_every_kernel_before_it_and_the_step_adds_up():
    profile = load_script()
    kernels = [("norm", 0.0, 2.0),
               ("gemv", 1.0, 12.0),   # a dependent launch: started inside the norm, adds 10 past it
               ("rotary", 13.0, 14.5),  # after a gap: adds its whole run
               ("norm", 14.0, 15.0),  # starts before rotary ends: adds 0.5
               ("tiny", 14.25, 14.5)]  # wholly inside another: adds nothing
    totals = profile.exposed_by_name(kernels)
    assert totals == {"norm": (3.0, 2.5), "gemv": (11.0, 10.0), "rotary": (1.5, 1.5), "tiny": (0.25, 0.0)}
    busy = profile.busy_union([(start, end) for _, start, end in kernels])
    assert sum(exposed for _, exposed in totals.values()) == busy == 14.0
    assert profile.exposed_by_name([]) == {}
