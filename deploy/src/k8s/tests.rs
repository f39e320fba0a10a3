use std::path::Path;

use super::*;

fn deployment(text: &str) -> Deployment {
    Deployment::from_toml(text, Path::new("/deployments")).unwrap()
}

const TEXT: &str = "[model]\npath = \"ckpt\"\n[cards]\ncount = 3\n[attention]\nnodes = 2\n";

fn kinds(m: &Manifests) -> Vec<(String, String)> {
    m.objects()
        .map(|o| {
            (
                o["kind"].as_str().unwrap().to_string(),
                o["metadata"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The objects that run pods (Deployments).
fn pods(m: &Manifests) -> Vec<&Value> {
    m.objects()
        .filter(|o| o["spec"]["template"].is_object())
        .collect()
}

#[test]
fn one_object_set_per_role_with_prefixed_names() {
    let mut tls = BTreeMap::new();
    tls.insert("ca.pem".to_string(), "x".to_string());
    for node in ["attn-0", "attn-1", "card-0", "card-1", "card-2", "frontend"] {
        tls.insert(format!("{node}.pem"), format!("cert of {node}"));
        tls.insert(format!("{node}.key.pem"), format!("key of {node}"));
    }
    let options = K8sOptions {
        name: "prod".into(),
        namespace: Some("inference".into()),
        tls: Some(tls),
        ..K8sOptions::default()
    };
    let m = render(&deployment(TEXT), &options).unwrap();
    let got = kinds(&m);
    let want: Vec<(String, String)> = [
        ("ConfigMap", "prod-deployment"),
        ("Secret", "prod-tls-attn-0"),
        ("Secret", "prod-tls-attn-1"),
        ("Secret", "prod-tls-card-0"),
        ("Secret", "prod-tls-card-1"),
        ("Secret", "prod-tls-card-2"),
        ("Secret", "prod-tls-frontend"),
        ("Service", "prod-card-0"),
        ("Deployment", "prod-card-0"),
        ("Service", "prod-card-1"),
        ("Deployment", "prod-card-1"),
        ("Service", "prod-card-2"),
        ("Deployment", "prod-card-2"),
        ("Service", "prod-attention-0"),
        ("Deployment", "prod-attention-0"),
        ("Service", "prod-attention-1"),
        ("Deployment", "prod-attention-1"),
        ("Service", "prod-frontend"),
        ("Deployment", "prod-frontend"),
    ]
    .iter()
    .map(|(k, n)| (k.to_string(), n.to_string()))
    .collect();
    assert_eq!(got, want);
    assert!(
        m.objects()
            .all(|o| o["metadata"]["namespace"] == "inference")
    );
    // Each node's Secret holds the CA certificate and that node's files, no other node's key.
    let card_1 = m
        .objects()
        .find(|o| o["metadata"]["name"] == "prod-tls-card-1")
        .unwrap();
    let files: Vec<&String> = card_1["stringData"].as_object().unwrap().keys().collect();
    assert_eq!(files, ["ca.pem", "card-1.key.pem", "card-1.pem"]);
    assert_eq!(card_1["stringData"]["card-1.key.pem"], "key of card-1");
    let yaml = m.to_yaml().unwrap();
    assert_eq!(yaml.matches("\n---\n").count() + 1, want.len());
    assert!(yaml.starts_with("---\napiVersion: v1\nkind: ConfigMap\nmetadata:"));
}

#[test]
fn without_tls_the_secret_is_left_out_and_a_pvc_is_mounted_everywhere() {
    let options = K8sOptions {
        model_pvc: Some("weights".into()),
        ..K8sOptions::default()
    };
    let m = render(&deployment(TEXT), &options).unwrap();
    assert!(!kinds(&m).iter().any(|(k, _)| k == "Secret"));
    let pods = pods(&m);
    assert_eq!(pods.len(), 6);
    for o in pods {
        let spec = &o["spec"]["template"]["spec"];
        let volumes = spec["volumes"].as_array().unwrap();
        assert!(
            volumes
                .iter()
                .any(|v| v["persistentVolumeClaim"]["claimName"] == "weights")
        );
        let mounts = spec["containers"][0]["volumeMounts"].as_array().unwrap();
        assert!(mounts.iter().any(|v| v["mountPath"] == MODEL_MOUNT));
        let args = spec["containers"][0]["args"].as_array().unwrap();
        let model = args.iter().position(|a| a == "--model").unwrap();
        assert_eq!(args[model + 1], "/models/ckpt");
    }
}

#[test]
fn the_pods_deployment_file_points_inside_the_containers() {
    let m = render(&deployment(TEXT), &K8sOptions::default()).unwrap();
    let config = m.objects().next().unwrap();
    let text = config["data"][DEPLOYMENT_KEY].as_str().unwrap();
    let pod = Deployment::from_toml(text, Path::new(CONFIG_MOUNT)).unwrap();
    assert_eq!(pod.model.path.as_deref(), Some(Path::new("/models/ckpt")));
    assert_eq!(pod.cards.count, 3);
    assert_eq!(pod.card_addresses()[2], "afd-card-2:7100");
    assert_eq!(pod.attention_addresses()[1], "afd-attention-1:7200");
    assert!(pod.transport.tls_dir.is_none());
}

#[test]
fn what_cannot_run_on_kubernetes_is_refused() {
    let inproc = deployment("[model]\npath = \"m\"\n[transport]\nkind = \"inproc\"\n");
    let err = render(&inproc, &K8sOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("quic"), "{err}");
    let shape = deployment("[model]\nshape = \"tiny\"\n");
    let err = render(&shape, &K8sOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.path"), "{err}");
    for bad in ["", "Prod", "-x", "a_b", &"x".repeat(41)] {
        let options = K8sOptions {
            name: bad.to_string(),
            ..K8sOptions::default()
        };
        assert!(render(&deployment(TEXT), &options).is_err(), "{bad:?}");
    }
}

#[test]
fn the_api_key_reaches_the_frontend_from_its_own_secret_and_stays_out_of_the_config_map() {
    let text = format!("{TEXT}[server]\napi_key = \"sk-secret\"\n");
    let m = render(&deployment(&text), &K8sOptions::default()).unwrap();
    let config = m.objects().next().unwrap();
    assert!(!config.to_string().contains("sk-secret"));
    let secret = m
        .objects()
        .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == "afd-api-key")
        .unwrap();
    assert_eq!(secret["stringData"]["api-key"], "sk-secret");
    let frontend = m
        .objects()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "afd-frontend")
        .unwrap();
    let container = &frontend["spec"]["template"]["spec"]["containers"][0];
    assert!(!container["args"].to_string().contains("sk-secret"));
    let env = container["env"].as_array().unwrap();
    let key = env.iter().find(|e| e["name"] == "VLLM_API_KEY").unwrap();
    assert_eq!(key["valueFrom"]["secretKeyRef"]["name"], "afd-api-key");
    assert_eq!(key["valueFrom"]["secretKeyRef"]["key"], "api-key");
}

#[test]
fn every_pod_gets_time_to_drain_before_kubernetes_kills_it() {
    for (text, grace) in [
        (TEXT.to_string(), 45),
        (format!("{TEXT}[server]\nshutdown_timeout = 50.5\n"), 66),
    ] {
        let m = render(&deployment(&text), &K8sOptions::default()).unwrap();
        let pods = pods(&m);
        assert_eq!(pods.len(), 6);
        for o in pods {
            assert_eq!(
                o["spec"]["template"]["spec"]["terminationGracePeriodSeconds"], grace,
                "{text}"
            );
        }
    }
}
