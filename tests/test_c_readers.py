"""Files a trace reads through C libraries (kiln._keys._reads): h5py, netCDF4, pyarrow, zarr.

HDF5, netCDF and Arrow open their files in C, with no audit event; kiln wraps their known
openers while a recording is open. zarr's local store reads through Python's ``open`` in its own
event-loop thread and pool, which asyncio runs in the trace's context. Each test skips when its
library is not installed (the ``test`` extra installs them all).

In one process: what a recording keys for each reader; a ``kiln.jit`` function whose trace reads
a file through one hits its entry with no trace while the file is unchanged, and traces again
with the new content (as plain ``jax.jit``) once it changed. Across processes (slow): the same
with a fresh process per run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kiln_test_children import child_env, run_child

import kiln
from kiln._keys import _reads
from kiln._keys._reads import DIR, FILE, ReadRecorder, check_read

OLD = np.array([1.0, 2.0, 3.0])
NEW = np.array([3.0, 2.0, 1.0])  # the same values in another order: the same file size


def _back_date(path: Path) -> None:
    t = time.time() - 60
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (t, t))


# -- writers and readers, one per library ---------------------------------------------------


def _h5(path: Path, values: np.ndarray, create: bool) -> None:
    h5py = pytest.importorskip("h5py")
    if create:
        with h5py.File(path, "w") as f:
            f["x"] = values
    else:  # in place: the same file, the same size
        with h5py.File(path, "r+") as f:
            f["x"][...] = values


def _nc(path: Path, values: np.ndarray, create: bool) -> None:
    netCDF4 = pytest.importorskip("netCDF4")
    if create:
        with netCDF4.Dataset(path, "w") as d:
            d.createDimension("n", len(values))
            d.createVariable("x", "f8", ("n",))[:] = values
    else:
        with netCDF4.Dataset(path, "a") as d:
            d["x"][:] = values


def _table(values: np.ndarray) -> Any:
    pa = pytest.importorskip("pyarrow")
    return pa.table({"x": values})


def _parquet(path: Path, values: np.ndarray, create: bool) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(_table(values), path)


def _feather(path: Path, values: np.ndarray, create: bool) -> None:
    feather = pytest.importorskip("pyarrow.feather")
    feather.write_feather(_table(values), path)


def _csv(path: Path, values: np.ndarray, create: bool) -> None:
    pytest.importorskip("pyarrow.csv")
    path.write_text("x\n" + "".join(f"{v:.1f}\n" for v in values))


def _raw(path: Path, values: np.ndarray, create: bool) -> None:
    pytest.importorskip("pyarrow")
    path.write_bytes(values.astype(np.float64).tobytes())


def _zarr_array(path: Path, values: np.ndarray, create: bool) -> None:
    zarr = pytest.importorskip("zarr")
    if create:
        zarr.save_array(str(path), values)
    else:
        zarr.open_array(str(path), mode="r+")[:] = values


def _zarr_group(path: Path, values: np.ndarray, create: bool) -> None:
    zarr = pytest.importorskip("zarr")
    if create:
        group = zarr.open_group(str(path), mode="w")
        group.create_array("x", shape=values.shape, dtype=values.dtype)[:] = values
    else:
        zarr.open_group(str(path), mode="r+")["x"][:] = values


def _read_h5(p: str) -> Any:
    import h5py

    with h5py.File(p, "r") as f:
        return f["x"][...]


def _read_nc(p: str) -> Any:
    import netCDF4

    with netCDF4.Dataset(p) as d:
        return np.asarray(d["x"][:])


def _read_table(p: str) -> Any:
    import pyarrow.parquet as pq

    return pq.read_table(p).column("x").to_numpy()


def _read_parquet_file(p: str) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(p).read().column("x").to_numpy()


def _read_memory_map(p: str) -> Any:
    import pyarrow as pa

    with pa.memory_map(p) as f:
        return np.frombuffer(f.read(), np.float64)


def _read_os_file(p: str) -> Any:
    import pyarrow as pa

    with pa.OSFile(p) as f:
        return np.frombuffer(f.read(), np.float64)


def _read_feather_table(p: str) -> Any:
    import pyarrow.feather as feather

    return feather.read_table(p).column("x").to_numpy()


def _read_feather(p: str) -> Any:
    pytest.importorskip("pandas")
    import pyarrow.feather as feather

    return feather.read_feather(p)["x"].to_numpy()


def _read_csv(p: str) -> Any:
    import pyarrow.csv as pcsv

    return pcsv.read_csv(p).column("x").to_numpy()


def _read_zarr_open(p: str) -> Any:
    import zarr

    return zarr.open(p, mode="r")[:]


def _read_zarr_array(p: str) -> Any:
    import zarr

    return zarr.open_array(p, mode="r")[:]


def _read_zarr_group(p: str) -> Any:
    import zarr

    return zarr.open_group(p, mode="r")["x"][:]


# name: (file name, writer, reader)
CASES: dict[str, tuple[str, Callable[[Path, np.ndarray, bool], None], Callable[[str], Any]]] = {
    "h5py.File": ("d.h5", _h5, _read_h5),
    "netCDF4.Dataset": ("d.nc", _nc, _read_nc),
    "pyarrow.parquet.read_table": ("d.parquet", _parquet, _read_table),
    "pyarrow.parquet.ParquetFile": ("d.parquet", _parquet, _read_parquet_file),
    "pyarrow.memory_map": ("d.bin", _raw, _read_memory_map),
    "pyarrow.OSFile": ("d.bin", _raw, _read_os_file),
    "pyarrow.feather.read_table": ("d.feather", _feather, _read_feather_table),
    "pyarrow.feather.read_feather": ("d.feather", _feather, _read_feather),
    "pyarrow.csv.read_csv": ("d.csv", _csv, _read_csv),
    "zarr.open": ("a.zarr", _zarr_array, _read_zarr_open),
    "zarr.open_array": ("a.zarr", _zarr_array, _read_zarr_array),
    "zarr.open_group": ("g.zarr", _zarr_group, _read_zarr_group),
}


def _keyed_files(items: list[list[str]]) -> set[str]:
    return {os.path.abspath(i[0]) for i in items if i[1] == FILE}


@pytest.mark.parametrize("name", list(CASES))
def test_a_recording_keys_the_file_a_c_library_reads(tmp_path: Path, name: str) -> None:
    file, write, read = CASES[name]
    path = tmp_path / file
    write(path, OLD, True)
    _back_date(path)
    with ReadRecorder() as r:
        np.testing.assert_array_equal(read(str(path)), OLD)
    items = r.items()
    assert r.unkeyable is None, r.unkeyable
    keyed = _keyed_files(items)
    if path.is_dir():  # zarr: the files its store read (metadata, chunks), as it read them
        assert keyed and all(k.startswith(str(path) + os.sep) for k in keyed), items
    else:
        assert keyed == {str(path)}, items
    assert all(check_read(*i) is None for i in items if i[1] in (FILE, DIR))
    write(path, NEW, False)
    changed = [check_read(*i) for i in items if i[1] == FILE]
    assert any(c is not None and "changed" in c for c in changed), (items, changed)


@pytest.mark.parametrize("name", list(CASES))
def test_kiln_jit_hits_while_the_file_is_unchanged_and_follows_a_change(
    tmp_path: Path, name: str
) -> None:
    """Cold: traced and compiled. The same function again (its table cleared): a store hit,
    no trace. The file's content changed (the same size): traced again, with the new values,
    as plain jax.jit gives them."""
    file, write, read = CASES[name]
    path = tmp_path / file
    write(path, OLD, True)
    p = str(path)
    traces = []

    def scaled(x):
        traces.append(1)
        return x * jnp.asarray(read(p), jnp.float32)

    f = kiln.jit(scaled)
    x = jnp.ones(3, jnp.float32)
    np.testing.assert_array_equal(f(x), OLD)
    assert kiln.stats().reasons.get("verify-path", 0) == 0, kiln.stats().reasons
    f.clear_cache()
    kiln.reset_stats()
    traces.clear()
    np.testing.assert_array_equal(f(x), OLD)
    s = kiln.stats()
    assert (s.hits, s.traces, s.compiles, len(traces)) == (1, 0, 0, 0), s

    size = sum(q.stat().st_size for q in ([path, *path.rglob("*")] if path.is_dir() else [path])
               if q.is_file())
    write(path, NEW, False)
    if not path.is_dir() and name != "pyarrow.feather.read_feather":
        assert path.stat().st_size == size  # nothing but the content tells the change
    f.clear_cache()
    kiln.reset_stats()
    got = f(x)
    s = kiln.stats()
    assert s.hits == 0 and s.traces == 1 and s.compiles == 1, s
    np.testing.assert_array_equal(got, NEW)
    np.testing.assert_array_equal(got, jax.jit(lambda y: scaled(y))(x))


# -- what the wrappers are, and when ---------------------------------------------------------


def test_the_readers_are_wrapped_only_while_a_recording_is_open(tmp_path: Path) -> None:
    pcsv = pytest.importorskip("pyarrow.csv")
    netCDF4 = pytest.importorskip("netCDF4")
    read_csv, dataset = pcsv.read_csv, netCDF4.Dataset
    path = tmp_path / "d.nc"
    _nc(path, OLD, True)
    with ReadRecorder() as r:
        assert pcsv.read_csv is not read_csv and pcsv.read_csv.__wrapped__ is read_csv
        assert _reads.is_probe(pcsv.read_csv)  # the walk takes it for the original
        assert netCDF4.Dataset is not dataset
        with netCDF4.Dataset(path) as d:
            assert type(d) is dataset  # the library's own object
            assert isinstance(d, netCDF4.Dataset) and isinstance(d, dataset)
        assert issubclass(netCDF4.MFDataset, netCDF4.Dataset)
    assert pcsv.read_csv is read_csv and netCDF4.Dataset is dataset
    assert _keyed_files(r.items()) == {str(path)}


def test_readers_bound_by_name_before_the_trace_are_keyed_by_their_inner_opener(
    tmp_path: Path,
) -> None:
    """``from h5py import File`` and ``from pyarrow.parquet import read_table`` bind the
    library's own objects; kiln wraps what they call (h5py's ``make_fid``, ``ParquetDataset``,
    feather's reader), so those reads are keyed too."""
    pytest.importorskip("h5py")
    pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("pandas")
    from h5py import File
    from pyarrow.feather import read_feather
    from pyarrow.parquet import read_table

    _h5(tmp_path / "d.h5", OLD, True)
    _parquet(tmp_path / "d.parquet", OLD, True)
    _feather(tmp_path / "d.feather", OLD, True)
    with ReadRecorder() as r:
        File(tmp_path / "d.h5", "r").close()
        read_table(str(tmp_path / "d.parquet"))
        read_feather(str(tmp_path / "d.feather"))
    assert _keyed_files(r.items()) == {str(tmp_path / n) for n in ("d.h5", "d.parquet",
                                                                   "d.feather")}


