"""Persistence: the journal (WAL appends before replies, group commit, fencing, the Redis-outage policy:
journal, wal, redis_store), snapshots (snapshot, written off the serving process by snapshotter), recovery
(the snapshot plus the WAL after it), hot standbys (follower) and the embedded local redis-server (embedded).

Submodules are imported explicitly (`kvservice.store.embedded`, ...) so importing the package stays cheap.
"""
