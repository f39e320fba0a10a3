//! `afd k8s`: Kubernetes manifests for a deployment file.
//!
//! Every node is a one-replica Deployment with its own Service: card K (`NAME-card-K`, the name
//! attention nodes dial), attention node J (`NAME-attention-J`) and the frontend, because each
//! has its own identity (JetStream name `card-K` / `attn-J` / `frontend` and certificate) and
//! mounts only its own key: node N's Secret `NAME-tls-N` holds the CA certificate and N's
//! certificate and key. A ConfigMap holds the deployment file the nodes read. Readiness probes: a TCP connect to the cards' and
//! attention nodes' control ports (mutual TLS, which the kubelet's grpc probe cannot speak),
//! `GET /health` on the frontend.
//!
//! JetStream's data plane is direct pod-to-pod QUIC: cards and attention nodes bind their UDP
//! port on their pod IP (`$(POD_IP)`, from the downward API), which is the address they report
//! to each other, so no Service carries it.
//!
//! Rendering is pure ([`render`] takes the file's contents and the TLS files); [`load_tls`] and
//! [`Manifests::write`] do the I/O.

mod objects;
pub mod resources;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::deployment::{Deployment, is_path_like};
use crate::error::{Error, Result};
use crate::launch::plan::RolePaths;

/// Where the TLS Secret and the ConfigMap are mounted in every container.
pub const TLS_MOUNT: &str = "/etc/afd/tls";
/// Where the ConfigMap (deployment file, card profile) is mounted.
pub const CONFIG_MOUNT: &str = "/etc/afd/config";
/// The deployment file's key in the ConfigMap.
pub const DEPLOYMENT_KEY: &str = "deployment.toml";
/// The card profile's key in the ConfigMap, when the deployment names a profile file.
pub const CARD_PROFILE_KEY: &str = "card-profile.toml";
/// Where a model PersistentVolumeClaim is mounted.
pub const MODEL_MOUNT: &str = "/models";

/// How the manifests are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct K8sOptions {
    /// Prefix of every object's name and the `app.kubernetes.io/instance` label, so several
    /// deployments can share a namespace. Default `afd`.
    pub name: String,
    /// Container image holding the `afd` binary (and the model, without `model_pvc`).
    /// Default `afd:latest`.
    pub image: String,
    /// Namespace of every object; default: none (kubectl's current namespace).
    pub namespace: Option<String>,
    /// PersistentVolumeClaim holding the checkpoint folder, mounted read-only at `/models` in
    /// every pod. Default: none (the model is in the image).
    pub model_pvc: Option<String>,
    /// The checkpoint folder inside the containers. Default: `/models/<folder name>`.
    pub model_dir: Option<String>,
    /// The TLS Secret's files (name -> PEM); `None` leaves the Secret out, for a Secret made
    /// with `kubectl create secret generic NAME-tls --from-file=DIR`.
    pub tls: Option<BTreeMap<String, String>>,
    /// The pods' CPU, memory and GPU requests (from the plan); `None` renders none.
    pub resources: Option<resources::DeploymentResources>,
}

impl Default for K8sOptions {
    fn default() -> Self {
        K8sOptions {
            name: "afd".into(),
            image: "afd:latest".into(),
            namespace: None,
            model_pvc: None,
            model_dir: None,
            tls: None,
            resources: None,
        }
    }
}

/// The manifests, one YAML file per group of objects, in apply order.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifests {
    /// `(file name, objects)`: config and Secret, cards, each attention node, frontend.
    pub files: Vec<(String, Vec<Value>)>,
}

impl Manifests {
    /// Every object, in apply order.
    pub fn objects(&self) -> impl Iterator<Item = &Value> {
        self.files.iter().flat_map(|(_, objects)| objects)
    }

    /// All objects as one multi-document YAML stream.
    pub fn to_yaml(&self) -> Result<String> {
        yaml_stream(self.objects())
    }

    /// Writes one YAML file per group into `dir` (created if missing); returns the paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir)
            .map_err(Error::system(format!("cannot create {}", dir.display())))?;
        let mut written = Vec::new();
        for (name, objects) in &self.files {
            let path = dir.join(name);
            std::fs::write(&path, yaml_stream(objects.iter())?)
                .map_err(Error::system(format!("cannot write {}", path.display())))?;
            written.push(path);
        }
        Ok(written)
    }
}

fn yaml_stream<'a>(objects: impl Iterator<Item = &'a Value>) -> Result<String> {
    let mut out = String::new();
    for object in objects {
        out.push_str("---\n");
        out.push_str(&serde_norway::to_string(&conventional_order(object)?).map_err(Error::Yaml)?);
    }
    Ok(out)
}

/// The object with `apiVersion`, `kind` and `metadata` first, as manifests are read.
fn conventional_order(object: &Value) -> Result<serde_norway::Value> {
    const FIRST: [&str; 3] = ["apiVersion", "kind", "metadata"];
    let convert = |v: &Value| serde_norway::to_value(v).map_err(Error::Yaml);
    let Value::Object(fields) = object else {
        return convert(object);
    };
    let mut map = serde_norway::Mapping::new();
    let first = FIRST.iter().filter_map(|k| fields.get_key_value(*k));
    let rest = fields.iter().filter(|(k, _)| !FIRST.contains(&k.as_str()));
    for (key, value) in first.chain(rest) {
        map.insert(serde_norway::Value::String(key.clone()), convert(value)?);
    }
    Ok(serde_norway::Value::Mapping(map))
}

