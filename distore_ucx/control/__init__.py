"""Control plane: tables, samplers, removers, leases and node membership.

The process is server.py (`ControlPlane`: it builds the pieces below, runs
housekeeping and checkpoints, and answers `status`); dispatch.py routes each
request of the control channel to the module of its concept:

- tables: catalog.py (the tables by name: create, describe, priorities);
  tables.py (one table's records and leases), items.py (its record
  columns), evictions.py (what leaves it: slots freed, items retired),
  table_restore.py (its checkpoint image and the items nodes re-send),
  pending.py (checkpointed items awaiting a restore);
- inserts.py (`items_added`), admission.py (holding calls a rate limiter
  does not admit yet; the limits themselves are ../rate_limiters.py);
- sampling.py (`sample`, step by step), leases.py (who holds which lease),
  reclaim.py (releases, expiry, slots freed on their nodes);
- nodes.py (joining, heartbeats, leaving), membership.py (node states);
- arenas.py (a node's slot requests), room.py (eviction for room),
  tiers.py (demotion and staging), retirements.py (evicted leased slots);
- checkpoint.py (the file and the ids that never repeat), restore.py
  (coming back from it), writers.py (writer ids).
"""
