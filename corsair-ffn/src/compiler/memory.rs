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
        for a in program.accesses(i) {
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
