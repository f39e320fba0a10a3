//! The hardware profile: one card's hierarchy, memories, rates and latencies, read from TOML.
//!
//! The default profile (`profiles/corsair.toml`) is embedded in the binary; another one can be
//! parsed from text ([`HardwareProfile::from_toml`]). Numbers the public record lacks are listed
//! in `assumed` and checked to exist, so a report can say which figures are assumptions.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::TileFormat;

/// The embedded default profile.
pub const DEFAULT_PROFILE_TOML: &str = include_str!("../profiles/corsair.toml");

/// Counts of each level of the card's hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hierarchy {
    /// Packages per card.
    pub packages: usize,
    /// Chiplets per package.
    pub chiplets_per_package: usize,
    /// Gangs per chiplet.
    pub gangs_per_chiplet: usize,
    /// Slices per gang.
    pub slices_per_gang: usize,
    /// DIMC cores per slice.
    pub cores_per_slice: usize,
    /// SRAM banks per core.
    pub banks_per_core: usize,
}

impl Hierarchy {
    /// Cores on one card.
    pub fn cores(&self) -> usize {
        self.packages
            * self.chiplets_per_package
            * self.gangs_per_chiplet
            * self.slices_per_gang
            * self.cores_per_slice
    }

    /// Banks on one card.
    pub fn banks(&self) -> usize {
        self.cores() * self.banks_per_core
    }
}

/// Memories and their bandwidths.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// SRAM bytes per card.
    pub sram_bytes: u64,
    /// Aggregate SRAM bandwidth (bytes/s), shared evenly by the cores.
    pub sram_bandwidth: f64,
    /// LPDDR bytes per card.
    pub lpddr_bytes: u64,
    /// LPDDR bandwidth (bytes/s).
    pub lpddr_bandwidth: f64,
    /// On-card fabric bandwidth (bytes/s) for broadcasts and partial sums.
    pub noc_bandwidth: f64,
    /// Host link bandwidth (bytes/s) for receiving rows and sending results.
    pub host_link_bandwidth: f64,
}

/// Compute rates per card.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Compute {
    /// FLOP/s with MXINT8 weights.
    pub mxint8_flops: f64,
    /// FLOP/s with MXINT4 weights.
    pub mxint4_flops: f64,
    /// FLOP/s with MXFP4 weights.
    pub mxfp4_flops: f64,
    /// FLOP/s with bf16 (and f16) weights.
    pub bf16_flops: f64,
    /// FLOP/s with f32 weights.
    pub f32_flops: f64,
    /// Element-wise operations per second (activation, scaling, sums).
    pub vector_elements_per_second: f64,
}

/// Fixed latencies in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Issuing one instruction (synchronizing the cores it uses).
    pub instruction_ns: f64,
    /// Per weight tile on its core.
    pub tile_issue_ns: f64,
    /// Starting one LPDDR -> SRAM stream.
    pub dma_setup_ns: f64,
    /// One receive or send over the host link.
    pub host_link_ns: f64,
}

/// Compiler settings that depend on the hardware.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CompilerSettings {
    /// Target bytes of one weight tile.
    pub tile_bytes: u64,
    /// Above this, a tile also splits the reduction dimension.
    pub max_tile_bytes: u64,
    /// LM-head bytes streamed from LPDDR per chunk.
    pub lm_head_chunk_bytes: u64,
}

/// One card's hardware profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HardwareProfile {
    /// Short name.
    pub name: String,
    /// One line about the card.
    #[serde(default)]
    pub description: String,
    /// Dotted keys whose values are assumptions.
    #[serde(default)]
    pub assumed: Vec<String>,
    /// Hierarchy counts.
    pub hierarchy: Hierarchy,
    /// Memories.
    pub memory: Memory,
    /// Compute rates.
    pub compute: Compute,
    /// Fixed latencies.
    pub latency: Latency,
    /// Compiler settings.
    pub compiler: CompilerSettings,
}

impl Default for HardwareProfile {
    fn default() -> Self {
        // The embedded file is checked by a unit test; a parse failure here is a build defect.
        Self::from_toml(DEFAULT_PROFILE_TOML).unwrap_or_else(|e| panic!("embedded profile: {e}"))
    }
}

impl HardwareProfile {
    /// Parses and validates a profile.
    pub fn from_toml(text: &str) -> Result<Self> {
        let profile: HardwareProfile =
            toml::from_str(text).map_err(|source| Error::ProfileToml {
                what: "not a valid profile",
                source,
            })?;
        let value: toml::Value = toml::from_str(text).map_err(|source| Error::ProfileToml {
            what: "not valid TOML",
            source,
        })?;
        check_listed_keys(&value, &[("assumed", &profile.assumed)])?;
        profile.validate()?;
        Ok(profile)
    }

