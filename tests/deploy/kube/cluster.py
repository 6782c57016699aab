"""The parts of a cluster the tests play around a real API server: one namespace with
the chart's own ServiceAccount, Role and RoleBinding (rendered, applied as they are),
a service-account token from the TokenRequest API as a Pod would have it mounted,
and the stage Pods, whose status the tests write as the kubelet would."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kubernetes import client, utils

from tests.deploy.chart import render
from tests.deploy.kube.apiserver import KubeServer
from tests.deploy.manifests import by_kind, config_file

AUDIENCE = "https://kubernetes.default.svc"  # the server's --service-account-issuer


def admin_api(server: KubeServer, token: str = "") -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = server.url
    configuration.ssl_ca_cert = str(server.ca)
    configuration.api_key = {"authorization": token or server.admin_token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(configuration)


class Namespace:
    """A namespace holding the release ``omni``, as rendered from charts/ for it."""

    def __init__(self, server: KubeServer, name: str, *, with_role: bool = True) -> None:
        self.server = server
        self.name = name
        self.api = admin_api(server)
        self.core = client.CoreV1Api(self.api)
        self.core.create_namespace({"metadata": {"name": name}})
        self.docs = render(namespace=name)
        self.rbac = [
            doc
            for kind in ("ServiceAccount", "Role", "RoleBinding")
            for doc in by_kind(self.docs, kind).values()
        ]
        for doc in self.rbac if with_role else by_kind(self.docs, "ServiceAccount").values():
            utils.create_from_dict(self.api, doc, namespace=name)
        (self.account,) = by_kind(self.docs, "ServiceAccount")
        self.role = by_kind(self.docs, "Role")[self.account]
        stage = by_kind(self.docs, "Deployment")["omni-thinker"]["spec"]["template"]
        self._template = stage
        pipeline = config_file(self.docs, "omni-pipeline", "pipeline.yaml")
        (thinker,) = [s for s in pipeline["stages"] if s["name"] == "thinker"]
        self.selector = str(thinker["pods"])  # the thinker's Pods, as the chart selects them

    def mount_token(self, folder: Path) -> Path:
        """The chart's service account's token, CA and namespace, as a Pod has them."""
        request = client.CoreV1Api(self.api).create_namespaced_service_account_token(
            self.account,
            self.name,
            {"spec": {"audiences": [AUDIENCE], "expirationSeconds": 3600}},
        )
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "token").write_text(request.status.token)
        (folder / "ca.crt").write_bytes(self.server.ca.read_bytes())
        (folder / "namespace").write_text(self.name)
        return folder

    # --- the kubelet's part -----------------------------------------------------------

    def add_pod(self, name: str, ip: str, node: str, ready: bool = True) -> None:
        """A Pod of the thinker's Deployment (its template as rendered) on ``node``."""
        template = copy.deepcopy(self._template)
        spec: dict[str, Any] = {**template["spec"], "nodeName": node}
        for container in spec["containers"]:
            # gRPC probes came in 1.24: this server refuses them. The tests play the
            # kubelet, whose probes they stand for, so nothing else changes.
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                container.pop(probe, None)
        metadata = {"name": name, "labels": template["metadata"]["labels"]}
        self.core.create_namespaced_pod(self.name, {"metadata": metadata, "spec": spec})
        self.set_status(name, ip, ready)

    def set_status(self, name: str, ip: str, ready: bool) -> None:
        status: dict[str, Any] = {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
        if ip:
            status |= {"podIP": ip, "podIPs": [{"ip": ip}]}
        patch = [{"op": "replace", "path": "/status", "value": status}]
        self.core.patch_namespaced_pod_status(name, self.name, patch)

    def start_deletion(self, name: str) -> None:
        """Deletion begins (deletionTimestamp set); the Pod stays Ready while it drains."""
        self.core.delete_namespaced_pod(name, self.name, grace_period_seconds=60)

    def delete_now(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, self.name, grace_period_seconds=0)

    def close(self) -> None:
        self.core.delete_namespace(self.name)
        self.api.close()
