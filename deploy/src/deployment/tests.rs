use std::path::Path;

use super::*;
use planner::ReplicateExperts;

fn parse(text: &str) -> Result<Deployment> {
    Deployment::from_toml(text, Path::new("/deployments"))
}

#[test]
fn empty_file_is_all_defaults() {
    let d = parse("").unwrap();
    assert_eq!(d.cards.count, 2);
    assert_eq!(d.attention.nodes, 1);
    assert_eq!(d.attention.profile, "h100");
    assert_eq!(d.attention.device, gpu_attention::AttentionDevice::Cpu);
    assert_eq!(d.transport.kind, TransportKind::Quic);
    assert_eq!(d.server.port, 8000);
    assert!(d.model.huge_pages);
    assert!(matches!(
        d.model_source().unwrap(),
        ModelSource::Checkpoint(p) if p.ends_with(BUNDLED_MODEL)
    ));
}

#[test]
fn unknown_keys_are_refused_with_their_name() {
    let e = parse("[cards]\ncuont = 8\n").unwrap_err().to_string();
    assert!(e.contains("cuont"), "{e}");
    let e = parse("[nodes]\ncount = 1\n").unwrap_err().to_string();
    assert!(e.contains("nodes"), "{e}");
}

#[test]
fn relative_paths_resolve_against_the_file_folder() {
    let d = parse(
        "[model]\npath = \"../models/x\"\n[transport]\ntls_dir = \"certs\"\n\
         [attention]\nprofile = \"my/gpu.toml\"\n[cards]\nprofile = \"/abs/card.toml\"\n",
    )
    .unwrap();
    assert_eq!(
        d.model.path.as_deref(),
        Some(Path::new("/deployments/../models/x"))
    );
    assert_eq!(
        d.transport.tls_dir.as_deref(),
        Some(Path::new("/deployments/certs"))
    );
    assert_eq!(d.attention.profile, "/deployments/my/gpu.toml");
    assert_eq!(d.cards.profile, "/abs/card.toml");
    // Names stay names.
    assert_eq!(d.transport.profile, "jetstream");
}

