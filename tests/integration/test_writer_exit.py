"""A writer left open stores its items: at interpreter exit and when collected.

Each case runs an actor script in a subprocess (as a user's actor runs),
then checks the table from the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

SPEC = {"obs": ((64,), "float32")}

# The script's head: connect, a writer, 10 items (one at a time, as actors do).
HEAD = """
import gc, sys, time
import numpy as np
import distore_ucx as ds
client = ds.connect(sys.argv[1])
"""


def run_actor(address: str, body: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    script = HEAD + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, address], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ),
                          cwd=tempfile.gettempdir())  # the installed package, not the checkout


@pytest.fixture
def cluster(shared_cluster):
    """The module's cluster: each test uses a table of its own name
    (conftest's module_clusters)."""
    return shared_cluster


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
@pytest.mark.parametrize("max_delay", [None, 0.05])
def test_writer_open_at_exit_flushes(cluster, client, tls, max_delay):
    table = f"at_exit_{max_delay}"
    client.create_table(table, capacity=1000, spec=SPEC)
    done = run_actor(cluster.address, f"""
        writer = client.writer(max_delay={max_delay!r})
        for i in range(10):
            writer.insert({table!r}, {{"obs": np.full(64, i, np.float32)}})
        time.sleep(0.2)  # longer than max_delay: still no insert to send the batch
        # ends without writer.close() or client.close()
    """)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert client.table_info(table)["size"] == 10
    learner = client.learner(table, batch_size=10, sample_ahead=1)
    got = np.unique(learner.sample().data["obs"][:, 0])
    assert set(got.tolist()) <= set(range(10))
    learner.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_writer_garbage_collected_flushes(cluster, client, tls):
    client.create_table("collected", capacity=1000, spec=SPEC)
    done = run_actor(cluster.address, """
        def act():
            writer = client.writer()
            for i in range(10):
                writer.insert("collected", {"obs": np.full(64, i, np.float32)})
        act()  # the writer is dropped here, never closed
        gc.collect()
        size = client.table_info("collected")["size"]
        print("size", size)
        client.close()
    """)
    assert done.returncode == 0, done.stderr
    # Stored when collected, while the process still ran (not only at exit).
    assert "size 10" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert client.table_info("collected")["size"] == 10


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_writer_that_cannot_store_at_exit_warns_with_count(cluster, client, tls):
    # A table whose rate limiter admits 5 items until sampled: the other 5
    # wait out the writer's timeout at exit and are reported, not lost silently.
    import distore_ucx as ds

    client.create_table("held_at_exit", capacity=1000, spec=SPEC, rate_limiter=ds.Queue(5))
    done = run_actor(cluster.address, """
        writer = client.writer(max_items=5, timeout=1.0)
        for i in range(10):
            writer.insert("held_at_exit", {"obs": np.full(64, i, np.float32)})
    """)
    assert done.returncode == 0, done.stderr
    assert "5 items could not be stored" in done.stderr, done.stderr
    assert "still open at interpreter exit" in done.stderr
    assert client.table_info("held_at_exit")["size"] == 5
