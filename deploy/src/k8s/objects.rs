//! The Kubernetes objects of one deployment, as JSON values (written out as YAML).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::{CONFIG_MOUNT, K8sOptions, MODEL_MOUNT, TLS_MOUNT};
use crate::deployment::Deployment;
use crate::launch::plan::{API_KEY_ENV, RolePaths, attention_args, card_args, frontend_args};

/// The item of the API-key Secret.
const API_KEY_ITEM: &str = "api-key";

/// Object names, all prefixed with the instance name.
#[derive(Debug, Clone)]
pub struct Names {
    prefix: String,
}

impl Names {
    /// Names for instance `prefix`.
    pub fn new(prefix: &str) -> Self {
        Names {
            prefix: prefix.to_owned(),
        }
    }

    /// Card `k`'s Deployment and Service.
    pub fn card(&self, k: usize) -> String {
        format!("{}-card-{k}", self.prefix)
    }

    /// Attention node `j`'s Deployment and Service.
    pub fn attention(&self, j: usize) -> String {
        format!("{}-attention-{j}", self.prefix)
    }

    /// The frontend's Deployment and Service.
    pub fn frontend(&self) -> String {
        format!("{}-frontend", self.prefix)
    }

    /// The ConfigMap with the deployment file.
    pub fn config(&self) -> String {
        format!("{}-deployment", self.prefix)
    }

    /// The Secret with node `node`'s TLS material (`card-K`, `attn-J`, `frontend`): the CA
    /// certificate and that node's own certificate and key, nothing of any other node.
    pub fn tls(&self, node: &str) -> String {
        format!("{}-tls-{node}", self.prefix)
    }

    /// The Secret with the HTTP API key.
    pub fn api_key(&self) -> String {
        format!("{}-api-key", self.prefix)
    }

    /// Card K's Service name with its control port.
    pub fn card_addresses(&self, cards: usize, port: u16) -> Vec<String> {
        (0..cards)
            .map(|k| format!("{}:{port}", self.card(k)))
            .collect()
    }

    /// Attention node j's Service name with its step port.
    pub fn attention_addresses(&self, nodes: usize, port: u16) -> Vec<String> {
        (0..nodes)
            .map(|j| format!("{}:{port}", self.attention(j)))
            .collect()
    }
}

/// Container ports (every pod has its own IP, so every card uses the same ones).
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    /// Card gRPC control plane.
    pub card: u16,
    /// Card JetStream data plane (UDP).
    pub card_data: u16,
    /// Attention node gRPC step service.
    pub attention: u16,
    /// Attention node JetStream data plane (UDP).
    pub attention_data: u16,
    /// Frontend HTTP.
    pub http: u16,
}

impl Ports {
    /// The deployment's base ports; the data plane on the next port up.
    pub fn of(d: &Deployment) -> Self {
        Ports {
            card: d.cards.base_port,
            card_data: d.cards.base_port.wrapping_add(1),
            attention: d.attention.base_port,
            attention_data: d.attention.base_port.wrapping_add(1),
            http: if d.server.port == 0 {
                8000
            } else {
                d.server.port
            },
        }
    }
}

/// Builds the objects of one deployment.
pub struct Builder<'a> {
    pub d: &'a Deployment,
    pub options: &'a K8sOptions,
    pub names: &'a Names,
    pub ports: Ports,
    pub paths: &'a RolePaths,
}

