#!/usr/bin/env python3
"""Counts the crate's public API from rustdoc's JSON: the items a user can name by a public path.

    cargo +nightly rustdoc --lib --features <features> -- -Z unstable-options --output-format json
    python3 .ci/public_api.py target/doc/tower_redis_ratelimit.json [--list]

Functions are free functions, the inherent methods of public types (constructors, builder
methods, getters) and the methods that public traits declare; methods of trait impls (`Clone`,
`Display`, `Service`, ...) are not counted, as the traits' own crates define them. A type or
trait is counted once, at its first public path. `--list` prints every counted function.
"""

import json
import sys
from collections import Counter


def main():
    path = sys.argv[1]
    listing = "--list" in sys.argv
    doc = json.load(open(path))
    index = doc["index"]
    root = index[str(doc["root"])]
    seen = set()
    kinds = Counter()
    functions = []

    def item(id_):
        return index.get(str(id_))

    def visit(it, prefix):
        if it is None or it["visibility"] != "public" and prefix:
            return
        key = str(it["id"])
        if key in seen:
            return
        seen.add(key)
        inner = it["inner"]
        (kind, body), = inner.items()
        name = it.get("name") or ""
        here = f"{prefix}::{name}" if prefix else name
        if kind == "module":
            for child in body["items"]:
                visit(item(child), here)
        elif kind == "use":
            target = item(body["id"]) if body.get("id") is not None else None
            if target is None:
                return
            if body.get("is_glob"):
                for child in target["inner"].get("module", {}).get("items", []):
                    visit(item(child), prefix)
            else:
                visit(dict(target, name=body["name"]) if target else None, prefix)
        elif kind == "function":
            kinds["function"] += 1
            functions.append(here)
        elif kind in ("struct", "enum", "union"):
            kinds[kind] += 1
            for impl_id in body["impls"]:
                impl = item(impl_id)["inner"]["impl"]
                if impl["trait"] is not None or impl["is_synthetic"] or impl["blanket_impl"]:
                    continue
                for method in impl["items"]:
                    m = item(method)
                    if m["visibility"] != "public":
                        continue
                    if "function" in m["inner"]:
                        kinds["function"] += 1
                        functions.append(f"{here}::{m['name']}")
                    elif "assoc_const" in m["inner"]:
                        kinds["const"] += 1
        elif kind == "trait":
            kinds["trait"] += 1
            for method in body["items"]:
                m = item(method)
                if "function" in m["inner"]:
                    kinds["function"] += 1
                    functions.append(f"{here}::{m['name']}")
        elif kind in ("constant", "static"):
            kinds["const"] += 1
        elif kind == "type_alias":
            kinds["type alias"] += 1

    visit(root, "")
    for name in sorted(functions) if listing else []:
        print(name)
    plural = {"type alias": "type aliases"}
    order = ["function", "struct", "enum", "trait", "const", "type alias"]
    print(", ".join(f"{kinds[k]} {plural.get(k, k + 's')}" for k in order))


if __name__ == "__main__":
    main()
