#!/usr/bin/env python3
"""Counts the instruction classes that matter for the attention kernels in the SASS of cubins
(as `tools/compile_check.py --keep DIR` leaves them): tensor-core products, `ldmatrix`,
16-byte asynchronous copies, global and local memory traffic, fast exponentials.

    python3 tools/sass_summary.py DIR/*.cubin          # whole kernels
    python3 tools/sass_summary.py --loop DIR/*.cubin   # the main loop of each kernel

With `--loop` only the instructions of each kernel's main loop are counted: the widest
backward branch whose body holds tensor-core products. That is a static count: branches
inside the loop that most iterations skip (the last block's bounds checks, the mask's edge)
are included. The most frequent opcodes of the loop follow the table.

Needs `cuobjdump` and `nvdisasm` on PATH (CUDA toolkit, or the PyPI wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm). Predicated-off padding (`@!PT`) is not
counted.
"""
import collections
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
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
TARGET = re.compile(r"BRA\b.*?0x([0-9a-f]+)")


def instructions(cubin):
    """(address, text) of every instruction but predicated-off padding."""
    sass = subprocess.run(
        ["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    found = []
    for line in sass.splitlines():
        m = INSTRUCTION.match(line)
        if m and not m.group(2).startswith("@!PT"):
            found.append((int(m.group(1), 16), m.group(2)))
    return found


def main_loop(found):
    """The instructions of the widest backward branch whose body holds products."""
    best = None
    for address, text in found:
        m = TARGET.search(text)
        if not m or int(m.group(1), 16) >= address:
            continue
        start = int(m.group(1), 16)
        body = [t for a, t in found if start <= a <= address]
        if any(re.search(CLASSES[0][1], t) for t in body):
            if best is None or len(body) > len(best):
                best = body
    return best or []


def opcode(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def count(texts):
    counts = dict.fromkeys([name for name, _ in CLASSES] + ["total"], 0)
    for text in texts:
        counts["total"] += 1
        for name, pattern in CLASSES:
            if re.search(r"\b" + pattern, text):
                counts[name] += 1
    return counts


def main(args):
    loop = "--loop" in args
    paths = [a for a in args if a != "--loop"]
    if not paths:
        sys.exit(__doc__)
    names = [name for name, _ in CLASSES] + ["total"]
    print("| kernel | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    mixes = []
    for path in paths:
        texts = [t for _, t in instructions(path)]
        if loop:
            texts = main_loop(instructions(path))
            mixes.append(collections.Counter(opcode(t) for t in texts))
        counts = count(texts)
        kernel = path.rsplit("/", 1)[-1].split(".")[0]
        print(f"| {kernel} | " + " | ".join(str(counts[n]) for n in names) + " |")
    for path, mix in zip(paths, mixes):
        kernel = path.rsplit("/", 1)[-1].split(".")[0]
        common = ", ".join(f"{op} {n}" for op, n in mix.most_common(12))
        print(f"\n{kernel} loop: {common}")


if __name__ == "__main__":
    main(sys.argv[1:])
