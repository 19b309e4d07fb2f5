"""`make bench`: every benchmark, each writing its own section of docs/benchmarks.md."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = (["saturation.py"], ["extraction.py", "--time-limit", "60"], ["lowering.py"], ["importing.py"], ["plans.py"],
           ["training.py"], ["substitutions.py"])


def main() -> int:
    for script, *args in SCRIPTS:
        print(f"== {script} {' '.join(args)}", flush=True)
        code = subprocess.call([sys.executable, str(HERE / script), *args])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
