"""Adapters to third-party engines; the only place outside tests and benchmarks that imports them."""
