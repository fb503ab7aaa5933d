"""The process of test_held_sends.py: a writer's rendezvous sends aborted
while their receiver holds them, then the writer's runtime closed and
collected before its staging buffer is freed.

    python held_send_peer.py staging|bare   # prints "held N", then "ok"; exit 0

A receiver (a UCX runtime with an AmInbox listening on 127.0.0.1, as a
storage node takes inserts) keeps the insert messages it gets without ever
receiving them, as a node does with a batch it has not pulled yet. A writer
(its own runtime, a StagingBuffer as writers stage batches) posts a batch
of two items with am_send. UCX has handed the receiver the right to read
the staging buffer (the rendezvous), so closing the writer's runtime aborts
the two sends and leaves them to finish when the buffer is unmapped. Then
the runtime is dropped and collected (its workers too, unless something
keeps them), and only then the staging buffer: as when an exception's
traceback keeps a writer's batch until the garbage collector frees it.

Two guards stop what once followed (UCX queued the aborted sends'
completion, at the unmap, on a destroyed worker: a crash or a hang, and
UCX's warning that their requests were never returned): am_send passes
the region's own registration, so aborted sends end at once, and a
runtime's regions hold its workers (RegionOwner). `staging` runs as
writers do, both guards on; `bare` registers the buffer with the bare UCX
context, so only the first stands between it and that crash (the second
is tested alone in test_held_sends.py). Not a test module itself.
"""

from __future__ import annotations

import gc
import sys
import time

import numpy as np

from distore_ucx._native_loader import _native
from distore_ucx.client.writer.staging import StagingBuffer
from distore_ucx.config import rendezvous_config, ucx_tls
from distore_ucx.protocol import AM_INSERT_ID
from distore_ucx.transport.runtime import UcxRuntime

ITEM = 1 << 19  # bytes per item: well above the rendezvous threshold


def main(mode: str) -> int:
    receiver = UcxRuntime(config=rendezvous_config(), env_tls=ucx_tls())
    inbox = _native.AmInbox(receiver.worker, AM_INSERT_ID)
    port = inbox.listen("127.0.0.1", 0)
    writer = UcxRuntime(config=rendezvous_config(), env_tls=ucx_tls())
    if mode == "staging":
        region = StagingBuffer(writer, 0, 2 * ITEM).region
    else:  # the region holds the context only, not the workers
        region = _native.MemoryRegion.write_protected(writer.context, 2 * ITEM)
    region.view()[:] = 7
    ep = writer.listener_endpoint("127.0.0.1", port, "receiver", 10.0)
    _native.am_send(ep, region, AM_INSERT_ID, 1, np.array([0, ITEM], np.uint64),
                    np.array([ITEM, ITEM], np.uint64))
    deadline = time.monotonic() + 10
    while inbox.waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    print("held", inbox.waiting, flush=True)
    if inbox.waiting < 2:
        return 2  # the receiver never got both: nothing was tested
    writer.close()  # closes the endpoint: the held sends are aborted
    del ep, writer
    gc.collect()  # the writer's runtime is gone
    del region  # unmapped now: UCX finishes the aborted sends on the writer's worker
    gc.collect()
    inbox.close()
    receiver.close()
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
