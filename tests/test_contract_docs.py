"""docs/backend-contract.md against the code: its table of members and its error limits."""

import inspect
import re

from candelabra.conformance.thresholds import threshold_table
from candelabra.core.contract.backend import Backend
from candelabra.core.contract.ops import OP_NAMES, Ops
from support import REPO

PAGE = (REPO / "docs" / "backend-contract.md").read_text()


def call_form(function) -> str:
    """`name(a, b=1, *rest)` as the page writes a member: parameters without self or cls, defaults as repr."""
    parameters = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name in ("self", "cls"):
            continue
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            parameters.append(f"*{parameter.name}")
        elif parameter.default is inspect.Parameter.empty:
            parameters.append(parameter.name)
        else:
            parameters.append(f"{parameter.name}={parameter.default!r}")
    return f"{function.__name__}({', '.join(parameters)})"


def table_rows(heading: str) -> dict[str, list[str]]:
    """The rows of the table under `heading`, by their first cell."""
    section = PAGE.split(heading, 1)[1].split("\n### ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [cell.strip() for cell in cells[1:]] for cells in rows[1:]}


def backend_methods() -> list[str]:
    return [name for name, value in vars(Backend).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, classmethod))]


def test_the_page_lists_every_backend_method_with_its_signature_and_whether_it_is_required():
    rows = table_rows("### `Backend`")
    listed = " ".join(rows)
    for name in backend_methods():
        function = getattr(Backend, name)
        form = call_form(function)
        if name.startswith("check_"):
            assert f"`{name}`" in listed, name
            continue
        row = next((cells for first, cells in rows.items() if f"`{form}`" in first), None)
        assert row is not None, f"no row for {form}"
        expected = "yes" if name in Backend.__abstractmethods__ else "no"
        assert row[0] == expected, f"{form} is marked {row[0]!r}, the code says {expected!r}"


def test_the_page_lists_every_op_with_its_signature():
    rows = table_rows("### `Ops`")
    for name in ("supports", *OP_NAMES):
        assert f"`{call_form(getattr(Ops, name))}`" in rows, name


def test_every_required_method_raises_a_message_naming_the_class_the_method_and_the_page():
    for name in Backend.__abstractmethods__:
        source = inspect.getsource(getattr(Backend, name))
        assert re.search(rf'_required\("{name}", ', source), f"{name} raises without naming itself"


def test_the_page_shows_the_limits_the_code_holds_backends_to():
    indented = "\n".join(f"    {line}" if line else "" for line in threshold_table().splitlines())
    assert indented in PAGE, "regenerate docs/backend-contract.md's table from `candelabra conformance --thresholds`"
