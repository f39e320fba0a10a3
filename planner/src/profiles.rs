//! Profiles of the attention device (a GPU) and of the network between it and the cards, as data
//! files in `planner/profiles/` (the Corsair card's profile is corsair-ffn's own).
//!
//! Each profile lists the keys that are assumptions (`assumed`) and the keys fitted on a seed
//! figure (`calibrated`); the loader checks that each listed key exists, so a report can say
//! exactly which numbers are not public figures.

use corsair_ffn::profile::check_listed_keys;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Built-in GPU profiles: name and TOML text.
pub const BUILTIN_DEVICES: &[(&str, &str)] = &[
    ("h100", include_str!("../profiles/h100.toml")),
    ("h200", include_str!("../profiles/h200.toml")),
];

/// Built-in network profiles: name and TOML text.
pub const BUILTIN_NETWORKS: &[(&str, &str)] =
    &[("jetstream", include_str!("../profiles/jetstream.toml"))];

/// A GPU's memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceMemory {
    /// HBM bytes.
    pub hbm_bytes: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// L2 cache bytes (reported; the model does not credit reuse through it).
    pub l2_bytes: f64,
    /// Bytes kept free for the runtime, activations and allocator slack.
    pub reserved_bytes: f64,
}

/// A GPU's arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceCompute {
    /// Dense BF16 FLOP/s.
    pub bf16_flops: f64,
}

/// How decode kernels behave on the device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceKernels {
    /// Fixed cost of one kernel on the critical path, in ns.
    pub fixed_ns: f64,
    /// Fraction of HBM bandwidth the MXFP4 expert kernels reach (dequantizing in the kernel).
    pub mxfp4_moe_bandwidth_efficiency: f64,
    /// Bytes per parameter of the weights the device holds besides experts (bf16: 2).
    pub weight_bytes_per_param: f64,
    /// Bytes per KV-cache element (bf16: 2).
    pub kv_bytes_per_element: f64,
}

/// The attention device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    /// Short name.
    pub name: String,
    /// One line about the device.
    #[serde(default)]
    pub description: String,
    /// Dotted keys whose values are assumptions.
    #[serde(default)]
    pub assumed: Vec<String>,
    /// Dotted keys fitted on a seed figure.
    #[serde(default)]
    pub calibrated: Vec<String>,
    /// Memory.
    pub memory: DeviceMemory,
    /// Arithmetic.
    pub compute: DeviceCompute,
    /// Kernel behavior.
    pub kernels: DeviceKernels,
}

/// The data plane between attention nodes and cards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkProfile {
    /// Short name.
    pub name: String,
    /// One line about the network.
    #[serde(default)]
    pub description: String,
    /// Dotted keys whose values are assumptions.
    #[serde(default)]
    pub assumed: Vec<String>,
    /// Dotted keys fitted on a seed figure.
    #[serde(default)]
    pub calibrated: Vec<String>,
    /// Bandwidth of one NIC, each way, bytes/s.
    pub nic_bandwidth: f64,
    /// Latency of one one-sided write, NIC to NIC, in ns.
    pub hop_latency_ns: f64,
    /// Cards sharing one NIC.
    pub cards_per_nic: usize,
    /// NICs per attention node.
    pub nics_per_attention_node: usize,
}

/// Checks that every key listed in `assumed` and `calibrated` exists in the TOML text (the same
/// check as the card's profile: [`corsair_ffn::profile::check_listed_keys`]).
fn check_listed(text: &str, lists: &[(&str, &[String])]) -> Result<()> {
    let value: toml::Value = toml::from_str(text).map_err(|source| Error::Toml {
        what: "not valid TOML",
        source,
    })?;
    Ok(check_listed_keys(&value, lists)?)
}

fn positive(what: &str, values: &[(&str, f64)]) -> Result<()> {
    for (key, v) in values {
        if !(v.is_finite() && *v > 0.0) {
            return Err(Error::Config(format!(
                "{what} profile: `{key}` must be a positive number, not {v}"
            )));
        }
    }
    Ok(())
}

impl DeviceProfile {
    /// Parses and validates a device profile.
    pub fn from_toml(text: &str) -> Result<Self> {
        let p: DeviceProfile = toml::from_str(text).map_err(|source| Error::Toml {
            what: "not a valid device profile",
            source,
        })?;
        check_listed(
            text,
            &[("assumed", &p.assumed), ("calibrated", &p.calibrated)],
        )?;
        positive(
            "device",
            &[
                ("memory.hbm_bytes", p.memory.hbm_bytes),
                ("memory.hbm_bandwidth", p.memory.hbm_bandwidth),
                ("compute.bf16_flops", p.compute.bf16_flops),
                (
                    "kernels.mxfp4_moe_bandwidth_efficiency",
                    p.kernels.mxfp4_moe_bandwidth_efficiency,
                ),
                (
                    "kernels.weight_bytes_per_param",
                    p.kernels.weight_bytes_per_param,
                ),
                (
                    "kernels.kv_bytes_per_element",
                    p.kernels.kv_bytes_per_element,
                ),
            ],
        )?;
        if p.kernels.fixed_ns < 0.0 || p.memory.reserved_bytes < 0.0 {
            return Err(Error::Config(
                "device profile: `kernels.fixed_ns` and `memory.reserved_bytes` cannot be negative"
                    .into(),
            ));
        }
        Ok(p)
    }

    /// A built-in profile by name (`h100`, `h200`).
    pub fn builtin(name: &str) -> Option<Result<Self>> {
        BUILTIN_DEVICES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| Self::from_toml(text))
    }
}

impl NetworkProfile {
    /// Parses and validates a network profile.
    pub fn from_toml(text: &str) -> Result<Self> {
        let p: NetworkProfile = toml::from_str(text).map_err(|source| Error::Toml {
            what: "not a valid network profile",
            source,
        })?;
        check_listed(
            text,
            &[("assumed", &p.assumed), ("calibrated", &p.calibrated)],
        )?;
        positive("network", &[("nic_bandwidth", p.nic_bandwidth)])?;
        if p.hop_latency_ns < 0.0 || p.cards_per_nic == 0 || p.nics_per_attention_node == 0 {
            return Err(Error::Config(
                "network profile: `hop_latency_ns` cannot be negative; `cards_per_nic` and \
                 `nics_per_attention_node` must be at least 1"
                    .into(),
            ));
        }
        Ok(p)
    }

    /// A built-in profile by name (`jetstream`).
    pub fn builtin(name: &str) -> Option<Result<Self>> {
        BUILTIN_NETWORKS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| Self::from_toml(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_parse() {
        for (name, _) in BUILTIN_DEVICES {
            let p = DeviceProfile::builtin(name).unwrap().unwrap();
            assert_eq!(&p.name, name);
            assert!(p.calibrated.len() <= 2);
        }
        for (name, _) in BUILTIN_NETWORKS {
            let p = NetworkProfile::builtin(name).unwrap().unwrap();
            assert_eq!(&p.name, name);
        }
        assert!(DeviceProfile::builtin("a100").is_none());
    }

    #[test]
    fn listed_keys_must_exist() {
        let text = include_str!("../profiles/h100.toml")
            .replace("calibrated = [", "calibrated = [\"kernels.nope\", ");
        let e = DeviceProfile::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains("kernels.nope"), "{e}");
    }
}
