"""The error vocabulary of the control channel (protocol.ERRORS), both ways."""

from __future__ import annotations

import msgpack
import pytest

from distore_ucx import errors, protocol


@pytest.mark.parametrize("code, cls", sorted(protocol.ERRORS.items()))
def test_every_code_comes_back_as_its_class(code, cls):
    exc = cls("what happened") if cls is not errors.RemoteError else cls("boom", code)
    msg = protocol.error_reply(7, exc)
    assert msg == {"id": 7, "ok": False, "error": code, "message": str(exc)}
    # Through the frame encoding, as a peer receives it.
    body = b"".join(bytes(b) for b in protocol.encode(msg))[protocol.HEADER_SIZE:]
    back = protocol.remote_error(protocol.decode(body), "control plane")
    assert type(back) is cls
    assert str(back).endswith("(from control plane)") and str(exc) in str(back)


def test_codes_and_classes_are_one_to_one():
    assert len(set(protocol.ERRORS.values())) == len(protocol.ERRORS)
    # Every public error of errors.py that can cross the wire has a code.
    public = {c for c in vars(errors).values() if isinstance(c, type)
              and issubclass(c, errors.DistoreError)}
    native_only = {errors.OutOfBoundsError, errors.InvalidArgument, errors.Unsupported}
    # Raised where a connection is made, about the peer: never sent.
    local_only = {errors.WrongPeer}
    assert public - native_only - local_only - set(protocol.ERRORS.values()) == set()


def test_an_unlisted_subclass_travels_as_its_nearest_listed_base():
    class Special(errors.StorageFull):
        pass

    assert protocol.error_code(Special("x")) == "storage_full"
    assert protocol.error_code(errors.OutOfBoundsError("x")) == "ucx"
    assert protocol.error_code(protocol.ProtocolError("bad")) == "invalid_request"
    assert protocol.error_code(KeyError("bug")) == "internal"
    assert protocol.error_code(ValueError("bug")) == "internal"


def test_an_unknown_or_missing_code_is_a_remote_error_naming_it():
    back = protocol.remote_error({"id": 1, "ok": False, "error": "from_the_future",
                                  "message": "m"}, "node a")
    assert type(back) is errors.RemoteError and back.kind == "from_the_future"
    # Class names (as an older peer sent them) are not looked up in errors.py.
    back = protocol.remote_error({"error": "ConfigError", "message": "m"}, "node a")
    assert type(back) is errors.RemoteError
    back = protocol.remote_error({"error": None}, "node a")
    assert type(back) is errors.RemoteError and "unknown error" in str(back)


def test_not_the_users_configuration_is_not_a_config_error():
    # A node gone is a connection problem (writers resend), an invalid request
    # is a value problem of the peer; neither is ConfigError.
    assert issubclass(errors.NodeGone, errors.ConnectionFailed)
    assert not issubclass(errors.NodeGone, errors.ConfigError)
    assert not issubclass(errors.InvalidRequest, errors.ConfigError)
    assert msgpack.unpackb(msgpack.packb(protocol.error_reply(1, errors.NodeGone("x"))))[
        "error"] == "node_gone"
