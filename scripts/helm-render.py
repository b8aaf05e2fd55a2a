#!/usr/bin/env python3
"""Renders the kvpick chart as `helm template` does, with the real Helm engine.

The engine is Helm v4's Go SDK (PyPI `helm-python-sdk`, which bundles it as libhelm_c),
installed into .venv/ by scripts/setup-deploy-tools.sh; no helm binary is on PyPI, npm or
Debian. Values files are merged in order (later wins), then checked against the chart's
values.schema.json (as `helm install` does: a typo fails here), then rendered. Prints the
manifests as one multi-document YAML stream, each preceded by `# Source: <template>`, in
template order; empty documents are left out. Exit status 1 with the reason on a values or
render error.

Usage: .venv/bin/python scripts/helm-render.py [-f VALUES.yaml]... [--name RELEASE]
       [--namespace NS] [--show-only TEMPLATE.yaml]... [--lint] [CHART_DIR]
"""

import argparse
import pathlib
import sys

import helm_python as helm


def merge(base, override):
    """Helm's values merge: maps merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base.get(key), value) if key in base else value
        return out
    return override


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chart", nargs="?", default=str(root / "deploy/helm/kvpick"))
    parser.add_argument("-f", "--values", action="append", default=[])
    parser.add_argument("--name", default="kvpick")
    parser.add_argument("--namespace", default="default")
    parser.add_argument(
        "--lint",
        action="store_true",
        help="run `helm lint --strict` with the values instead; fail on a warning or error",
    )
    parser.add_argument(
        "--show-only", action="append", default=[], help="only these templates (file names)"
    )
    args = parser.parse_args()
    values = {}
    for path in args.values:
        values = merge(values, helm.values_from_yaml(pathlib.Path(path).read_text()) or {})
    if args.lint:
        report = helm.lint(args.chart, values, strict=True, namespace=args.namespace)
        # Severity: 0 unknown, 1 info, 2 warning, 3 error.
        bad = [m for m in report["messages"] if m["severity"] >= 2] + list(report["errors"])
        for message in report["messages"]:
            print(f"helm-lint: {message['path']}: {message['error']}", file=sys.stderr)
        return 1 if bad else 0
    try:
        with helm.Chart.load(args.chart) as chart:
            chart.validate_schema(values)
            manifests = chart.render(
                values, name=args.name, namespace=args.namespace, is_install=True
            )
    except helm.HelmError as error:
        print(f"helm-render: {error}", file=sys.stderr)
        return 1
    for template in sorted(manifests):
        if template.endswith("NOTES.txt"):
            continue
        if args.show_only and template.rsplit("/", 1)[-1] not in args.show_only:
            continue
        for document in manifests[template].split("\n---"):
            body = document.strip("\n")
            if not body.strip() or all(
                line.lstrip().startswith("#") or not line.strip() for line in body.splitlines()
            ):
                continue
            print(f"---\n# Source: {template}\n{body}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