#[test]
fn micro_batches_take_numbers_or_auto() {
    use gpu_attention::MicroBatches;
    for (text, want) in [
        ("2", MicroBatches::Two),
        ("1", MicroBatches::One),
        ("\"auto\"", MicroBatches::Auto),
        ("\"2\"", MicroBatches::Two),
    ] {
        let d = parse(&format!("[overlap]\nmicro_batches = {text}\n")).unwrap();
        assert_eq!(d.overlap.micro_batches.0, want, "{text}");
    }
    let e = parse("[overlap]\nmicro_batches = 3\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("micro_batches"), "{e}");
}

#[test]
fn inconsistent_settings_name_the_key() {
    for (text, key) in [
        ("[attention]\nnodes = 0\n", "attention.nodes"),
        (
            "[model]\npath = \"x\"\nshape = \"gpt-oss-20b\"\n",
            "model.shape",
        ),
        ("[model]\nshape = \"gpt-oss-200b\"\n", "model.shape"),
        (
            "[cards]\ncount = 2\naddresses = [\"a:1\"]\n",
            "cards.addresses",
        ),
        (
            "[transport]\nkind = \"inproc\"\ntls_dir = \"c\"\n",
            "transport.tls_dir",
        ),
        (
            "[attention]\nkv_cache_memory = 0\n",
            "attention.kv_cache_memory",
        ),
    ] {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
}

#[test]
fn addresses_follow_base_ports_unless_listed() {
    let d = parse("[cards]\ncount = 3\nbase_port = 9000\n").unwrap();
    assert_eq!(
        d.card_addresses(),
        ["127.0.0.1:9000", "127.0.0.1:9001", "127.0.0.1:9002"]
    );
    let d = parse("[attention]\nnodes = 2\naddresses = [\"a:1\", \"b:2\"]\n").unwrap();
    assert_eq!(d.attention_addresses(), ["a:1", "b:2"]);
}

#[test]
fn a_named_shape_plans_but_does_not_run() {
    let d = parse("[model]\nshape = \"gpt-oss-20b\"\n").unwrap();
    let config = d.model_config().unwrap();
    assert_eq!(config.hidden_size, 2880);
    assert_eq!(config.num_layers(), 24);
    let e = d.cluster_config().unwrap_err().to_string();
    assert!(e.contains("model.path"), "{e}");
}

#[test]
fn cluster_config_carries_the_keys() {
    let d = parse(
        "[model]\nformat = \"mxint8\"\nactivation_dtype = \"bf16\"\nhuge_pages = false\n\
         [cards]\ncount = 3\n\
         allow_spill = true\n\
         replicas = [{ expert = 1 }]\nreplicate_experts = false\n[transport]\nkind = \"inproc\"\n\
         [attention]\nnodes = 2\nmax_num_seqs = 4\nmax_model_len = 100\nblock_size = 16\n\
         [overlap]\nmicro_batches = 1\n",
    )
    .unwrap();
    let c = d.cluster_config().unwrap();
    assert_eq!(c.cards, 3);
    assert_eq!(c.attention_nodes, 2);
    assert_eq!(c.transport, TransportKind::Inproc);
    assert_eq!(c.weight_format, corsair_ffn::FormatChoice::Mxint8);
    assert_eq!(c.activation_dtype, model::kernels::ActivationDtype::Bf16);
    assert!(c.allow_spill);
    assert!(!c.huge_pages);
    assert_eq!(c.replicas.len(), 1);
    assert_eq!(c.replicate_experts, ReplicateExperts::Never);
    assert_eq!(c.node.micro_batches, gpu_attention::MicroBatches::One);
    let model = d.model_config().unwrap();
    assert_eq!(c.replicas_for(&model, None).unwrap().0, c.replicas);
    // 4 sequences of 100 tokens, rounded up to 16-token blocks.
    assert_eq!(
        c.node.kv.memory_bytes,
        4 * 112 * KvCacheConfig::bytes_per_token(&model)
    );
}

#[test]
fn zero_cards_is_the_monolithic_baseline() {
    let d = parse("[cards]\ncount = 0\n").unwrap();
    assert!(d.is_monolithic());
    let e = d.cluster_config().unwrap_err().to_string();
    assert!(e.contains("cards.count"), "{e}");
}

#[test]
fn round_trips_through_toml() {
    let d = parse("[cards]\ncount = 5\n[workload]\nbatch = 64\n").unwrap();
    let again = parse(&d.to_toml().unwrap()).unwrap();
    assert_eq!(again.cards.count, 5);
    assert_eq!(again.workload.batch, 64);
}

#[test]
fn shutdown_timeout_is_seconds_and_not_negative() {
    assert_eq!(parse("").unwrap().server.shutdown_timeout, 30.0);
    let d = parse("[server]\nshutdown_timeout = 2.5\n").unwrap();
    assert_eq!(d.server.shutdown_timeout, 2.5);
    let e = parse("[server]\nshutdown_timeout = -1.0\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("server.shutdown_timeout"), "{e}");
}

#[test]
fn the_attention_device_and_gpu_memory_reach_the_node() {
    use gpu_attention::AttentionDevice;
    let d = parse(
        "[attention]\ndevice = \"cuda:1\"\nprofile = \"h200\"\ngpu_memory_utilization = 0.8\n",
    )
    .unwrap();
    assert_eq!(d.attention.device, AttentionDevice::Cuda(1));
    assert_eq!(d.attention.profile, "h200");
    let c = d.cluster_config().unwrap();
    assert_eq!(c.node.device, AttentionDevice::Cuda(1));
    assert_eq!(c.node.kv.gpu_memory_utilization, Some(0.8));
    // A profile name where the device goes is pointed at its key.
    let e = parse("[attention]\ndevice = \"h100\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("attention.profile"), "{e}");
    // A GPU's memory fraction needs a GPU, a fraction, and no second size.
    for (text, key) in [
        ("gpu_memory_utilization = 0.9", "attention.device"),
        ("device = \"cuda\"\ngpu_memory_utilization = 1.5", "(0, 1]"),
        (
            "device = \"cuda\"\ngpu_memory_utilization = 0.9\nkv_cache_memory = 64",
            "both",
        ),
    ] {
        let e = parse(&format!("[attention]\n{text}\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
}

#[test]
fn replicate_experts_adds_a_copy_of_every_expert_to_the_listed_replicas() {
    let d = parse("[cards]\ncount = 2\nreplicate_experts = true\nreplicas = [{ expert = 1 }]\n")
        .unwrap();
    let c = d.cluster_config().unwrap();
    assert_eq!(c.replicate_experts, ReplicateExperts::Always);
    let model = d.model_config().unwrap();
    let experts = model.moe.map(|m| m.num_experts).unwrap_or(0);
    assert!(experts > 1);
    let (replicas, choice) = c.replicas_for(&model, None).unwrap();
    assert!(choice.every_expert);
    assert_eq!(replicas.len(), 1 + experts);
    for e in 0..experts as u32 {
        assert!(
            replicas.iter().any(|r| r.expert == e && r.layer.is_none()),
            "expert {e} not replicated: {replicas:?}"
        );
    }
    // Placed on two cards, every card then holds every expert of every MoE layer.
    let placed = corsair_ffn::assignment::plan_placement(
        &model,
        &corsair_ffn::assignment::PlacementOptions { cards: 2, replicas },
    )
    .unwrap();
    for card in &placed {
        for share in &card.layers {
            if let corsair_ffn::assignment::LayerShare::Moe { experts: held } = share {
                assert_eq!(held.len(), experts);
            }
        }
    }
}

#[test]
fn placement_by_load_needs_its_record_and_replaces_the_other_copies() {
    let d = parse(
        "[cards]\nplacement = \"load\"\nexpert_load = \"routing.json\"\nnum_redundant_experts = 4\n",
    )
    .unwrap();
    assert_eq!(d.cards.placement, PlacementPolicy::Load);
    assert_eq!(
        d.cards.expert_load.as_deref(),
        Some(Path::new("/deployments/routing.json"))
    );
    assert_eq!(d.cards.num_redundant_experts, 4);
    for (text, key) in [
        ("placement = \"load\"\n", "cards.placement"),
        ("expert_load = \"r.json\"\n", "cards.expert_load"),
        ("num_redundant_experts = 2\n", "cards.num_redundant_experts"),
        (
            "placement = \"load\"\nexpert_load = \"r.json\"\nreplicate_experts = true\n",
            "cards.replicas",
        ),
    ] {
        let e = parse(&format!("[cards]\n{text}")).unwrap_err().to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
}

#[test]
fn eplb_and_card_groups_reach_the_cluster_settings_and_bad_values_name_their_key() {
    let d = parse(
        "[cards]\ncount = 4\ngroups = 2\neplb = true\neplb_window = 50\neplb_step_interval = 70\n\
         eplb_min_gain = 0.2\nnum_redundant_experts = 4\n",
    )
    .unwrap();
    let eplb = d.cluster_config().unwrap().eplb.unwrap();
    assert_eq!(
        (eplb.window, eplb.step_interval, eplb.num_redundant_experts),
        (50, 70, 4)
    );
    assert_eq!((eplb.card_groups, eplb.min_gain), (2, 0.2));
    // Without eplb, extra copies need a placement by load.
    assert!(
        parse("[cards]\nnum_redundant_experts = 2\n")
            .unwrap_err()
            .to_string()
            .contains("cards.eplb")
    );
    for (text, key) in [
        ("count = 4\ngroups = 3\n", "cards.groups"),
        ("groups = 0\n", "cards.groups"),
        ("eplb = true\neplb_window = 0\n", "cards.eplb_window"),
        ("eplb = true\neplb_min_gain = 1.5\n", "cards.eplb_min_gain"),
    ] {
        let e = parse(&format!("[cards]\n{text}")).unwrap_err().to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
}
