"""A TorchRL buffer's handle (distore_ucx/torchrl/handle.py) without a
store: unpickling never connects, close() of a buffer never used connects
to nothing, and its first use raises the connection's error."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("torch", reason="needs torch (pip install '.[examples]')")
pytest.importorskip("tensordict", reason="needs tensordict (pip install '.[examples]')")


def test_an_unused_handle_connects_at_first_use_and_closes_without_connecting():
    """Unpickling never connects; close() of a buffer never used connects to
    nothing; its first use raises the connection's error, saying where."""
    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer
    from distore_ucx.torchrl.handle import BufferHandle, _open

    handle = BufferHandle(cls=DistoreReplayBuffer, address="127.0.0.1:9", table="t",
                          token_file=None, timeout=0.5, options={"batch_size": 4})
    rb = pickle.loads(pickle.dumps(_open(DistoreReplayBuffer, handle)))
    assert rb.__dict__["_pending_handle"] == handle  # a copy of a handle is the handle
    rb.close()
    rb = _open(DistoreReplayBuffer, handle)
    with pytest.raises(ds.DistoreError, match="127.0.0.1:9"):
        len(rb)
    assert "_pending_handle" in rb.__dict__  # it tries again at its next use
    rb.close()
