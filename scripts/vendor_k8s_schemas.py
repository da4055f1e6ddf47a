"""Re-make deploy/schemas/kubernetes.json from the Kubernetes JSON schemas of the ``kubernetes-validate`` wheel.

    pip download kubernetes-validate==1.37.0 --no-deps -d /tmp/kv
    .venv/bin/python scripts/vendor_k8s_schemas.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl

It keeps the strict (unknown fields refused) definitions of one Kubernetes version that the kinds deploy/validate.py
knows reach through ``$ref`` (the objects deploy.render writes, and the pod template the KubeRay schema refers to),
without their ``description`` texts: the validation is the same, the file a tenth of the size.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: deploy/ is the repo's

from deploy.validate import KUBERNETES_KINDS, KUBERNETES_VERSION  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "deploy" / "schemas" / "kubernetes.json"
REF = re.compile(r"^#/\$defs/(.+)$")


def closure(definitions: dict, roots: list[str]) -> dict:
    """The definitions reachable from ``roots`` through ``$ref``."""
    kept, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if name in kept:
            continue
        kept[name] = definitions[name]
        todo += [REF.match(ref)[1] for ref in _refs(definitions[name])]
    return dict(sorted(kept.items()))


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


def without_descriptions(node):
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [without_descriptions(value) for value in node]
    return node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", help="kubernetes_validate-*.whl")
    args = parser.parse_args(argv)
    member = f"kubernetes_validate/kubernetes-json-schema/v{KUBERNETES_VERSION}-local-strict/_definitions.json"
    with zipfile.ZipFile(args.wheel) as wheel:
        source = json.loads(wheel.read(member))
    roots = sorted(set(KUBERNETES_KINDS.values()) | {"io.k8s.api.core.v1.PodTemplateSpec"})
    bundle = {
        "$schema": source["$schema"],
        "$id": source["$id"],
        "$comment": f"Kubernetes v{KUBERNETES_VERSION} strict definitions ({member} of {Path(args.wheel).name}), "
        "only those the rendered kinds reach, descriptions removed: scripts/vendor_k8s_schemas.py",
        "$defs": without_descriptions(closure(source["$defs"], roots)),
    }
    OUT.write_text(json.dumps(bundle, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {OUT}: {len(bundle['$defs'])} definitions, {OUT.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
