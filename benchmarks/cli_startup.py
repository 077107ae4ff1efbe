"""How long `mdc --help` and a config error take, each in a fresh process (what a person waits for),
and which heavy modules the CLI imported to answer: torch, Ray and MLflow belong to the command that
runs something, never to help or to a typo.

    python -m benchmarks.cli_startup [--repeats 5] [--root DIR]

--root: the checkout whose CLI is timed (default: this one), e.g. an older commit's worktree for a
before/after pair. Prints the median and the range of each, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "mdc --help": ["--help"],
    "mdc train train.stpes=3 (config error)": ["train", "train.stpes=3"],
}


def timed(root: Path, args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(root)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=root, env=env, capture_output=True, check=False)
    return time.perf_counter() - start


def heavy_modules(root: Path) -> list[str]:
    """The heavy modules in sys.modules after `import pipelines.cli` (what every invocation pays)."""
    code = "import sys, pipelines.cli; print([m for m in ('torch', 'ray', 'mlflow') if m in sys.modules])"
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().replace("'", '"'))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    print(f"root {args.root}, load average before {os.getloadavg()[0]:.2f}")
    timed(args.root, ["--help"])  # warm the file cache: every later run reads the same files
    for name, argv in CASES.items():
        times = [timed(args.root, argv) for _ in range(args.repeats)]
        print(f"{name}: median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})")
    print(f"heavy modules after `import pipelines.cli`: {heavy_modules(args.root) or 'none'}")
    print(f"load average after {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
