"""HTTP client programs for a running server: `candelabra chat` and `candelabra bench`."""
