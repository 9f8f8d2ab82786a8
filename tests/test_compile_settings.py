"""What the compiler is given is in the key: compile options from jax's config, XLA's
flags as the backend read them at start, a flags file by its contents.

Cross-process: process A fills the store, B runs under another compile setting and must compile
the program again and give what plain ``jax.jit`` gives there, C (A's setting again) loads A's
entry with no trace and no compile. The program is ``a * b - c`` with ``c`` the rounded
``a * b``: XLA:CPU contracts it into a fused multiply-add (the rounding error of each product)
unless its backend optimizations are off (zeros). Whether the value changes depends on the CPU
(FMA); that the executable XLA builds changes does not, and is asserted too.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import jax
import pytest

import kiln
from kiln._base import _jax_compat
from kiln._keys import environment_parts
from kiln._keys._compile_settings import compile_settings_parts, parse_xla_flags

OPT_OFF = "--xla_backend_optimization_level=0"

PROG = '''\
import hashlib
import os
import sys

import jax
import numpy as np

import kiln
from kiln._keys import environment_parts

mode = sys.argv[1]
if mode == "noopt":
    jax.config.update("jax_disable_most_optimizations", True)
elif mode == "late-flags":
    jax.devices()  # the backend starts: XLA has read its flags
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # never reaches XLA


def residual(a, b, c):
    TRACE()
    return a * b - c


def plain_residual(a, b, c):
    return a * b - c


rng = np.random.default_rng(0)
a = rng.standard_normal(64, dtype=np.float32)
b = rng.standard_normal(64, dtype=np.float32)
c = a * b  # rounded to float32: a fused multiply-add leaves the rounding error, else 0

call("kiln", kiln.jit(residual), a, b, c)
call("plain", jax.jit(plain_residual), a, b, c)
compiled = jax.jit(plain_residual).lower(a, b, c).compile()
executable = compiled.runtime_executable()
report(
    executable=hashlib.sha256(executable.client.serialize_executable(executable)).hexdigest(),
    parts={n: v for n, v in environment_parts() if n.startswith(("compile-", "xla-flags:"))},
)
'''


def _check_run(run: Any, xp: Any, *, warm: bool) -> list[float]:
    """kiln's value is plain jax.jit's in this process; A cold / C warm as asked."""
    rec = run["kiln"]
    (xp.assert_warm if warm else xp.assert_cold)(rec)
    assert xp.value(rec) == xp.value(run["plain"])
    return list(xp.value(rec))


def _check_changed(a: Any, b: Any, xp: Any) -> None:
    """B's setting changed what XLA built (machine-independent), and when that changes the
    value on this CPU, B's kiln value is the new one (``_check_run``: B's kiln == B's jax.jit)."""
    assert a.extra["executable"] != b.extra["executable"]
    if xp.value(a["plain"]) != xp.value(b["plain"]):
        assert xp.value(a["kiln"]) != xp.value(b["kiln"])


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> Any:
    def make(name: str) -> Any:
        prog = xp.Program(tmp_path_factory.mktemp(name))
        prog.write("prog.py", PROG)
        return prog

    return make


@pytest.mark.slow
def test_disable_most_optimizations_is_keyed(program: Any, xp: Any) -> None:
    """``jax.config.update("jax_disable_most_optimizations", True)`` (the same trace) compiles
    again and gives jax.jit's value; the default setting hits again, and so does the changed
    one (its own entry)."""
    prog = program("noopt")
    a = prog.run("default")
    b = prog.run("noopt")
    c = prog.run("default")
    d = prog.run("noopt")
    a_value = _check_run(a, xp, warm=False)
    _check_run(b, xp, warm=False)
    _check_changed(a, b, xp)
    assert _check_run(c, xp, warm=True) == a_value
    assert _check_run(d, xp, warm=True) == xp.value(b["plain"])
    assert a.extra["parts"]["compile-options"] != b.extra["parts"]["compile-options"]
    assert a.extra["parts"] == c.extra["parts"] and b.extra["parts"] == d.extra["parts"]


