//! `afd k8s`: the output parses as YAML, and its names, Services and ports wire every role to
//! the ones it talks to: attention nodes dial card Services that select exactly one card pod
//! on the port it listens on, the frontend dials attention Services the same way, probes hit
//! ports the containers expose, every volume names the ConfigMap and Secrets that are
//! rendered, and each pod mounts only its own node's key.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use deploy::deployment::Deployment;
use serde::Deserialize;
use serde_json::Value;

mod common;

use common::{AFD, afd_ok, tiny};

fn afd_k8s(args: &[&str]) -> String {
    String::from_utf8(afd_ok(|c| c.arg("k8s").args(args))).unwrap()
}

/// Every document of a YAML stream.
fn parse(yaml: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap()
}

fn find<'a>(objects: &'a [Value], kind: &str, n: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && name(o) == n)
        .unwrap_or_else(|| panic!("no {kind} {n}"))
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn flag(args: &[String], f: &str) -> String {
    let i = args
        .iter()
        .position(|a| a == f)
        .unwrap_or_else(|| panic!("no {f} in {args:?}"));
    args[i + 1].clone()
}

fn container(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]["containers"][0]
}

/// The container port a Service port or probe names (by name or number).
fn container_port(c: &Value, port: &Value) -> u64 {
    let ports = c["ports"].as_array().unwrap();
    let found = ports
        .iter()
        .find(|p| (port.is_string() && p["name"] == *port) || p["containerPort"] == *port);
    found.unwrap_or_else(|| panic!("no container port {port} in {ports:?}"))["containerPort"]
        .as_u64()
        .unwrap()
}

/// Whether `selector`'s labels are all on `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .unwrap()
        .iter()
        .all(|(k, v)| labels[k] == *v)
}

/// The workloads (Deployment/StatefulSet) whose pods Service `svc` selects.
fn selected<'a>(objects: &'a [Value], svc: &Value) -> Vec<&'a Value> {
    objects
        .iter()
        .filter(|o| o["spec"]["template"].is_object())
        .filter(|o| {
            selects(
                &svc["spec"]["selector"],
                &o["spec"]["template"]["metadata"]["labels"],
            )
        })
        .collect()
}

/// `host:port` -> the Service it names (the first DNS label) and the container port it reaches.
fn resolve<'a>(objects: &'a [Value], address: &str) -> (&'a Value, u64) {
    let (host, port) = address.rsplit_once(':').unwrap();
    let service_name = host;
    let svc = find(objects, "Service", service_name);
    let port: u64 = port.parse().unwrap();
    let svc_port = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == port)
        .unwrap_or_else(|| panic!("Service {service_name} has no port {port}"));
    let workloads = selected(objects, svc);
    assert_eq!(
        workloads.len(),
        1,
        "{service_name} selects {} workloads",
        workloads.len()
    );
    (
        workloads[0],
        container_port(container(workloads[0]), &svc_port["targetPort"]),
    )
}

