"""The metric families of every role, built from plain numbers at scrape time.

A control plane's and a storage node's state belongs to its event-loop
thread: ``*_snapshot`` copies it into plain numbers on that loop, and
``*_families`` builds the Prometheus families from the copy off the loop
(:class:`~.registries.LoopCollector`). Learners and writers keep plain
counters (:mod:`.stats`) read directly. :func:`catalog` lists every metric
distore exports (docs/operations.md describes each).

prometheus_client is imported only when families are built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .stats import ControlStats, LearnerStats, NodeStats, TableStats, WriterStats


def _families():
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    return CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


def control_families(snap: dict) -> list:
    """Metric families from a control plane snapshot (see control_snapshot)."""
    C, G, H = _families()
    t = ["table"]
    size = G("distore_table_size", "Items in the table (sampleable)", labels=t)
    cap = G("distore_table_capacity", "Items the table holds at most", labels=t)
    ins = C("distore_table_inserts", "Items inserted into the table", labels=t)
    smp = C("distore_table_samples", "Items sampled from the table (a batch of n counts n)",
            labels=t)
    ev = C("distore_table_evictions", "Items removed by the remover at capacity or after "
           "max_times_sampled", labels=t)
    leased = G("distore_table_leased_items", "Items under at least one lease (being read)",
               labels=t)
    holds = C("distore_table_rate_limiter_holds", "Calls the rate limiter held (op: insert "
              "batch or sample request)", labels=t + ["op"])
    tmo = C("distore_table_rate_limiter_timeouts", "Held calls that timed out (op: insert "
            "batch or sample request)", labels=t + ["op"])
    waiting = G("distore_table_rate_limiter_waiting", "Calls the rate limiter holds now",
                labels=t + ["op"])
    pu = C("distore_table_priority_updates", "Priorities set by update_priorities", labels=t)
    pm = C("distore_table_priority_updates_missing", "Priority updates for keys no longer in "
           "the table", labels=t)
    dec = H("distore_table_sample_decision_seconds", "Control-plane time to choose, lease and "
            "locate one sample request's items (rate-limiter wait excluded)", labels=t)
    for r in snap["tables"]:
        lv = [r["name"]]
        size.add_metric(lv, r["size"])
        cap.add_metric(lv, r["capacity"])
        ins.add_metric(lv, r["inserts"])
        smp.add_metric(lv, r["samples"])
        ev.add_metric(lv, r["deletes"])
        leased.add_metric(lv, r["leased"])
        st: TableStats = r["stats"]
        for op in ("insert", "sample"):
            holds.add_metric(lv + [op], st["holds"].get(op, 0))
            tmo.add_metric(lv + [op], st["timeouts"].get(op, 0))
            waiting.add_metric(lv + [op], st["waiting"].get(op, 0))
        pu.add_metric(lv, st["priority_updates"])
        pm.add_metric(lv, st["priority_missing"])
        buckets, total = st["decision"]
        dec.add_metric(lv, buckets, total)
    leases = G("distore_leases", "Sample leases outstanding (one per sampled batch not yet "
               "released)")
    leases.add_metric([], snap["leases"])
    nodes = G("distore_nodes", "Storage nodes known to the control plane", labels=["state"])
    nodes.add_metric(["alive"], snap["nodes_alive"])
    nodes.add_metric(["dead"], snap["nodes_dead"])
    # Of the alive: missed heartbeats, routed around, items kept (membership.py).
    nodes.add_metric(["unresponsive"], snap.get("nodes_unresponsive", 0))
    arena = G("distore_nodes_arena_bytes", "Arena bytes of the live storage nodes")
    arena.add_metric([], snap["arena_bytes"])
    used = G("distore_nodes_used_bytes", "Arena bytes in use on the live storage nodes "
             "(as last reported)")
    used.add_metric([], snap["used_bytes"])
    mem = C("distore_membership_changes", "Storage nodes that joined, re-joined, left or were "
            "dropped", labels=["change"])
    for change in ("joined", "rejoined", "left", "dropped"):
        mem.add_metric([change], snap["membership"].get(change, 0))
    ck = C("distore_checkpoints", "Checkpoints written")
    ck.add_metric([], snap["checkpoints"])
    ckf = C("distore_checkpoint_failures", "Checkpoints that failed")
    ckf.add_metric([], snap["checkpoint_failures"])
    out = [size, cap, ins, smp, ev, leased, holds, tmo, waiting, pu, pm, dec, leases, nodes,
           arena, used, mem, ck, ckf]
    last = snap["last_checkpoint"]
    if last is not None:
        for name, doc, key in (
            ("distore_checkpoint_duration_seconds", "Time the last checkpoint took", "seconds"),
            ("distore_checkpoint_size_bytes", "Size of the last checkpoint file", "bytes"),
            ("distore_checkpoint_items", "Items in the last checkpoint", "items"),
            ("distore_checkpoint_timestamp_seconds", "Unix time of the last checkpoint",
             "created"),
        ):
            g = G(name, doc)
            g.add_metric([], last[key])
            out.append(g)
    restoring = G("distore_restoring", "1 while a restore waits for nodes to re-send items")
    restoring.add_metric([], 1 if snap["restoring"] else 0)
    out.append(restoring)
    return out


def control_snapshot(plane, restoring: bool = False) -> dict:
    """Plain numbers of a ControlPlane, taken on its event loop; `restoring`:
    whether a restore waits for nodes to re-send their items (the control
    plane says, as it passes its snapshot to serve_process)."""
    tables = []
    for t in list(plane.tables.values()):
        st: TableStats = t.stats
        tables.append({
            "name": t.name, "size": t.size, "capacity": t.capacity, "inserts": t.inserts,
            "samples": t.samples, "deletes": t.deletes, "leased": t.leased(),
            "stats": {"holds": dict(st.holds), "timeouts": dict(st.timeouts),
                      "waiting": dict(st.waiting), "priority_updates": st.priority_updates,
                      "priority_missing": st.priority_missing,
                      "decision": st.decision.snapshot()},
        })
    nodes = list(plane.members.nodes.values())
    alive = [n for n in nodes if n.alive]
    stats: ControlStats = plane.stats
    return {
        "tables": tables, "leases": len(plane.leases),
        "nodes_alive": len(alive), "nodes_dead": len(nodes) - len(alive),
        "nodes_unresponsive": sum(not n.live for n in alive),
        "arena_bytes": sum(n.arena_size for n in alive),
        "used_bytes": sum(n.used_bytes for n in alive),
        "membership": dict(stats.membership), "checkpoints": stats.checkpoints,
        "checkpoint_failures": stats.checkpoint_failures,
        "last_checkpoint": plane.last_checkpoint,
        "restoring": restoring,
    }


def node_families(snap: dict) -> list:
    """Metric families from a storage node snapshot (see node_snapshot)."""
    C, G, H = _families()
    n = ["node"]
    lv = [snap["node"]]
    total = G("distore_node_arena_bytes", "Size of the node's arena", labels=n)
    total.add_metric(lv, snap["arena_bytes"])
    used = G("distore_node_arena_used_bytes", "Arena bytes in slots in use", labels=n)
    used.add_metric(lv, snap["used_bytes"])
    carved = G("distore_node_arena_carved_bytes", "Arena bytes below the bump pointer "
               "(carved into slots at some point)", labels=n)
    carved.add_metric(lv, snap["carved_bytes"])
    items = G("distore_node_items", "Slots in use on the node, by table", labels=n + ["table"])
    for table, count in snap["items"].items():
        items.add_metric(lv + [table], count)
    b = C("distore_node_insert_batches", "Insert batches stored and acknowledged", labels=n)
    b.add_metric(lv, snap["batches"])
    i = C("distore_node_insert_items", "Items stored and acknowledged", labels=n)
    i.add_metric(lv, snap["items_inserted"])
    by = C("distore_node_insert_bytes", "Item bytes stored and acknowledged", labels=n)
    by.add_metric(lv, snap["bytes"])
    f = C("distore_node_insert_failures", "Insert batches that failed (slots freed)", labels=n)
    f.add_metric(lv, snap["failed_batches"])
    r = C("distore_node_registration_requests", "items_added requests sent to the control "
          "plane (each registers the insert batches stored while the last was answered)",
          labels=n)
    r.add_metric(lv, snap["registration_requests"])
    lat = H("distore_node_insert_seconds", "Time from an insert request to its acknowledgement "
            "(pull, registration and any rate-limiter wait)", labels=n)
    buckets, total_s = snap["latency"]
    lat.add_metric(lv, buckets, total_s)
    joined = G("distore_node_joined", "1 while the node is registered with a control plane",
               labels=n)
    joined.add_metric(lv, 1 if snap["joined"] else 0)
    out = [total, used, carved, items, b, i, by, f, r, lat, joined]
    am = snap.get("am_sample")
    if am:  # the node serves samples by active message (storage/sample_server.py)
        sb = C("distore_node_sample_batches", "Sample batches served by active message, by "
               "outcome (done; failed: the learner went away; abandoned: no progress for "
               "a while)", labels=n + ["outcome"])
        for outcome, key in (("done", "batches_done"), ("failed", "batches_failed"),
                             ("abandoned", "abandoned")):
            sb.add_metric(lv + [outcome], am[key])
        sy = C("distore_node_sample_bytes", "Bytes of sample batches sent by active message",
               labels=n)
        sy.add_metric(lv, am["bytes"])
        sr = C("distore_node_sample_refused", "Sample requests refused (busy, malformed, out "
               "of bounds); the learner reads those items by gets", labels=n)
        sr.add_metric(lv, am["refused"])
        si = G("distore_node_sample_batches_in_flight", "Sample batches being sent now",
               labels=n)
        si.add_metric(lv, am["in_flight"])
        ss = G("distore_node_sample_batches_stuck", "Abandoned sample batches whose sends UCX "
               "has not ended yet", labels=n)
        ss.add_metric(lv, am["stuck"])
        sc = G("distore_node_sample_connections", "Learners connected to the node's sample "
               "listener (those that went away are closed within a second)", labels=n)
        sc.add_metric(lv, am.get("connections", 0))
        sm = C("distore_node_sample_run_messages", "Sample messages that carried a field of "
               "several items bound for consecutive rows, copied into a bounce chunk", labels=n)
        sm.add_metric(lv, am.get("runs", 0))
        su = C("distore_node_sample_unpacked_runs", "Runs sent item by item because no bounce "
               "chunk was free (many batches at once): slower, never wrong", labels=n)
        su.add_metric(lv, am.get("unpacked", 0))
        out += [sb, sy, sr, si, ss, sc, sm, su]
    return out


def node_snapshot(node, joined: bool) -> dict:
    """Plain numbers of a StorageNode, taken on its event loop; `joined`:
    whether it is registered with a control plane (the node says, as it
    passes its snapshot to serve_process)."""
    arena = node.arena
    st: NodeStats = node.stats
    items = {} if arena is None else {
        name: s.n - s.free_slots for name, s in arena.tables().items()}
    return {
        "node": node.name, "arena_bytes": arena.size if arena else 0,
        "used_bytes": arena.used_bytes if arena else 0,
        "carved_bytes": arena.high_water if arena else 0, "items": items,
        "batches": st.batches, "items_inserted": st.items, "bytes": st.bytes,
        "failed_batches": st.failed_batches, "latency": st.latency.snapshot(),
        "registration_requests": node.registrations.requests, "joined": joined,
        "am_sample": dict(getattr(node, "sample_server", None) and node.sample_server.stats
                          or {}),
    }


def client_families(learners: Iterable[tuple[str, Any]],
                    writers: Iterable[tuple[str, Any]]) -> list:
    """Metric families of learners and writers, each given with its label
    value (the registry passes this process's live ones)."""
    C, G, H = _families()
    lt = ["table", "learner"]
    fi = C("distore_learner_fetched_items", "Items read into the learner's ring, by path "
           "(mapped: same-host read-only mapping; ucx: one-sided UCX reads; ucx-am: "
           "UCX active messages)",
           labels=lt + ["path"])
    fb = C("distore_learner_fetched_bytes", "Bytes read into the learner's ring (slot header "
           "included), by path", labels=lt + ["path"])
    ur = C("distore_learner_ucx_reads", "One-sided UCX reads posted (path ucx): one per "
           "run of slots that follow each other in a node's arena, so a slice's steps "
           "stored together are one read (a same-host CMA read counts one per header and "
           "field)", labels=lt)
    nb = C("distore_learner_batches", "Batches handed out", labels=lt)
    rs = C("distore_learner_resampled_items", "Items dropped (slot reused, node gone) and "
           "sampled again", labels=lt)
    torn = C("distore_learner_torn_items", "Items whose slot was rewritten while copied "
             "(resampled)", labels=lt)
    ex = C("distore_learner_expired_batches", "Batches sampled or read ahead, then dropped "
           "unread and sampled again: held past their lease (the learner paused longer "
           "than control.lease_timeout less a quarter)", labels=lt)
    pm = C("distore_learner_priority_updates_missing", "Priority updates for keys no longer "
           "in the table", labels=lt)
    gl = H("distore_learner_gather_seconds", "Time of one gather: reading a sampled batch's "
           "items from every node into the ring", labels=lt)
    ws = C("distore_learner_data_wait_seconds", "Time the training loop waited for the next "
           "prefetched batch while iterating", labels=lt)
    wr = G("distore_learner_data_wait_ratio", "Share of wall time since iterating began "
           "spent waiting for data (0..1)", labels=lt)
    for name, learner in learners:
        st: LearnerStats = learner.stats
        lv = [learner.table, name]
        for path in ("mapped", "ucx", "ucx-am"):
            fi.add_metric(lv + [path], st.fetched_items.get(path, 0))
            fb.add_metric(lv + [path], st.fetched_bytes.get(path, 0))
        ur.add_metric(lv, int(st.ucx_reads[0]))
        nb.add_metric(lv, st.batches)
        rs.add_metric(lv, learner.resampled)
        torn.add_metric(lv, learner.torn)
        ex.add_metric(lv, learner.expired)
        pm.add_metric(lv, learner.priority_updates_missing)
        buckets, total = st.gather.snapshot()
        gl.add_metric(lv, buckets, total)
        ws.add_metric(lv, st.wait_seconds)
        wr.add_metric(lv, st.wait_ratio())
    wt = ["writer"]
    wi = C("distore_writer_inserted_items", "Items stored and acknowledged", labels=wt)
    wb = C("distore_writer_inserted_bytes", "Item bytes stored and acknowledged", labels=wt)
    wn = C("distore_writer_batches", "Batches stored and acknowledged", labels=wt)
    wl = H("distore_writer_batch_seconds", "Time from sending a batch to its acknowledgement",
           labels=wt)
    for name, writer in writers:
        st: WriterStats = writer.stats
        wi.add_metric([name], st.items)
        wb.add_metric([name], st.bytes)
        wn.add_metric([name], st.batches)
        buckets, total = st.latency.snapshot()
        wl.add_metric([name], buckets, total)
    return [fi, fb, nb, rs, torn, ex, pm, gl, ws, wr, wi, wb, wn, wl]


def catalog() -> dict[str, tuple[str, str]]:
    """Every metric distore exports: {name as scraped: (type, help)}.

    Counters are listed with their ``_total`` suffix, histograms by their
    base name (scraped as ``_bucket``, ``_sum`` and ``_count``); the process
    metrics (``process_*``) come from prometheus_client's ProcessCollector.
    """
    hist = TableStats().decision.snapshot()
    table = {"name": "t", "size": 0, "capacity": 1, "inserts": 0, "samples": 0, "deletes": 0,
             "leased": 0, "stats": {"holds": {}, "timeouts": {}, "waiting": {},
                                    "priority_updates": 0, "priority_missing": 0,
                                    "decision": hist}}
    control = {"tables": [table], "leases": 0, "nodes_alive": 0, "nodes_dead": 0,
               "arena_bytes": 0, "used_bytes": 0, "membership": {}, "checkpoints": 0,
               "checkpoint_failures": 0, "restoring": False,
               "last_checkpoint": {"seconds": 0.0, "bytes": 0, "items": 0, "created": 0.0}}
    node = {"node": "n", "arena_bytes": 0, "used_bytes": 0, "carved_bytes": 0,
            "items": {"t": 0}, "batches": 0, "items_inserted": 0, "bytes": 0,
            "failed_batches": 0, "latency": hist, "registration_requests": 0, "joined": True}
    out = {}
    for fam in control_families(control) + node_families(node) + client_families((), ()):
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = (fam.type, fam.documentation)
    from prometheus_client import ProcessCollector

    for fam in ProcessCollector(registry=None).collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = (fam.type, fam.documentation)
    return out
