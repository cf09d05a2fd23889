"""The checks of a task's layer that run in the image, by the image's Python (standard library
only: this file is copied into the build's folder and run as a script there).

``sources DIR``: what each source distribution in ``DIR`` (pip's download of those the layer
would build) needs to build: a compiler and Python's headers for C/C++/Cython sources, CUDA's
compiler for CUDA sources, the image's torch where its build imports torch; what the image
lacks refuses the build before it starts, else a JSON list of what will be compiled and
against which torch. ``imports SITE``: with the layer bound at ``SITE`` first on Python's path,
every top-level module it installs imported, and every namespace it shares with the image
holding both halves. A refusal is written to ``refused.txt`` (in the working folder) and ends
the script with :data:`REFUSED`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

REFUSED = 4  # the exit status of a refusal (its reasons in refused.txt)
REFUSAL = "refused.txt"
NATIVE = (".c", ".cc", ".cpp", ".cxx", ".pyx")  # compiled for Python: a compiler, Python.h
CUDA = (".cu", ".cuh")  # CUDA's compiler (nvcc) and headers too
# A build that imports torch (setup.py) or requires it (pyproject.toml's build-system).
USES_TORCH = re.compile(r"^\s*(import|from)\s+torch\b|[\"']torch\b", re.M)
LEGACY_BACKEND = ["setuptools"]  # a build without pyproject.toml (pip's --use-pep517)
MODULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\.py|\.[A-Za-z0-9_-]+\.so|\.so|\.abi3\.so)$")


def _members(archive: Path) -> dict[str, bytes | None]:
    """Every member's path below the sdist's top folder; setup.py's and pyproject.toml's text."""
    found: dict[str, bytes | None] = {}
    wanted = ("setup.py", "pyproject.toml")
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                inner = name.split("/", 1)[-1]
                found[inner] = z.read(name) if inner in wanted else None
        return found
    with tarfile.open(archive) as t:
        for member in t.getmembers():
            inner = member.name.split("/", 1)[-1]
            handle = t.extractfile(member) if inner in wanted and member.isfile() else None
            found[inner] = handle.read() if handle else None
    return found


def needs(members: dict[str, bytes | None]) -> dict[str, object]:
    """What building an sdist of these ``members`` needs: ``native`` (its C/C++/Cython
    sources), ``cuda`` (its CUDA sources), ``torch`` (its build imports torch), ``requires``
    (its build-system's requirements, by name)."""
    paths = sorted(members)
    text = b"\n".join(members.get(n) or b"" for n in ("setup.py", "pyproject.toml")).decode(
        errors="replace"
    )
    requires = LEGACY_BACKEND
    if members.get("pyproject.toml"):
        system = tomllib.loads(members["pyproject.toml"].decode()).get("build-system", {})
        requires = [re.split(r"[\s\[<>=!~;@(]", r.strip(), maxsplit=1)[0]
                    for r in system.get("requires", LEGACY_BACKEND)]  # fmt: skip
    return {
        "native": [p for p in paths if p.endswith(NATIVE + CUDA)],
        "cuda": any(p.endswith(CUDA) for p in paths) or "CUDAExtension" in text,
        "torch": bool(USES_TORCH.search(text)),
        "requires": sorted({r for r in requires if r}),
    }


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_version() -> str | None:
    """The image's torch as it names itself (``torch.__version__``, e.g. ``2.5.1+cu124``: the
    build an extension compiles against), read from its ``version.py`` without importing it."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec and spec.submodule_search_locations) or []:
        found = re.search(
            r"^__version__\s*=\s*['\"]([^'\"]+)", Path(folder, "version.py").read_text(), re.M
        )
        if found:
            return found.group(1)
    return None


def _bdist_wheel() -> bool:
    """Whether the image's setuptools builds wheels itself (70.1 and newer): a build that
    still lists ``wheel`` needs no wheel package then."""
    found = re.match(r"(\d+)\.(\d+)", _installed("setuptools") or "0.0")
    return found is not None and (int(found[1]), int(found[2])) >= (70, 1)


def lacking(need: dict[str, object]) -> list[str]:
    """What this image lacks to build a source distribution that needs ``need``."""
    missing = [f"{r} (its build requirement)" for r in need["requires"]
               if not _installed(r) and not (r == "wheel" and _bdist_wheel())]  # fmt: skip
    if need["native"] or need["cuda"]:
        compilers = {"C++ compiler": os.environ.get("CXX", "c++"),
                     "C compiler": os.environ.get("CC", "cc")}  # fmt: skip
        missing += [f"a {what} ({cmd})" for what, cmd in compilers.items() if not shutil.which(cmd)]
        include = Path(sysconfig.get_paths()["include"])
        if not (include / "Python.h").is_file():
            missing.append(f"Python's headers ({include}/Python.h: python3-dev)")
    if need["cuda"]:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        if not (shutil.which("nvcc") or Path(home, "bin", "nvcc").is_file()):
            missing.append(f"CUDA's compiler and headers (nvcc: not on PATH nor in {home}/bin)")
    if need["torch"] and not torch_version():
        missing.append("torch")
    return missing


def sources(folder: Path, out: Path) -> list[str]:
    """Check every sdist in ``folder``; write what is built from source to ``out``; the
    refusals (one a package: what it is, what the image lacks)."""
    refusals, built = [], []
    for archive in sorted(folder.iterdir()):
        stem = re.sub(r"(\.tar\.gz|\.tar\.bz2|\.tgz|\.zip)$", "", archive.name)
        name, _, version = stem.rpartition("-")
        need = needs(_members(archive))
        missing = lacking(need)
        native = need["native"]
        if missing:
            kind = "pure Python"
            if native:
                kind = "to compile: " + ", ".join(native[:3]) + (", ..." if native[3:] else "")
            if need["torch"]:
                kind += "; its build imports torch"
            refusals.append(f"{name}=={version}: a source distribution ({kind}), and the image "
                            f"lacks {'; '.join(missing)}")  # fmt: skip
        built.append({"package": f"{name}=={version}", "compiled": bool(native),
                      "torch": torch_version() if need["torch"] else None})  # fmt: skip
    out.write_text(json.dumps(built))
    return refusals


def units(site: Path) -> dict[str, Path]:
    """The importable names the layer ``site`` installs at its top (a namespace folder's:
    those below it) -> their path."""
    found: dict[str, Path] = {}

    def walk(folder: Path, prefix: str) -> None:
        for entry in sorted(folder.iterdir()):
            if entry.name.endswith((".dist-info", ".egg-info", ".data")) or entry.name in (
                "bin", "__pycache__"
            ):  # fmt: skip
                continue
            if entry.is_dir() and entry.name.isidentifier():
                if (entry / "__init__.py").is_file():
                    found[prefix + entry.name] = entry
                else:
                    walk(entry, f"{prefix}{entry.name}.")
            elif (m := MODULE.match(entry.name)) and m.group(1) != "__init__":
                found.setdefault(prefix + m.group(1), entry)

    walk(site, "")
    return found


def owners(site: Path) -> dict[str, str]:
    """Top-level name -> the distribution (``name==version``) whose RECORD installed it."""
    found: dict[str, str] = {}
    for record in site.glob("*.dist-info/RECORD"):
        meta = (record.parent / "METADATA").read_text(errors="replace")
        fields = dict(re.findall(r"^(Name|Version): (.+)$", meta, re.M))
        dist = f"{fields.get('Name', '?').strip()}=={fields.get('Version', '?').strip()}"
        for line in record.read_text(errors="replace").splitlines():
            top = line.split(",", 1)[0].split("/", 1)[0]
            top = MODULE.sub(r"\1", top)
            found.setdefault(top, dist)
    return found


def _split(site: Path, top: str, image: list[Path], by: dict[str, str]) -> str | None:
    """Why the namespace ``top``, in the layer ``site`` and in the image's path ``image``, is
    not whole once imported (both halves on its ``__path__``); None when it is, or not split."""
    halves = [site / top] + [p / top for p in image if (p / top).is_dir()]
    if len(halves) == 1 or not halves[0].is_dir():
        return None
    try:
        module = importlib.import_module(top)
    except BaseException:  # (named by the import of the layer's own modules)
        return None
    seen = {Path(p).resolve() for p in getattr(module, "__path__", [])}
    hidden = [h for h in halves if h.resolve() not in seen]
    if not hidden:
        return None
    regular = [str(h) for h in halves if (h / "__init__.py").is_file()]
    return (
        f"the namespace {top} is split between the layer ({halves[0]}, from {by.get(top, '?')}) "
        f"and the image ({', '.join(map(str, halves[1:]))}), and Python imports only one half: "
        f"{', '.join(map(str, hidden))} hidden (an __init__.py in {', '.join(regular) or 'none'})"
    )


def imports(site: Path) -> list[str]:
    """The problems of the layer ``site`` (first on sys.path): a namespace it shares with the
    image that is not whole, a module of its own that cannot be imported or is another's."""
    site = site.resolve()
    by = owners(site)
    image = [Path(p) for p in sys.path if p and not Path(p).resolve().is_relative_to(site)]
    found = units(site)
    problems = [why for top in sorted({n.split(".")[0] for n in found})
                if (why := _split(site, top, image, by))]  # fmt: skip
    for name, path in found.items():
        label = f"{name} (from {by.get(name.split('.')[0], 'the layer')})"
        try:
            module = importlib.import_module(name)
        except BaseException as e:  # whatever the import raises is the finding
            problems.append(f"{label} cannot be imported: {type(e).__name__}: {e}")
            continue
        where = [Path(p) for p in getattr(module, "__path__", [])]
        where = where or [Path(module.__file__ or "/")]
        if not any(p.resolve().is_relative_to(path if path.is_dir() else path.parent)
                   for p in where):  # fmt: skip
            problems.append(f"{label}: Python imports another {name} ({where[0]})")
    return problems


def main(argv: list[str]) -> int:
    what, where = argv[0], Path(argv[1])
    here = Path(__file__).parent  # the build's folder
    if sys.path and Path(sys.path[0]).resolve() == here.resolve():
        del sys.path[0]  # (not on a rank's path)
    found = sources(where, here / "sources.json") if what == "sources" else imports(where)
    if not found:
        return 0
    (here / REFUSAL).write_text("".join(f"{p}\n" for p in found))
    for problem in found:
        print(f"ddppipe: {problem}", file=sys.stderr)
    return REFUSED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