/// Checks the wiring of one rendered deployment with `cards` cards and `nodes` attention nodes.
fn check(objects: &[Value], cards: usize, nodes: usize, prefix: &str) {
    // Config and TLS material.
    let config = find(objects, "ConfigMap", &format!("{prefix}-deployment"));
    let text = config["data"]["deployment.toml"].as_str().unwrap();
    let pod_file = Deployment::from_toml(text, Path::new("/etc/afd/config")).unwrap();
    assert_eq!(pod_file.cards.count, cards);
    assert_eq!(pod_file.attention.nodes, nodes);
    // One Secret per node: the CA certificate and that node's certificate and key.
    let nodes_named: Vec<String> = (0..nodes)
        .map(|j| format!("attn-{j}"))
        .chain((0..cards).map(|k| format!("card-{k}")))
        .chain(["frontend".to_owned()])
        .collect();
    let secrets: Vec<&Value> = objects.iter().filter(|o| o["kind"] == "Secret").collect();
    assert_eq!(secrets.len(), nodes_named.len());
    for node in &nodes_named {
        let secret = find(objects, "Secret", &format!("{prefix}-tls-{node}"));
        let files: BTreeSet<&str> = secret["stringData"]
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        let want = [
            "ca.pem".to_string(),
            format!("{node}.pem"),
            format!("{node}.key.pem"),
        ];
        assert_eq!(files, want.iter().map(|s| s.as_str()).collect());
        for pem in secret["stringData"].as_object().unwrap().values() {
            assert!(pem.as_str().unwrap().contains("-----BEGIN"));
        }
    }

    // Every pod: volumes name the objects above, mounts name the volumes, the probe hits an
    // exposed port, and its listen port is a declared container port.
    let workloads: Vec<&Value> = objects
        .iter()
        .filter(|o| o["spec"]["template"].is_object())
        .collect();
    assert_eq!(workloads.len(), cards + nodes + 1);
    for w in &workloads {
        let spec = &w["spec"]["template"]["spec"];
        let volumes: BTreeMap<&str, &Value> = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| (v["name"].as_str().unwrap(), v))
            .collect();
        assert_eq!(volumes["config"]["configMap"]["name"], name(config));
        let c = container(w);
        // The pod's own node: `card-K` or `attn-J` from its --id, or the frontend.
        let a = args(c);
        let node = match a[0].as_str() {
            "card" => format!("card-{}", flag(&a, "--id")),
            "attention" => format!("attn-{}", flag(&a, "--id")),
            _ => "frontend".to_owned(),
        };
        assert_eq!(
            volumes["tls"]["secret"]["secretName"],
            format!("{prefix}-tls-{node}")
        );
        for m in c["volumeMounts"].as_array().unwrap() {
            assert!(volumes.contains_key(m["name"].as_str().unwrap()), "{m}");
        }
        let probe = &c["readinessProbe"];
        let port = if probe["tcpSocket"].is_object() {
            assert_ne!(
                args(c)[0],
                "frontend",
                "the frontend's probe is GET /health"
            );
            &probe["tcpSocket"]["port"]
        } else {
            &probe["httpGet"]["port"]
        };
        container_port(c, port);
        // Every role, the frontend too, has its certificate for the control plane's TLS.
        assert_eq!(flag(&a, "--certs"), deploy::k8s::TLS_MOUNT);
        let listen = if a[0] == "frontend" {
            flag(&a, "--port")
        } else {
            flag(&a, "--listen").rsplit_once(':').unwrap().1.to_string()
        };
        container_port(c, &Value::from(listen.parse::<u64>().unwrap()));
        assert_eq!(
            flag(&a, "--model"),
            pod_file.model.path.as_ref().unwrap().display().to_string()
        );
    }

    // Cards: one Deployment each, its --id its index, behind a Service of the same name.
    let mut card_ids = BTreeSet::new();
    for k in 0..cards {
        let d = find(objects, "Deployment", &format!("{prefix}-card-{k}"));
        assert_eq!(d["spec"]["replicas"], 1);
        let a = args(container(d));
        assert_eq!(a[0], "card");
        card_ids.insert(flag(&a, "--id"));
        find(objects, "Service", &format!("{prefix}-card-{k}"));
    }
    assert_eq!(card_ids, (0..cards).map(|k| k.to_string()).collect());

    // Attention nodes dial card K's Service, in card order, on the cards' listen port.
    let mut ids = BTreeSet::new();
    let mut attention_listen = BTreeMap::new();
    for j in 0..nodes {
        let d = find(objects, "Deployment", &format!("{prefix}-attention-{j}"));
        let a = args(container(d));
        assert_eq!(a[0], "attention");
        ids.insert(flag(&a, "--id"));
        assert_eq!(flag(&a, "--deployment"), "/etc/afd/config/deployment.toml");
        let dialed: Vec<String> = flag(&a, "--cards").split(',').map(String::from).collect();
        assert_eq!(dialed.len(), cards);
        for (k, address) in dialed.iter().enumerate() {
            let (host, _) = address.rsplit_once(':').unwrap();
            assert_eq!(host, format!("{prefix}-card-{k}"));
            let (workload, port) = resolve(objects, address);
            assert_eq!(workload["kind"], "Deployment");
            assert_eq!(flag(&args(container(workload)), "--id"), k.to_string());
            let card_listen = flag(&args(container(workload)), "--listen");
            assert!(
                card_listen.ends_with(&format!(":{port}")),
                "{card_listen} vs {port}"
            );
        }
        attention_listen.insert(name(d).to_string(), flag(&a, "--listen"));
    }
    assert_eq!(ids, (0..nodes).map(|j| j.to_string()).collect());

    // The frontend dials each attention node's Service, which reaches that node's listen port.
    let frontend = find(objects, "Deployment", &format!("{prefix}-frontend"));
    let a = args(container(frontend));
    assert_eq!(a[0], "frontend");
    let attention_addrs = flag(&a, "--attention-addrs");
    let dialed: Vec<&str> = attention_addrs.split(',').collect();
    assert_eq!(dialed.len(), nodes);
    let mut reached = BTreeSet::new();
    for address in dialed {
        let (workload, port) = resolve(objects, address);
        let listen = &attention_listen[name(workload)];
        assert!(listen.ends_with(&format!(":{port}")), "{listen} vs {port}");
        reached.insert(name(workload).to_string());
    }
    assert_eq!(reached.len(), nodes, "two addresses reach the same node");
    let svc = find(objects, "Service", &format!("{prefix}-frontend"));
    let (workload, port) = resolve(
        objects,
        &format!("{}:{}", name(svc), svc["spec"]["ports"][0]["port"]),
    );
    assert_eq!(name(workload), name(frontend));
    assert_eq!(port.to_string(), flag(&a, "--port"));
}

#[test]
fn the_tiny_deployment_renders_wired_manifests() {
    let objects = parse(&afd_k8s(&[tiny().to_str().unwrap()]));
    let d = Deployment::load(&tiny()).unwrap();
    check(&objects, d.cards.count, d.attention.nodes, "afd");
}

