"""``python -m deploy.validate DIR|FILE ...``: check rendered manifests against the Kubernetes and KubeRay schemas.

Offline (no cluster): every object of every YAML file must be a kind this renderer writes, and valid under the
schemas vendored in ``deploy/schemas/`` (Kubernetes' strict definitions, unknown fields refused; KubeRay's RayCluster
and RayJob), checked with ``jsonschema``. What a schema cannot say (CEL rules of the CRDs, admission webhooks,
quota, whether the image exists) is left to the cluster. Exit 0: all valid; 1: the errors, one a line.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

import yaml

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
KUBERNETES_VERSION = "1.33.0"
# (apiVersion, kind) -> definition in schemas/kubernetes.json
KUBERNETES_KINDS = {
    ("v1", "ConfigMap"): "io.k8s.api.core.v1.ConfigMap",
    ("v1", "Service"): "io.k8s.api.core.v1.Service",
    ("apps/v1", "StatefulSet"): "io.k8s.api.apps.v1.StatefulSet",
    ("batch/v1", "Job"): "io.k8s.api.batch.v1.Job",
}
# (apiVersion, kind) -> definition in schemas/kuberay.json
KUBERAY_KINDS = {("ray.io/v1", "RayCluster"): "RayCluster", ("ray.io/v1", "RayJob"): "RayJob"}


@cache
def _validators() -> dict:
    import jsonschema
    from referencing import Registry, Resource

    kubernetes = json.loads((SCHEMA_DIR / "kubernetes.json").read_text())
    kuberay = json.loads((SCHEMA_DIR / "kuberay.json").read_text())
    registry = Registry().with_resources(
        [(schema["$id"], Resource.from_contents(schema)) for schema in (kubernetes, kuberay)]
    )
    validators = {}
    for kinds, bundle in ((KUBERNETES_KINDS, kubernetes), (KUBERAY_KINDS, kuberay)):
        for key, definition in kinds.items():
            schema = {"$ref": f"{bundle['$id']}#/$defs/{definition}"}
            validators[key] = jsonschema.Draft202012Validator(schema, registry=registry)
    return validators


def object_errors(obj: object) -> list[str]:
    """What is wrong with one manifest object ([] when valid), each naming the field's path."""
    if not isinstance(obj, dict):
        return [f"not a Kubernetes object: {type(obj).__name__}"]
    key = (obj.get("apiVersion"), obj.get("kind"))
    validator = _validators().get(key)
    if validator is None:
        known = sorted(f"{api} {kind}" for api, kind in _validators())
        return [f"apiVersion {key[0]!r} kind {key[1]!r} is not a kind this renderer writes ({', '.join(known)})"]
    errors = sorted(validator.iter_errors(obj), key=lambda error: list(error.absolute_path))
    return [f"{'.'.join(str(part) for part in error.absolute_path) or '<root>'}: {error.message}" for error in errors]


def file_errors(path: Path) -> tuple[int, list[str]]:
    """(objects checked, errors) of one YAML file; each error names the file, the object and the field."""
    try:
        objects = [obj for obj in yaml.safe_load_all(path.read_text()) if obj is not None]
    except yaml.YAMLError as error:
        return 0, [f"{path}: not YAML: {error}"]
    errors = []
    for obj in objects:
        name = f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}" if isinstance(obj, dict) else "?"
        errors += [f"{path}: {name}: {message}" for message in object_errors(obj)]
    return len(objects), errors


def manifest_files(paths: list[str]) -> list[Path]:
    files = []
    for given in map(Path, paths):
        files += sorted(given.glob("*.yaml")) if given.is_dir() else [given]
    return files


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m deploy.validate DIR|FILE ...", file=sys.stderr)
        return 2
    files, num_objects, errors = manifest_files(paths), 0, []
    for path in files:
        checked, found = file_errors(path)
        num_objects, errors = num_objects + checked, errors + found
    for line in errors:
        print(line)
    verdict = "valid" if not errors else f"{len(errors)} errors"
    print(
        f"{num_objects} objects in {len(files)} files: {verdict} (Kubernetes v{KUBERNETES_VERSION}, KubeRay ray.io/v1)"
    )
    return 1 if errors or not files else 0


if __name__ == "__main__":
    sys.exit(main())
