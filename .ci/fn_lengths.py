#!/usr/bin/env python3
"""Lists the Rust functions in src/ longer than LIMIT lines (default 80), outside test code.

Test code is a `#[cfg(test)]` item's braces, or a whole file declared as `#[cfg(test)] mod x;`
with the modules in its folder.
A function's length runs from its `fn` line to its closing brace. Exits 1 if any is longer.
Usage: .ci/fn_lengths.py [LIMIT] [--list N]  (--list N: print the N longest, whatever their length)
"""
import pathlib
import re
import sys

args = sys.argv[1:]
listing = None
if "--list" in args:
    i = args.index("--list")
    listing = int(args[i + 1])
    del args[i : i + 2]
limit = int(args[0]) if args else 80
root = pathlib.Path(__file__).resolve().parent.parent / "src"


def code_of(line):
    """The line without comments, strings and character literals."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return re.sub(r"//.*$", "", line)


# Files that are test modules as a whole.
test_files = set()
for path in root.rglob("*.rs"):
    lines = path.read_text().split("\n")
    for before, line in zip(lines, lines[1:]):
        m = re.match(r"\s*(pub(\(crate\))?\s+)?mod\s+(\w+)\s*;", line)
        if m and before.strip() == "#[cfg(test)]":
            here = path.parent if path.name in ("mod.rs", "lib.rs") else path.with_suffix("")
            test_files.add(here / f"{m.group(3)}.rs")
            # The module's folder, with its own modules (`tests/differential.rs`).
            test_files.update((here / m.group(3)).rglob("*.rs"))

found = []
for path in sorted(root.rglob("*.rs")):
    if path in test_files:
        continue
    depth, test_depth, pending_test, open_fns = 0, None, False, []
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if line.strip().startswith("#[cfg(test)]"):
            pending_test = True
        code = code_of(line)
        m = re.search(r"\bfn\s+(\w+)", code)
        if m and test_depth is None:
            open_fns.append([m.group(1), n, None])
        for ch in code:
            if ch == "{":
                depth += 1
                if pending_test and test_depth is None:
                    test_depth, pending_test = depth, False
                if open_fns and open_fns[-1][2] is None:
                    open_fns[-1][2] = depth
            elif ch == "}":
                if test_depth == depth:
                    test_depth = None
                if open_fns and open_fns[-1][2] == depth:
                    name, start, _ = open_fns.pop()
                    found.append((n - start + 1, f"{path.relative_to(root.parent)}:{start}", name))
                depth -= 1
            elif ch == ";" and open_fns and open_fns[-1][2] is None:
                open_fns.pop()  # a declaration without a body
        if pending_test and code.strip() and not code.strip().startswith("#"):
            pending_test = False  # the attribute's item had no braces on its first line
found.sort(reverse=True)
if listing is not None:
    for length, where, name in found[:listing]:
        print(f"{length:4} {where} {name}")
over = [f for f in found if f[0] > limit]
for length, where, name in over:
    print(f"{where}: fn {name} is {length} lines (at most {limit} outside tests)")
sys.exit(1 if over else 0)