@pytest.mark.slow
def test_xla_flags_are_keyed_as_the_backend_read_them(program: Any, xp: Any) -> None:
    """A sets ``os.environ["XLA_FLAGS"]`` after the backend started (XLA never saw it): its
    entry is keyed without the flags, so B, with the flags exported (in effect), compiles
    again and gives jax.jit's value; C (flags set late again) hits A's entry, D B's."""
    prog = program("late_flags")
    a = prog.run("late-flags")
    b = prog.run("default", env={"XLA_FLAGS": OPT_OFF})
    c = prog.run("late-flags")
    d = prog.run("default", env={"XLA_FLAGS": OPT_OFF})
    a_value = _check_run(a, xp, warm=False)
    _check_run(b, xp, warm=False)
    _check_changed(a, b, xp)
    assert _check_run(c, xp, warm=True) == a_value
    assert _check_run(d, xp, warm=True) == xp.value(b["plain"])
    assert a.extra["parts"]["xla-flags:XLA_FLAGS"] == ""
    assert b.extra["parts"]["xla-flags:XLA_FLAGS"] == OPT_OFF


@pytest.mark.slow
def test_a_flags_file_is_keyed_by_its_contents(program: Any, xp: Any) -> None:
    """``XLA_FLAGS`` naming a file (a value not starting with ``-``: XLA reads the file): a
    change of the file's contents compiles again; the contents back, A's entry hits."""
    prog = program("flags_file")
    flags = prog.dir / "xla.flags"
    env = {"XLA_FLAGS": str(flags)}
    flags.write_text("--xla_cpu_enable_fast_math=false\n")
    a = prog.run("default", env=env)
    flags.write_text(f"{OPT_OFF}\n")
    b = prog.run("default", env=env)
    flags.write_text("--xla_cpu_enable_fast_math=false\n")
    c = prog.run("default", env=env)
    a_value = _check_run(a, xp, warm=False)
    _check_run(b, xp, warm=False)
    _check_changed(a, b, xp)
    assert _check_run(c, xp, warm=True) == a_value
    assert a.extra["parts"]["xla-flags:XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    assert b.extra["parts"]["xla-flags:XLA_FLAGS"] == OPT_OFF
    assert not any(str(flags) in v for run in (a, b) for v in run.extra["parts"].values())


# ----------------------------------------------------------------------------------------------
# In this process
# ----------------------------------------------------------------------------------------------
def _settings() -> dict[str, str]:
    return dict(compile_settings_parts(jax.devices()[0].client))


def test_os_environ_after_start_does_not_change_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend started long ago: XLA_FLAGS / LIBTPU_INIT_ARGS set now never reach XLA."""
    before = environment_parts()
    monkeypatch.setenv("XLA_FLAGS", OPT_OFF)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_foo=1")
    assert environment_parts() == before


def test_compile_options_follow_jax_config() -> None:
    """Config that feeds the compile options changes the part, and it comes back with the
    setting; config that only changes tracing is keyed elsewhere (``config:*``)."""
    base = _settings()["compile-options"]
    for name, value in (("jax_disable_most_optimizations", True),
                        ("jax_optimization_level", "O1"),
                        ("jax_exec_time_optimization_effort", 0.5),  # (not in jax 0.12)
                        ("jax_compiler_enable_remat_pass", False)):
        if name not in jax.config.values:
            continue
        old = jax.config.values[name]
        jax.config.update(name, value)
        try:
            assert _settings()["compile-options"] != base, name
        finally:
            jax.config.update(name, old)
        assert _settings()["compile-options"] == base, name
    with jax.default_matmul_precision("highest"):
        assert _settings()["compile-options"] == base


def test_compile_options_digest_is_jaxs_own() -> None:
    """The digest is JAX's cache key's digest of the options JAX builds (its own clearing of
    what does not change the executable), for one device, with the paths into JAX's cache
    directory set empty (set at all: a field set to "" serializes apart from one never set)."""
    from jax._src import cache_key, compiler

    backend = jax.devices()[0].client
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                           detailed_logging=True, backend=backend)
    debug = options.executable_build_options.debug_options
    debug.xla_gpu_per_fusion_autotune_cache_dir = ""
    debug.xla_gpu_kernel_cache_file = ""
    h = hashlib.sha256()
    cache_key._hash_serialized_compile_options(h, options, strip_device_assignment=True)
    assert _jax_compat.compile_options_digest(backend) == h.hexdigest()


def test_the_route_does_not_change_the_key() -> None:
    """With JAX's persistent cache on (the kiln:// route), JAX puts paths into its cache
    directory in the compile options: the key leaves them out."""
    before = _settings()
    kiln.enable_jax_cache()
    try:
        assert jax.config.jax_compilation_cache_dir is not None  # type: ignore[attr-defined]
        assert _settings() == before
    finally:
        kiln.disable_jax_cache()


def test_flags_at_backend_start_are_held() -> None:
    """The flags are the ones taken when the backend started (this process: none set, as the
    test environment has none), not os.environ now."""
    flags = _jax_compat.flags_at_backend_start()
    assert set(flags) == {"XLA_FLAGS", "LIBTPU_INIT_ARGS", "argv"}
    assert _settings()["xla-flags:XLA_FLAGS"] == " ".join(
        w for w in parse_xla_flags(flags["XLA_FLAGS"])
        if w.split("=", 1)[0] not in _jax_compat.flags_left_out_of_jax_key())


@pytest.mark.parametrize(("text", "flags"), [
    ("", []),
    ("--a", ["--a"]),
    ("  --a=1\t--b=2\n", ["--a=1", "--b=2"]),
    ("--a='x y' --b=\"p \\\" q\" --c", ["--a=x y", '--b=p " q', "--c"]),
    ("--a='x \\ y'", ["--a=x \\ y"]),  # no escapes in single quotes
    ("--a=1 stop --b=2", ["--a=1"]),  # XLA stops at a word not starting with "-"
    ("--a=1 --a=2", ["--a=1", "--a=2"]),  # order kept: the last one wins in XLA
])
def test_parse_xla_flags(text: str, flags: list[str]) -> None:
    assert parse_xla_flags(text) == flags


def test_a_flags_file_is_read_by_its_contents(tmp_path: Any) -> None:
    """XLA's rule: a value that does not start with ``-`` (after white space) names a file."""
    path = tmp_path / "flags"
    path.write_text(f"{OPT_OFF}\n")
    assert _jax_compat._flags_text(str(path)) == f"{OPT_OFF}\n"
    assert _jax_compat._flags_text(f"  {OPT_OFF}") == f"  {OPT_OFF}"
    assert _jax_compat._flags_text("") == ""
    assert _jax_compat._flags_text(os.fspath(tmp_path / "missing")).endswith("missing")


def test_dump_flags_do_not_change_the_key() -> None:
    """The flags JAX's own cache key leaves out (dump settings) are left out here too."""
    left_out = _jax_compat.flags_left_out_of_jax_key()
    assert "--xla_dump_to" in left_out
    words = parse_xla_flags(f"--xla_dump_to=/tmp/x {OPT_OFF}")
    assert [w for w in words if w.split("=", 1)[0] not in left_out] == [OPT_OFF]


def test_no_part_is_read_from_os_environ_at_call_time() -> None:
    """The compile settings' parts are there, and no ``env:*`` part (the text of
    ``os.environ`` at call time) is left."""
    names = [n for n, _ in environment_parts()]
    assert not any(n.startswith("env:") for n in names)
    assert {"compile-options", "xla-flags:XLA_FLAGS", "xla-flags:LIBTPU_INIT_ARGS",
            "xla-flags:argv"} <= set(names)
