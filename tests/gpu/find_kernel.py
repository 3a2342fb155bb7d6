"""Print the Inductor source of kernels whose name matches, and the lines of the generated wrappers that launch
them (their grid and arguments), from an Inductor cache directory.

    python3 tests/gpu/find_kernel.py CACHE_DIR NAME_SUBSTRING [...]
"""

import os
import re
import sys


def main() -> None:
    root, names = sys.argv[1], sys.argv[2:]
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            try:
                text = open(path).read()
            except (OSError, UnicodeDecodeError):
                continue
            for name in names:
                if name not in text:
                    continue
                m = re.search(rf"def (\w*{re.escape(name)}\w*)\(", text)
                if m:
                    start = text.rfind("@triton", 0, m.start())
                    print(f"==== {path}: kernel {m.group(1)}\n{text[max(start, 0): m.start() + 4000]}\n")
                # each launch with the wrapper lines before it (buffer allocations give the sizes)
                lines = text.splitlines()
                for i, line in enumerate(lines):
                    if name in line and ".run(" in line:
                        print(f"---- {path}:{i}")
                        print("\n".join(l[:300] for l in lines[max(0, i - 12) : i + 2]))

if __name__ == "__main__":
    main()
