"""A small `helm` for machines without the binary, on Helm's own library (helm-python-sdk: Helm 4's Go SDK).

    python3 hack/helm.py install   RELEASE CHART [-n NS] [--create-namespace] [-f values.yaml] [--set k=v] [--wait]
    python3 hack/helm.py upgrade   RELEASE CHART [-n NS] [--install] [--create-namespace] [-f ...] [--set ...] [--wait]
    python3 hack/helm.py uninstall RELEASE [-n NS]
    python3 hack/helm.py template  RELEASE CHART [-n NS] [-f ...] [--set ...]
    python3 hack/helm.py lint      CHART [-f ...] [--set ...]
    python3 hack/helm.py list      [-n NS]

The flags mean what they mean to helm; KUBECONFIG picks the cluster. Where `helm` is installed, use it:
the chart is an ordinary Helm chart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _values(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path in args.values or ():
        values = _deep_merge(values, yaml.safe_load(Path(path).read_text()) or {})
    for expression in args.set or ():
        values = _deep_merge(values, helm.parse_set_string(expression))
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/helm.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, release: bool, chart: bool, values: bool) -> argparse.ArgumentParser:
        p = sub.add_parser(name)
        if release:
            p.add_argument("release")
        if chart:
            p.add_argument("chart")
        p.add_argument("-n", "--namespace", default="default")
        if values:
            p.add_argument("-f", "--values", action="append", help="a values file (repeatable)")
            p.add_argument("--set", action="append", help="key=value, as helm --set (repeatable)")
        return p

    for name in ("install", "upgrade"):
        p = command(name, True, True, True)
        p.add_argument("--create-namespace", action="store_true")
        p.add_argument("--wait", action="store_true", help="until the objects are ready")
        p.add_argument("--timeout", type=int, default=300, help="seconds")
        if name == "upgrade":
            p.add_argument("--install", action="store_true", help="install when the release does not exist")
    command("uninstall", True, False, False)
    command("template", True, True, True)
    command("lint", False, True, True)
    command("list", False, False, False)
    args = parser.parse_args(argv)

    try:
        if args.command == "lint":
            report = helm.lint(args.chart, _values(args), strict=True, namespace=args.namespace)
            for message in report["messages"]:
                severity = ("INFO", "INFO", "WARNING", "ERROR")[message["severity"] % 4]
                print(f"[{severity}] {message['path']}: {message['error']}")
            return 1 if report["errors"] else 0
        if args.command == "template":
            with helm.Chart.load(args.chart) as chart:
                for crd in chart.crds:
                    print(f"---\n# Source: {crd['filename']}\n{crd['data'].strip()}")
                for path, text in sorted(
                    chart.render(_values(args), name=args.release, namespace=args.namespace).items()
                ):
                    if text.strip() and path.endswith(".yaml"):  # as helm template: no NOTES.txt
                        print(f"---\n# Source: {path}\n{text.strip()}")
            return 0
        with helm.Config(namespace=args.namespace) as cfg:
            if args.command == "list":
                for item in cfg.list():
                    print(item["name"], item["namespace"], item["revision"], item["status"], item["chart_version"])
                return 0
            if args.command == "uninstall":
                cfg.uninstall(args.release)
                print(f"release {args.release} uninstalled")
                return 0
            wait = "watcher" if args.wait else None
            installed = any(r["name"] == args.release for r in cfg.list())
            if args.command == "install" or (args.install and not installed):
                release = cfg.install(
                    args.chart,
                    args.release,
                    _values(args),
                    namespace=args.namespace,
                    create_namespace=args.create_namespace,
                    wait=wait,
                    timeout=args.timeout,
                )
            else:
                release = cfg.upgrade(
                    args.chart, args.release, _values(args), namespace=args.namespace, wait=wait, timeout=args.timeout
                )
            print(f"release {args.release}: revision {release.get('revision')}, {release.get('status')}")
            return 0
    except helm.HelmError as err:
        print(f"hack/helm.py {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
