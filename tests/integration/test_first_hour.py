"""What a new user meets in the first hour: closed objects, tables that can
never fit, and small traps, each with an error that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import numpy as np
import pytest

import distore_ucx as ds

SPEC = ((64,), "uint8")


@pytest.fixture(scope="module")
def store():
    with ds.LocalCluster(nodes=2, arena_bytes=2 << 20, log_level="WARNING") as cluster:
        yield cluster


@pytest.fixture
def client(store):
    c = ds.connect(store.address)
    yield c
    c.close()


def test_closed_learner_writer_and_client_say_they_are_closed(store):
    client = ds.connect(store.address)
    client.create_table("closed", capacity=100, spec=SPEC)
    writer = client.writer()
    writer.insert("closed", np.zeros((8, 64), np.uint8))
    writer.close()
    with pytest.raises(ds.Closed, match="this writer is closed"):
        writer.insert("closed", np.zeros(64, np.uint8))
    with pytest.raises(ds.Closed, match="this writer is closed"):
        writer.flush()
    learner = client.learner("closed", batch_size=4)
    learner.sample()
    learner.close()
    with pytest.raises(ds.Closed, match="this learner of table 'closed' is closed"):
        learner.sample()
    with pytest.raises(ds.Closed, match="this learner of table 'closed' is closed"):
        next(iter(learner))
    with pytest.raises(ds.Closed):
        learner.update_priorities(np.zeros(1, np.uint64), [1.0])
    live = client.learner("closed", batch_size=4, prefetch=1)
    next(iter(live))
    client.close()  # closes its learners too
    with pytest.raises(ds.Closed, match="this learner of table 'closed' is closed"):
        next(iter(live))
    with pytest.raises(ds.Closed, match="this client is closed: connect again"):
        client.table_info("closed")
    with pytest.raises(ds.Closed):
        client.writer()
    assert issubclass(ds.Closed, ds.DistoreError)


def test_an_item_larger_than_every_arena_is_refused_at_create(client):
    with pytest.raises(ds.ConfigError, match=r"one item takes \d+ bytes .* the largest storage "
                                             r"node's arena is 2097152 bytes"):
        client.create_table("huge", capacity=1, spec=((3 << 20,), "uint8"))
    assert "huge" not in [t["name"] for t in client.tables()]


def test_a_capacity_beyond_every_arena_warns_at_create(store, client):
    with pytest.warns(ds.CapacityWarning, match=r"table 'big': capacity 100000 x 128-byte "
                                                r"slots .* the 2 live storage node\(s\)"):
        info = client.create_table("big", capacity=100_000, spec=SPEC)
    assert info["capacity"] == 100_000 and "warnings" not in info
    with open(os.path.join(store.log_dir, "control.log")) as fh:  # and in its log
        assert "table 'big': capacity 100000 x 128-byte slots" in fh.read()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one that fits says nothing
        client.create_table("small", capacity=100, spec=SPEC)


def test_storage_full_names_the_table_that_holds_the_space():
    with ds.LocalCluster(nodes=1, arena_bytes=2 << 20, log_level="WARNING") as one, \
            ds.connect(one.address) as client:
        with pytest.warns(ds.CapacityWarning):
            client.create_table("hog", capacity=40_000, spec=((1000,), "uint8"))
        client.create_table("victim", capacity=100, spec=((1000,), "uint8"))
        with client.writer(max_items=64) as w:
            for _ in range(50):  # 3.2 MB: more than the arena holds; hog evicts its own
                w.insert("hog", np.zeros((64, 1000), np.uint8))
        hog = client.table_info("hog")
        assert 0 < hog["size"] <= hog["fits"] < 40_000
        with pytest.raises(ds.StorageFull) as info, client.writer() as w:
            w.insert("victim", np.zeros((10, 1000), np.uint8))
        text = str(info.value)
        assert "the space is held by table 'hog'" in text
        assert "Table 'hog' holds the most: give it a smaller capacity" in text
        assert "Lower table 'victim'" not in text


def test_table_exists_says_which_fields_differ(client):
    client.create_table("twice", capacity=10, spec=SPEC)
    with pytest.raises(ds.TableExists, match=r"capacity: 10 there, 20 asked") as info:
        client.create_table("twice", capacity=20, spec=SPEC, sampler=ds.Lifo())
    assert "sampler: {'kind': 'uniform'" in str(info.value)
    assert "spec" not in str(info.value)


def test_wrong_number_of_priorities_says_how_many(client):
    client.create_table("prios", capacity=100, spec=SPEC)
    with client.writer() as w:
        with pytest.raises(ValueError, match=r"3 priorities \(shape \(3,\)\) for 5 items"):
            w.insert("prios", np.zeros((5, 64), np.uint8), priority=[1.0, 2.0, 3.0])
        w.insert("prios", np.zeros((5, 64), np.uint8), priority=np.arange(5.0))


@pytest.mark.parametrize("kwargs, message", [
    ({"sampler": ds.Prioritized}, (r"sampler=ds.Prioritized is the function, not a sampler: "
                                   r"call it, e.g. sampler=ds.Prioritized\(alpha=0.6\)")),
    ({"remover": ds.Fifo}, r"remover=ds.Fifo is the function.*remover=ds.Fifo\(\)"),
    ({"rate_limiter": ds.Queue}, r"rate_limiter=ds.Queue is the function.*ds.Queue\(size\)"),
])
def test_an_uncalled_sampler_says_call_it(client, kwargs, message):
    with pytest.raises(ds.ConfigError, match=message):
        client.create_table("uncalled", capacity=10, spec=SPEC, **kwargs)


def test_a_list_of_pixel_values_goes_into_a_uint8_field(client):
    client.create_table("lists", capacity=10, spec={"obs": ((2, 2), "uint8")})
    with client.writer() as w:
        w.insert("lists", {"obs": [[1, 2], [3, 255]]})
    with client.learner("lists", batch_size=1) as learner:
        assert learner.sample().data["obs"].tolist() == [[[1, 2], [3, 255]]]


def test_a_batch_larger_than_the_queue_is_refused_at_once(client):
    client.create_table("q", capacity=100, spec=SPEC, rate_limiter=ds.Queue(10))
    with pytest.raises(ds.ConfigError, match=r"table 'q': Queue\(10\) can never hand out 64 "
                                             r"items at once .* batch_size <= 10"):
        client.learner("q", batch_size=64, timeout=60)
    client.learner("q", batch_size=10).close()


PROGRAM = """
import numpy as np
import distore_ucx as ds
cluster = ds.LocalCluster(nodes=1, arena_bytes=4 << 20, log_level="WARNING").start()
client = ds.connect(cluster.address)
client.create_table("t", capacity=100, spec=((8,), "uint8"))
w = client.writer()
w.insert("t", np.zeros((10, 8), np.uint8))
w.flush()
client.learner("t", batch_size=4).sample()
next(iter(client.learner("t", batch_size=4, prefetch=2)))  # a prefetch thread too
print("sampled", flush=True)
# no close() anywhere
"""


# The store goes first (the with block ends), the client is never closed.
PROGRAM_STORE_GONE = """
import numpy as np
import distore_ucx as ds
with ds.LocalCluster(nodes=1, arena_bytes=4 << 20, log_level="WARNING") as cluster:
    client = ds.connect(cluster.address)
    client.create_table("t", capacity=100, spec=((8,), "uint8"))
    w = client.writer()
    w.insert("t", np.zeros((10, 8), np.uint8))
    w.flush()
    learner = client.learner("t", batch_size=4)
    learner.sample()  # holds a lease, and has the next batch's request in flight
