//! The memory sanitizer: rebuilds every read and write from the instruction stream and proves
//! the memory plan, the way seed 001's Graph & Memory Sanitizer does.
//!
//! It flags: conflicting writes (two writers of the same bytes in one instruction, a write
//! over bytes nobody read yet, a write to resident weights, two tiles for one output block),
//! reads of bytes not yet written (a producer that runs later), missing producers (nobody
//! writes the region), incomplete producers (the writers leave some read bytes unwritten, or
//! a matmul's tiles do not cover its matrix), live regions that overlap in memory, accesses
//! outside a region's declared lifetime, capacity overflows (past the end of a memory, a
//! weight tile straddling cores) and out-of-bounds accesses (past a region's end, unknown
//! regions, placements outside the hierarchy). Every layer's stream and the LM head's are
//! checked as independent units, since the card runs them on separate requests.

mod intervals;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::assignment::Span;
use crate::program::{InstructionAccesses, Lifetime, MemoryKind, Op, Program, RegionId};
use intervals::IntervalSet;

/// The kinds of problem the sanitizer reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FindingKind {
    /// Two writes to the same bytes with no read between, or a write to resident weights.
    ConflictingWrite,
    /// A read of bytes that are written only later.
    UninitializedRead,
    /// A read of a region no instruction writes.
    MissingProducer,
    /// A read of bytes the region's producers never write.
    IncompleteProducer,
    /// Two regions share memory while both are live.
    LiveOverlap,
    /// An access outside the region's declared lifetime.
    OutsideLifetime,
    /// A region past the end of its memory, or a weight tile across cores.
    CapacityOverflow,
    /// An access past its region's end, an unknown region, or an impossible placement.
    OutOfBounds,
}

impl std::fmt::Display for FindingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FindingKind::ConflictingWrite => "conflicting write",
            FindingKind::UninitializedRead => "read of bytes not yet written",
            FindingKind::MissingProducer => "missing producer",
            FindingKind::IncompleteProducer => "incomplete producer",
            FindingKind::LiveOverlap => "live regions overlap",
            FindingKind::OutsideLifetime => "access outside lifetime",
            FindingKind::CapacityOverflow => "capacity overflow",
            FindingKind::OutOfBounds => "out of bounds",
        })
    }
}

/// One problem, with its memory receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// What kind.
    pub kind: FindingKind,
    /// The instruction involved, if any.
    pub instruction: Option<u32>,
    /// The region involved, if any.
    pub region: Option<RegionId>,
    /// What exactly.
    pub detail: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.kind)?;
        if let Some(i) = self.instruction {
            write!(f, " at instruction {i}")?;
        }
        write!(f, ": {}", self.detail)
    }
}

/// What the sanitizer checked and found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SanitizerReport {
    /// Instructions checked.
    pub instructions: usize,
    /// Regions checked.
    pub regions: usize,
    /// Accesses rebuilt from the instructions.
    pub accesses: usize,
    /// Bytes read and written, summed over accesses (largest shape).
    pub bytes_accessed: u64,
    /// Problems (empty: the program is proven).
    pub findings: Vec<Finding>,
}

impl SanitizerReport {
    /// Whether nothing was found.
    pub fn is_clean(&self) -> bool {
        self.findings.is_empty()
    }
}

/// Checks a program.
pub fn sanitize(program: &Program) -> SanitizerReport {
    let mut s = Sanitizer {
        p: program,
        report: SanitizerReport::default(),
        live: vec![None; program.regions.len()],
    };
    s.report.instructions = program.instructions.len();
    s.report.regions = program.regions.len();
    s.check_regions();
    let mut units: Vec<Span> = program.layers.iter().map(|l| l.instructions).collect();
    units.extend(program.lm_head.as_ref().map(|l| l.instructions));
    let mut owned = vec![false; program.instructions.len()];
    for u in &units {
        if u.end > program.instructions.len() || u.start > u.end {
            s.find(
                FindingKind::OutOfBounds,
                None,
                None,
                format!("instruction span {u} is outside the stream"),
            );
            continue;
        }
        for o in &mut owned[u.start..u.end] {
            *o = true;
        }
        s.check_unit(*u);
    }
    if let Some(i) = owned.iter().position(|o| !o) {
        s.find(
            FindingKind::OutOfBounds,
            Some(i as u32),
            None,
            "instruction belongs to no layer or LM head".into(),
        );
    }
    s.check_tile_coverage();
    s.check_overlaps();
    s.report
}

struct Sanitizer<'a> {
    p: &'a Program,
    report: SanitizerReport,
    /// Instructions that actually touch each region (first, last).
    live: Vec<Option<(u32, u32)>>,
}

