//! Which processes a deployment is made of, with their command lines and health checks: the
//! I/O-free half of `afd up`. The same roles and names are used by the Kubernetes manifests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::cluster::{FRONTEND_NAME, TransportKind, attention_name, card_name};
use crate::deployment::{Deployment, is_path_like};
use crate::error::{Error, Result};

/// One process of a deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Card `k` (`afd card --id k`).
    Card(usize),
    /// Attention node `j` (`afd attention --id j`).
    Attention(usize),
    /// The HTTP frontend and router (`afd frontend --attention-addrs ...`).
    Frontend,
}

impl Role {
    /// The role's name in logs, process lists and Kubernetes objects: `card-0`, `attention-0`,
    /// `frontend`.
    pub fn name(&self) -> String {
        match self {
            Role::Card(k) => format!("card-{k}"),
            Role::Attention(j) => format!("attention-{j}"),
            Role::Frontend => "frontend".into(),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// How a launcher tells that a process is ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthCheck {
    /// Card `index`'s gRPC `Card.Health` answers at `address` (`host:port`), asked over the
    /// control plane's TLS as attention node 0 (whose identity is in `certs`): cards answer
    /// attention nodes only.
    Card {
        /// `host:port`.
        address: String,
        /// The card's index (its certificate is `card-INDEX`).
        index: usize,
        /// The certificate folder.
        certs: PathBuf,
    },
    /// Attention node `index`'s gRPC `Attention.Health` says ready at `address`, asked as the
    /// frontend (identity in `certs`).
    Attention {
        /// `host:port`.
        address: String,
        /// The node's index (its certificate is `attn-INDEX`).
        index: usize,
        /// The certificate folder.
        certs: PathBuf,
    },
    /// `GET path` answers 200 at this `host:port`.
    Http {
        /// `host:port`.
        address: String,
        /// The path, e.g. `/health`.
        path: String,
    },
}

/// One process to start: `afd ARGS...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSpec {
    /// What it is.
    pub role: Role,
    /// Arguments after the `afd` program name (the subcommand first).
    pub args: Vec<String>,
    /// Environment variables set for it besides the inherited ones (secrets go here, not in
    /// `args`, which anyone on the machine can read).
    pub env: Vec<(String, String)>,
    /// When it counts as started.
    pub health: HealthCheck,
}

/// Where each role listens, once ports are chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Addresses {
    /// Control plane of each card, in card order.
    pub cards: Vec<SocketAddr>,
    /// Step service of each attention node, in node order.
    pub attention: Vec<SocketAddr>,
    /// The HTTP frontend.
    pub frontend: SocketAddr,
}

impl Addresses {
    /// The addresses a deployment file names (`cards.*`, `attention.*`, `server.*`). A local
    /// launch binds them, so each must be an `IP:port` of this machine.
    pub fn from_deployment(d: &Deployment) -> Result<Self> {
        let parse = |key: &str, text: &str| -> Result<SocketAddr> {
            text.parse().map_err(|_| {
                Error::Config(format!(
                    "`{key}` gives `{text}`, but `afd up` starts every process on this machine \
                     and needs an IP:port to listen on; use an IP address (e.g. 127.0.0.1), or \
                     `afd up --free-ports`"
                ))
            })
        };
        let cards = d
            .card_addresses()
            .iter()
            .map(|a| parse("cards", a))
            .collect::<Result<_>>()?;
        let attention = d
            .attention_addresses()
            .iter()
            .map(|a| parse("attention", a))
            .collect::<Result<_>>()?;
        let frontend = parse(
            "server.host/server.port",
            &format!("{}:{}", d.server.host, d.server.port),
        )
        .or_else(|_| {
            parse(
                "server.host",
                &format!("[{}]:{}", d.server.host, d.server.port),
            )
        })?;
        Ok(Addresses {
            cards,
            attention,
            frontend,
        })
    }

    /// Node names that need certificates: `attn-J` and `card-K`.
    pub fn tls_names(&self) -> Vec<String> {
        (0..self.attention.len())
            .map(attention_name)
            .chain((0..self.cards.len()).map(card_name))
            .chain(std::iter::once(FRONTEND_NAME.to_owned()))
            .collect()
    }
}