    fn validate(&self) -> Result<()> {
        let h = &self.hierarchy;
        let counts = [
            h.packages,
            h.chiplets_per_package,
            h.gangs_per_chiplet,
            h.slices_per_gang,
            h.cores_per_slice,
            h.banks_per_core,
        ];
        if counts.contains(&0) {
            return Err(Error::Profile(
                "every hierarchy count must be at least 1".into(),
            ));
        }
        if !self.memory.sram_bytes.is_multiple_of(h.banks() as u64 * 64) {
            return Err(Error::Profile(format!(
                "sram_bytes ({}) must split into {} banks of a multiple of 64 bytes",
                self.memory.sram_bytes,
                h.banks()
            )));
        }
        let rates = [
            self.memory.sram_bandwidth,
            self.memory.lpddr_bandwidth,
            self.memory.noc_bandwidth,
            self.memory.host_link_bandwidth,
            self.compute.mxint8_flops,
            self.compute.mxint4_flops,
            self.compute.mxfp4_flops,
            self.compute.bf16_flops,
            self.compute.f32_flops,
            self.compute.vector_elements_per_second,
        ];
        if rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return Err(Error::Profile(
                "bandwidths and compute rates must be positive".into(),
            ));
        }
        let c = &self.compiler;
        if c.tile_bytes == 0 || c.max_tile_bytes < c.tile_bytes || c.lm_head_chunk_bytes == 0 {
            return Err(Error::Profile(
                "compiler: tile_bytes must be positive and at most max_tile_bytes; lm_head_chunk_bytes positive"
                    .into(),
            ));
        }
        if c.max_tile_bytes > self.core_bytes() {
            return Err(Error::Profile(format!(
                "compiler.max_tile_bytes ({}) exceeds one core's SRAM ({})",
                c.max_tile_bytes,
                self.core_bytes()
            )));
        }
        Ok(())
    }

    /// SRAM bytes of one bank.
    pub fn bank_bytes(&self) -> u64 {
        self.memory.sram_bytes / self.hierarchy.banks() as u64
    }

    /// SRAM bytes of one core.
    pub fn core_bytes(&self) -> u64 {
        self.bank_bytes() * self.hierarchy.banks_per_core as u64
    }

    /// SRAM bandwidth of one core (bytes/s).
    pub fn core_bandwidth(&self) -> f64 {
        self.memory.sram_bandwidth / self.hierarchy.cores() as f64
    }

    /// Card FLOP/s for weights in `format`.
    pub fn flops(&self, format: TileFormat) -> f64 {
        match format {
            TileFormat::Mxfp4 => self.compute.mxfp4_flops,
            TileFormat::Mxint8 => self.compute.mxint8_flops,
            TileFormat::Bf16 | TileFormat::F16 => self.compute.bf16_flops,
            TileFormat::F32 => self.compute.f32_flops,
        }
    }

    /// FLOP/s of one core for weights in `format`.
    pub fn core_flops(&self, format: TileFormat) -> f64 {
        self.flops(format) / self.hierarchy.cores() as f64
    }

    /// The location of SRAM byte `address` (card-linear), if it is on the card.
    pub fn locate(&self, address: u64) -> Option<SramLocation> {
        if address >= self.memory.sram_bytes {
            return None;
        }
        let h = &self.hierarchy;
        let bank_bytes = self.bank_bytes();
        let mut index = address / bank_bytes;
        let offset = address % bank_bytes;
        let mut take = |n: usize| {
            let v = (index % n as u64) as u32;
            index /= n as u64;
            v
        };
        let bank = take(h.banks_per_core);
        let core = take(h.cores_per_slice);
        let slice = take(h.slices_per_gang);
        let gang = take(h.gangs_per_chiplet);
        let chiplet = take(h.chiplets_per_package);
        let package = take(h.packages);
        Some(SramLocation {
            package,
            chiplet,
            gang,
            slice,
            core,
            bank,
            offset,
        })
    }

    /// The card-linear address of a location (inverse of [`Self::locate`]), or `None` when a
    /// coordinate is outside the hierarchy.
    pub fn address(&self, loc: &SramLocation) -> Option<u64> {
        let h = &self.hierarchy;
        let coords = [
            (loc.package as usize, h.packages),
            (loc.chiplet as usize, h.chiplets_per_package),
            (loc.gang as usize, h.gangs_per_chiplet),
            (loc.slice as usize, h.slices_per_gang),
            (loc.core as usize, h.cores_per_slice),
            (loc.bank as usize, h.banks_per_core),
        ];
        if coords.iter().any(|&(v, n)| v >= n) || loc.offset >= self.bank_bytes() {
            return None;
        }
        let mut index = 0u64;
        for (v, n) in coords {
            index = index * n as u64 + v as u64;
        }
        Some(index * self.bank_bytes() + loc.offset)
    }

    /// The core (card-wide index) holding SRAM byte `address`.
    pub fn core_of(&self, address: u64) -> usize {
        (address / self.core_bytes()) as usize
    }
}

