#!/usr/bin/env python3
"""Counts the instruction classes that matter for the attention kernels in the SASS of cubins
(as `tools/compile_check.py --keep DIR` leaves them): tensor-core products, `ldmatrix`,
16-byte asynchronous copies, global and local memory traffic, fast exponentials.

    python3 tools/sass_summary.py DIR/*.cubin

Needs `cuobjdump` and `nvdisasm` on PATH (CUDA toolkit, or the PyPI wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm). Predicated-off padding (`@!PT`) is not
counted.
"""
import re
import subprocess
import sys

CLASSES = [
    ("HMMA", r"HMMA\.16816\.F32"),
    ("LDSM", r"LDSM\.16\.M88\.4"),
    ("LDSM.T", r"LDSM\.16\.MT88\.4"),
    ("LDGSTS.128", r"LDGSTS\.E\.BYPASS\.128"),
    ("LDG", r"LDG\.E"),
    ("STG", r"STG\.E"),
    ("LDL", r"LDL"),
    ("STL", r"STL"),
    ("MUFU.EX2", r"MUFU\.EX2"),
]
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?);")


def summary(cubin):
    sass = subprocess.run(
        ["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    counts = dict.fromkeys([name for name, _ in CLASSES] + ["total"], 0)
    for line in sass.splitlines():
        m = INSTRUCTION.match(line)
        if not m or m.group(1).startswith("@!PT"):
            continue
        counts["total"] += 1
        for name, pattern in CLASSES:
            if re.search(r"\b" + pattern, m.group(1)):
                counts[name] += 1
    return counts


def main(paths):
    if not paths:
        sys.exit(__doc__)
    names = [name for name, _ in CLASSES] + ["total"]
    print("| kernel | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    for path in paths:
        counts = summary(path)
        kernel = path.rsplit("/", 1)[-1].split(".")[0]
        print(f"| {kernel} | " + " | ".join(str(counts[n]) for n in names) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