print("sampled", flush=True)
"""


@pytest.mark.parametrize("tls", ["tcp", "sm"])
@pytest.mark.parametrize("program", [PROGRAM, PROGRAM_STORE_GONE], ids=["store-up", "store-gone"])
def test_a_program_that_never_closes_exits_quietly_and_at_once(tls, program):
    env = dict(os.environ, UCX_TLS=tls, UCX_NET_DEVICES="lo")
    env.pop("UCX_LOG_LEVEL", None)  # UCX's own default: its warnings are shown
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], capture_output=True,
                         text=True, timeout=120, env=env, cwd=tempfile.gettempdir(),
                         check=False)
    took = time.monotonic() - start
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "sampled"
    # Leases are left to expire: exit never waits for a control plane that left
    # (it would retry for the client's 30 s timeout, per learner). A prefetch
    # thread caught reconnecting is still joined (up to 30 s): not tested here.
    assert took < 25, f"the program took {took:.0f} s to exit"
    assert "progress thread should be explicitly stopped" not in out.stderr, out.stderr
    assert "WARN" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "distore_ucx", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=tempfile.gettempdir(), check=False)


def test_the_control_plane_listens_on_loopback_by_default(tmp_path):
    psutil = pytest.importorskip("psutil")
    ready = tmp_path / "control.ready"
    proc = subprocess.Popen([sys.executable, "-m", "distore_ucx", "--log-level", "WARNING",
                             "control", "--port", "0", "--ready-file", str(ready)],
                            cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "control did not start"
            time.sleep(0.05)  # polling a file, with a deadline
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("argv, role", [
    (["control", "--host", "0.0.0.0", "--port", "0"], "control plane on 0.0.0.0"),
    (["node", "--control", "127.0.0.1:1", "--host", "0.0.0.0", "--arena", "16MiB"],
     "storage node on 0.0.0.0"),
])
def test_listening_beyond_loopback_without_a_token_is_refused(argv, role):
    out = _cli(*argv)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"refusing to run the {role} without a token" in out.stderr
    assert "--token-file FILE" in out.stderr and "--insecure" in out.stderr


def test_insecure_is_allowed_and_logged_loudly(caplog):
    from distore_ucx import cli
    from distore_ucx.config import resolve

    settings = resolve({"control.host": "0.0.0.0", "auth.insecure": True}, {})
    with caplog.at_level("WARNING", logger="distore_ucx.cli"):
        cli._refuse_exposure("control plane", "0.0.0.0", settings)
    loud = [r for r in caplog.records if r.levelname == "WARNING" and "INSECURE" in r.message]
    assert len(loud) >= 2
    with pytest.raises(ds.ConfigError, match="refusing"):
        cli._refuse_exposure("control plane", "0.0.0.0", resolve({}, {}))
