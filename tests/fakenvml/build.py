"""Build the fake NVML library with gcc, once per set of sources and flags.

Tests import this module (``from fakenvml.build import build``, with ``tests/`` on ``sys.path``
as pytest puts it there) or load it by path; it imports nothing outside the standard library.
From a shell: ``python tests/fakenvml/build.py OUT_DIR [--omit NAME ...]`` prints the path.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("fakenvml.c", "scenario.c")
HEADERS = ("nvml_abi.h", "scenario.h")
LIBRARY_NAME = "libnvidia-ml.so.1"
STAMP_NAME = LIBRARY_NAME + ".sha256"
FLAGS = (
    "-shared",
    "-fPIC",
    "-O2",
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fvisibility=hidden",
    f"-Wl,-soname,{LIBRARY_NAME}",
)
LIBS = ("-lm", "-lpthread")


class BuildError(RuntimeError):
    """gcc is missing or rejected the sources; the message carries its output."""


def exported_functions() -> list[str]:
    """Every NVML entry point the fake defines, in source order (each one can be omitted)."""
    text = (SOURCE_DIR / "fakenvml.c").read_text()
    return re.findall(r"^#ifndef OMIT_(\w+)$", text, flags=re.MULTILINE)


def build(out_dir: Path, omit: Sequence[str] = ()) -> Path:
    """Compile into ``out_dir/libnvidia-ml.so.1`` unless an identical build is already there.

    Each name in ``omit`` compiles that exported function out (``-DOMIT_<name>``), as an older
    driver would lack it; pynvml then raises ``NVMLError_FunctionNotFound``. A process can load
    only one variant, so give each variant its own ``out_dir``.
    """
    known = set(exported_functions())
    unknown = sorted(set(omit) - known)
    if unknown:
        raise ValueError(f"not functions of the fake NVML library: {', '.join(unknown)}")
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise BuildError("gcc is needed to build the fake NVML library and is not on PATH")
    command = [
        compiler,
        *FLAGS,
        *(f"-DOMIT_{name}" for name in sorted(set(omit))),
        *(str(SOURCE_DIR / source) for source in SOURCES),
        *LIBS,
    ]
    digest = _digest(command)
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / LIBRARY_NAME
    stamp = out_dir / STAMP_NAME
    if library.exists() and stamp.exists() and stamp.read_text() == digest:
        return library
    # Compile beside the target and rename, so that a concurrent reader never sees half a file.
    with tempfile.TemporaryDirectory(prefix=".fakenvml-", dir=out_dir) as scratch:
        partial = Path(scratch) / LIBRARY_NAME
        completed = subprocess.run(
            [*command, "-o", str(partial)], capture_output=True, text=True, check=False
        )
        if completed.returncode != 0:
            raise BuildError(f"{' '.join(command)} failed:\n{completed.stderr}")
        partial.replace(library)
    stamp.write_text(digest)
    return library


def preload(library: Path) -> ctypes.CDLL:
    """Load the built library so that pynvml's ``CDLL("libnvidia-ml.so.1")`` finds it.

    glibc matches a later dlopen of a bare name against the SONAME of libraries already loaded;
    RTLD_GLOBAL is not what makes that work, but it mirrors how the real library is used.
    """
    return ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


def _digest(command: Sequence[str]) -> str:
    sha = hashlib.sha256()
    for part in command:
        sha.update(part.encode() + b"\0")
    for name in (*SOURCES, *HEADERS):
        sha.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    return sha.hexdigest()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the fake libnvidia-ml.so.1.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--omit", action="append", default=[], metavar="NAME", help="leave out this function"
    )
    arguments = parser.parse_args(argv)
    print(build(arguments.out_dir, arguments.omit))


if __name__ == "__main__":
    main()