/// Files the launch refers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchFiles {
    /// The deployment file (attention nodes read their settings from it).
    pub deployment: PathBuf,
    /// The folder with the cluster CA and every node's certificate.
    pub certs: PathBuf,
}

/// Every process of a deployment, in start order: cards, attention nodes, frontend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchPlan {
    /// The processes, each started once the one before it is healthy.
    pub processes: Vec<ProcessSpec>,
    /// The frontend's base URL.
    pub url: String,
}

/// A host to reach a listening address at: a wildcard listen address is reached on loopback.
pub fn reachable(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => {
            std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
        }
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => {
            std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
        }
        ip => ip,
    };
    SocketAddr::new(ip, addr.port()).to_string()
}

fn path_arg(p: &Path) -> String {
    p.display().to_string()
}

/// Paths every role is given, as its process sees them (this machine, or inside a container).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolePaths {
    /// The deployment file attention nodes read their settings from.
    pub deployment: String,
    /// The folder with the cluster CA and the node certificates.
    pub certs: String,
    /// The checkpoint folder.
    pub model: String,
    /// The cards' hardware profile file, when it is not the built-in one.
    pub card_profile: Option<String>,
}

/// `afd card` for card `id` (a number, or a variable a manifest expands) with its control plane
/// on `listen` and, when given, its JetStream data plane on `data_listen`.
pub fn card_args(
    d: &Deployment,
    paths: &RolePaths,
    id: &str,
    listen: &str,
    data_listen: Option<&str>,
) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "card".into(),
        "--id".into(),
        id.into(),
        "--listen".into(),
        listen.into(),
        "--certs".into(),
        paths.certs.clone(),
        "--model".into(),
        paths.model.clone(),
        "--card-threads".into(),
        d.cards.card_threads.to_string(),
    ];
    if let Some(data) = data_listen {
        args.extend(["--data-listen".into(), data.into()]);
    }
    if let Some(profile) = &paths.card_profile {
        args.extend(["--profile".into(), profile.clone()]);
    }
    args
}

/// `afd attention` for node `id`, its step service on `listen`, over the cards whose control
/// planes are at `cards` (in card order); settings from the deployment file.
pub fn attention_args(
    paths: &RolePaths,
    id: usize,
    listen: &str,
    data_listen: Option<&str>,
    cards: &[String],
) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "attention".into(),
        "--deployment".into(),
        paths.deployment.clone(),
        "--model".into(),
        paths.model.clone(),
        "--id".into(),
        id.to_string(),
        "--listen".into(),
        listen.into(),
        "--cards".into(),
        cards.join(","),
        "--certs".into(),
        paths.certs.clone(),
    ];
    if let Some(data) = data_listen {
        args.extend(["--data-listen".into(), data.into()]);
    }
    args
}

/// The variable `afd serve` reads its API key from (vLLM's name).
pub const API_KEY_ENV: &str = "VLLM_API_KEY";

/// `afd frontend` (the frontend alone) on `host:port`, over the attention nodes at `attention`.
pub fn frontend_args(
    d: &Deployment,
    paths: &RolePaths,
    host: &str,
    port: u16,
    attention: &[String],
) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "frontend".into(),
        "--model".into(),
        paths.model.clone(),
        "--host".into(),
        host.into(),
        "--port".into(),
        port.to_string(),
        "--attention-addrs".into(),
        attention.join(","),
        "--certs".into(),
        paths.certs.clone(),
        "--max-num-seqs".into(),
        d.attention.max_num_seqs.to_string(),
        "--max-model-len".into(),
        d.attention.max_model_len.to_string(),
        "--max-num-batched-tokens".into(),
        d.attention.max_num_batched_tokens.to_string(),
        "--max-waiting".into(),
        d.server.max_waiting.to_string(),
        "--shutdown-timeout".into(),
        d.server.shutdown_timeout.to_string(),
    ];
    if !d.attention.enable_prefix_caching {
        args.push("--no-enable-prefix-caching".into());
    }
    let served = d.model.served_name.clone().or_else(|| {
        Path::new(&paths.model)
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
    });
    if let Some(name) = served {
        args.extend(["--served-model-name".into(), name]);
    }
    args
}

