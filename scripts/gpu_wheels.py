"""Fetch the wheels a bare GPU machine needs for scripts/gpu_check.py, as docs/benchmarks.md's table lists them.

    python scripts/gpu_wheels.py            # download them into .whl/ (git-ignored) and print their total size
    python scripts/gpu_wheels.py --list     # the pinned wheels and the pip command, nothing downloaded

The table between the gpu-wheels markers in docs/benchmarks.md is the one place the list lives: which project
dependencies the lent GPU machines already have and which travel as wheels (each pinned, with what it needs
there). The machines run CPython 3.12 on x86_64 Linux, so the wheels are fetched for that platform whatever this
machine runs. On the GPU machine, before the command:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD

The device tool carries at most 64 MiB per call; this script fails if the wheels come to more.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
CARRY_LIMIT = 64 * 2**20   # what one call of the device tool may carry
PLATFORM_FLAGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                  *[f for p in ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                                "manylinux2014_x86_64") for f in ("--platform", p)]]


def table_rows(text: str) -> list[tuple[str, str, str]]:
    """(dependency, on the GPU machine, carried as wheels) for each row of the gpu-wheels table."""
    table = text.split("<!-- gpu-wheels:begin -->")[1].split("<!-- gpu-wheels:end -->")[0]
    rows = [line.split("|")[1:-1] for line in table.strip().splitlines()[2:]]
    return [(a.strip(), b.strip(), c.strip()) for a, b, c in rows]


def pinned_wheels(text: str) -> list[str]:
    """NAME==VERSION for every wheel the table says to carry, in its order ("bitsandbytes 0.50.2 (41 MiB, ...)")."""
    out = []
    for _, _, carried in table_rows(text):
        if carried:
            out += [f"{name}=={version}" for name, version in re.findall(r"([A-Za-z0-9_.-]+) (\d[\w.]*)", carried)]
    return out


def download_command(wheels: list[str], dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM_FLAGS, "-d", str(dest), *wheels]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the wheels and the pip command; download nothing")
    ap.add_argument("--dest", default=str(ROOT / ".whl"), help="where the wheels go (default .whl/)")
    args = ap.parse_args()
    wheels = pinned_wheels(DOC.read_text())
    dest = Path(args.dest)
    cmd = download_command(wheels, dest)
    print(f"{len(wheels)} wheels (docs/benchmarks.md): {' '.join(wheels)}")
    if args.list:
        print(" ".join(cmd[1:]))
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        print(f"error: pip download failed (exit {proc.returncode}); the machine needs PyPI", file=sys.stderr)
        return proc.returncode
    wanted = {re.sub(r"[-_.]+", "_", w.split("==")[0]).lower() for w in wheels}
    files = [f for f in dest.glob("*.whl") if f.name.split("-")[0].lower() in wanted]
    size = sum(f.stat().st_size for f in files)
    print(f"{len(files)} files in {dest}, {size / 2**20:.1f} MiB (the device tool carries {CARRY_LIMIT >> 20} MiB a call)")
    if size > CARRY_LIMIT:
        print("error: more than one call may carry; split the carried rows over two calls", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
