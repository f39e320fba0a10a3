//! The memory plan: lifetimes of transient buffers, their lifetime-aware packing into one SRAM
//! pool (buffers of different layers share addresses), and the placement of resident weight
//! tiles on cores (round-robin, so every layer's work spreads over the card and every core
//! holds a slice of every layer).

use crate::profile::HardwareProfile;
use crate::program::{Lifetime, MemoryKind, Program};

/// Alignment of every region.
pub(crate) const ALIGN: u64 = 64;

/// Sets every transient region's lifetime to the span of instructions touching it.
pub(crate) fn derive_lifetimes(program: &mut Program) {
    let mut span: Vec<Option<(u32, u32)>> = vec![None; program.regions.len()];
    for i in 0..program.instructions.len() {
        for a in program.accesses(i).accesses {
            if let Some(s) = span.get_mut(a.region as usize) {
                let i = i as u32;
                *s = Some(match *s {
                    None => (i, i),
                    Some((f, l)) => (f.min(i), l.max(i)),
                });
            }
        }
    }
    for (region, s) in program.regions.iter_mut().zip(span) {
        if let Lifetime::Transient { .. } = region.lifetime {
            let (first, last) = s.unwrap_or((0, 0));
            region.lifetime = Lifetime::Transient { first, last };
        }
    }
}

/// Packs the transient SRAM regions into a pool, first fit by start time: a region may reuse
/// the bytes of any region whose last use is strictly before its first. Sets pool-relative
/// addresses and returns the pool size. Regions are packed largest first among equal starts.
pub(crate) fn allocate_pool(program: &mut Program) -> u64 {
    let mut order: Vec<usize> = (0..program.regions.len())
        .filter(|&i| {
            let r = &program.regions[i];
            r.memory == MemoryKind::Sram && matches!(r.lifetime, Lifetime::Transient { .. })
        })
        .collect();
    let spans: Vec<(u32, u32)> = program
        .regions
        .iter()
        .map(|r| match r.lifetime {
            Lifetime::Transient { first, last } => (first, last),
            Lifetime::Resident => (0, u32::MAX),
        })
        .collect();
    order.sort_by_key(|&i| (spans[i].0, std::cmp::Reverse(program.regions[i].bytes)));
    // Live allocations: (start, end, last use), kept sorted by start.
    let mut live: Vec<(u64, u64, u32)> = Vec::new();
    let mut pool = 0u64;
    for i in order {
        let (first, last) = spans[i];
        live.retain(|&(_, _, l)| l >= first);
        let size = program.regions[i].bytes.next_multiple_of(ALIGN).max(ALIGN);
        let mut at = 0u64;
        let mut slot = live.len();
        for (j, &(s, e, _)) in live.iter().enumerate() {
            if s >= at + size {
                slot = j;
                break;
            }
            at = at.max(e);
        }
        live.insert(slot, (at, at + size, last));
        program.regions[i].address = at;
        pool = pool.max(at + size);
    }
    pool
}

/// Places the pool at the top `pool_cores` cores and moves pool regions there.
pub(crate) fn place_pool(program: &mut Program, profile: &HardwareProfile, pool_cores: usize) {
    let cores = profile.hierarchy.cores();
    let base = (cores - pool_cores) as u64 * profile.core_bytes();
    program.pool_base = base;
    for r in &mut program.regions {
        if r.memory == MemoryKind::Sram && matches!(r.lifetime, Lifetime::Transient { .. }) {
            r.address += base;
            r.location = profile.locate(r.address);
        }
    }
}

/// Places every resident SRAM region (tiles of non-streamed matrices, biases) on the first
/// `weight_cores` cores, round-robin. Returns the index of the first matrix that found no room.
pub(crate) fn place_weights(
    program: &mut Program,
    profile: &HardwareProfile,
    weight_cores: usize,
) -> Result<(), usize> {
    let core_bytes = profile.core_bytes();
    let cores = profile.hierarchy.cores();
    let mut used = vec![0u64; weight_cores];
    let mut cursor = 0usize;
    let mut streamed_cursor = 0usize;
    for mi in 0..program.matrices.len() {
        let mut regions: Vec<(Option<usize>, u32)> = program.matrices[mi]
            .tiles
            .iter()
            .enumerate()
            .map(|(t, tile)| (Some(t), tile.region))
            .collect();
        if let Some(b) = program.matrices[mi].bias {
            regions.push((None, b));
        }
        for (tile, region) in regions {
            let r = &mut program.regions[region as usize];
            if r.memory != MemoryKind::Sram {
                // Streamed tiles run on whichever core the scheduler picks: spread them too.
                if let Some(t) = tile {
                    program.matrices[mi].tiles[t].core = (streamed_cursor % cores) as u32;
                    streamed_cursor += 1;
                }
                continue;
            }
            let size = r.bytes.next_multiple_of(ALIGN).max(ALIGN);
            let core = (0..weight_cores)
                .map(|i| (cursor + i) % weight_cores)
                .find(|&c| used[c] + size <= core_bytes)
                .ok_or(mi)?;
            r.address = core as u64 * core_bytes + used[core];
            r.location = profile.locate(r.address);
            used[core] += size;
            cursor = (core + 1) % weight_cores;
            if let Some(t) = tile {
                program.matrices[mi].tiles[t].core = core as u32;
            }
        }
    }
    Ok(())
}

