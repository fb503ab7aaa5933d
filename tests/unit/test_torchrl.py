"""distore_ucx.torchrl without a store: specs from TensorDicts, key names,
and that importing distore_ucx leaves torch alone."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install '.[examples]')")
tensordict = pytest.importorskip(
    "tensordict", reason="needs tensordict (pip install '.[examples]')"
)
TensorDict = tensordict.TensorDict


def run_python(code: str, check: bool) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, outside the checkout (the installed package)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=check, cwd="/")


def test_importing_distore_ucx_imports_neither_torch_nor_torchrl():
    code = (
        "import sys, distore_ucx; "
        "print(sorted(m for m in ('torch', 'tensordict', 'torchrl') if m in sys.modules))"
    )
    out = run_python(code, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_spec_of_a_nested_tensordict_has_per_item_shapes_and_dtypes():
    from distore_ucx.torchrl import spec_of

    td = TensorDict(
        {
            "observation": torch.zeros(5, 4),
            "action": torch.zeros(5, 2, dtype=torch.long),
            ("next", "reward"): torch.zeros(5, 1),
            ("next", "done"): torch.zeros(5, 1, dtype=torch.bool),
            "td_error": torch.zeros(5),
        },
        [5],
    )
    spec = spec_of(td, exclude=["td_error"])
    assert spec == {
        "observation": ((4,), np.dtype("float32")),
        "action": ((2,), np.dtype("int64")),
        "next/reward": ((1,), np.dtype("float32")),
        "next/done": ((1,), np.dtype("bool")),
    }
    import distore_ucx as ds

    parsed = ds.TableSpec.parse(spec)  # a spec distore takes as it is
    assert [f.name for f in parsed.fields] == list(spec)


@pytest.mark.parametrize(
    "td, words",
    [
        (lambda: TensorDict({"a/b": torch.zeros(2, 1)}, [2]), ["'a/b'", "exclude_keys="]),
        (lambda: TensorDict({"x" * 70: torch.zeros(2, 1)}, [2]), ["70 characters", "64"]),
        (
            lambda: TensorDict({"w": torch.zeros(2, 1, dtype=torch.bfloat16)}, [2]),
            ["bfloat16", "convert"],
        ),
    ],
)
def test_keys_and_dtypes_a_table_cannot_hold_are_refused_with_what_to_do(td, words):
    import distore_ucx as ds
    from distore_ucx.torchrl import spec_of

    with pytest.raises(ds.ConfigError) as err:
        spec_of(td())
    for word in words:
        assert word in str(err.value)


def test_the_first_ndim_batch_dimensions_index_items():
    # As TorchRL's storages: [n_envs, T] is n_envs items of [T] steps with
    # ndim=1 (the default), n_envs * T items with ndim=2.
    import distore_ucx as ds
    from distore_ucx.torchrl import spec_of

    td = TensorDict({"obs": torch.zeros(2, 3, 4)}, [2, 3])
    assert spec_of(td) == {"obs": ((3, 4), np.dtype("float32"))}
    assert spec_of(td, ndim=2) == {"obs": ((4,), np.dtype("float32"))}
    with pytest.raises(ds.SpecMismatch, match="first 3 batch dimension"):
        spec_of(td, ndim=3)
    with pytest.raises(TypeError, match="TensorDict"):
        spec_of({"obs": torch.zeros(2, 4)})


def test_without_tensordict_the_import_says_what_to_install():
    code = (
        "import sys; sys.modules['tensordict'] = None\n"
        "try:\n    import distore_ucx.torchrl\nexcept ImportError as e:\n    print(e)"
    )
    out = run_python(code, check=True)
    assert "pip install 'distore-ucx[torchrl]'" in out.stdout, out.stdout + out.stderr


def test_the_example_without_torchrl_says_what_to_install():
    import os

    path = os.path.abspath(
        os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torchrl_dqn.py")
    )
    code = (
        "import runpy, sys; sys.modules['torchrl'] = None; "
        f"sys.argv = [{path!r}]; runpy.run_path({path!r}, run_name='__main__')"
    )
    out = run_python(code, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs torchrl, which is not installed" in out.stderr
    assert "pip install 'distore-ucx[examples]'" in out.stderr and "Traceback" not in out.stderr
