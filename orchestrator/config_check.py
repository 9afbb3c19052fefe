"""`orchestrator check-config FILE...`: load configs and say everything that is wrong, or what they describe.

A file may hold several YAML documents, each an orchestrator config, or be a Kubernetes manifest: then the
orchestrator configs are the ConfigMap entries that look like one (named orchestrator.yaml or .yml, or with at
least one of the config's top-level keys), checked as the pod will load them; other documents and entries
(Deployments, TensorRT-LLM engine options) are skipped, and said so. Every error of a document is reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import yaml

from orchestrator import config as config_module
from orchestrator.launch import check_sim_workers

CONFIG_ENTRY_NAMES = ("orchestrator.yaml", "orchestrator.yml")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check-config", help="validate config files, Kubernetes manifests included (names "
                                                   "every key in error)", description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, nargs="+", help="YAML files: configs, or manifests holding one in a ConfigMap")
    p.add_argument("--no-path-checks", action="store_true",
                   help="skip checks of paths that exist only on the target host (model.dir); always skipped for "
                        "configs inside a Kubernetes manifest")
    p.set_defaults(run=run)


@attrs.frozen
class Document:
    """One orchestrator config found in a file: where (for messages) and what."""

    where: str  # the file, with the document or ConfigMap entry when the file holds more than one thing
    data: Any
    in_manifest: bool  # its paths are the pod's, not this host's


def documents(path: Path) -> tuple[list[Document], list[str]]:
    """The orchestrator configs of a file, and notes on what was skipped. ConfigError if it is not YAML."""
    file = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise config_module.ConfigError(file, "(file)", f"a readable YAML file ({exc.strerror})") from exc
    try:
        loaded = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise config_module.ConfigError(file, "(syntax)", f"valid YAML: {exc}") from exc
    if not loaded:
        raise config_module.ConfigError(file, "(file)", "a configuration: the file is empty")
    found: list[Document] = []
    skipped: list[str] = []
    for index, doc in enumerate(loaded):
        where = file if len(loaded) == 1 else f"{file} (document {index + 1})"
        if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc:
            found += _from_manifest(doc, where, skipped)
        else:
            found.append(Document(where, doc, in_manifest=False))
    return found, skipped


def _from_manifest(doc: dict, where: str, skipped: list[str]) -> Iterator[Document]:
    name = (doc.get("metadata") or {}).get("name", "?") if isinstance(doc.get("metadata"), dict) else "?"
    if doc["kind"] != "ConfigMap":
        skipped.append(f"{where}: {doc['kind']} {name}: not a ConfigMap")
        return
    data = doc.get("data") or {}
    if not isinstance(data, dict):
        raise config_module.ConfigError(where, f"ConfigMap {name}: data", "a mapping of file names to contents")
    config_keys = {field.name for field in attrs.fields(config_module.Config)} | {"models"}
    for entry, content in data.items():
        entry_where = f"{where}: ConfigMap {name}, {entry}"
        try:
            parsed = yaml.safe_load(content) if isinstance(content, str) else None
        except yaml.YAMLError as exc:
            if entry in CONFIG_ENTRY_NAMES:
                raise config_module.ConfigError(entry_where, "(syntax)", f"valid YAML: {exc}") from exc
            parsed = None
        if entry in CONFIG_ENTRY_NAMES or (isinstance(parsed, dict) and config_keys & set(parsed)):
            yield Document(entry_where, parsed, in_manifest=True)
        else:
            skipped.append(f"{entry_where}: not an orchestrator config")


def check(document: Document, *, check_paths: bool) -> config_module.Config:
    """The config, or a ConfigError holding every error it has."""
    config = config_module.from_dict(document.data, file=document.where, base_dir=Path(document.where).parent,
                                     check_paths=check_paths and not document.in_manifest)
    check_sim_workers(config, document.where)
    problem = config_module.serving_problem(config, document.where)
    if problem is not None:
        raise problem
    return config


def run(args: argparse.Namespace) -> int:
    status = 0
    for path in args.config:
        try:
            found, skipped = documents(path)
        except config_module.ConfigError as exc:
            print(f"error: {exc}")
            status = 1
            continue
        for note in skipped:
            print(f"skipped: {note}")
        if not found:
            print(f"error: {path}: no orchestrator config in it")
            status = 1
        for document in found:
            try:
                config = check(document, check_paths=not args.no_path_checks)
            except config_module.ConfigError as exc:
                for error in exc.errors:
                    print(f"error: {error}")
                status = 1
                continue
            paths = " (paths not checked: the pod's)" if document.in_manifest else ""
            for view in config.models:  # one line per served model
                discovery = "etcd" if view.discovery.etcd is not None else "static"
                workers = sum(w.count for w in config.launch.workers
                              if config_module.launched_model(config, w) is view)
                print(f"ok: {document.where}: {view.mode} mode, model {view.model.name} ({view.model_dir}), "
                      f"{discovery} discovery, {workers} launched worker{'' if workers == 1 else 's'}{paths}")
    return status
