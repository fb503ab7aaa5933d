"""TableDefinition: one parse and check of a table, for every path that makes one."""

from __future__ import annotations

import math

import pytest

import distore_ucx as ds
from distore_ucx.config import check_file, resolve
from distore_ucx.errors import ConfigError
from distore_ucx.spec import TableSpec
from distore_ucx.table_definition import TableDefinition, TableProblems

SPEC = {"obs": ((4,), "float32")}


def test_defaults_and_the_wire_round_trip():
    d = TableDefinition.make("t", 10, SPEC)
    assert (d.sampler, d.remover, d.rate_limiter) == (ds.Uniform(), ds.Fifo(), ds.MinSize(1))
    assert d.spec == TableSpec.parse(SPEC) and d.max_times_sampled == 0
    for made in (d, TableDefinition.make("p", 5, SPEC, ds.Prioritized(0.6), "lifo",
                                         ds.SampleToInsertRatio(2, 3, 10), 4)):
        assert TableDefinition.from_wire(made.to_wire()) == made
    # Optional fields may be missing on the wire, as older clients send them.
    assert TableDefinition.from_wire({"name": "t", "capacity": 10,
                                      "spec": TableSpec.parse(SPEC).to_wire()}) == d


def test_a_queue_gets_fifo_selectors_and_one_use_on_every_path():
    d = TableDefinition.make("q", 10, SPEC, rate_limiter=ds.Queue(10))
    assert (d.sampler.kind, d.remover.kind, d.max_times_sampled) == ("fifo", "fifo", 1)
    assert TableDefinition.from_wire(d.to_wire()) == d
    toml = TableDefinition.from_config({"name": "q", "capacity": 10, "spec": [[4], "float32"],
                                        "rate_limiter": {"kind": "queue", "size": 10}})
    assert toml.rate_limiter == ds.Queue(10) and toml.max_times_sampled == 1
    with pytest.raises(ConfigError, match="Fifo sampler"):
        TableDefinition.make("q", 10, SPEC, sampler=ds.Uniform(), rate_limiter=ds.Queue(10))
    with pytest.raises(ConfigError, match="smaller than the queue size"):
        TableDefinition.make("q", 5, SPEC, rate_limiter=ds.Queue(10))


@pytest.mark.parametrize("kwargs, match", [
    ({"capacity": 0}, "capacity"),
    ({"capacity": True}, "capacity"),
    ({"max_times_sampled": -1}, "max_times_sampled"),
    ({"sampler": "psychic"}, "sampler"),
    ({"spec": {"x": ((-1,), "uint8")}}, "not storable"),
    ({"name": ""}, "name"),
])
def test_bad_parts_are_config_errors(kwargs, match):
    args = {"name": "t", "capacity": 10, "spec": SPEC, **kwargs}
    with pytest.raises(ConfigError, match=match):
        TableDefinition.make(**args)


def test_toml_tables_take_rate_limiters_selectors_with_alpha_and_max_times_sampled(tmp_path):
    path = tmp_path / "distore.toml"
    path.write_text("""
[[tables]]
name = "per"
capacity = 1000
spec = { obs = [[8], "float32"] }
sampler = { kind = "prioritized", alpha = 0.6 }
max_times_sampled = 3

[tables.rate_limiter]
kind = "sample_to_insert_ratio"
samples_per_insert = 8
min_size_to_sample = 100
error_buffer = 80
""")
    assert check_file(str(path)) == []
    (t,) = resolve({}, {}, str(path)).control().tables
    assert t.sampler == ds.Prioritized(0.6) and t.max_times_sampled == 3
    assert t.rate_limiter == ds.SampleToInsertRatio(8, 100, 80)
    assert not math.isinf(t.rate_limiter.max_diff)


def test_every_problem_of_a_toml_table_is_listed():
    with pytest.raises(TableProblems) as info:
        TableDefinition.from_config({"name": "t", "capacity": -1, "spec": [[4], "uint8"],
                                     "sampler": "psychic", "colour": 1,
                                     "rate_limiter": {"kind": "queue"}})
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert any("unknown key(s) colour" in p for p in problems)
    assert any("capacity must be" in p for p in problems)
    assert any("sampler 'psychic' unknown" in p for p in problems)
    assert any("rate_limiter: queue takes size; missing: size" in p for p in problems)


def test_the_deployment_guide_table_example_checks_clean(tmp_path):
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "deployment.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```toml\n")[1:]]
    (example,) = [b for b in blocks if "[[tables]]" in b and "rate_limiter" in b]
    path = tmp_path / "distore.toml"
    path.write_text(example)
    assert check_file(str(path)) == []
    (t,) = resolve({}, {}, str(path)).control().tables
    assert t.rate_limiter.kind == "sample_to_insert_ratio" and t.sampler.alpha == 0.6
