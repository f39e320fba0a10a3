//! The pods' resource requests, sized from the plan: a card pod holds its shard (what the
//! plan's compiler puts in the card's SRAM and LPDDR) in host memory; an attention node on the
//! CPU holds its weights and its KV cache, one on a GPU its weights in host memory while it
//! uploads them and asks for the GPU (`nvidia.com/gpu`, which Kubernetes takes as a limit).

use serde_json::{Value, json};

use crate::deployment::Deployment;
use crate::plan::Plan;

/// Host memory every afd process needs beside its weights and caches: the runtime, the
/// JetStream regions, step buffers (assumed).
const PROCESS_OVERHEAD_BYTES: u64 = 512 << 20;

/// What one pod asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodResources {
    /// CPU, in thousandths of a core.
    pub cpu_millis: u64,
    /// Host memory.
    pub memory_bytes: u64,
    /// NVIDIA GPUs.
    pub gpus: u32,
}

impl PodResources {
    /// The container's `resources` object.
    pub fn to_json(&self) -> Value {
        let mut r = json!({
            "requests": {
                "cpu": cpu_quantity(self.cpu_millis),
                "memory": format!("{}Mi", self.memory_bytes.div_ceil(1 << 20)),
            },
        });
        if self.gpus > 0 {
            // Extended resources are requested through limits (requests, if given, must equal them).
            r["limits"] = json!({ "nvidia.com/gpu": self.gpus });
        }
        r
    }
}

/// A Kubernetes CPU quantity: whole cores as an integer, else millicores.
fn cpu_quantity(millis: u64) -> String {
    if millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        format!("{millis}m")
    }
}

/// Requests of every role of a deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeploymentResources {
    /// Each card pod (the largest card's share, the same for every card).
    pub card: PodResources,
    /// Each attention node pod.
    pub attention: PodResources,
    /// The frontend pod.
    pub frontend: PodResources,
}

impl DeploymentResources {
    /// Sized from `plan` of deployment `d`; `kv_cache_bytes` is what one node allocates for
    /// its KV cache on the host (f32, [`Deployment::kv_cache_bytes`]).
    pub fn from_plan(d: &Deployment, plan: &Plan, kv_cache_bytes: u64) -> Self {
        let shard = plan
            .per_card
            .iter()
            .map(|c| c.sram_bytes_needed + c.lpddr_by_kind.values().sum::<u64>())
            .max()
            .unwrap_or(0);
        let card_cores = d.cards.card_threads.max(1) as u64;
        let on_gpu = d.attention.device.is_cuda();
        let attention_memory = plan.attention.weight_bytes
            + if on_gpu { 0 } else { kv_cache_bytes }
            + PROCESS_OVERHEAD_BYTES;
        DeploymentResources {
            card: PodResources {
                cpu_millis: 1000 * card_cores,
                memory_bytes: shard + PROCESS_OVERHEAD_BYTES,
                gpus: 0,
            },
            attention: PodResources {
                // On the CPU the node computes attention itself: two cores; on a GPU one core
                // drives it.
                cpu_millis: if on_gpu { 1000 } else { 2000 },
                memory_bytes: attention_memory,
                gpus: u32::from(on_gpu),
            },
            frontend: PodResources {
                cpu_millis: 1000,
                memory_bytes: PROCESS_OVERHEAD_BYTES,
                gpus: 0,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_kubernetes_quantities() {
        let r = PodResources {
            cpu_millis: 1500,
            memory_bytes: (3 << 20) + 1,
            gpus: 0,
        };
        let v = r.to_json();
        assert_eq!(v["requests"]["cpu"], "1500m");
        assert_eq!(v["requests"]["memory"], "4Mi");
        assert!(v.get("limits").is_none());
        let g = PodResources {
            cpu_millis: 2000,
            gpus: 1,
            ..r
        }
        .to_json();
        assert_eq!(g["requests"]["cpu"], "2");
        assert_eq!(g["limits"]["nvidia.com/gpu"], 1);
    }
}