impl Sanitizer<'_> {
    fn find(
        &mut self,
        kind: FindingKind,
        instruction: Option<u32>,
        region: Option<RegionId>,
        detail: String,
    ) {
        self.report.findings.push(Finding {
            kind,
            instruction,
            region,
            detail,
        });
    }

    fn name(&self, r: RegionId) -> String {
        self.p
            .regions
            .get(r as usize)
            .map_or_else(|| format!("#{r} (unknown)"), |x| x.name.clone())
    }

    /// Static checks of every region: inside its memory, placement consistent, tiles on one core.
    fn check_regions(&mut self) {
        let prof = &self.p.profile;
        for (id, r) in self.p.regions.iter().enumerate() {
            let id = id as RegionId;
            let end = r.address.saturating_add(r.bytes);
            let cap = match r.memory {
                MemoryKind::Sram => prof.memory.sram_bytes,
                MemoryKind::Lpddr => prof.memory.lpddr_bytes,
            };
            if end > cap {
                let d = format!(
                    "{} ends at byte {end:#x} of {:?}, which holds {cap:#x}",
                    r.name, r.memory
                );
                self.find(FindingKind::CapacityOverflow, None, Some(id), d);
                continue;
            }
            if r.memory == MemoryKind::Sram {
                if r.location != prof.locate(r.address) {
                    let d = format!(
                        "{} is placed at {} but its address {:#x} is {}",
                        r.name,
                        r.location.map_or("nowhere".into(), |l| l.to_string()),
                        r.address,
                        prof.locate(r.address)
                            .map_or("off the card".into(), |l| l.to_string())
                    );
                    self.find(FindingKind::OutOfBounds, None, Some(id), d);
                }
                if r.kind.is_resident()
                    && r.bytes > 0
                    && prof.core_of(r.address) != prof.core_of(end - 1)
                {
                    let d = format!(
                        "{} ({} bytes at {:#x}) straddles two cores",
                        r.name, r.bytes, r.address
                    );
                    self.find(FindingKind::CapacityOverflow, None, Some(id), d);
                }
            }
        }
        for m in &self.p.matrices {
            for t in &m.tiles {
                let want = m.tile_bytes(t);
                if let Some(r) = self.p.regions.get(t.region as usize)
                    && r.bytes < want
                {
                    let d = format!(
                        "tile region {} has {} bytes, its tile needs {want}",
                        r.name, r.bytes
                    );
                    self.find(FindingKind::CapacityOverflow, None, Some(t.region), d);
                }
            }
        }
    }

    /// Replays one independent stream (a layer or the LM head).
    fn check_unit(&mut self, unit: Span) {
        let mut written: HashMap<RegionId, IntervalSet> = HashMap::new();
        let mut unread: HashMap<RegionId, IntervalSet> = HashMap::new();
        // (instruction, region, byte ranges not written when read)
        type Unwritten = (u32, RegionId, Vec<(u64, u64)>);
        let mut pending_reads: Vec<Unwritten> = Vec::new();
        for i in unit.start..unit.end {
            let InstructionAccesses { accesses, missing } = self.p.accesses(i);
            self.report.accesses += accesses.len();
            let i32_ = i as u32;
            for m in missing {
                let d = format!("{:?} refers to {m}", self.p.instructions[i]);
                self.find(FindingKind::OutOfBounds, Some(i32_), None, d);
            }
            let mut writes: Vec<(RegionId, u64, u64)> = Vec::new();
            // Reads first (an instruction reads its inputs before writing its outputs).
            for pass_writes in [false, true] {
                for a in accesses.iter().filter(|a| a.write == pass_writes) {
                    self.report.bytes_accessed += a.end.saturating_sub(a.start);
                    let Some(region) = self.p.regions.get(a.region as usize) else {
                        let d = format!(
                            "{:?} refers to region {} which does not exist",
                            self.p.instructions[i], a.region
                        );
                        self.find(FindingKind::OutOfBounds, Some(i32_), None, d);
                        continue;
                    };
                    if a.end > region.bytes || a.start > a.end {
                        let d = format!(
                            "{} bytes {:#x}..{:#x} of {} ({} bytes)",
                            if a.write { "writes" } else { "reads" },
                            a.start,
                            a.end,
                            region.name,
                            region.bytes
                        );
                        self.find(FindingKind::OutOfBounds, Some(i32_), Some(a.region), d);
                        continue;
                    }
                    let slot = &mut self.live[a.region as usize];
                    *slot = Some(slot.map_or((i32_, i32_), |(f, l)| (f.min(i32_), l.max(i32_))));
                    if let Lifetime::Transient { first, last } = region.lifetime
                        && !(first..=last).contains(&i32_)
                    {
                        let d = format!(
                            "{} is declared live in instructions {first}..={last}",
                            region.name
                        );
                        self.find(FindingKind::OutsideLifetime, Some(i32_), Some(a.region), d);
                    }
                    if region.kind.is_resident() {
                        if a.write {
                            let d = format!("writes resident {} ({})", region.kind, region.name);
                            self.find(FindingKind::ConflictingWrite, Some(i32_), Some(a.region), d);
                        }
                        continue;
                    }
                    if a.write {
                        if let Some(&(r, s, e)) = writes
                            .iter()
                            .find(|&&(r, s, e)| r == a.region && s < a.end && a.start < e)
                        {
                            let d = format!(
                                "two writes of {} in one instruction overlap at {:#x}..{:#x}",
                                self.name(r),
                                s.max(a.start),
                                e.min(a.end)
                            );
                            self.find(FindingKind::ConflictingWrite, Some(i32_), Some(r), d);
                        }
                        writes.push((a.region, a.start, a.end));
                    } else {
                        let w = written.entry(a.region).or_default();
                        let missing = w.uncovered(a.start, a.end);
                        if !missing.is_empty() {
                            pending_reads.push((i32_, a.region, missing));
                        }
                        unread.entry(a.region).or_default().remove(a.start, a.end);
                    }
                }
            }
            for (r, s, e) in writes {
                let u = unread.entry(r).or_default();
                if let Some(&(cs, ce)) = u.covered(s, e).first() {
                    let d = format!(
                        "overwrites bytes {cs:#x}..{ce:#x} of {} that no instruction read",
                        self.name(r)
                    );
                    self.find(FindingKind::ConflictingWrite, Some(i as u32), Some(r), d);
                }
                u.insert(s, e);
                written.entry(r).or_default().insert(s, e);
            }
        }
        for (i, r, missing) in pending_reads {
            let w = written.get(&r).cloned().unwrap_or_default();
            let (s, e) = (missing[0].0, missing[missing.len() - 1].1);
            let (kind, d) = if w.is_empty() {
                (
                    FindingKind::MissingProducer,
                    format!("reads {} but no instruction writes it", self.name(r)),
                )
            } else if missing.iter().any(|&(s, e)| !w.covered(s, e).is_empty()) {
                (
                    FindingKind::UninitializedRead,
                    format!(
                        "reads bytes {s:#x}..{e:#x} of {} before they are written",
                        self.name(r)
                    ),
                )
            } else {
                (
                    FindingKind::IncompleteProducer,
                    format!(
                        "reads bytes {s:#x}..{e:#x} of {} that its producers never write",
                        self.name(r)
                    ),
                )
            };
            self.find(kind, Some(i), Some(r), d);
        }
    }

    /// The tiles of every reduced matmul form row bands, each band's segment runs partition
    /// the reduction, and the bands tile the rows the reduce covers without gaps or overlaps.
    fn check_tile_coverage(&mut self) {
        // Row spans reduced per matrix (row-major reduces cover chunks of it).
        let mut chunks: HashMap<u32, Vec<(usize, usize)>> = HashMap::new();
        for (i, op) in self.p.instructions.iter().enumerate() {
            let Op::Reduce { matmul, layout, .. } = op else {
                continue;
            };
            let Some(Op::MatMul { matrix, tiles, .. }) = self.p.instructions.get(*matmul as usize)
            else {
                let d = format!("reduce names instruction {matmul}, which is not a matmul");
                self.find(FindingKind::MissingProducer, Some(i as u32), None, d);
                continue;
            };
            let Some(m) = self.p.matrices.get(*matrix as usize) else {
                continue;
            };
            let nseg = m.segments();
            let mut ts: Vec<_> = tiles
                .iter()
                .filter_map(|r| m.tiles.get(r.tile as usize))
                .collect();
            if ts.len() != tiles.len() {
                self.find(
                    FindingKind::OutOfBounds,
                    Some(*matmul),
                    None,
                    format!("{} lacks a tile the matmul runs", m.name),
                );
            }
            ts.sort_by_key(|t| (t.rows.start, t.segments.start));
            let mut problem: Option<(FindingKind, String)> = None;
            let first = ts.first().map_or(0, |t| t.rows.start);
            let last = ts.last().map_or(0, |t| t.rows.end);
            let mut band_end = match layout {
                crate::program::OutLayout::TokenMajor => 0,
                crate::program::OutLayout::RowMajor => {
                    chunks.entry(*matrix).or_default().push((first, last));
                    first
                }
            };
            let mut k = 0;
            while k < ts.len() && problem.is_none() {
                let rows = ts[k].rows;
                if rows.start > band_end {
                    problem = Some((
                        FindingKind::IncompleteProducer,
                        format!("rows {band_end}..{} of {} have no tile", rows.start, m.name),
                    ));
                } else if rows.start < band_end {
                    problem = Some((
                        FindingKind::ConflictingWrite,
                        format!(
                            "rows {}..{band_end} of {} are in two tiles",
                            rows.start, m.name
                        ),
                    ));
                }
                let mut seg_end = 0;
                while k < ts.len() && ts[k].rows.start == rows.start && problem.is_none() {
                    let t = ts[k];
                    if t.rows != rows {
                        problem = Some((
                            FindingKind::ConflictingWrite,
                            format!("tiles of rows {rows} and {} of {} overlap", t.rows, m.name),
                        ));
                    } else if t.segments.start > seg_end {
                        problem = Some((
                            FindingKind::IncompleteProducer,
                            format!(
                                "rows {rows}, segments {seg_end}..{} of {} have no tile",
                                t.segments.start, m.name
                            ),
                        ));
                    } else if t.segments.start < seg_end {
                        problem = Some((
                            FindingKind::ConflictingWrite,
                            format!(
                                "rows {rows}, segment {} of {} is in two tiles",
                                t.segments.start, m.name
                            ),
                        ));
                    }
                    seg_end = t.segments.end;
                    k += 1;
                }
                if problem.is_none() && seg_end != nseg {
                    problem = Some((
                        FindingKind::IncompleteProducer,
                        format!(
                            "rows {rows}, segments {seg_end}..{nseg} of {} have no tile",
                            m.name
                        ),
                    ));
                }
                band_end = rows.end;
            }
            if problem.is_none()
                && *layout == crate::program::OutLayout::TokenMajor
                && band_end != m.rows
            {
                problem = Some((
                    FindingKind::IncompleteProducer,
                    format!("rows {band_end}..{} of {} have no tile", m.rows, m.name),
                ));
            }
            if let Some((kind, d)) = problem {
                self.find(kind, Some(*matmul), None, d);
            }
        }
        for (matrix, mut spans) in chunks {
            let Some(m) = self.p.matrices.get(matrix as usize) else {
                continue;
            };
            spans.sort_unstable();
            let mut at = 0;
            for (s, e) in spans {
                if s != at {
                    let kind = if s > at {
                        FindingKind::IncompleteProducer
                    } else {
                        FindingKind::ConflictingWrite
                    };
                    self.find(
                        kind,
                        None,
                        None,
                        format!(
                            "{}: rows {}..{} are reduced {} times",
                            m.name,
                            s.min(at),
                            s.max(at),
                            if s > at { 0 } else { 2 }
                        ),
                    );
                }
                at = at.max(e);
            }
            if at != m.rows {
                self.find(
                    FindingKind::IncompleteProducer,
                    None,
                    None,
                    format!("{}: rows {at}..{} are never reduced", m.name, m.rows),
                );
            }
        }
    }

    /// Regions sharing memory must not be live at the same time (resident: always live).
    fn check_overlaps(&mut self) {
        let mut order: Vec<usize> = (0..self.p.regions.len())
            .filter(|&i| self.p.regions[i].bytes > 0)
            .collect();
        order.sort_by_key(|&i| {
            (
                self.p.regions[i].memory == MemoryKind::Lpddr,
                self.p.regions[i].address,
            )
        });
        let span = |s: &Self, i: usize| -> Option<(u32, u32)> {
            if s.p.regions[i].kind.is_resident() {
                Some((0, u32::MAX))
            } else {
                s.live[i]
            }
        };
        let mut active: Vec<usize> = Vec::new();
        let mut found = 0;
        for &i in &order {
            let r = &self.p.regions[i];
            active.retain(|&j| {
                let o = &self.p.regions[j];
                o.memory == r.memory && o.address + o.bytes > r.address
            });
            if let Some((f, l)) = span(self, i) {
                for &j in &active {
                    if let Some((fj, lj)) = span(self, j)
                        && f <= lj
                        && fj <= l
                        && found < 100
                    {
                        found += 1;
                        let o = &self.p.regions[j];
                        let d = format!(
                            "{} [{:#x}..{:#x}) and {} [{:#x}..{:#x}) share memory and are both live in instructions {}..={}",
                            o.name,
                            o.address,
                            o.address + o.bytes,
                            r.name,
                            r.address,
                            r.address + r.bytes,
                            f.max(fj),
                            l.min(lj)
                        );
                        self.find(
                            FindingKind::LiveOverlap,
                            Some(f.max(fj)),
                            Some(i as RegionId),
                            d,
                        );
                    }
                }
            }
            active.push(i);
        }
    }
}