/// The TLS files pods need from a folder made by `afd certs`: `ca.pem` and every node's
/// `NODE.pem` / `NODE.key.pem` (never the CA's private key).
pub fn load_tls(dir: &Path, nodes: &[String]) -> Result<BTreeMap<String, String>> {
    let mut files = BTreeMap::new();
    let mut names = vec!["ca.pem".to_string()];
    for node in nodes {
        names.push(format!("{node}.pem"));
        names.push(format!("{node}.key.pem"));
    }
    for name in names {
        let path = dir.join(&name);
        let text = std::fs::read_to_string(&path).map_err(Error::system(format!(
            "cannot read {} (make the certificates with `afd certs --out {} --nodes {}`)",
            path.display(),
            dir.display(),
            nodes.join(",")
        )))?;
        files.insert(name, text);
    }
    Ok(files)
}

/// The files of node `node`'s Secret: the CA certificate, its certificate and its key.
pub fn node_tls_files(node: &str) -> [String; 3] {
    [
        "ca.pem".to_string(),
        format!("{node}.pem"),
        format!("{node}.key.pem"),
    ]
}

/// Node names needing a certificate: `attn-J`, `card-K` and `frontend`.
pub fn tls_names(d: &Deployment) -> Vec<String> {
    (0..d.attention.nodes)
        .map(crate::cluster::attention_name)
        .chain((0..d.cards.count).map(crate::cluster::card_name))
        .chain(std::iter::once(crate::cluster::FRONTEND_NAME.to_owned()))
        .collect()
}

/// A Kubernetes object name: lowercase letters, digits and `-`, starting and ending with an
/// alphanumeric, short enough for `NAME-attention-J` to stay within 63 characters.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 40
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "--name `{name}`: Kubernetes names take lowercase letters, digits and `-` (not at \
             either end), at most 40 characters here"
        )))
    }
}

/// The manifests of deployment `d` (as loaded from its file).
pub fn render(d: &Deployment, options: &K8sOptions) -> Result<Manifests> {
    check_name(&options.name)?;
    if d.transport.kind == crate::cluster::TransportKind::Inproc {
        return Err(Error::Config(format!(
            "{}: `transport.kind = \"inproc\"` runs in one process; pods talk over QUIC, so set \
             `transport.kind = \"quic\"`",
            d.source.display()
        )));
    }
    if d.cards.count == 0 {
        return Err(Error::Config(format!(
            "{}: `cards.count = 0` runs the whole model on the attention device, a single \
             process: serve it with `afd serve --reference`, or set `cards.count` to 1 or more",
            d.source.display()
        )));
    }
    let checkpoint = d.checkpoint()?;
    let model_dir = match &options.model_dir {
        Some(dir) => dir.clone(),
        None => {
            let folder = checkpoint
                .canonicalize()
                .unwrap_or_else(|_| checkpoint.clone())
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .ok_or_else(|| {
                    Error::Config(format!(
                        "{}: `model.path` has no folder name; pass --model-dir",
                        d.source.display()
                    ))
                })?;
            format!("{MODEL_MOUNT}/{folder}")
        }
    };
    let card_profile = if is_path_like(&d.cards.profile) {
        let text = std::fs::read_to_string(&d.cards.profile).map_err(Error::system(format!(
            "{}: cannot read the card profile {}",
            d.source.display(),
            d.cards.profile
        )))?;
        Some(text)
    } else {
        None
    };
    let names = objects::Names::new(&options.name);
    let ports = objects::Ports::of(d);
    // The file the pods read: the model and the profile where the containers have them, the
    // addresses as the cluster names them, no host paths.
    let mut pod_file = d.clone();
    pod_file.model.path = Some(PathBuf::from(&model_dir));
    pod_file.model.shape = None;
    pod_file.transport.tls_dir = None;
    // The key goes to the frontend from a Secret of its own.
    pod_file.server.api_key = None;
    pod_file.cards.addresses = names.card_addresses(d.cards.count, ports.card);
    pod_file.attention.addresses = names.attention_addresses(d.attention.nodes, ports.attention);
    if card_profile.is_some() {
        pod_file.cards.profile = format!("{CONFIG_MOUNT}/{CARD_PROFILE_KEY}");
    }
    let mut config = BTreeMap::new();
    config.insert(DEPLOYMENT_KEY.to_string(), pod_file.to_toml()?);
    if let Some(text) = card_profile {
        config.insert(CARD_PROFILE_KEY.to_string(), text);
    }
    let paths = RolePaths {
        deployment: format!("{CONFIG_MOUNT}/{DEPLOYMENT_KEY}"),
        certs: TLS_MOUNT.into(),
        model: model_dir,
        card_profile: pod_file
            .cards
            .profile
            .starts_with(CONFIG_MOUNT)
            .then(|| pod_file.cards.profile.clone()),
    };
    let build = objects::Builder {
        d,
        options,
        names: &names,
        ports,
        paths: &paths,
    };
    let mut files = Vec::new();
    let mut base = vec![build.config_map(&config)];
    if let Some(tls) = &options.tls {
        base.extend(tls_names(d).iter().map(|node| build.secret(node, tls)));
    }
    if let Some(key) = &d.server.api_key {
        base.push(build.api_key_secret(key));
    }
    files.push(("00-config.yaml".to_string(), base));
    files.push((
        "10-cards.yaml".to_string(),
        (0..d.cards.count).flat_map(|k| build.card(k)).collect(),
    ));
    for j in 0..d.attention.nodes {
        files.push((format!("20-attention-{j}.yaml"), build.attention(j)));
    }
    files.push(("30-frontend.yaml".to_string(), build.frontend()));
    Ok(Manifests { files })
}
