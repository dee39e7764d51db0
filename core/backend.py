"""Where plugins written for the first contract import from; the contract now lives in
`candelabra.core.contract`, which this module re-exports."""

from candelabra.core.contract import *  # noqa: F403
from candelabra.core.contract import __all__  # noqa: F401