/// The processes of deployment `d` listening on `addresses`. Pure: nothing is started or read.
pub fn plan(d: &Deployment, addresses: &Addresses, files: &LaunchFiles) -> Result<LaunchPlan> {
    if d.transport.kind == TransportKind::Inproc {
        return Err(Error::Config(format!(
            "{}: `transport.kind = \"inproc\"` joins cards and attention nodes inside one \
             process, so there is nothing for `afd up` to start separately; run it with \
             `afd serve --transport inproc`, or set `transport.kind = \"quic\"`",
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
    if addresses.cards.len() != d.cards.count || addresses.attention.len() != d.attention.nodes {
        return Err(Error::Config(format!(
            "{} card and {} attention addresses for {} cards and {} attention nodes",
            addresses.cards.len(),
            addresses.attention.len(),
            d.cards.count,
            d.attention.nodes
        )));
    }
    let paths = RolePaths {
        deployment: path_arg(&files.deployment),
        certs: path_arg(&files.certs),
        model: path_arg(&d.checkpoint()?),
        card_profile: is_path_like(&d.cards.profile).then(|| d.cards.profile.clone()),
    };
    let mut processes = Vec::new();
    for (k, listen) in addresses.cards.iter().enumerate() {
        processes.push(ProcessSpec {
            role: Role::Card(k),
            args: card_args(d, &paths, &k.to_string(), &listen.to_string(), None),
            env: Vec::new(),
            health: HealthCheck::Card {
                address: reachable(*listen),
                index: k,
                certs: files.certs.clone(),
            },
        });
    }
    let cards: Vec<String> = addresses.cards.iter().map(|a| reachable(*a)).collect();
    for (j, listen) in addresses.attention.iter().enumerate() {
        processes.push(ProcessSpec {
            role: Role::Attention(j),
            args: attention_args(&paths, j, &listen.to_string(), None, &cards),
            env: Vec::new(),
            health: HealthCheck::Attention {
                address: reachable(*listen),
                index: j,
                certs: files.certs.clone(),
            },
        });
    }
    let attention: Vec<String> = addresses.attention.iter().map(|a| reachable(*a)).collect();
    processes.push(ProcessSpec {
        role: Role::Frontend,
        args: frontend_args(
            d,
            &paths,
            &addresses.frontend.ip().to_string(),
            addresses.frontend.port(),
            &attention,
        ),
        env: d
            .server
            .api_key
            .iter()
            .map(|key| (API_KEY_ENV.to_string(), key.clone()))
            .collect(),
        health: HealthCheck::Http {
            address: reachable(addresses.frontend),
            path: "/health".into(),
        },
    });
    Ok(LaunchPlan {
        processes,
        url: format!("http://{}", reachable(addresses.frontend)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deployment(text: &str) -> Deployment {
        Deployment::from_toml(text, Path::new("/deployments")).unwrap()
    }

    fn files() -> LaunchFiles {
        LaunchFiles {
            deployment: "/deployments/d.toml".into(),
            certs: "/run/certs".into(),
        }
    }

    fn arg<'a>(spec: &'a ProcessSpec, flag: &str) -> &'a str {
        let i = spec.args.iter().position(|a| a == flag).unwrap();
        &spec.args[i + 1]
    }

    const TEXT: &str = "[model]\npath = \"ckpt\"\n[cards]\ncount = 3\n[attention]\nnodes = 2\n";

    #[test]
    fn every_role_is_wired_to_the_addresses_it_talks_to() {
        let d = deployment(TEXT);
        let addresses = Addresses::from_deployment(&d).unwrap();
        let plan = plan(&d, &addresses, &files()).unwrap();
        let roles: Vec<Role> = plan.processes.iter().map(|p| p.role).collect();
        assert_eq!(
            roles,
            [
                Role::Card(0),
                Role::Card(1),
                Role::Card(2),
                Role::Attention(0),
                Role::Attention(1),
                Role::Frontend
            ]
        );
        let cards: Vec<String> = plan.processes[..3]
            .iter()
            .map(|p| arg(p, "--listen").to_string())
            .collect();
        for (k, p) in plan.processes[..3].iter().enumerate() {
            assert_eq!(arg(p, "--id"), k.to_string());
            assert_eq!(
                p.health,
                HealthCheck::Card {
                    address: cards[k].clone(),
                    index: k,
                    certs: files().certs,
                }
            );
        }
        let mut attention = Vec::new();
        for (j, p) in plan.processes[3..5].iter().enumerate() {
            assert_eq!(arg(p, "--cards"), cards.join(","));
            assert_eq!(arg(p, "--id"), j.to_string());
            assert_eq!(arg(p, "--model"), "/deployments/ckpt");
            attention.push(arg(p, "--listen").to_string());
        }
        let frontend = &plan.processes[5];
        assert_eq!(arg(frontend, "--attention-addrs"), attention.join(","));
        assert_eq!(arg(frontend, "--certs"), arg(&plan.processes[0], "--certs"));
        assert_eq!(arg(frontend, "--served-model-name"), "ckpt");
        let port = arg(frontend, "--port");
        assert!(plan.url.ends_with(&format!(":{port}")), "{}", plan.url);
        let mut all: Vec<&str> = cards.iter().chain(&attention).map(|s| s.as_str()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 5, "two roles share an address");
        assert_eq!(
            addresses.tls_names(),
            ["attn-0", "attn-1", "card-0", "card-1", "card-2", "frontend"]
        );
    }

    #[test]
    fn the_api_key_goes_to_the_frontend_environment_only() {
        let d = deployment(&format!("{TEXT}[server]\napi_key = \"sk-1\"\n"));
        let addresses = Addresses::from_deployment(&d).unwrap();
        let plan = plan(&d, &addresses, &files()).unwrap();
        for p in &plan.processes {
            assert!(!p.args.iter().any(|a| a.contains("sk-1")), "{:?}", p.args);
            let want: Vec<(String, String)> = match p.role {
                Role::Frontend => vec![(API_KEY_ENV.into(), "sk-1".into())],
                _ => Vec::new(),
            };
            assert_eq!(p.env, want);
        }
    }

    #[test]
    fn a_wildcard_listen_address_is_checked_on_loopback() {
        let d = deployment("[model]\npath = \"m\"\n[server]\nhost = \"0.0.0.0\"\nport = 9000\n");
        let addresses = Addresses::from_deployment(&d).unwrap();
        let plan = plan(&d, &addresses, &files()).unwrap();
        assert_eq!(plan.url, "http://127.0.0.1:9000");
        let frontend = plan.processes.last().unwrap();
        assert_eq!(arg(frontend, "--host"), "0.0.0.0");
    }

    #[test]
    fn inproc_and_host_names_are_refused_with_the_way_out() {
        let d = deployment("[model]\npath = \"m\"\n[transport]\nkind = \"inproc\"\n");
        let addresses = Addresses::from_deployment(&d).unwrap();
        let err = plan(&d, &addresses, &files()).unwrap_err().to_string();
        assert!(err.contains("afd serve --transport inproc"), "{err}");
        let d = deployment(
            "[model]\npath = \"m\"\n[cards]\ncount = 1\naddresses = [\"card-0.svc:7100\"]\n",
        );
        let err = Addresses::from_deployment(&d).unwrap_err().to_string();
        assert!(err.contains("--free-ports"), "{err}");
    }

    #[test]
    fn a_shape_without_weights_cannot_be_launched() {
        let d = deployment("[model]\nshape = \"tiny\"\n");
        let addresses = Addresses::from_deployment(&d).unwrap();
        let err = plan(&d, &addresses, &files()).unwrap_err().to_string();
        assert!(err.contains("model.path"), "{err}");
    }

    #[test]
    fn prefix_caching_is_on_unless_the_deployment_turns_it_off() {
        let frontend_of = |text: &str| {
            let d = deployment(text);
            let addresses = Addresses::from_deployment(&d).unwrap();
            plan(&d, &addresses, &files())
                .unwrap()
                .processes
                .pop()
                .unwrap()
        };
        let flag = "--no-enable-prefix-caching".to_string();
        assert!(!frontend_of(TEXT).args.contains(&flag));
        let off = frontend_of(&format!("{TEXT}enable_prefix_caching = false\n"));
        assert_eq!(off.role, Role::Frontend);
        assert!(off.args.contains(&flag), "{:?}", off.args);
    }
}
