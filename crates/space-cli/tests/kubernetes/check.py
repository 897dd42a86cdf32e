"""Checks deploy/kubernetes without a cluster: every manifest against the
Kubernetes schemas (the kubernetes-validate package, strict), every `space`
command line in them against the binary's own --help, and the Kind config's
workers against the node DaemonSets' selectors. Prints KUBERNETES OK."""

import glob
import os
import re
import subprocess
import sys

import yaml

DEPLOY = os.environ["DEPLOY"]
SPACE = os.environ["SPACE_BIN"]
VERSION = "1.30.0"

manifests = sorted(p for p in glob.glob(os.path.join(DEPLOY, "*.yaml")) if not p.endswith("kind-cluster.yaml"))
assert manifests, "no manifests"
ran = subprocess.run([os.path.join(os.path.dirname(sys.executable), "kubernetes-validate"), "--strict",
                      "-k", VERSION, *manifests], capture_output=True, text=True)
print(ran.stdout, ran.stderr)
assert ran.returncode == 0, "a manifest does not validate"
kinds = set()
selectors = []
for path in manifests:
    for doc in yaml.safe_load_all(open(path)):
        if not doc:
            continue
        kinds.add(doc["kind"])
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        if doc["kind"] == "DaemonSet":
            selectors.append(spec.get("nodeSelector", {}))
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            if container.get("command") != ["space"]:
                continue
            args = container["args"]
            subcommand = args[0]
            help_text = subprocess.run([SPACE, subcommand, "--help"], capture_output=True, text=True, check=True).stdout
            for arg in args[1:]:
                flag = arg.split("=")[0]
                assert flag.startswith("--"), f"{path}: {arg!r} is not a flag"
                assert re.search(rf"(^|\s){re.escape(flag)}[\s=,]", help_text, re.M), \
                    f"{path}: `space {subcommand}` has no {flag}"
for kind in ("Namespace", "Deployment", "DaemonSet", "StatefulSet", "Service", "Secret", "NetworkPolicy"):
    assert kind in kinds, f"no {kind}"

kind_config = yaml.safe_load(open(os.path.join(DEPLOY, "kind-cluster.yaml")))
assert kind_config["kind"] == "Cluster" and kind_config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
workers = [n for n in kind_config["nodes"] if n["role"] == "worker"]
assert len(workers) >= 2
for worker in workers:
    labels = worker.get("labels", {})
    assert any(all(labels.get(k) == v for k, v in s.items()) for s in selectors), \
        f"a Kind worker ({labels}) matches no node DaemonSet"
    assert any(m["containerPath"] == "/var/lib/space" for m in worker.get("extraMounts", []))
print("KUBERNETES OK")
