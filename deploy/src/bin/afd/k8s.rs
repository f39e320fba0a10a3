//! `afd k8s FILE`: Kubernetes manifests for a deployment file (see `deploy::k8s` and
//! docs/KUBERNETES.md).

use std::path::PathBuf;

use anyhow::{Context, bail};
use deploy::deployment::Deployment;
use deploy::k8s::resources::DeploymentResources;
use deploy::k8s::{K8sOptions, load_tls, render, tls_names};

/// Render the Kubernetes manifests of a deployment: every card, attention node and the frontend
/// as a Deployment with a Service, a ConfigMap with the deployment file, and per node a TLS
/// Secret with only that node's key.
#[derive(Debug, clap::Args)]
pub struct K8sArgs {
    /// The deployment file (TOML).
    file: PathBuf,
    /// Write one YAML file per group of objects into this folder (for `kubectl apply -f DIR`)
    /// instead of printing them all.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Container image with the `afd` binary (and the model, without --model-pvc).
    #[arg(long, default_value = "afd:latest")]
    image: String,
    /// Prefix of every object's name (several deployments in one namespace).
    #[arg(long, default_value = "afd")]
    name: String,
    /// Namespace of every object (default: kubectl's current one).
    #[arg(long)]
    namespace: Option<String>,
    /// PersistentVolumeClaim holding the checkpoint folder, mounted read-only at /models.
    #[arg(long)]
    model_pvc: Option<String>,
    /// The checkpoint folder inside the containers (default: /models/<the folder's name>).
    #[arg(long)]
    model_dir: Option<String>,
    /// Folder made by `afd certs` whose certificates go into the Secrets (default: the file's
    /// `transport.tls_dir`, else a new cluster CA made now, whose key is not kept).
    #[arg(long)]
    certs: Option<PathBuf>,
    /// Leave the TLS Secrets out (make node N's with `kubectl create secret generic
    /// NAME-tls-N --from-file=DIR/ca.pem --from-file=DIR/N.pem --from-file=DIR/N.key.pem`).
    #[arg(long, conflicts_with = "certs")]
    no_secret: bool,
}

pub fn run(args: K8sArgs) -> anyhow::Result<()> {
    let deployment = Deployment::load(&args.file)?;
    let names = tls_names(&deployment);
    let certs = args.certs.clone().or(deployment.transport.tls_dir.clone());
    let tls = match (args.no_secret, certs) {
        (true, _) => None,
        (false, Some(dir)) => Some(load_tls(&dir, &names)?),
        (false, None) => {
            let scratch = tempfile::Builder::new()
                .prefix("afd-k8s-certs-")
                .tempdir()
                .context("making a folder for the certificates")?;
            jetstream::write_cluster(scratch.path(), &names)
                .context("making the cluster CA and node certificates")?;
            Some(load_tls(scratch.path(), &names)?)
        }
    };
    // The pods' requests come from the plan of the same file.
    let plan = deploy::plan::plan_deployment(&deployment).with_context(|| {
        format!(
            "sizing the pods' CPU and memory requests from the plan of {} (it reads the model's \
             config.json)",
            args.file.display()
        )
    })?;
    let kv_bytes = deployment.kv_cache_bytes(&deployment.model_config()?) as u64;
    let options = K8sOptions {
        name: args.name,
        image: args.image,
        namespace: args.namespace,
        model_pvc: args.model_pvc,
        model_dir: args.model_dir,
        tls,
        resources: Some(DeploymentResources::from_plan(&deployment, &plan, kv_bytes)),
    };
    let manifests = render(&deployment, &options)
        .with_context(|| format!("rendering {}", args.file.display()))?;
    match &args.out {
        Some(dir) => {
            for path in manifests.write(dir)? {
                println!("{}", path.display());
            }
            if options.tls.is_some() {
                eprintln!(
                    "the Secrets in {} hold private keys: keep it out of version control",
                    dir.display()
                );
            }
        }
        None => {
            let yaml = manifests.to_yaml()?;
            if yaml.is_empty() {
                bail!("nothing to render");
            }
            print!("{yaml}");
        }
    }
    Ok(())
}