impl Builder<'_> {
    fn labels(&self, component: &str) -> Value {
        json!({
            "app.kubernetes.io/name": "afd",
            "app.kubernetes.io/instance": self.options.name,
            "app.kubernetes.io/component": component,
        })
    }

    fn metadata(&self, name: &str, component: &str) -> Value {
        let mut m = json!({ "name": name, "labels": self.labels(component) });
        if let Some(ns) = &self.options.namespace {
            m["namespace"] = json!(ns);
        }
        m
    }

    /// The deployment file (and card profile) every pod mounts.
    pub fn config_map(&self, files: &BTreeMap<String, String>) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self.metadata(&self.names.config(), "config"),
            "data": files,
        })
    }

    /// Node `node`'s Secret: the cluster CA certificate and that node's certificate and key,
    /// taken from `files` (every node's, as [`super::load_tls`] reads them). Each pod mounts only
    /// its own, so a pod that is broken into gives away one identity, not the cluster's.
    pub fn secret(&self, node: &str, files: &BTreeMap<String, String>) -> Value {
        let own = super::node_tls_files(node);
        let data: BTreeMap<&String, &String> = files
            .iter()
            .filter(|(name, _)| own.contains(name))
            .collect();
        json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": self.metadata(&self.names.tls(node), "tls"),
            "type": "Opaque",
            "stringData": data,
        })
    }

    /// The HTTP API key (`server.api_key`), kept out of the ConfigMap.
    pub fn api_key_secret(&self, key: &str) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": self.metadata(&self.names.api_key(), "api-key"),
            "type": "Opaque",
            "stringData": {API_KEY_ITEM: key},
        })
    }

    fn volumes(&self, node: &str) -> Value {
        let mut v = vec![
            json!({"name": "tls", "secret": {"secretName": self.names.tls(node), "defaultMode": 0o400}}),
            json!({"name": "config", "configMap": {"name": self.names.config()}}),
        ];
        if let Some(claim) = &self.options.model_pvc {
            v.push(json!({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}));
        }
        Value::Array(v)
    }

    fn mounts(&self) -> Value {
        let mut v = vec![
            json!({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": true}),
            json!({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": true}),
        ];
        if self.options.model_pvc.is_some() {
            v.push(json!({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": true}));
        }
        Value::Array(v)
    }

    /// The pod IP, for binding the JetStream data plane to the address peers can reach.
    fn pod_ip_env() -> Value {
        json!({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    }

    fn container(
        &self,
        role: &str,
        args: Vec<String>,
        env: Vec<Value>,
        ports: Value,
        probe: Value,
    ) -> Value {
        let mut c = json!({
            "name": role,
            "image": self.options.image,
            "args": args,
            "env": env,
            "ports": ports,
            "readinessProbe": probe,
            "volumeMounts": self.mounts(),
        });
        if let Some(r) = &self.options.resources {
            let pod = match role {
                "card" => r.card,
                "attention" => r.attention,
                _ => r.frontend,
            };
            c["resources"] = pod.to_json();
        }
        c
    }

    /// The control port accepts connections. Not Kubernetes' grpc probe: the control plane is
    /// mutual TLS, which the kubelet's probe does not speak; an attention node listens only
    /// once its cards are connected, a card as soon as it can take a shard.
    fn control_probe(port: u16) -> Value {
        json!({"tcpSocket": {"port": port}, "initialDelaySeconds": 2, "periodSeconds": 5, "failureThreshold": 3})
    }

    /// The pod of node `node` (its TLS identity) running `container`.
    fn pod_spec(&self, node: &str, container: Value) -> Value {
        json!({
            "containers": [container],
            "volumes": self.volumes(node),
            // SIGTERM drains every role for up to server.shutdown_timeout; the rest covers
            // ending what still runs and closing, before Kubernetes sends SIGKILL.
            "terminationGracePeriodSeconds": self.d.server.shutdown_timeout.ceil() as u64 + 15,
        })
    }

    fn card_labels(&self, k: usize) -> Value {
        let mut l = self.labels("card");
        l["afd/card"] = json!(k.to_string());
        l
    }

    /// Card `k`: its Service and Deployment (one replica: a card has its own identity, and a
    /// pod of its own so that it mounts only its own key).
    pub fn card(&self, k: usize) -> Vec<Value> {
        let name = self.names.card(k);
        let p = self.ports;
        let args = card_args(
            self.d,
            self.paths,
            &k.to_string(),
            &format!("0.0.0.0:{}", p.card),
            Some(&format!("$(POD_IP):{}", p.card_data)),
        );
        let ports = json!([
            {"name": "grpc", "containerPort": p.card, "protocol": "TCP"},
            {"name": "jetstream", "containerPort": p.card_data, "protocol": "UDP"},
        ]);
        let container = self.container(
            "card",
            args,
            vec![Self::pod_ip_env()],
            ports,
            Self::control_probe(p.card),
        );
        self.service_and_deployment(
            &name,
            "card",
            self.card_labels(k),
            &crate::cluster::card_name(k),
            container,
            p.card,
        )
    }

    /// A Service on `port` (`grpc`) and a one-replica Deployment of node `node`'s pod.
    fn service_and_deployment(
        &self,
        name: &str,
        component: &str,
        labels: Value,
        node: &str,
        container: Value,
        port: u16,
    ) -> Vec<Value> {
        let mut metadata = self.metadata(name, component);
        metadata["labels"] = labels.clone();
        let service = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata,
            "spec": {
                "selector": labels,
                "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"}],
            },
        });
        let deployment = json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": metadata,
            "spec": {
                "replicas": 1,
                // Never two pods with one node identity.
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": self.pod_spec(node, container),
                },
            },
        });
        vec![service, deployment]
    }

    fn node_labels(&self, j: usize) -> Value {
        let mut l = self.labels("attention");
        l["afd/attention-node"] = json!(j.to_string());
        l
    }

    /// Attention node `j`: its Service and Deployment (one replica: the node has its own
    /// identity and KV cache).
    pub fn attention(&self, j: usize) -> Vec<Value> {
        let name = self.names.attention(j);
        let p = self.ports;
        let cards = self.names.card_addresses(self.d.cards.count, p.card);
        let args = attention_args(
            self.paths,
            j,
            &format!("0.0.0.0:{}", p.attention),
            Some(&format!("$(POD_IP):{}", p.attention_data)),
            &cards,
        );
        let ports = json!([
            {"name": "grpc", "containerPort": p.attention, "protocol": "TCP"},
            {"name": "jetstream", "containerPort": p.attention_data, "protocol": "UDP"},
        ]);
        let container = self.container(
            "attention",
            args,
            vec![Self::pod_ip_env()],
            ports,
            Self::control_probe(p.attention),
        );
        self.service_and_deployment(
            &name,
            "attention",
            self.node_labels(j),
            &crate::cluster::attention_name(j),
            container,
            p.attention,
        )
    }

    /// The frontend: Service and Deployment (one replica: its router owns the attention nodes'
    /// KV blocks).
    pub fn frontend(&self) -> Vec<Value> {
        let name = self.names.frontend();
        let p = self.ports;
        let attention = self
            .names
            .attention_addresses(self.d.attention.nodes, p.attention);
        let args = frontend_args(self.d, self.paths, "0.0.0.0", p.http, &attention);
        let ports = json!([{"name": "http", "containerPort": p.http, "protocol": "TCP"}]);
        let probe = json!({
            "httpGet": {"path": "/health", "port": "http"},
            "initialDelaySeconds": 2,
            "periodSeconds": 5,
        });
        // The API key reaches the frontend from its Secret, as `afd up` passes it: in the
        // environment, never on the command line.
        let env = match &self.d.server.api_key {
            Some(_) => vec![json!({
                "name": API_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": self.names.api_key(), "key": API_KEY_ITEM}},
            })],
            None => Vec::new(),
        };
        let container = self.container("frontend", args, env, ports, probe);
        let service = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.metadata(&name, "frontend"),
            "spec": {
                "selector": self.labels("frontend"),
                "ports": [{"name": "http", "port": p.http, "targetPort": "http", "protocol": "TCP"}],
            },
        });
        let deployment = json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.metadata(&name, "frontend"),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": self.labels("frontend")},
                "template": {
                    "metadata": {"labels": self.labels("frontend")},
                    "spec": self.pod_spec(crate::cluster::FRONTEND_NAME, container),
                },
            },
        });
        vec![service, deployment]
    }
}