/// A key that one of a profile's lists (`assumed`, `calibrated`) names but the profile does
/// not set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{list}` names `{key}`, which the profile does not set")]
pub struct UnsetKey {
    /// The list naming it.
    pub list: String,
    /// The dotted key.
    pub key: String,
}

/// Checks that every dotted key (`memory.sram_bytes`) of each named list is set in `value`, a
/// profile file parsed as TOML: the check behind every profile's `assumed` (and the planner's
/// `calibrated`), so a report can say exactly which figures are assumptions.
pub fn check_listed_keys(
    value: &toml::Value,
    lists: &[(&str, &[String])],
) -> std::result::Result<(), UnsetKey> {
    for (list, keys) in lists {
        for key in keys.iter() {
            let set = key
                .split('.')
                .try_fold(value, |v, part| v.get(part))
                .is_some();
            if !set {
                return Err(UnsetKey {
                    list: (*list).to_owned(),
                    key: key.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Where a byte of SRAM is: package, chiplet, gang, slice, core, bank and offset in the bank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SramLocation {
    /// Package on the card.
    pub package: u32,
    /// Chiplet in the package.
    pub chiplet: u32,
    /// Gang in the chiplet.
    pub gang: u32,
    /// Slice in the gang.
    pub slice: u32,
    /// Core in the slice.
    pub core: u32,
    /// Bank in the core.
    pub bank: u32,
    /// Byte offset in the bank.
    pub offset: u64,
}

impl std::fmt::Display for SramLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p{}/c{}/g{}/s{}/core{}/b{}+{:#x}",
            self.package, self.chiplet, self.gang, self.slice, self.core, self.bank, self.offset
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_profile_parses_with_published_figures() {
        let p = HardwareProfile::default();
        assert_eq!(p.hierarchy.packages * p.hierarchy.chiplets_per_package, 8);
        assert_eq!(p.memory.sram_bandwidth, 150e12);
        assert_eq!(p.memory.lpddr_bandwidth, 400e9);
        assert_eq!(p.compute.mxint8_flops, 2.4e15);
        assert_eq!(p.compute.mxint4_flops, 9.6e15);
        assert_eq!(p.hierarchy.cores(), 2048);
        assert_eq!(p.core_bytes(), 1 << 20);
        assert!(p.assumed.iter().any(|k| k == "hierarchy.cores_per_slice"));
    }

    #[test]
    fn locate_and_address_are_inverse() {
        let p = HardwareProfile::default();
        for addr in [
            0,
            63,
            p.bank_bytes(),
            p.core_bytes() * 77 + 12345,
            p.memory.sram_bytes - 1,
        ] {
            let loc = p.locate(addr).unwrap();
            assert_eq!(p.address(&loc), Some(addr));
        }
        assert!(p.locate(p.memory.sram_bytes).is_none());
        let last = p.locate(p.memory.sram_bytes - 1).unwrap();
        assert_eq!((last.package, last.chiplet, last.core), (1, 3, 31));
    }

    #[test]
    fn unknown_assumed_key_is_rejected() {
        let text =
            DEFAULT_PROFILE_TOML.replace("\"compiler.tile_bytes\",", "\"compiler.no_such_key\",");
        let err = HardwareProfile::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("compiler.no_such_key"), "{err}");
    }

    #[test]
    fn listed_keys_are_found_at_any_depth() {
        let value: toml::Value = toml::from_str("a = 1\n[b]\nc = 2\n[b.d]\ne = 3\n").unwrap();
        let keys = |k: &[&str]| k.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let set = keys(&["a", "b.c", "b.d.e", "b.d"]);
        assert_eq!(check_listed_keys(&value, &[("assumed", &set)]), Ok(()));
        let unset = keys(&["b.c", "b.d.f"]);
        let err = check_listed_keys(&value, &[("assumed", &set), ("calibrated", &unset)]);
        assert_eq!(
            err,
            Err(UnsetKey {
                list: "calibrated".into(),
                key: "b.d.f".into()
            })
        );
        // A key below a value that is not a table is not set either.
        let under_a_number = keys(&["a.x"]);
        assert!(check_listed_keys(&value, &[("assumed", &under_a_number)]).is_err());
    }

    #[test]
    fn zero_counts_are_rejected() {
        let text = DEFAULT_PROFILE_TOML.replace("banks_per_core = 4", "banks_per_core = 0");
        assert!(HardwareProfile::from_toml(&text).is_err());
    }
}