def test_writing_through_a_reader_is_an_output_and_reading_while_writing_is_unkeyable(
    tmp_path: Path,
) -> None:
    h5py = pytest.importorskip("h5py")
    with ReadRecorder() as r:
        with h5py.File(tmp_path / "out.h5", "w") as f:
            f["x"] = OLD
    assert r.items() == [] and r.unkeyable is None
    _h5(tmp_path / "rw.h5", OLD, True)
    with ReadRecorder() as r:
        with h5py.File(tmp_path / "rw.h5", "a") as f:
            f["y"] = NEW
    assert r.items() == [] and r.unkeyable is not None and "changed while" in r.unkeyable


def test_a_dataset_directory_is_keyed_by_its_tree(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "table"
    (folder / "part=a").mkdir(parents=True)
    pq.write_table(_table(OLD), folder / "part=a" / "0.parquet")
    _back_date(folder)
    with ReadRecorder() as r:
        pq.read_table(str(folder))
    items = r.items()
    assert r.unkeyable is None, r.unkeyable
    assert [(os.path.relpath(i[0], tmp_path), i[1]) for i in items] == [
        ("table", DIR), ("table/part=a", DIR), ("table/part=a/0.parquet", FILE)]
    (folder / "part=b").mkdir()
    pq.write_table(_table(NEW), folder / "part=b" / "0.parquet")
    assert check_read(*items[0]) is not None  # a new partition: the listing changed


@pytest.mark.parametrize("what", ["netCDF4.MFDataset", "pyarrow.parquet.read_metadata",
                                  "pyarrow.input_stream", "pyarrow.csv.open_csv",
                                  "pyarrow.json.read_json", "pyarrow.ipc.open_file",
                                  "pyarrow.ipc.open_stream", "pyarrow.orc.ORCFile",
                                  "pyarrow.dataset.dataset"])
def test_other_known_readers_are_keyed(tmp_path: Path, what: str) -> None:
    path = tmp_path / "d"
    if what == "netCDF4.MFDataset":
        netCDF4 = pytest.importorskip("netCDF4")
        for i in range(2):
            with netCDF4.Dataset(tmp_path / f"m{i}.nc", "w", format="NETCDF4_CLASSIC") as d:
                d.createDimension("t", None)
                d.createVariable("x", "f8", ("t",))[:] = OLD
        path = tmp_path / "m0.nc"

        def read() -> Any:
            with netCDF4.MFDataset(str(tmp_path / "m*.nc")) as d:
                return d["x"][:]
    elif what == "pyarrow.json.read_json":
        pjson = pytest.importorskip("pyarrow.json")
        path.write_text('{"x": 1.0}\n{"x": 2.0}\n')

        def read() -> Any:
            return pjson.read_json(str(path))
    elif what == "pyarrow.orc.ORCFile":
        orc = pytest.importorskip("pyarrow.orc")
        orc.write_table(_table(OLD), str(path))

        def read() -> Any:
            return orc.ORCFile(str(path)).read()
    elif what.startswith("pyarrow.ipc"):
        ipc = pytest.importorskip("pyarrow.ipc")
        table = _table(OLD)
        new = ipc.new_file if what.endswith("file") else ipc.new_stream
        with new(str(path), table.schema) as w:
            w.write_table(table)

        def read() -> Any:
            opener = ipc.open_file if what.endswith("file") else ipc.open_stream
            return opener(str(path)).read_all()
    elif what == "pyarrow.input_stream":
        pa = pytest.importorskip("pyarrow")
        path.write_bytes(b"data")

        def read() -> Any:
            with pa.input_stream(str(path)) as s:
                return s.read()
    elif what == "pyarrow.csv.open_csv":
        pcsv = pytest.importorskip("pyarrow.csv")
        _csv(path, OLD, True)

        def read() -> Any:
            return pcsv.open_csv(str(path)).read_all()
    elif what == "pyarrow.dataset.dataset":
        ds = pytest.importorskip("pyarrow.dataset")
        _parquet(path, OLD, True)

        def read() -> Any:
            return ds.dataset(str(path), format="parquet").to_table()
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        _parquet(path, OLD, True)

        def read() -> Any:
            return pq.read_metadata(str(path))
    with ReadRecorder() as r:
        read()
    items = r.items()
    assert r.unkeyable is None, r.unkeyable
    assert str(path) in _keyed_files(items), items


def test_a_source_that_is_no_local_file_is_unkeyable(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    with ReadRecorder() as r:
        with pytest.raises(OSError):
            h5py.File(str(tmp_path / "part%d.h5"), "r", driver="family")
    assert r.unkeyable is not None and "HDF5 driver family" in r.unkeyable, r.unkeyable
    with pytest.raises(_reads._c_readers._NotLocal):
        _reads._c_readers._local("s3://bucket/table.parquet")
    assert _reads._c_readers._local("file:///data/t%20x.parquet") == "/data/t x.parquet"


def test_kiln_imports_no_reader_library(tmp_path: Path) -> None:
    """Opening a recording wraps the readers of the libraries already imported and imports
    none (a warm start never pays for h5py or pyarrow)."""
    prog = (
        "import sys\n"
        "from kiln._keys._reads import ReadRecorder\n"
        "with ReadRecorder():\n"
        "    open(sys.argv[1]).close()\n"
        "libs = ('h5py', 'netCDF4', 'pyarrow', 'zarr')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in libs))\n"
    )
    (tmp_path / "f").write_text("")
    proc = run_child([sys.executable, "-c", prog, tmp_path / "f"], env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


# -- across processes --------------------------------------------------------------------------

PROG = '''
import numpy as np
import jax
import jax.numpy as jnp

import h5py
import netCDF4
import pyarrow as pa
import pyarrow.csv
import pyarrow.feather
import pyarrow.parquet as pq
import zarr

import kiln


def by_h5py(x):
    TRACE()
    with h5py.File("d.h5", "r") as f:
        return x * jnp.asarray(f["x"][...], jnp.float32)


def by_netcdf(x):
    TRACE()
    with netCDF4.Dataset("d.nc") as d:
        return x * jnp.asarray(np.asarray(d["x"][:]), jnp.float32)


def by_parquet(x):
    TRACE()
    return x * jnp.asarray(pq.read_table("d.parquet").column("x").to_numpy(), jnp.float32)


def by_parquet_file(x):
    TRACE()
    table = pq.ParquetFile("d.parquet").read()
    return x * jnp.asarray(table.column("x").to_numpy(), jnp.float32)


def by_memory_map(x):
    TRACE()
    with pa.memory_map("d.bin") as f:
        return x * jnp.asarray(np.frombuffer(f.read(), np.float64), jnp.float32)


def by_os_file(x):
    TRACE()
    with pa.OSFile("d.bin") as f:
        return x * jnp.asarray(np.frombuffer(f.read(), np.float64), jnp.float32)


def by_feather(x):
    TRACE()
    table = pyarrow.feather.read_table("d.feather")
    return x * jnp.asarray(table.column("x").to_numpy(), jnp.float32)


def by_csv(x):
    TRACE()
    table = pyarrow.csv.read_csv("d.csv")
    return x * jnp.asarray(table.column("x").to_numpy(), jnp.float32)


def by_zarr(x):
    TRACE()
    return x * jnp.asarray(zarr.open_array("a.zarr", mode="r")[:], jnp.float32)


def late_import(x):
    TRACE()
    import pyarrow.json  # first imported while tracing: its reader is not wrapped yet

    table = pyarrow.json.read_json("d.json")
    return x * jnp.asarray(table.column("x").to_numpy(), jnp.float32)


FUNCTIONS = {name: fn for name, fn in globals().items() if name.startswith(("by_", "late_"))}
x = jnp.ones(3, jnp.float32)
for name, fn in FUNCTIONS.items():
    call(name, kiln.jit(fn), x)
for name, fn in FUNCTIONS.items():
    call("jax:" + name, jax.jit(fn), x)
report()
'''

CROSS = ("by_h5py", "by_netcdf", "by_parquet", "by_parquet_file", "by_memory_map",
         "by_os_file", "by_feather", "by_csv", "by_zarr")


def _write_inputs(folder: Path, values: np.ndarray, create: bool) -> None:
    for file, write in (("d.h5", _h5), ("d.nc", _nc), ("d.parquet", _parquet),
                        ("d.bin", _raw), ("d.feather", _feather), ("d.csv", _csv),
                        ("a.zarr", _zarr_array)):
        write(folder / file, values, create)
    (folder / "d.json").write_text("".join(f'{{"x": {v}}}\n' for v in values))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    for lib in ("h5py", "netCDF4", "pyarrow", "zarr"):
        pytest.importorskip(lib)
    prog = xp.Program(tmp_path_factory.mktemp("c_readers"))
    prog.write("prog.py", PROG)
    _write_inputs(prog.dir, OLD, True)
    out = {"A": prog.run(), "B": prog.run()}
    _write_inputs(prog.dir, NEW, False)
    out["C"] = prog.run()
    _write_inputs(prog.dir, OLD, False)
    out["D"] = prog.run()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", CROSS)
def test_across_processes_a_changed_file_gives_the_new_value(
    runs: dict[str, Any], xp: Any, name: str
) -> None:
    """A cold, B and D the original value, C traced and compiled again with the new value,
    as plain jax.jit gives it in the same process."""
    a, b, c, d = (runs[k][name] for k in "ABCD")
    xp.assert_cold(a)
    for rec in (a, b, d):
        assert xp.value(rec) == OLD.tolist()
    assert xp.value(c) == NEW.tolist()
    assert c["py_traces"] >= 1 and c["compiles"] == 1 and c["hits"] == 0, c
    for k in "ABCD":
        assert xp.value(runs[k][name]) == xp.value(runs[k]["jax:" + name])


@pytest.mark.slow
@pytest.mark.parametrize("name", CROSS)
def test_across_processes_an_unchanged_file_warm_starts(
    runs: dict[str, Any], xp: Any, name: str
) -> None:
    """B (nothing changed since A): loaded with no trace, no lowering, no compile."""
    xp.assert_warm(runs["B"][name])


@pytest.mark.slow
def test_across_processes_a_reader_first_imported_while_tracing_takes_the_verify_path(
    runs: dict[str, Any], xp: Any
) -> None:
    xp.assert_cold(runs["A"]["late_import"])
    for k in "BD":
        xp.assert_warm_verified(runs[k]["late_import"])
    for k in "ABCD":  # that function only
        assert runs[k].stats["reasons"].get("verify-path", 0) == 1, runs[k].stats["reasons"]
        assert xp.value(runs[k]["late_import"]) == xp.value(runs[k]["jax:late_import"])
    assert xp.value(runs["C"]["late_import"]) == NEW.tolist()
