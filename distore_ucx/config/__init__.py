"""Typed configuration, and the one description of every setting.

A setting has one dotted name (``node.arena``), which is also its place in
``distore.toml`` (section ``[node]``, key ``arena``), one CLI flag
(``--arena``) and one environment variable (``DISTORE_ARENA``). Values are
taken in this order: CLI flag, then ``DISTORE_*`` variable, then the TOML
file, then the default. The CLI and the environment are read in one place
(cli.py) and handed to :func:`resolve`; nothing deeper reads either, and
processes get the typed dataclasses below. The one exception: measuring and
debugging switches (``DISTORE_AM_INSERTS``, ``DISTORE_AM_SAMPLES``, ...:
:data:`SWITCHES`), read by the functions of :mod:`.environment` where they
are used; ``distore config show`` lists them with the settings.

The package, one concept a module:

- :mod:`.settings`: the settings table, where every default is written once;
- :mod:`.roles`: the typed configurations (ControlConfig, NodeConfig,
  UcxConfig), whose setting-fed fields take their defaults from the table;
- :mod:`.values`: how one value is read (sizes, numbers, ports, tables);
- :mod:`.toml_file`: reading distore.toml, each problem with its line;
- :mod:`.resolved`: resolve() and Settings (flag > variable > file > default);
- :mod:`.checks`: what the processes refuse at start (config check);
- :mod:`.auth`: reading the shared token;
- :mod:`.environment`: the switches read from the environment where used
  (SWITCHES, switches_table).
"""

from ..table_definition import TableProblems
from .auth import MIN_TOKEN_BYTES, read_token, token_path
from .checks import check_exposure, check_file, is_loopback
from .environment import (
    AM_MIN_ITEM_BYTES,
    SWITCHES,
    Switch,
    am_insert_runs_enabled,
    am_inserts_enabled,
    am_min_item_bytes,
    am_samples_enabled,
    disk_bounce,
    local_map_default,
    register_delay,
    rendezvous_config,
    runtime_config,
    sample_ahead_from_env,
    size_from_env,
    switch_from_env,
    switches_shown,
    switches_table,
    ucx_tls,
    uvloop_enabled,
)
from .resolved import Settings, resolve
from .roles import ControlConfig, NodeConfig, UcxConfig
from .settings import (
    BY_NAME,
    METRICS_PORT_CONTROL,
    METRICS_PORT_NODE,
    SECTIONS,
    SETTINGS,
    Setting,
    settings_table,
)
from .toml_file import Problem, load_file
from .values import parse_size

# The first line is what `from distore_ucx.config import *` gave before the
# package; the rest were importable by name then too, and still are.
__all__ = [
    "ControlConfig", "NodeConfig", "UcxConfig", "Settings", "Setting",
    "SETTINGS", "Problem", "resolve", "load_file", "check_file", "parse_size", "settings_table",
    "TableProblems", "check_exposure", "is_loopback",
    "BY_NAME", "SECTIONS", "METRICS_PORT_CONTROL", "METRICS_PORT_NODE",
    "MIN_TOKEN_BYTES", "read_token", "token_path",
    "AM_MIN_ITEM_BYTES", "am_insert_runs_enabled", "am_inserts_enabled", "am_min_item_bytes",
    "am_samples_enabled",
    "disk_bounce",
    "local_map_default", "register_delay", "rendezvous_config", "runtime_config",
    "sample_ahead_from_env",
    "size_from_env",
    "switch_from_env", "ucx_tls", "uvloop_enabled", "SWITCHES", "Switch", "switches_shown",
    "switches_table",
]
