"""Persistence: the Redis WAL + snapshot store and the embedded local redis-server.

Submodules are imported explicitly (`kvservice.store.embedded`, ...) so importing the package stays cheap.
"""