#[test]
fn several_cards_and_attention_nodes_written_to_a_folder_are_wired() {
    let dir = tempfile::tempdir().unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/afd-tiny-gpt-oss");
    let file = dir.path().join("wide.toml");
    std::fs::write(
        &file,
        format!(
            "[model]\npath = \"{}\"\n[cards]\ncount = 3\nbase_port = 9100\n[attention]\nnodes = 2\n\
             base_port = 9200\n[server]\nport = 9000\n",
            model.display()
        ),
    )
    .unwrap();
    let certs = dir.path().join("certs");
    let made = Command::new(AFD)
        .args(["certs", "--out", certs.to_str().unwrap()])
        .args(["--nodes", "attn-0,attn-1,card-0,card-1,card-2,frontend"])
        .output()
        .unwrap();
    assert!(made.status.success());
    let out = dir.path().join("manifests");
    let listed = afd_k8s(&[
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--name",
        "wide",
        "--certs",
        certs.to_str().unwrap(),
    ]);
    let mut objects = Vec::new();
    for path in listed.lines() {
        objects.extend(parse(&std::fs::read_to_string(path).unwrap()));
    }
    check(&objects, 3, 2, "wide");
    // The Secrets hold the certificates made by `afd certs`, not new ones, and no CA key.
    let secret = find(&objects, "Secret", "wide-tls-card-2");
    let ca = std::fs::read_to_string(certs.join("ca.pem")).unwrap();
    assert_eq!(secret["stringData"]["ca.pem"], ca.as_str());
    let key = std::fs::read_to_string(certs.join("card-2.key.pem")).unwrap();
    assert_eq!(secret["stringData"]["card-2.key.pem"], key.as_str());
    assert!(secret["stringData"].get("ca.key.pem").is_none());
}

/// A Kubernetes memory or CPU quantity as afd writes them, in bytes or millicores.
fn quantity(q: &Value, unit: &str) -> u64 {
    let s = q
        .as_str()
        .unwrap_or_else(|| panic!("{q} is not a string quantity"));
    match unit {
        "memory" => {
            let mib = s.strip_suffix("Mi").unwrap_or_else(|| panic!("memory {s}"));
            mib.parse::<u64>().unwrap() << 20
        }
        _ => match s.strip_suffix('m') {
            Some(m) => m.parse().unwrap(),
            None => s.parse::<u64>().unwrap() * 1000,
        },
    }
}

/// Every pod asks for CPU and memory sized from the plan (cards at least their shard, the
/// attention node at least its weights and KV cache), and an attention node on a GPU asks for
/// one `nvidia.com/gpu` (as a limit, the way Kubernetes takes extended resources).
#[test]
fn pods_request_what_the_plan_sizes_and_gpu_nodes_a_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/afd-tiny-gpt-oss");
    for device in ["cpu", "cuda"] {
        let file = dir.path().join(format!("{device}.toml"));
        std::fs::write(
            &file,
            format!(
                "[model]\npath = \"{}\"\n[cards]\ncount = 2\n[attention]\ndevice = \"{device}\"\n\
                 kv_cache_memory = 64\n",
                model.display()
            ),
        )
        .unwrap();
        let objects = parse(&afd_k8s(&[file.to_str().unwrap()]));
        let d = Deployment::load(&file).unwrap();
        let plan: Value =
            serde_json::from_slice(&afd_ok(|c| c.arg("plan").arg(&file).arg("--json"))).unwrap();
        for w in objects.iter().filter(|o| o["spec"]["template"].is_object()) {
            let c = container(w);
            let r = &c["resources"];
            let cpu = quantity(&r["requests"]["cpu"], "cpu");
            let memory = quantity(&r["requests"]["memory"], "memory");
            assert!(cpu >= 1000, "{}: {r}", name(w));
            let role = args(c)[0].clone();
            let gpus = r["limits"]["nvidia.com/gpu"].as_u64();
            match role.as_str() {
                "card" => {
                    let largest = plan["per_card"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|c| c["sram_bytes_needed"].as_u64().unwrap())
                        .max()
                        .unwrap();
                    assert!(memory >= largest, "card {memory} < {largest}");
                    assert_eq!(gpus, None);
                }
                "attention" => {
                    let weights = plan["attention"]["weight_bytes"].as_u64().unwrap();
                    let kv = (d.attention.kv_cache_memory.unwrap() as u64) << 20;
                    if device == "cuda" {
                        assert_eq!(gpus, Some(1), "{r}");
                        assert!(memory >= weights, "{memory} < {weights}");
                    } else {
                        assert_eq!(gpus, None);
                        assert!(memory >= weights + kv, "{memory} < {weights} + {kv}");
                    }
                }
                _ => assert_eq!(gpus, None),
            }
            // Nothing but the three known keys.
            for key in r.as_object().unwrap().keys() {
                assert!(key == "requests" || key == "limits", "{key}");
            }
        }
    }
}