/// Places LPDDR regions one after the other; returns the bytes used.
pub(crate) fn place_lpddr(program: &mut Program) -> u64 {
    let mut at = 0u64;
    for r in &mut program.regions {
        if r.memory == MemoryKind::Lpddr {
            r.address = at;
            r.location = None;
            at += r.bytes.next_multiple_of(ALIGN).max(ALIGN);
        }
    }
    at
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::assignment::{CardAssignment, Span};
    use crate::format::TileFormat;
    use crate::program::{ActivationSpec, Matrix, MatrixRole, Region, RegionKind, Tile};

    fn program(regions: Vec<Region>, matrices: Vec<Matrix>) -> Program {
        Program {
            assignment: CardAssignment {
                card: 0,
                cards: 1,
                layers: Vec::new(),
                lm_head_rows: Span::new(0, 0),
            },
            profile: HardwareProfile::default(),
            hidden: 64,
            top_k: 1,
            num_experts: 0,
            max_tokens: 1,
            expert_activation: ActivationSpec::SwiGlu,
            regions,
            matrices,
            instructions: Vec::new(),
            layers: Vec::new(),
            lm_head: None,
            pool_base: 0,
            pool_bytes: 0,
        }
    }

    fn region(kind: RegionKind, memory: MemoryKind, bytes: u64, lifetime: Lifetime) -> Region {
        Region {
            name: String::new(),
            kind,
            memory,
            // Whatever the input says, the plan must not depend on it.
            address: 0xdead_0000,
            bytes,
            location: None,
            lifetime,
        }
    }

    /// A region to pack (SRAM, transient), a resident one or an LPDDR one (both left alone).
    fn any_region() -> impl Strategy<Value = Region> {
        (0u8..6, 0u64..5000, 0u32..40, 0u32..12).prop_map(|(which, bytes, first, len)| {
            let transient = Lifetime::Transient {
                first,
                last: first + len,
            };
            match which {
                0 => region(
                    RegionKind::Bias,
                    MemoryKind::Sram,
                    bytes,
                    Lifetime::Resident,
                ),
                1 => region(RegionKind::Staging, MemoryKind::Lpddr, bytes, transient),
                _ => region(RegionKind::Activation, MemoryKind::Sram, bytes, transient),
            }
        })
    }

    fn packed(r: &Region) -> Option<(u32, u32)> {
        match (r.memory, r.lifetime) {
            (MemoryKind::Sram, Lifetime::Transient { first, last }) => Some((first, last)),
            _ => None,
        }
    }

    fn size(r: &Region) -> u64 {
        r.bytes.next_multiple_of(ALIGN).max(ALIGN)
    }

    proptest! {
        /// The pool's plan: aligned, inside the pool, no two buffers live at the same
        /// instruction share a byte, each buffer at the lowest address first fit allows in the
        /// documented order, and the same input always gives the same plan.
        #[test]
        fn pool_buffers_never_overlap_while_live(regions in prop::collection::vec(any_region(), 0..40)) {
            let mut p = program(regions.clone(), Vec::new());
            let pool = allocate_pool(&mut p);
            let live: Vec<usize> = (0..p.regions.len()).filter(|&i| packed(&p.regions[i]).is_some()).collect();
            for (i, r) in p.regions.iter().enumerate() {
                if packed(r).is_none() {
                    prop_assert_eq!(r, &regions[i], "only transient SRAM regions are placed");
                    continue;
                }
                prop_assert_eq!(r.address % ALIGN, 0);
                prop_assert!(r.address + size(r) <= pool, "region {} ends past the pool", i);
            }
            for (x, &a) in live.iter().enumerate() {
                for &b in &live[x + 1..] {
                    let (ra, rb) = (&p.regions[a], &p.regions[b]);
                    let ((fa, la), (fb, lb)) = (packed(ra).unwrap(), packed(rb).unwrap());
                    let together = fa <= lb && fb <= la;
                    let apart = ra.address + size(ra) <= rb.address || rb.address + size(rb) <= ra.address;
                    prop_assert!(!together || apart, "regions {} and {} are live together and overlap", a, b);
                }
            }
            // Bounds any packing meets: at least the bytes live at the busiest instruction, at
            // most every buffer side by side.
            let total: u64 = live.iter().map(|&i| size(&p.regions[i])).sum();
            let busiest = (0u32..52)
                .map(|t| {
                    live.iter()
                        .filter(|&&i| matches!(packed(&p.regions[i]), Some((f, l)) if f <= t && t <= l))
                        .map(|&i| size(&p.regions[i]))
                        .sum::<u64>()
                })
                .max()
                .unwrap_or(0);
            prop_assert!(busiest <= pool && pool <= total, "{} <= {} <= {}", busiest, pool, total);
            prop_assert_eq!(pool, live.iter().map(|&i| p.regions[i].address + size(&p.regions[i])).max().unwrap_or(0));

            // First fit, replayed: by first use, larger first, then by index, each at the
            // lowest address (0 or the end of a buffer placed before it and still live) where it
            // overlaps nothing placed before it and still live.
            let mut order = live.clone();
            order.sort_by_key(|&i| (packed(&p.regions[i]).unwrap().0, std::cmp::Reverse(p.regions[i].bytes), i));
            for (x, &i) in order.iter().enumerate() {
                let first = packed(&p.regions[i]).unwrap().0;
                let before: Vec<(u64, u64)> = order[..x]
                    .iter()
                    .filter(|&&j| packed(&p.regions[j]).unwrap().1 >= first)
                    .map(|&j| (p.regions[j].address, p.regions[j].address + size(&p.regions[j])))
                    .collect();
                let fits = |at: u64| before.iter().all(|&(s, e)| at + size(&p.regions[i]) <= s || e <= at);
                let lowest = std::iter::once(0)
                    .chain(before.iter().map(|b| b.1))
                    .filter(|&at| fits(at))
                    .min();
                prop_assert_eq!(Some(p.regions[i].address), lowest, "region {} is not first fit", i);
            }

            let mut again = program(regions, Vec::new());
            prop_assert_eq!(allocate_pool(&mut again), pool);
            prop_assert_eq!(again.regions, p.regions);
        }

        /// Resident tiles and biases: each inside one of the weight cores, none overlapping
        /// another, its tile computed on the core that holds it; a refusal only when the
        /// first fit really found a core too full for a region; the pool placed above the
        /// weight cores, on the card.
        #[test]
        fn weights_stay_inside_their_cores(
            // Eighths of a core as well, so cores fill up to their last bytes.
            tiles in prop::collection::vec(prop::collection::vec((prop_oneof![1u64..400_000, (1u64..=8).prop_map(|k| k << 17)], any::<bool>()), 1..4), 1..12),
            biases in prop::collection::vec(any::<bool>(), 12),
            weight_cores in 1usize..5,
            pool_bytes in 1u64..3_000_000,
        ) {
            let profile = HardwareProfile::default();
            let mut regions = Vec::new();
            let mut matrices = Vec::new();
            for (m, tiles) in tiles.iter().enumerate() {
                let mut tile_list = Vec::new();
                for &(bytes, spilled) in tiles {
                    let memory = if spilled { MemoryKind::Lpddr } else { MemoryKind::Sram };
                    regions.push(region(RegionKind::ExpertWeight, memory, bytes, Lifetime::Resident));
                    tile_list.push(Tile { region: (regions.len() - 1) as u32, rows: Span::new(0, 1), segments: Span::new(0, 1), core: 0 });
                }
                let bias = biases[m].then(|| {
                    regions.push(region(RegionKind::Bias, MemoryKind::Sram, 256, Lifetime::Resident));
                    (regions.len() - 1) as u32
                });
                matrices.push(Matrix {
                    name: format!("m{m}"),
                    role: MatrixRole::Down { layer: 0, expert: Some(m as u32) },
                    rows: 1,
                    cols: 32,
                    format: TileFormat::Bf16,
                    source_format: TileFormat::Bf16,
                    tiles: tile_list,
                    bias,
                    streamed: false,
                    activations: Default::default(),
                });
            }
            // One transient buffer standing for the whole pool.
            regions.push(region(RegionKind::Activation, MemoryKind::Sram, pool_bytes, Lifetime::Transient { first: 0, last: 0 }));
            let mut p = program(regions, matrices);
            let core_bytes = profile.core_bytes();
            let cores = profile.hierarchy.cores();
            match place_weights(&mut p, &profile, weight_cores) {
                Ok(()) => {
                    let mut placed: Vec<(u64, u64)> = Vec::new();
                    for m in &p.matrices {
                        for t in &m.tiles {
                            let r = &p.regions[t.region as usize];
                            if r.memory == MemoryKind::Lpddr {
                                prop_assert!((t.core as usize) < cores);
                                continue;
                            }
                            prop_assert_eq!(t.core as u64, r.address / core_bytes, "a tile runs where it is held");
                        }
                        let sram = m.tiles.iter().map(|t| t.region).chain(m.bias).filter(|&r| p.regions[r as usize].memory == MemoryKind::Sram);
                        for id in sram {
                            let r = &p.regions[id as usize];
                            let core = r.address / core_bytes;
                            prop_assert!((core as usize) < weight_cores, "{} is outside the weight cores", r.name);
                            prop_assert!(r.address + size(r) <= (core + 1) * core_bytes, "{} crosses a core's end", r.name);
                            prop_assert_eq!(r.location, profile.locate(r.address));
                            placed.push((r.address, r.address + size(r)));
                        }
                    }
                    placed.sort();
                    prop_assert!(placed.windows(2).all(|w| w[0].1 <= w[1].0), "two weights share bytes");
                }
                Err(mi) => {
                    // Refused only when no weight core had room for the region it stopped at
                    // (the first of matrix `mi` still at its input address).
                    let sram = |m: &Matrix| -> Vec<u32> {
                        m.tiles.iter().map(|t| t.region).chain(m.bias)
                            .filter(|&r| p.regions[r as usize].memory == MemoryKind::Sram)
                            .collect()
                    };
                    let stuck = sram(&p.matrices[mi]).into_iter()
                        .find(|&r| p.regions[r as usize].address == 0xdead_0000)
                        .map(|r| size(&p.regions[r as usize]));
                    prop_assert!(stuck.is_some(), "matrix {} was refused with every region placed", mi);
                    let mut used = vec![0u64; weight_cores];
                    for m in &p.matrices[..=mi] {
                        for r in sram(m) {
                            let r = &p.regions[r as usize];
                            if r.address != 0xdead_0000 {
                                used[(r.address / core_bytes) as usize] += size(r);
                            }
                        }
                    }
                    let stuck = stuck.unwrap_or(0);
                    prop_assert!(
                        used.iter().all(|&u| u + stuck > core_bytes),
                        "refused {} bytes with cores holding {:?} of {}", stuck, used, core_bytes
                    );
                }
            }
            let pool_cores = pool_bytes.div_ceil(core_bytes) as usize;
            // Its pool-relative address, as the pool's packing gives it.
            if let Some(r) = p.regions.last_mut() {
                r.address = 0;
            }
            place_pool(&mut p, &profile, pool_cores);
            let r = p.regions.last().unwrap();
            prop_assert_eq!(p.pool_base, (cores - pool_cores) as u64 * core_bytes);
            prop_assert_eq!(r.address, p.pool_base);
            prop_assert!(r.address + r.bytes <= profile.memory.sram_bytes);
            prop_assert_eq!(r.location, profile.locate(r.address));
        }
    }

    #[test]
    fn lpddr_regions_follow_one_another_aligned() {
        let mut p = program(
            vec![
                region(
                    RegionKind::LmHeadWeight,
                    MemoryKind::Lpddr,
                    100,
                    Lifetime::Resident,
                ),
                region(RegionKind::Bias, MemoryKind::Sram, 100, Lifetime::Resident),
                region(
                    RegionKind::ExpertWeight,
                    MemoryKind::Lpddr,
                    0,
                    Lifetime::Resident,
                ),
                region(
                    RegionKind::ExpertWeight,
                    MemoryKind::Lpddr,
                    64,
                    Lifetime::Resident,
                ),
            ],
            Vec::new(),
        );
        // 100 bytes take 128; an empty region still takes one 64-byte unit.
        assert_eq!(place_lpddr(&mut p), 128 + 64 + 64);
        let at: Vec<u64> = p.regions.iter().map(|r| r.address).collect();
        assert_eq!(at, vec![0, 0xdead_0000, 128, 192]);
    }
}
